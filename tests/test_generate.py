"""generate / stream_generate: greedy equals the manual loop, streaming never splits a
character and joins to generate's text, stop strings, EOS, seeded sampling, cache reuse."""

from __future__ import annotations

import codecs

import numpy as np
import pytest

import kvcandle
from builders import SHAPES, write_gguf
from kvcandle import parity
from kvcandle.tokenizer import Tokenizer
from kvcandle.sampling import apply_repetition_penalty, sample, top_k_filter, top_p_filter

CHAT = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"


def test_greedy_equals_manual_loop(default_model):
    ids = default_model.tokenizer.encode(parity.PROMPT)
    r = kvcandle.generate(default_model, parity.PROMPT, max_tokens=20)
    assert r.tokens == parity.kv_greedy(default_model, ids, 20)
    assert r.text == default_model.tokenizer.decode(r.tokens) and r.finish_reason == "length"
    assert r.prompt_tokens == 5 and r.decode_tps > 0 and r.prefill_tps > 0


@pytest.mark.parametrize("prompt", ["用中文介绍一下北京：", "Reply with three emoji: 🎉", parity.PROMPT])
def test_stream_joins_to_generate_and_never_splits_characters(default_model, prompt):
    pieces = list(kvcandle.stream_generate(default_model, prompt, max_tokens=30))
    result = kvcandle.generate(default_model, prompt, max_tokens=30)
    assert "".join(p.text for p in pieces) == result.text
    assert all("\ufffd" not in p.text for p in pieces)
    assert sum(len(p.tokens) for p in pieces) == len(result.tokens)
    assert pieces[-1].finish_reason == result.finish_reason
    assert len(result.tokens) == 30 if result.finish_reason == "length" else result.finish_reason == "eos"


def test_stop_string(default_model):
    full = kvcandle.generate(default_model, parity.PROMPT, max_tokens=20).text  # " Paris.\n\nThe answer is: ..."
    r = kvcandle.generate(default_model, parity.PROMPT, max_tokens=20, stop=["answer"])
    assert r.finish_reason == "stop" and r.text == full[: full.index("answer")]
    pieces = list(kvcandle.stream_generate(default_model, parity.PROMPT, max_tokens=20, stop="answer"))
    assert "".join(p.text for p in pieces) == r.text


def test_eos_ends_generation(default_model):
    r = kvcandle.generate(default_model, CHAT, max_tokens=64)
    assert r.finish_reason == "eos" and "Paris" in r.text
    assert 2 not in r.tokens  # <|im_end|> is the EOS id


def test_seeded_sampling(default_model):
    kw = dict(max_tokens=15, temperature=0.9, top_k=50, top_p=0.95)
    a = kvcandle.generate(default_model, parity.PROMPT, seed=1, **kw)
    b = kvcandle.generate(default_model, parity.PROMPT, seed=1, **kw)
    c = kvcandle.generate(default_model, parity.PROMPT, seed=2, **kw)
    assert a.tokens == b.tokens and a.tokens != c.tokens


def test_cache_reuse_runs_only_new_tokens(default_model):
    cache = default_model.new_cache()
    first = kvcandle.generate(default_model, CHAT, max_tokens=64, cache=cache)
    assert first.stats.prefill_tokens == first.prompt_tokens
    convo = default_model.tokenizer.encode(CHAT) + first.tokens + [2] + default_model.tokenizer.encode(
        "\n<|im_start|>user\nAnd of Germany?<|im_end|>\n<|im_start|>assistant\n"
    )
    held = len(cache)
    second = kvcandle.generate(default_model, convo, max_tokens=40, cache=cache)
    fresh = kvcandle.generate(default_model, convo, max_tokens=40)
    assert second.stats.prefill_tokens == len(convo) - held
    assert second.tokens == fresh.tokens


