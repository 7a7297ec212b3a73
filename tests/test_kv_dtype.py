"""Caches that store keys and values as float16 for a float32 model
(``model.new_cache(dtype="float16")``): half the memory and the bytes a decode step reads;
every cache operation exact as for float32. Their accuracy against float64 is in
test_parity.py (test_float16_cache_within_its_bound)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import kvcandle

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


@pytest.mark.parametrize("model_name", ["tiny", "default_model"])
def test_fork_crop_and_continuation_are_exact(model_name: str, request: pytest.FixtureRequest) -> None:
    model: kvcandle.Model = request.getfixturevalue(model_name)
    base = model.new_cache(dtype="float16")
    model.forward(IDS[:6], base)
    fork = base.fork()
    a = model.forward(IDS[6:], fork, all_logits=True)
    fresh = model.new_cache(dtype="float16")
    model.forward(IDS[:6], fresh)
    assert np.array_equal(a, model.forward(IDS[6:], fresh, all_logits=True))
    # the parent never sees the fork's tokens; crop then continue equals the fresh run
    assert base.tokens == IDS[:6]
    fork.crop(6)
    assert np.array_equal(model.forward(IDS[6:], fork, all_logits=True), a)
    # single-token decode steps over a float16 cache, forked midway
    steps = [model.forward([t], base) for t in IDS[6:9]]
    again = model.new_cache(dtype="float16")
    model.forward(IDS[:6], again)
    assert all(np.array_equal(s, model.forward([t], again)) for s, t in zip(steps, IDS[6:9]))


def test_a_float16_cache_saves_and_generates(default_model: kvcandle.Model, tmp_path: Path) -> None:
    cache = default_model.new_cache(dtype="float16")
    r = kvcandle.generate(default_model, "The capital of France is", max_tokens=4, cache=cache)
    assert r.text.startswith(" Paris")
    cache.save(tmp_path / "h")
    back = kvcandle.load_cache(tmp_path / "h", default_model)
    assert back.dtype == "float16" and back.tokens == cache.tokens
    assert np.array_equal(back.layers[7].keys, cache.layers[7].keys)
    assert np.array_equal(default_model.forward([13], back), default_model.forward([13], cache))


def test_cache_dtypes_a_model_cannot_take(tiny: kvcandle.Model, tiny_dirs: dict[str, Path]) -> None:
    with pytest.raises(kvcandle.DTypeError, match="float64"):
        tiny.new_cache(dtype="float64")
    with pytest.raises(TypeError):
        tiny.new_cache(dtype=16)  # type: ignore[arg-type]
    f16_model = kvcandle.load(tiny_dirs["gqa"], dtype="float16")
    assert f16_model.new_cache().dtype == "float16"
    with pytest.raises(kvcandle.DTypeError, match="float32"):
        f16_model.new_cache(dtype="float32")
