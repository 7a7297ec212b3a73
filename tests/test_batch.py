"""``model.forward_batch``: several sequences, each with its own cache, in one call. Decode
rows and short chunks (up to ``kvcandle.SMALL_CHUNK`` tokens) run as rows of one step and
must give, bit for bit, what each sequence gives alone with ``forward`` whatever else is
in the batch, and a short chunk what its tokens give decoded one by one; longer chunks of
several sequences run with their rows stacked in every product and must give, bit for
bit, what each gives alone too; a refused call names the sequence and changes no cache."""

from __future__ import annotations

import numpy as np
import pytest

import kvcandle
from builders import Shape, quantized_weights, write_gguf, write_hf_dir


def alone(model, prompt, step, dtype=None):
    """The logits of `step` after `prompt`, run alone on a fresh cache."""
    cache = model.new_cache(dtype=dtype)
    if prompt:
        model.forward(prompt, cache)
    return model.forward(step, cache)


def check_batch_equals_alone(model, prompts, steps, dtype=None):
    caches = []
    for p in prompts:
        c = model.new_cache(dtype=dtype)
        if p:
            model.forward(p, c)
        caches.append(c)
    got = model.forward_batch(steps, caches)
    assert len(got) == len(prompts)
    for b, (p, s) in enumerate(zip(prompts, steps)):
        assert np.array_equal(got[b], alone(model, p, s, dtype)), f"sequence {b}"
        assert caches[b].tokens == p + s


@pytest.mark.parametrize("name", ["gqa", "mha_tied"])
def test_decode_rows_are_bit_identical_to_running_alone(tiny_models, name):
    model = tiny_models[name]
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, 101, n).tolist() for n in (0, 1, 7, 30, 12, 5, 40, 3)]
    for batch in (1, 2, 3, 8):
        steps = [[int(t)] for t in rng.integers(0, 101, batch)]
        check_batch_equals_alone(model, prompts[:batch], steps)
    # with a float16 cache too
    check_batch_equals_alone(model, prompts[:4], [[1], [2], [3], [4]], dtype="float16")


def test_quantized_decode_rows_are_bit_identical(tmp_path):
    shape = Shape("q", vocab=101, hidden=256, intermediate=512, heads=4, kv_heads=2, layers=2, max_pos=256)
    floats, blocks = quantized_weights(shape, "Q4_K", seed=2)
    model = kvcandle.load(write_gguf(tmp_path / "q.gguf", shape, weights=floats, blocks=blocks), quantized=True)
    assert model.quantized
    rng = np.random.default_rng(4)
    prompts = [rng.integers(0, 101, n).tolist() for n in (9, 0, 70, 2)]
    check_batch_equals_alone(model, prompts, [[5], [6], [7], [8]])
    # 8-bit caches (heads of 64: two blocks each), and caches of every type in one batch
    check_batch_equals_alone(model, prompts, [[5], [6], [7], [8]], dtype="q8_0")
    dtypes = ["q8_0", "float32", "float16", "q8_0"]
    caches = [model.new_cache(dtype=d) for d in dtypes]
    for p, c in zip(prompts, caches):
        if p:
            model.forward(p, c)
    got = model.forward_batch([[1], [2, 3], [4], [5]], caches)
    for b, (p, s, d) in enumerate(zip(prompts, [[1], [2, 3], [4], [5]], dtypes)):
        want = alone(model, p, s, d) if len(s) == 1 else one_by_one(model, p, s, d)[0][-1]
        assert np.array_equal(got[b], want), f"sequence {b} ({d} cache)"


def one_by_one(model, prompt, chunk, dtype=None):
    """Every position's logits of `chunk` after `prompt`, its tokens decoded one at a time."""
    cache = model.new_cache(dtype=dtype)
    if prompt:
        model.forward(prompt, cache)
    return np.stack([model.forward([t], cache) for t in chunk]), cache


