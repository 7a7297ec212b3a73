"""Speculative decoding (``draft=``): greedy output identical to plain decoding with every
drafter, the sampled distribution exactly the model's (chi-squared over many draws on a
tiny model), no guessed position left in a cache after a rejection or an early stop, and
typed errors for bad drafters."""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest

import kvcandle
from kvcandle import cli
from kvcandle.speculative import prompt_lookup

CHAT = [
    "Write a short story about a llama who learns to code.",
    "Explain how a KV cache speeds up transformer decoding.",
]


def chat_prompt(model, text):
    return model.tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)


def test_greedy_output_is_plain_greedy_decoding_with_every_drafter(default_model, default_quantized):
    model = default_model
    rng = np.random.default_rng(0)
    for text in CHAT:
        prompt = chat_prompt(model, text)
        plain = kvcandle.generate(model, prompt, max_tokens=48)
        perfect = list(plain.tokens)
        ids = model.tokenizer.encode(prompt)

        def oracle(tokens, k):  # guesses the plain continuation, wrong every fifth token
            done = len(tokens) - len(ids)
            return [t if (done + i) % 5 else (t + 1) % 49152 for i, t in enumerate(perfect[done:done + k])]

        drafters = {
            "quantized copy": default_quantized,
            "prompt lookup": "prompt-lookup",
            "random": lambda tokens, k: rng.integers(0, 49152, k).tolist(),
            "oracle": oracle,
        }
        for name, draft in drafters.items():
            for num_draft in (1, 4, 12):
                r = kvcandle.generate(model, prompt, max_tokens=48, draft=draft, num_draft=num_draft)
                assert (r.tokens, r.text, r.finish_reason) == (plain.tokens, plain.text, plain.finish_reason), (name, num_draft)
        assert r.stats.accepted_tokens > 0  # the oracle's guesses were kept
    # the quantized model as the target, prompt lookup as the drafter
    prompt = chat_prompt(model, CHAT[0])
    plain = kvcandle.generate(default_quantized, prompt, max_tokens=32)
    spec = kvcandle.generate(default_quantized, prompt, max_tokens=32, draft="prompt-lookup")
    assert spec.tokens == plain.tokens


def test_the_cache_never_keeps_a_rejected_guess(default_model):
    model = default_model
    prompt = model.tokenizer.encode(chat_prompt(model, CHAT[1]))
    cache = model.new_cache()
    seen = []

    def drafter(tokens, k):
        # the model's cache holds every token so far but the last, never a guess
        assert cache.tokens == tokens[:-1]
        seen.append(len(tokens))
        return [int(t) for t in np.random.default_rng(len(tokens)).integers(0, 49152, k)] if len(seen) % 2 else tokens[-k:]

    r = kvcandle.generate(model, prompt, max_tokens=30, cache=cache, draft=drafter, num_draft=3)
    assert len(seen) > 3
    fed = r.tokens if r.finish_reason == "eos" else r.tokens[:-1]
    assert cache.tokens == prompt + fed
    # a stream closed after a few pieces: the cache holds exactly what was given out
    cache2 = model.new_cache()
    got = []
    stream = kvcandle.stream_generate(model, prompt, max_tokens=40, cache=cache2, draft="prompt-lookup")
    for piece in stream:
        got.extend(piece.tokens)
        if len(got) >= 7:
            break
    stream.close()
    assert cache2.tokens == prompt + got[:-1] or cache2.tokens == prompt + got


def test_an_interrupted_round_leaves_the_cache_consistent(default_model):
    model = default_model
    prompt = model.tokenizer.encode("The capital of France is")
    cache = model.new_cache()
    calls = {"n": 0}

    def drafter(tokens, k):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return tokens[-k:]

    got = []
    with pytest.raises(KeyboardInterrupt):
        for piece in kvcandle.stream_generate(model, prompt, max_tokens=30, cache=cache, draft=drafter, num_draft=2):
            got.extend(piece.tokens)
    # the tokens given out so far are in the cache but the last (and text held back for
    # a stop string does not exist here), nothing else
    assert cache.tokens[: len(prompt)] == prompt
    assert len(cache) <= len(prompt) + 30
    again = kvcandle.generate(model, prompt, max_tokens=8)
    cont = kvcandle.generate(model, prompt, max_tokens=8, cache=cache)
    assert cont.tokens == again.tokens  # the cache goes on as any cache does


def test_pieces_say_which_tokens_were_guesses(default_model):
    model = default_model
    text = "one two three four five six seven eight nine ten " * 6
    prompt = chat_prompt(model, "Repeat exactly: " + text)
    stats = kvcandle.generation.Stats()
    pieces = list(kvcandle.stream_generate(model, prompt, max_tokens=40, draft="prompt-lookup", stats=stats))
    eos_guess = pieces[-1].finish_reason == "eos"  # an end token kept as a guess is in no piece
    assert sum(p.draft_tokens for p in pieces) + eos_guess >= stats.accepted_tokens >= sum(p.draft_tokens for p in pieces) > 0
    assert all(0 <= p.draft_tokens <= len(p.tokens) for p in pieces)
    assert stats.drafted_tokens >= stats.accepted_tokens and 0 < stats.acceptance <= 1


def test_prompt_lookup_takes_the_latest_longest_match():
    assert prompt_lookup([1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 1, 2, 3], 2) == [7, 8]  # latest of two matches
    assert prompt_lookup([4, 5, 6, 1, 2, 5, 6], 3) == [1, 2, 5]  # the 2-gram [5, 6]
    assert prompt_lookup([1, 2, 3], 4) == []
    assert prompt_lookup([7, 7, 7], 2) == [7]