def test_diverging_prompt_crops_to_common_prefix(default_model):
    cache = default_model.new_cache()
    kvcandle.generate(default_model, parity.PROMPT, max_tokens=10, cache=cache)
    r = kvcandle.generate(default_model, "The capital of Germany is", max_tokens=10, cache=cache)
    assert r.stats.prefill_tokens == 2  # "The capital of" reused
    assert r.tokens == kvcandle.generate(default_model, "The capital of Germany is", max_tokens=10).tokens
    assert cache.tokens[:5] == default_model.tokenizer.encode("The capital of Germany is")


def test_context_length_is_a_finish_reason(tmp_path):
    model = kvcandle.load(write_gguf(tmp_path / "tiny.gguf", SHAPES[0]))  # context 64, with a tokenizer
    model.config.eos_token_ids.clear()
    model.tokenizer.eos_token_ids.clear()
    cache = model.new_cache()
    r = kvcandle.generate(model, "abcdefghij", max_tokens=500, cache=cache)
    assert r.finish_reason == "context"
    assert len(cache) == 64 and len(r.tokens) == 64 - 10 + 1


def test_without_tokenizer_text_cannot_be_generated(tiny):
    with pytest.raises(ValueError, match="no tokenizer"):
        kvcandle.generate(tiny, [1, 2, 3])


@pytest.mark.parametrize(
    "kw,message",
    [
        ({"temperature": -1}, "temperature"),
        ({"top_k": 0}, "top_k"),
        ({"top_p": 1.5}, "top_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"stop": [""]}, "stop"),
    ],
)
def test_bad_settings(default_model, kw, message):
    with pytest.raises(ValueError, match=message):
        kvcandle.generate(default_model, "hi", **kw)


def test_sampling_functions():
    logits = np.array([1.0, 3.0, 2.0, 0.5], dtype=np.float32)
    assert sample(logits) == 1
    assert np.isneginf(top_k_filter(logits, 2)).tolist() == [True, False, False, True]
    p = np.exp(logits) / np.exp(logits).sum()
    kept = ~np.isneginf(top_p_filter(logits, float(p[1]) + 1e-3))
    assert kept.tolist() == [False, True, True, False]
    draws = {sample(logits, temperature=1.0, top_k=2, rng=np.random.default_rng(s)) for s in range(50)}
    assert draws == {1, 2}


def test_chat_template_errors_are_value_errors(default_model):
    tok = default_model.tokenizer
    with pytest.raises(ValueError, match=r"messages\[0\] must be a dict with a 'role'"):
        tok.apply_chat_template(["hello"])
    with pytest.raises(ValueError, match="cannot render"):
        tok.apply_chat_template([{"role": "user", "content": None}])  # the template concatenates strings
    assert tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=True)[:1] == [1]