@pytest.mark.parametrize("dtype", [None, "float16"])
def test_a_short_chunk_is_its_tokens_decoded_one_by_one(tiny_models, dtype):
    # the rows of a short chunk see each other as decode steps would: bit for bit the
    # same logits and the same cache (what verifying guessed tokens needs)
    model = tiny_models["gqa"]
    rng = np.random.default_rng(8)
    for start, n in ((0, 2), (5, kvcandle.SMALL_CHUNK), (56, 8), (60, 3), (40, 1)):
        prompt, chunk = rng.integers(0, 101, start).tolist(), rng.integers(0, 101, n).tolist()
        want, ref = one_by_one(model, prompt, chunk, dtype)
        cache = model.new_cache(dtype=dtype)
        if prompt:
            model.forward(prompt, cache)
        got = model.forward(chunk, cache, all_logits=True)
        assert np.array_equal(got, want), (start, n)
        assert np.array_equal(model.forward(chunk, _with(model, prompt, dtype)), want[-1])
        assert cache.tokens == ref.tokens
        assert all(np.array_equal(a.keys, b.keys) and np.array_equal(a.values, b.values) for a, b in zip(cache.layers, ref.layers))


def test_a_float16_models_short_chunk_is_its_tokens_one_by_one(tiny_dirs):
    # a float16 model's products are candle's, whose rows are not independent bit for
    # bit: its short chunks run one position at a time, so the promise holds there too
    model = kvcandle.load(tiny_dirs["gqa"], dtype="float16")
    rng = np.random.default_rng(10)
    for start, n in ((0, 2), (5, kvcandle.SMALL_CHUNK), (60, 3)):
        prompt, chunk = rng.integers(0, 101, start).tolist(), rng.integers(0, 101, n).tolist()
        want, ref = one_by_one(model, prompt, chunk, None)
        cache = _with(model, prompt, None)
        assert np.array_equal(model.forward(chunk, cache, all_logits=True), want), (start, n)
        assert np.array_equal(model.forward(chunk, _with(model, prompt, None)), want[-1])
        assert cache.tokens == ref.tokens
        assert all(np.array_equal(a.keys, b.keys) for a, b in zip(cache.layers, ref.layers))
        other = _with(model, rng.integers(0, 101, 7).tolist(), None)
        got = model.forward_batch([chunk, [4]], [_with(model, prompt, None), other], all_logits=True)
        assert np.array_equal(got[0], want)


def test_quantized_short_chunks_are_decode_steps_and_batch_invariant(tmp_path):
    shape = Shape("q", vocab=101, hidden=256, intermediate=512, heads=4, kv_heads=2, layers=2, max_pos=256)
    floats, blocks = quantized_weights(shape, "Q4_1", seed=5)
    model = kvcandle.load(write_gguf(tmp_path / "q.gguf", shape, weights=floats, blocks=blocks), quantized=True)
    rng = np.random.default_rng(9)
    prompts = [rng.integers(0, 101, n).tolist() for n in (9, 0, 70)]
    chunks = [rng.integers(0, 101, n).tolist() for n in (3, 8, 1)]
    caches = [_with(model, p) for p in prompts]
    got = model.forward_batch(chunks, caches, all_logits=True)
    for b, (p, c) in enumerate(zip(prompts, chunks)):
        assert np.array_equal(got[b], one_by_one(model, p, c)[0]), f"sequence {b}"


def test_forks_of_one_prompt_decode_together(default_model):
    # the default model: 8 forks of a 150-token prompt, each fed its own token, over steps
    model = default_model
    prompt = model.tokenizer.encode("The capital of France is Paris. " * 20)[:150]
    base = model.new_cache()
    model.forward(prompt, base)
    forks = [base.fork() for _ in range(8)]
    alone_caches = [base.fork() for _ in range(8)]
    tokens = [[100 + b] for b in range(8)]
    for _ in range(3):
        got = model.forward_batch(tokens, forks)
        want = [model.forward(t, c) for t, c in zip(tokens, alone_caches)]
        for b in range(8):
            assert np.array_equal(got[b], want[b]), f"sequence {b}"
        tokens = [[int(g.argmax())] for g in got]
    assert all(f.tokens == a.tokens for f, a in zip(forks, alone_caches))