def wilson_hilferty(df: int, z: float = 3.72) -> float:
    """The chi-squared value with ``df`` degrees of freedom exceeded with probability
    about 1e-4 (z = 3.72), by the Wilson-Hilferty approximation."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def chi_squared(counts: Counter, probs: np.ndarray, draws: int) -> tuple[float, int]:
    """Pearson's statistic over the tokens expected at least 5 times (the rest pooled)."""
    expected = probs * draws
    big = expected >= 5
    stat = sum((counts.get(i, 0) - e) ** 2 / e for i, e in enumerate(expected) if big[i])
    rest_e = expected[~big].sum()
    rest_o = sum(c for i, c in counts.items() if not big[i])
    cells = int(big.sum())
    if rest_e > 0:
        stat += (rest_o - rest_e) ** 2 / rest_e
        cells += 1
    return stat, cells - 1


@pytest.mark.parametrize("drafter", ["fixed guesses", "draft model", "the model itself"])
def test_sampled_tokens_have_exactly_the_models_distribution(tiny_models, drafter):
    # the second token after a fixed prefix, over many seeded draws: its distribution is
    # the model's, sum over t1 of p(t1) p(t2 | t1), whatever the drafter guesses
    model = tiny_models["gqa"]
    prefix = [5, 17, 3, 42]
    temperature = 0.5  # a few likely tokens, where a wrong rule shows
    p1 = kvcandle.sampling.distribution(model.forward(prefix), temperature=temperature)
    p2 = np.zeros_like(p1)
    for t1 in range(len(p1)):
        p2 += p1[t1] * kvcandle.sampling.distribution(model.forward(prefix + [t1]), temperature=temperature)
    likely = int(np.argmax(p2))  # a guess that is often right, so both branches are taken
    draft = {
        "fixed guesses": lambda tokens, k: [likely, 11, 13][:k],
        "draft model": tiny_models["mha_tied"],
        "the model itself": model,
    }[drafter]
    draws = 6000
    counts: Counter = Counter()
    accepted = 0
    for seed in range(draws):
        stats = kvcandle.generation.Stats()
        steps = kvcandle.generate_step(model, prefix, model.new_cache(), temperature=temperature, seed=seed, stats=stats, draft=draft, num_draft=2)
        next(steps)
        counts[next(steps)] += 1
        steps.close()
        accepted += stats.accepted_tokens
    stat, df = chi_squared(counts, p2, draws)
    print(f"{drafter}: chi-squared {stat:.1f} over {df} degrees of freedom (1e-4 level {wilson_hilferty(df):.1f}), {accepted} guesses kept")
    assert stat < wilson_hilferty(df)
    assert accepted > 0


def test_bad_drafters_are_refused_by_name(default_model, tiny, tmp_path):
    model = default_model
    cache = model.new_cache()
    model.forward([1, 2, 3], cache)
    for bad, match in (
        (dict(draft="nope"), "draft must be"),
        (dict(draft=42), "draft must be"),
        (dict(draft="prompt-lookup", num_draft=0), "num_draft"),
        (dict(draft="prompt-lookup", num_draft=kvcandle.SMALL_CHUNK), "num_draft"),
        (dict(draft=tiny), "vocabulary of 101 tokens"),
        (dict(draft=lambda t, k: [10**9]), "outside the vocabulary"),
        (dict(draft=lambda t, k: "abc"), "token ids"),
        (dict(draft="prompt-lookup", n=2), "draft with n"),
    ):
        with pytest.raises(kvcandle.InputError, match=match):
            kvcandle.generate(model, [1, 2, 3, 4], max_tokens=5, cache=cache, **bad)
        assert cache.tokens[:3] == [1, 2, 3]


def test_the_command_line_takes_a_draft(default_model):
    out, err = _Pipe(), _Pipe()
    code = cli.main(["generate", "The capital of France is", "--max-tokens", "20", "--draft", "quantized", "--num-draft", "3"], stdin=_Pipe(), stdout=out, stderr=err)
    assert code == 0
    assert out.getvalue() == kvcandle.generate(default_model, "The capital of France is", max_tokens=20).text + "\n"
    assert "drafted" in err.getvalue() and "kept" in err.getvalue()
    code = cli.main(["generate", "a b a b a b a", "--max-tokens", "5", "--draft", "prompt-lookup"], stdin=_Pipe(), stdout=_Pipe(), stderr=_Pipe())
    assert code == 0
    err = _Pipe()
    assert cli.main(["generate", "x", "--draft", "prompt-lookup", "--num-draft", "0"], stdin=_Pipe(), stdout=_Pipe(), stderr=err) == 1
    assert "num_draft" in err.getvalue()


class _Pipe:
    def __init__(self, text: str = "") -> None:
        import io

        self._io = io.StringIO(text)

    def write(self, s: str) -> int:
        return self._io.write(s)

    def flush(self) -> None:
        pass

    def isatty(self) -> bool:
        return False

    def __iter__(self):
        return iter(self._io)

    def getvalue(self) -> str:
        return self._io.getvalue()


def test_a_conversation_takes_a_draft(default_model, default_quantized):
    plain, spec = kvcandle.Conversation(default_model), kvcandle.Conversation(default_model)
    for text in ("Hi! Who are you?", "Say that again, word for word."):
        a = plain.send(text, max_tokens=24)
        b = spec.send(text, max_tokens=24, draft=default_quantized, num_draft=3)
        assert (a.text, a.tokens) == (b.text, b.tokens)
    assert plain.tokens == spec.tokens and plain.cache.tokens == spec.cache.tokens
