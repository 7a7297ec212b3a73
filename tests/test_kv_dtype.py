"""Caches that store keys and values in fewer bits for a float32 model: float16
(``model.new_cache(dtype="float16")``, half the memory and the bytes a decode step reads)
and 8-bit blocks (``dtype="q8_0"``: 32 int8 values and a float16 scale per block, 0.27 of
float32's bytes); every cache operation exact on what is stored. Their accuracy against
float64 is in test_parity.py (test_stored_caches_within_their_bound)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import kvcandle
from builders import Shape, write_gguf

IDS = [3, 9, 27, 81, 43, 29, 87, 61, 83, 49, 11, 5]


def test_a_float16_cache_holds_the_rounded_keys(tiny: kvcandle.Model) -> None:
    full, half = tiny.new_cache(), tiny.new_cache(dtype="float16")
    assert (full.dtype, half.dtype) == ("float32", "float16")
    tiny.forward(IDS, full)
    tiny.forward(IDS, half)
    assert half.nbytes * 2 == full.nbytes and half.bytes_per_token * 2 == full.bytes_per_token
    k = half.layers[0].keys
    assert k.dtype == np.float16 and k.shape == full.layers[0].keys.shape
    # the first layer's keys do not depend on the cache: exactly the float32 ones, rounded
    assert np.array_equal(k, full.layers[0].keys.astype(np.float16))
    assert np.array_equal(half.layers[0].values, full.layers[0].values.astype(np.float16))


@pytest.fixture(scope="module")
def wide(tmp_path_factory: pytest.TempPathFactory) -> kvcandle.Model:
    """A tiny float32 model whose heads are 64 wide: two 8-bit blocks per head."""
    shape = Shape("wide", vocab=101, hidden=256, intermediate=384, heads=4, kv_heads=2, layers=2, max_pos=256)
    return kvcandle.load(write_gguf(tmp_path_factory.mktemp("wide") / "wide.gguf", shape))


def q8_0(x: np.ndarray) -> np.ndarray:
    """The 8-bit cache's rounding, written out in numpy: per block of 32 of the last axis,
    a float16 scale of max |x| / 127, each value the nearest multiple of it (ties away
    from zero), clamped to 127 steps."""
    blocks = x.astype(np.float32).reshape(*x.shape[:-1], -1, 32)
    scale = (np.abs(blocks).max(-1, keepdims=True) / np.float32(127)).astype(np.float16).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        r = blocks / np.where(scale > 0, scale, 1)
    q = np.clip(np.sign(r) * np.floor(np.abs(r) + 0.5), -127, 127)
    return (q * scale).reshape(x.shape).astype(np.float32)


def test_an_8bit_cache_holds_the_rounded_keys(wide: kvcandle.Model) -> None:
    full, eight = wide.new_cache(), wide.new_cache(dtype="q8_0")
    assert eight.dtype == "q8_0"
    wide.forward(IDS, full)
    wide.forward(IDS, eight)
    # 64 values: two blocks of 32 one-byte values and a 2-byte scale, against 4 bytes each
    assert eight.bytes_per_token * 256 == full.bytes_per_token * 68 and eight.nbytes == len(IDS) * eight.bytes_per_token
    k = eight.layers[0].keys
    assert k.dtype == np.float32 and k.shape == full.layers[0].keys.shape
    # the first layer's keys do not depend on the cache: the float32 ones, rounded
    assert np.array_equal(k, q8_0(full.layers[0].keys))
    assert np.array_equal(eight.layers[0].values, q8_0(full.layers[0].values))
    assert 0 < np.abs(k - full.layers[0].keys).max() <= np.abs(full.layers[0].keys).max() / 254 * 1.001


def test_an_8bit_cache_needs_heads_of_whole_blocks(tiny: kvcandle.Model) -> None:
    with pytest.raises(kvcandle.DTypeError, match="multiple of 32"):
        tiny.new_cache(dtype="q8_0")
    with pytest.raises(kvcandle.DTypeError, match='unknown cache dtype "q8"'):
        tiny.new_cache(dtype="q8")


@pytest.mark.parametrize(("model_name", "dtype"), [("tiny", "float16"), ("default_model", "float16"), ("wide", "q8_0"), ("default_model", "q8_0")])
def test_fork_crop_and_continuation_are_exact(model_name: str, dtype: str, request: pytest.FixtureRequest) -> None:
    model: kvcandle.Model = request.getfixturevalue(model_name)
    base = model.new_cache(dtype=dtype)
    model.forward(IDS[:6], base)
    fork = base.fork()
    a = model.forward(IDS[6:], fork, all_logits=True)
    fresh = model.new_cache(dtype=dtype)
    model.forward(IDS[:6], fresh)
    assert np.array_equal(a, model.forward(IDS[6:], fresh, all_logits=True))
    # the parent never sees the fork's tokens; crop then continue equals the fresh run
    assert base.tokens == IDS[:6]
    fork.crop(6)
    assert np.array_equal(model.forward(IDS[6:], fork, all_logits=True), a)
    # single-token decode steps over the cache, forked midway
    steps = [model.forward([t], base) for t in IDS[6:9]]
    again = model.new_cache(dtype=dtype)
    model.forward(IDS[:6], again)
    assert all(np.array_equal(s, model.forward([t], again)) for s, t in zip(steps, IDS[6:9]))


@pytest.mark.parametrize("dtype", ["float16", "q8_0"])
def test_a_stored_cache_saves_and_generates(default_model: kvcandle.Model, tmp_path: Path, dtype: str) -> None:
    cache = default_model.new_cache(dtype=dtype)
    r = kvcandle.generate(default_model, "The capital of France is", max_tokens=4, cache=cache)
    assert r.text.startswith(" Paris")
    cache.save(tmp_path / "h")
    # the file holds what is stored: 8-bit blocks as their bytes
    assert (tmp_path / "h").stat().st_size < len(cache) * cache.bytes_per_token + 16384  # + the header
    back = kvcandle.load_cache(tmp_path / "h", default_model)
    assert back.dtype == dtype and back.tokens == cache.tokens
    assert np.array_equal(back.layers[7].keys, cache.layers[7].keys)
    assert np.array_equal(default_model.forward([13], back), default_model.forward([13], cache))
    # forks of a loaded cache share its blocks and continue exactly
    fork = back.fork()
    assert kvcandle.held_bytes([back, fork]) == kvcandle.held_bytes([back])
    assert np.array_equal(default_model.forward([14], fork), default_model.forward([14], cache))


def test_cache_dtypes_a_model_cannot_take(tiny: kvcandle.Model, tiny_dirs: dict[str, Path]) -> None:
    with pytest.raises(kvcandle.DTypeError, match="float64"):
        tiny.new_cache(dtype="float64")
    with pytest.raises(TypeError):
        tiny.new_cache(dtype=16)  # type: ignore[arg-type]
    f16_model = kvcandle.load(tiny_dirs["gqa"], dtype="float16")
    assert f16_model.new_cache().dtype == "float16"
    with pytest.raises(kvcandle.DTypeError, match="float32"):
        f16_model.new_cache(dtype="float32")


def test_a_prompt_cache_of_8bit_caches_is_exact(wide: kvcandle.Model) -> None:
    pc = kvcandle.PromptCache(wide, max_bytes=10**8)
    entry = wide.new_cache(dtype="q8_0")
    wide.forward(IDS, entry)
    assert pc.insert(entry)
    # one block of 64 positions of 8-bit rows, shared by the entry and the cache inserted
    assert pc.nbytes == kvcandle.held_bytes([entry]) == 64 * entry.bytes_per_token
    found = pc.lookup(IDS[:7] + [50, 60])
    assert found.dtype == "q8_0" and found.tokens == IDS[:7]
    got = wide.forward([50, 60], found, all_logits=True)
    fresh = wide.new_cache(dtype="q8_0")
    wide.forward(IDS[:7], fresh)
    assert np.array_equal(got, wide.forward([50, 60], fresh, all_logits=True))
    assert np.array_equal(found.layers[1].keys, fresh.layers[1].keys)
    # the entry is untouched by the lookup's continuation
    assert entry.tokens == IDS and pc.lookup(IDS).tokens == IDS