def test_decode_rows_and_prefill_chunks_in_one_call(tiny):
    caches = [tiny.new_cache() for _ in range(3)]
    tiny.forward([1, 2, 3], caches[0])
    tiny.forward([4], caches[2])
    got = tiny.forward_batch([[5], [6, 7, 8, 9], [10, 11]], caches, all_logits=True)
    assert [g.shape for g in got] == [(1, 101), (4, 101), (2, 101)]
    want = [
        tiny.forward([5], _with(tiny, [1, 2, 3]), all_logits=True),
        tiny.forward([6, 7, 8, 9], tiny.new_cache(), all_logits=True),
        tiny.forward([10, 11], _with(tiny, [4]), all_logits=True),
    ]
    for b in range(3):
        assert np.array_equal(got[b], want[b]), f"sequence {b}"


@pytest.mark.parametrize("kind", ["float32", "float16", "Q4_1", "Q6_K"])
def test_long_chunks_of_several_sequences_stack_and_equal_each_alone(tmp_path, kind):
    # prompts longer than SMALL_CHUNK, several PREFILL_CHUNKs long, with short ones and
    # decode rows in the same call: the r-th chunks of all sequences run in one round,
    # the long ones stacked in passes of up to PREFILL_ROWS rows (here more than one pass)
    shape = Shape("long", vocab=101, hidden=256, intermediate=256, heads=4, kv_heads=2, max_pos=1024)  # K-quant rows: 256 columns
    if kind in ("float32", "float16"):
        model = kvcandle.load(write_hf_dir(tmp_path / "m", shape, seed=6), dtype=kind)
    else:
        floats, blocks = quantized_weights(shape, kind, seed=6)
        model = kvcandle.load(write_gguf(tmp_path / "q.gguf", shape, weights=floats, blocks=blocks), quantized=True)
    chunk, rows = kvcandle.PREFILL_CHUNK, kvcandle.PREFILL_ROWS
    rng = np.random.default_rng(12)
    # ... and more than eight sequences whose last chunk is long in one pass (the head
    # then has many rows; a quantized product of more than eight rows takes other kernels)
    prompts = [rng.integers(0, 101, n).tolist() for n in (0, 5, 0, 40, 0, 2, 0, 1, 9, 0, 30, 0, 0, 3, 0)]
    lens = [2 * chunk + 44, chunk, rows - chunk + 7, 1, kvcandle.SMALL_CHUNK + 1, 3] + [kvcandle.SMALL_CHUNK + 1 + i for i in range(9)]
    steps = [rng.integers(0, 101, n).tolist() for n in lens]
    assert 3 * chunk > rows  # the first round's long chunks take two passes
    for all_logits in (False, True):
        caches = [_with(model, p) for p in prompts]
        got = model.forward_batch(steps, caches, all_logits=all_logits)
        for b, (p, s) in enumerate(zip(prompts, steps)):
            ref = _with(model, p)
            want = model.forward(s, ref, all_logits=all_logits)
            assert got[b].shape == want.shape and np.array_equal(got[b], want), (kind, all_logits, b)
            assert caches[b].tokens == p + s
            assert all(np.array_equal(x.keys, y.keys) and np.array_equal(x.values, y.values) for x, y in zip(caches[b].layers, ref.layers)), b


def _with(model, ids, dtype=None):
    cache = model.new_cache(dtype=dtype)
    if ids:
        model.forward(ids, cache)
    return cache


