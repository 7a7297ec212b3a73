"""``kvcandle.beam_search``: beams are forks of one cache decoded together, and the search
is transformers' beam search: on a tiny model, the same hypotheses in the same order
with the same scores as transformers in float64 on the same weights (hypotheses whose
scores are closer than the float32 noise may swap places)."""

from __future__ import annotations

import numpy as np
import pytest

import kvcandle

EOS = 2  # the tiny models' end-of-sequence id (builders.hf_config)
CLEAR = 1e-4  # scores further apart than this are in the same order; float32 moves them ~1e-6


def hf_beams(ref, prompt, **settings):
    import torch

    out = ref.generate(
        torch.tensor([prompt]), do_sample=False, num_return_sequences=settings["num_beams"], output_scores=True,
        return_dict_in_generate=True, pad_token_id=0, eos_token_id=EOS, **settings,
    )
    hyps = []
    for seq, score in zip(out.sequences, out.sequences_scores.tolist()):
        tokens = seq[len(prompt):].tolist()
        if EOS in tokens:
            tokens = tokens[: tokens.index(EOS) + 1]  # padding after the end token
        hyps.append((score, tokens))
    return hyps


CASES = [
    ([5, 17, 3], dict(num_beams=4, length_penalty=1.0, early_stopping=False)),
    ([5, 17, 3], dict(num_beams=3, length_penalty=0.0, early_stopping=True)),
    ([9, 8, 7, 6], dict(num_beams=2, length_penalty=2.0, early_stopping=False)),
    ([1], dict(num_beams=5, length_penalty=1.0, early_stopping=False)),
    ([40, 41, 42, 43, 44, 45, 46, 47, 48, 49], dict(num_beams=3, length_penalty=-0.5, early_stopping=False)),
]


def test_the_same_hypotheses_as_transformers(tmp_path):
    from builders import Shape, float64_reference, write_hf_dir

    # weights whose end token comes up, so finished hypotheses and the early stop are met
    path = write_hf_dir(tmp_path / "hf", Shape("beams", vocab=101, hidden=64, intermediate=128, heads=4, kv_heads=2, layers=2, max_pos=64), seed=4)
    seen = {"eos": 0, "length": 0}
    model, ref = kvcandle.load(path), float64_reference(path)
    for prompt, settings in CASES:
        want = hf_beams(ref, prompt, max_new_tokens=12, **settings)
        got = kvcandle.beam_search(model, prompt, max_tokens=12, n=settings["num_beams"], **settings)
        assert len(got) == len(want), (prompt, settings)
        for i, (r, (score, tokens)) in enumerate(zip(got, want)):
            seen[r.finish_reason] += 1
            mine = r.tokens + ([EOS] if r.finish_reason == "eos" else [])
            assert abs(r.score - score) < 1e-6 * max(10.0, abs(score)), (prompt, settings, i)  # transformers sums in float32
            neighbours = [s for j, (s, _) in enumerate(want) if j != i and abs(s - score) < CLEAR]
            if not neighbours:
                assert mine == tokens, (prompt, settings, i)
            else:  # a near tie: it is one of the hypotheses with that score
                assert mine in [t for s, t in want if abs(s - score) < CLEAR], (prompt, settings, i)
    assert seen["eos"] >= 1 and seen["length"] >= 1, seen


def test_beams_share_blocks_and_the_prompt_cache_is_kept(tiny):
    prompt = list(range(3, 60))  # 57 positions: most of a block shared by every beam
    cache = tiny.new_cache()
    results = kvcandle.beam_search(tiny, prompt, num_beams=4, max_tokens=5, cache=cache, n=4)
    assert cache.tokens == prompt
    for r in results:
        fed = r.tokens if r.finish_reason == "eos" else r.tokens[:-1]
        assert r.cache.tokens == prompt + fed
        assert r.score is not None and r.text == ""  # the tiny model has no tokenizer
    caches = [r.cache for r in results]
    assert kvcandle.held_bytes(caches + [cache]) < sum(c.nbytes for c in caches)
    # the best hypothesis alone is the first of the n
    best = kvcandle.beam_search(tiny, prompt, num_beams=4, max_tokens=5)
    assert (best.tokens, best.score) == (results[0].tokens, results[0].score)


def test_hypotheses_end_where_the_context_is_full(tiny):
    """As generate ends with "context": a continuation whose last token the cache cannot
    take ends there, never a PositionError halfway (the tiny model's context is 64)."""
    prompt = list(range(3, 65))  # 62 positions: two more fit, the third token ends it
    greedy, cache = [], tiny.new_cache()
    logits = tiny.forward(prompt, cache)
    for _ in range(3):
        greedy.append(int(np.argmax(logits)))
        if len(cache) < cache.max_length:
            logits = tiny.forward([greedy[-1]], cache)
    one = kvcandle.beam_search(tiny, prompt, num_beams=1, max_tokens=10)
    assert (one.tokens, one.finish_reason) == (greedy, "context")
    for r in kvcandle.beam_search(tiny, prompt, num_beams=3, max_tokens=10, n=3):
        assert r.finish_reason in ("context", "eos") and len(prompt) + len(r.tokens) <= tiny.config.max_position_embeddings + 1
        assert r.cache.tokens == prompt + (r.tokens if r.finish_reason == "eos" else r.tokens[:-1])
    full = kvcandle.beam_search(tiny, list(range(3, 67)), num_beams=2, max_tokens=10)  # the prompt fills it
    assert len(full.tokens) == 1 and full.finish_reason in ("context", "eos")


def test_one_beam_is_greedy_decoding(default_model):
    greedy = kvcandle.generate(default_model, "The capital of France is", max_tokens=8)
    beam = kvcandle.beam_search(default_model, "The capital of France is", num_beams=1, max_tokens=8)
    assert beam.tokens == greedy.tokens and beam.text == greedy.text
    wide = kvcandle.beam_search(default_model, "The capital of France is", num_beams=4, max_tokens=8)
    assert wide.text.strip() and np.isfinite(wide.score)


@pytest.mark.parametrize(
    "bad, name",
    [
        (dict(num_beams=0), "num_beams"),
        (dict(num_beams=2.5), "num_beams"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(length_penalty=float("nan")), "length_penalty"),
        (dict(length_penalty="1"), "length_penalty"),
        (dict(early_stopping="yes"), "early_stopping"),
        (dict(num_beams=2, n=3), "n must be at most num_beams"),
        (dict(n=0), "n"),
    ],
)
def test_bad_settings_are_refused_by_name(tiny, bad, name):
    cache = tiny.new_cache()
    tiny.forward([4, 5], cache)
    with pytest.raises((kvcandle.InputError, TypeError), match=name):
        kvcandle.beam_search(tiny, [4, 5, 6], cache=cache, **bad)
    assert cache.tokens == [4, 5]
