"""The cache's behaviour on both engines: kvcandle's own cache, and candle's own ``Cache``
with the length, reset, crop and fork that kvcandle's Python layer adds
(``model.upstream().tracked()``). The same tests pass on both, so the native engine's
guarantees are shown against candle's own; the differences are in cost (candle's crop
replays the kept tokens) and in what can be inspected (candle returns only the last
position's logits)."""

from __future__ import annotations

import numpy as np
import pytest

import kvcandle
from builders import ref_logits

# Every logit is measured against transformers in float64 on the same tiny model, never
# against another float32 run: the bound test_engine_tiny.py holds every float32 path to
# (float32 rounding here is ~1e-6 of logits of size ~1; a wrong position or a stale
# cache moves them by 1e-2 or more).
TOL = 1e-4


@pytest.fixture(params=["native", "upstream"])
def engine(request: pytest.FixtureRequest, tiny: kvcandle.Model):
    return tiny if request.param == "native" else tiny.upstream().tracked()


@pytest.fixture
def truth(tiny_references: dict):
    """``truth(ids)``: the float64 logits of the last of ``ids``, run from scratch."""
    return lambda ids: ref_logits(tiny_references["gqa"], ids)[-1]


def close(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and float(np.max(np.abs(a - b))) <= TOL


def test_length_tokens_and_positions_from_the_cache(engine, truth) -> None:
    cache = engine.new_cache()
    engine.forward([1, 2, 3], cache)
    out = engine.forward([4, 5], cache)
    assert len(cache) == 5 and cache.tokens == [1, 2, 3, 4, 5] and cache.max_length == 64
    # the positions came from the cache: the same as running everything at once
    assert close(out, truth([1, 2, 3, 4, 5]))


def test_reset_forgets_everything(engine, truth) -> None:
    cache = engine.new_cache()
    engine.forward([7, 8, 9], cache)
    cache.reset()
    assert len(cache) == 0 and cache.tokens == []
    assert close(engine.forward([1, 2], cache), truth([1, 2]))


@pytest.mark.parametrize("n", [0, 2, 5])
def test_crop_keeps_a_prefix_and_continues_as_a_fresh_run(engine, truth, n: int) -> None:
    cache = engine.new_cache()
    engine.forward([10, 11, 12, 13, 14], cache)
    assert cache.crop(n) == 5 - n
    assert cache.tokens == [10, 11, 12, 13, 14][:n]
    assert close(engine.forward([30, 31], cache), truth([10, 11, 12, 13, 14][:n] + [30, 31]))


def test_trim_drops_from_the_end(engine, truth) -> None:
    cache = engine.new_cache()
    engine.forward([10, 11, 12, 13], cache)
    assert cache.trim(3) == 3 and cache.tokens == [10]
    assert close(engine.forward([5], cache), truth([10, 5]))


def test_fork_isolation(engine, truth) -> None:
    base = engine.new_cache()
    engine.forward([1, 2, 3], base)
    child = base.fork()
    a = engine.forward([4, 5], base)
    b = engine.forward([6], child)
    assert base.tokens == [1, 2, 3, 4, 5] and child.tokens == [1, 2, 3, 6]
    assert close(a, truth([1, 2, 3, 4, 5])) and close(b, truth([1, 2, 3, 6]))
    # and neither sees what the other appends later
    assert close(engine.forward([7], child), truth([1, 2, 3, 6, 7]))
    assert close(engine.forward([8], base), truth([1, 2, 3, 4, 5, 8]))


def test_errors_leave_the_cache_as_it_was(engine, truth, tiny: kvcandle.Model, tiny_models: dict[str, kvcandle.Model]) -> None:
    cache = engine.new_cache()
    engine.forward([1, 2, 3], cache)
    with pytest.raises(kvcandle.InputError):
        engine.forward([], cache)
    with pytest.raises(kvcandle.TokenIdError):
        engine.forward([1, 101], cache)
    with pytest.raises(kvcandle.PositionError, match="at most 61 more"):
        engine.forward([1] * 62, cache)
    with pytest.raises(kvcandle.InputError):
        cache.crop(4)
    with pytest.raises(kvcandle.InputError):
        cache.trim(-1)
    with pytest.raises(TypeError):
        cache.crop(1.0)
    # a cache of another model (engine) of the same kind
    other = tiny_models["mha_tied"] if engine is tiny else tiny.upstream().tracked()
    with pytest.raises(kvcandle.CacheError):
        engine.forward([1], other.new_cache())
    assert cache.tokens == [1, 2, 3]
    assert close(engine.forward([4], cache), truth([1, 2, 3, 4]))


def test_both_engines_match_float64_chunk_by_chunk(tiny: kvcandle.Model, truth) -> None:
    up = tiny.upstream().tracked()
    ids = [5, 17, 33, 2, 90, 41]
    a, b = tiny.new_cache(), up.new_cache()
    seen: list[int] = []
    for chunk in ([5, 17, 33], [2], [90, 41]):
        seen += chunk
        assert close(tiny.forward(chunk, a), truth(seen)) and close(up.forward(chunk, b), truth(seen))
    assert a.tokens == b.tokens == ids