def test_chat_templates_render_as_transformers_renders_them(default_model):
    """transformers' ``apply_chat_template`` (rendering only: ``tokenize=False``) is the
    reference: its ``tojson`` options (``ensure_ascii``, ``sort_keys``, ...), ``tools``
    and ``documents`` defined as None, message keys whose value is None left out
    (``content=None`` printed "None"), and the ``{% generation %}`` tag. Each of these
    failed or rendered otherwise before."""
    from tokenizers import Tokenizer as HFTokenizer, models
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer.from_gguf_file(default_model.path)
    bos, eos = tok.id_to_token(tok.bos_token_id), tok.id_to_token(tok.eos_token_ids[0])
    reference = PreTrainedTokenizerFast(tokenizer_object=HFTokenizer(models.WordLevel({"<unk>": 0}, unk_token="<unk>")), bos_token=bos, eos_token=eos)
    messages = [
        {"role": "system", "content": "Be brief. Ünïcode ✓"},
        {"role": "user", "content": "Hi", "name": None},
        {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f", "arguments": {"b": 1, "a": "é"}}}]},
        {"role": "user", "content": "Thanks"},
    ]
    templates = [
        "{% for m in messages %}{{ m['role'] }}: {{ m | tojson(ensure_ascii=False, sort_keys=True) }}\n{% endfor %}",
        "{{ messages | tojson(indent=2, separators=(',', ': '), ensure_ascii=True) }}",
        "{% if tools is not none %}{{ tools | tojson }}{% endif %}{% if documents is none %}no docs{% endif %}{% for m in messages %}{{ m.role }}:{{ m.content }}|{% endfor %}",
        "{% for m in messages %}{% if m.role == 'assistant' %}{% generation %}A:{{ m.content }}{% endgeneration %}{% else %}{{ m.role }}:{{ m.content }}{% endif %}\n{% endfor %}",
        "{% for m in messages %}{{ m.role }}{% if m.content is defined %}={{ m.content }}{% endif %}{% if m.name is defined %} named{% endif %};{% endfor %}{{ bos_token }}",
    ]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    for template in templates:
        tok.chat_template = template
        for kw in ({}, {"tools": tools}):
            for generation_prompt in (False, True):
                want = reference.apply_chat_template(messages, chat_template=template, add_generation_prompt=generation_prompt, tokenize=False, **kw)
                assert tok.apply_chat_template(messages, add_generation_prompt=generation_prompt, **kw) == want, (template, kw)


def test_decode_stream_pieces_join_to_decode(default_model):
    """The streaming decoder's pieces are decode(ids), less an incomplete character at the
    end: on texts with CJK, emoji, combining marks, special tokens and whitespace runs,
    and on random ids (which split and break UTF-8 sequences anywhere)."""
    tok = default_model.tokenizer
    texts = ["用中文介绍一下北京：", "emoji 🎉👍🏽 and e\u0301", "<|im_start|>user\nHi<|im_end|>", "  spaces\t\ttabs\n\n"]
    rng = np.random.default_rng(0)
    sequences = [tok.encode(t) for t in texts] + [rng.integers(0, tok.vocab_size, 40).tolist() for _ in range(100)]
    for ids in sequences:
        stream = tok.decode_stream()
        pieces = [stream.add(i) for i in ids]
        assert "".join(pieces) == _without_an_unfinished_character(tok, ids)
    for t, ids in zip(texts, sequences):
        stream = tok.decode_stream()
        assert "".join(stream.add(i) for i in ids) == t


def _without_an_unfinished_character(tok, ids) -> str:
    """decode(ids), less the U+FFFD an unfinished UTF-8 character at the end decodes to,
    as Python's own incremental UTF-8 decoder tells it (it holds such bytes back)."""
    text = tok.decode(ids)
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    decoder.decode(b"".join(tok.token_bytes(i) for i in ids), final=False)
    return text[:-1] if decoder.decode(b"", final=True) else text


def test_a_real_replacement_character_is_streamed(default_model):
    """U+FFFD is a character of its own (token 24211 is its three bytes): the streaming
    decoder took any text ending in it for an unfinished character and held it back, so
    a generation ending in it lost it (``text`` empty where ``decode(tokens)`` was six of
    them)."""
    tok = default_model.tokenizer
    for text in ("abc\ufffd", "\ufffd", "\ufffd\ufffd x \ufffd"):
        stream = tok.decode_stream()
        assert "".join(stream.add(i) for i in tok.encode(text, add_special_tokens=False)) == text
    r = kvcandle.generate(default_model, "Replacement characters: " + "\ufffd" * 10, max_tokens=6)
    assert "\ufffd" in r.text and r.text == _without_an_unfinished_character(tok, r.tokens)
    pieces = list(kvcandle.stream_generate(default_model, "Replacement characters: " + "\ufffd" * 10, max_tokens=6))
    assert "".join(p.text for p in pieces) == r.text


def test_decode_stream_refuses_a_bad_id_and_goes_on(default_model):
    """``add`` of an id outside the vocabulary gave "" (10**6), a bare OverflowError (-1)
    or took a bool, and the id stayed in the stream, so every later ``add`` failed. Now
    each is refused as ``decode`` refuses it, and the stream goes on as if it had not
    been called."""
    tok = default_model.tokenizer
    ids = tok.encode("北京 🎉 Paris")
    want = tok.decode_stream()
    expected = [want.add(i) for i in ids]
    stream = tok.decode_stream()
    got = []
    for k, i in enumerate(ids):
        bad, error = [(10**6, kvcandle.TokenIdError), (-1, kvcandle.TokenIdError), (True, TypeError), ("7", TypeError), (tok.vocab_size, kvcandle.TokenIdError)][k % 5]
        with pytest.raises(error):
            stream.add(bad)
        got.append(stream.add(i))
    assert got == expected
    assert tok.id_to_token(-1) is None and tok.id_to_token(tok.vocab_size) is None and tok.id_to_token(ids[0]) is not None
    with pytest.raises(TypeError):
        tok.id_to_token("7")


def test_streaming_never_decodes_the_whole_text_again(default_model, monkeypatch):
    """stream_generate's cost per token must not grow with the text generated: it never
    calls decode() on the tokens so far (it used to, at every step)."""
    expected = kvcandle.generate(default_model, parity.PROMPT, max_tokens=40).text

    def whole_decode(*args, **kwargs):
        raise AssertionError("stream_generate decoded the whole text again")

    monkeypatch.setattr(default_model.tokenizer, "decode", whole_decode)
    pieces = list(kvcandle.stream_generate(default_model, parity.PROMPT, max_tokens=40, stop="no such stop"))
    assert "".join(p.text for p in pieces) == expected and len(pieces) > 10


def test_timers_count_the_models_work_not_the_callers(tiny):
    """The caller sleeps 0.2 s after each token; none of that may count as decoding."""
    import time

    from kvcandle.generation import Stats, generate_step

    stats = Stats()
    steps = generate_step(tiny, [1, 2, 3], tiny.new_cache(), stats=stats)
    for _ in range(5):
        next(steps)
        time.sleep(0.2)
    steps.close()
    assert stats.generated_tokens == 5 and stats.prefill_tokens == 3
    assert 0 < stats.prefill_seconds < 0.4 and 0 < stats.decode_seconds < 0.4, stats


def test_a_repetition_penalty_far_from_one_gives_finite_logits(default_model):
    """Any finite penalty > 0 is allowed: one far from 1 takes logits past float32's range,
    which stay at its largest number of their sign (an infinite logit made the sampling
    probabilities NaN); penalties near 1 are plain float32 arithmetic."""
    logits = np.array([3.0, -2.0, 0.0, 1.5, -0.5], dtype=np.float32)
    seen = [0, 1, 2]
    big = np.finfo(np.float32).max
    for penalty in (1e-40, 1e-300, 1e-50, 1e50, 1e300):
        out = apply_repetition_penalty(logits, seen, penalty)
        assert out.dtype == np.float32 and np.isfinite(out).all(), penalty
        assert (out[3:] == logits[3:]).all()
        wide = logits[:3].astype(np.float64)
        want = np.clip(np.where(wide > 0, wide / penalty, wide * penalty), -big, big)
        assert np.allclose(out[:3], want, rtol=1e-6, atol=1e-30), (penalty, out, want)
    for penalty in (1.1, 1.7, 0.9):
        out = apply_repetition_penalty(logits, seen, penalty)
        assert (out[:3] == np.where(logits[:3] > 0, logits[:3] / np.float32(penalty), logits[:3] * np.float32(penalty))).all()
    for temperature in (0.0, 0.7):
        r = kvcandle.generate(default_model, "1, 2, 3,", max_tokens=6, temperature=temperature, seed=1, repetition_penalty=1e-40)
        assert len(r.tokens) == 6 and all(0 <= t < 49152 for t in r.tokens)