def test_refused_batches_name_the_sequence_and_change_nothing(tiny_models):
    model, other = tiny_models["gqa"], tiny_models["mha_tied"]
    caches = [model.new_cache() for _ in range(3)]
    for i, c in enumerate(caches):
        model.forward([i + 1] * (i + 1), c)
    before = [c.tokens for c in caches]
    cases = [
        ([[1], [2], [101]], caches, kvcandle.TokenIdError, r"sequence 2: token id 101 at index 0"),
        ([[1], [-1], [3]], caches, kvcandle.TokenIdError, r"sequence 1: token id -1"),
        ([[1], [2], [1] * 62], caches, kvcandle.PositionError, r"sequence 2: cannot run 62 token"),
        ([[1], [], [3]], caches, kvcandle.InputError, r"sequence 1: ids is empty"),
        ([[1], [2], [3]], [caches[0], caches[1], caches[0]], kvcandle.CacheError, r"sequence 2 has the same cache as sequence 0"),
        ([[1], [2], [3]], [caches[0], caches[1], other.new_cache()], kvcandle.CacheError, r"sequence 2: this cache was made by another model"),
        ([[1], [2]], caches, kvcandle.InputError, r"2 sequences of ids and 3 caches"),
        ([], [], kvcandle.InputError, r"non-empty"),
        ([[1], ["x"], [3]], caches, TypeError, r"sequence 1"),
    ]
    for ids, cs, error, message in cases:
        with pytest.raises(error, match=message):
            model.forward_batch(ids, cs)
        assert [c.tokens for c in caches] == before, message
    with pytest.raises(TypeError, match=r"caches\[1\]"):
        model.forward_batch([[1], [2]], [caches[0], "cache"])


def test_generate_n_equals_each_generation_alone(default_model):
    # the prompt runs once; continuation i is what generate(seed=seed + i) gives alone,
    # bit for bit, so their texts, tokens and finish reasons are the same
    model = default_model
    prompt = "Once upon a time, a llama"
    settings = dict(max_tokens=12, temperature=0.9, top_p=0.95, seed=5, stop=[" the end"])
    many = kvcandle.generate(model, prompt, n=3, **settings)
    assert len(many) == 3
    for i, r in enumerate(many):
        one = kvcandle.generate(model, prompt, **{**settings, "seed": 5 + i})
        assert (r.text, r.tokens, r.finish_reason) == (one.text, one.tokens, one.finish_reason), i
        fed = r.tokens if r.finish_reason == "eos" else r.tokens[:-1]  # every token but the last is in the cache
        assert r.cache is not None and r.cache.tokens == model.tokenizer.encode(prompt) + fed
        assert r.stats.prompt_tokens == one.stats.prompt_tokens and r.stats.generated_tokens == len(r.tokens)
    assert len({tuple(r.tokens) for r in many}) > 1  # different seeds, different stories
    greedy = kvcandle.generate(model, "The capital of France is", max_tokens=8, n=2)
    alone = kvcandle.generate(model, "The capital of France is", max_tokens=8)
    assert [r.text for r in greedy] == [alone.text] * 2


def test_generate_n_keeps_the_given_cache_at_the_prompt(default_model):
    model = default_model
    cache = model.new_cache()
    ids = model.tokenizer.encode("The capital of France is")
    results = kvcandle.generate(model, ids, n=2, max_tokens=3, cache=cache)
    assert cache.tokens == ids and all(r.cache.tokens[: len(ids)] == ids for r in results)
    for bad in (0, -1, 1.5, "2", True):
        with pytest.raises((kvcandle.InputError, TypeError), match="n"):
            kvcandle.generate(model, ids, n=bad, cache=cache)
    assert cache.tokens == ids


def test_batch_generate_equals_each_prompt_alone(default_model):
    model = default_model
    prompts = ["The capital of France is", "Once upon a time, a llama", model.tokenizer.encode("def add(a, b):"), "1, 2, 3,"]
    settings = dict(max_tokens=10, temperature=0.8, top_k=40, seed=11, stop=["\n\n\n"])
    results = kvcandle.batch_generate(model, prompts, **settings)
    assert len(results) == len(prompts)
    for i, (p, r) in enumerate(zip(prompts, results)):
        one = kvcandle.generate(model, p, **{**settings, "seed": 11 + i})
        assert (r.text, r.tokens, r.finish_reason) == (one.text, one.tokens, one.finish_reason), i
    with pytest.raises(kvcandle.InputError, match=r"prompts\[1\]: the prompt is empty"):
        kvcandle.batch_generate(model, ["a", ""])
    with pytest.raises(kvcandle.InputError, match="prompts is empty"):
        kvcandle.batch_generate(model, [])
    with pytest.raises(kvcandle.InputError, match="temperature"):
        kvcandle.batch_generate(model, ["a"], temperature=-1)
    with pytest.raises(TypeError, match="prompts"):
        kvcandle.batch_generate(model, "a prompt")
