"""KVCache: length from Rust state, reset, O(1) crop, copy-on-write fork, inspection."""

from __future__ import annotations

import numpy as np
import pytest

import kvcandle
from builders import Shape, max_abs, write_hf_dir


def run(model, ids, cache=None):
    cache = cache if cache is not None else model.new_cache()
    return model.forward(ids, cache, all_logits=True), cache


def test_length_tokens_and_sizes(tiny):
    cache = tiny.new_cache()
    assert len(cache) == cache.seq_length == 0 and cache.tokens == [] and cache.nbytes == 0
    tiny.forward([5, 6, 7], cache)
    tiny.forward([8], cache)
    assert len(cache) == cache.seq_length == 4
    assert cache.tokens == [5, 6, 7, 8]
    assert cache.max_length == tiny.config.max_position_embeddings == 64
    c = tiny.config
    assert cache.bytes_per_token == 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * 4
    assert cache.nbytes == 4 * cache.bytes_per_token
    assert cache.layers[0].keys.shape == (1, 2, 4, 8)
    assert cache.layers[-1].values.shape == (1, 2, 4, 8)
    assert len(cache.layers) == 2


def test_empty_cache_layers_have_zero_length(tiny):
    cache = tiny.new_cache()
    assert cache.layers[0].keys.shape == (1, 2, 0, 8)


def test_layer_index_out_of_range(tiny):
    cache = tiny.new_cache()
    with pytest.raises(IndexError, match="layer 2"):
        cache.layers[2]
    with pytest.raises(IndexError, match="layer -3"):
        cache.layers[-3]
    for bad in (1.0, "0", True, None):
        with pytest.raises(TypeError, match="layer indices"):
            cache.layers[bad]
    assert cache.layers[np.int64(1)].keys.shape == cache.layers[1].keys.shape


def test_reset_drops_its_blocks_and_forgets_tokens(tiny):
    cache = tiny.new_cache()
    tiny.forward([1, 2, 3, 4, 5], cache)
    assert cache.capacity == kvcandle.BLOCK_LEN and cache.held_bytes == kvcandle.BLOCK_LEN * cache.bytes_per_token
    cache.reset()
    assert len(cache) == 0 and cache.tokens == [] and cache.capacity == 0 and cache.held_bytes == 0
    fresh, _ = run(tiny, [9, 8, 7])
    again = tiny.forward([9, 8, 7], cache, all_logits=True)
    assert max_abs(again, fresh) == 0.0


@pytest.mark.parametrize("op,n,kept", [("crop", 4, 4), ("crop", 0, 0), ("crop", 7, 7), ("trim", 3, 4), ("trim", 7, 0), ("trim", 0, 7)])
def test_crop_and_trim_keep_a_prefix(tiny, op, n, kept):
    ids = [3, 1, 4, 1, 5, 9, 2]
    _, cache = run(tiny, ids)
    dropped = getattr(cache, op)(n)
    assert dropped == 7 - kept and len(cache) == kept and cache.tokens == ids[:kept]
    # nothing copied or reallocated: the block is kept while positions remain in it
    assert cache.capacity == (kvcandle.BLOCK_LEN if kept else 0)
    # continuing after the crop equals running the prefix + new tokens from scratch
    cont = tiny.forward([6, 5], cache, all_logits=True)
    ref, _ = run(tiny, ids[:kept] + [6, 5])
    assert max_abs(cont, ref[kept:]) <= 1e-5
    assert max_abs(cache.layers[1].keys, _run_keys(tiny, ids[:kept] + [6, 5])) <= 1e-5


def _run_keys(model, ids):
    _, c = run(model, ids)
    return c.layers[1].keys


@pytest.mark.parametrize(
    "op,n,message",
    [
        ("crop", 8, r"cannot crop to 8: .* \[0, 7\]$"),
        ("crop", 100, "cannot crop to 100"),
        ("crop", -3, r"cannot crop to -3: .*; to drop the last 3 positions use trim\(3\)"),
        ("crop", 2**63, f"cannot crop to {2**63}"),
        ("crop", -(2**70), f"cannot crop to {-(2**70)}"),
        ("crop", np.int64(-1), "cannot crop to -1"),
        ("trim", 8, r"cannot trim 8: the cache holds 7 positions, so n must be in \[0, 7\]$"),
        ("trim", -1, "cannot trim -1"),
        ("trim", 2**64, f"cannot trim {2**64}"),
    ],
)
def test_crop_and_trim_out_of_range_raise_input_error_and_keep_cache(tiny, op, n, message):
    """A negative crop length is refused (crop(-0) could not be told from crop(0)); numbers
    too large for any integer type are InputError like any other, never OverflowError."""
    _, cache = run(tiny, list(range(7)))
    keys = cache.layers[0].keys
    with pytest.raises(ValueError, match=message) as e:
        getattr(cache, op)(n)
    assert isinstance(e.value, kvcandle.InputError)
    assert len(cache) == 7 and cache.tokens == list(range(7))
    assert np.array_equal(cache.layers[0].keys, keys)


@pytest.mark.parametrize("op", ["crop", "trim"])
def test_crop_and_trim_reject_non_int(tiny, op):
    cache = tiny.new_cache()
    with pytest.raises(TypeError, match="n must be an int"):
        getattr(cache, op)(1.5)
    with pytest.raises(TypeError, match="n must be an int"):
        getattr(cache, op)(True)


def test_fork_shares_until_append_then_isolates(tiny):
    prefix = [10, 20, 30]
    _, base = run(tiny, prefix)
    other = base.fork()
    assert other.tokens == prefix and len(other) == 3
    assert base.is_shared and other.is_shared
    assert other.capacity == base.capacity  # same storage, nothing copied

    a = tiny.forward([40, 41], base, all_logits=True)
    b = tiny.forward([50, 51, 52], other, all_logits=True)
    ref_a, ca = run(tiny, prefix + [40, 41])
    ref_b, cb = run(tiny, prefix + [50, 51, 52])
    assert max_abs(a, ref_a[3:]) <= 1e-5 and max_abs(b, ref_b[3:]) <= 1e-5
    for layer in range(2):
        assert max_abs(base.layers[layer].keys, ca.layers[layer].keys) <= 1e-5
        assert max_abs(other.layers[layer].values, cb.layers[layer].values) <= 1e-5
    # and each keeps going on its own
    a2 = tiny.forward([42], base)
    b2 = tiny.forward([53], other)
    assert max_abs(a2, run(tiny, prefix + [40, 41, 42])[0][-1]) <= 1e-5
    assert max_abs(b2, run(tiny, prefix + [50, 51, 52, 53])[0][-1]) <= 1e-5
    assert base.tokens == prefix + [40, 41, 42] and other.tokens == prefix + [50, 51, 52, 53]


def test_fork_of_cropped_cache_does_not_see_dropped_tail(tiny):
    _, base = run(tiny, [1, 2, 3, 4, 5, 6])
    base.crop(3)
    child = base.fork()
    out_child = tiny.forward([7], child)
    out_base = tiny.forward([8, 9], base, all_logits=True)
    assert max_abs(out_child, run(tiny, [1, 2, 3, 7])[0][-1]) <= 1e-5
    assert max_abs(out_base, run(tiny, [1, 2, 3, 8, 9])[0][3:]) <= 1e-5


def test_parent_append_after_fork_does_not_leak_into_child(tiny):
    _, base = run(tiny, [1, 2, 3])
    child = base.fork()
    tiny.forward([4, 5], base)
    assert len(child) == 3
    assert max_abs(child.layers[0].keys, run(tiny, [1, 2, 3])[1].layers[0].keys) == 0.0
    out = tiny.forward([6], child)
    assert max_abs(out, run(tiny, [1, 2, 3, 6])[0][-1]) <= 1e-5


def test_storage_grows_by_blocks_without_changing_results(tmp_path):
    model = kvcandle.load(write_hf_dir(tmp_path / "long", Shape("long", max_pos=300, layers=1)))
    cache = model.new_cache()
    ids = np.random.default_rng(0).integers(0, 101, 300).tolist()
    model.forward(ids[:10], cache)
    capacities = [cache.capacity]
    for t in ids[10:]:
        model.forward([t], cache)
        if cache.capacity != capacities[-1]:
            capacities.append(cache.capacity)
    block = kvcandle.BLOCK_LEN
    assert capacities == list(range(block, 300 + block, block))  # a block at a time, to the one holding the last position
    assert len(cache) == 300 == cache.max_length
    _, ref = run(model, ids)
    assert max_abs(cache.layers[0].keys, ref.layers[0].keys) <= 1e-5
    assert max_abs(cache.layers[0].values, ref.layers[0].values) <= 1e-5


def test_forward_without_cache_runs_on_a_fresh_one(tiny):
    a = tiny.forward([1, 2, 3])
    b = tiny.forward([1, 2, 3], tiny.new_cache())
    assert a.shape == (101,) and max_abs(a, b) == 0.0


def test_numpy_ids_accepted(tiny):
    a = tiny.forward(np.array([1, 2, 3], dtype=np.int32))
    b = tiny.forward(np.array([1, 2, 3], dtype=np.uint64))
    assert max_abs(a, b) == 0.0


def test_prefill_runs_only_what_the_cache_lacks(tiny):
    cache = tiny.new_cache()
    tiny.forward([1, 2, 3], cache)
    keys_before = cache.layers[0].keys
    logits = tiny.prefill([1, 2, 3, 4, 5], cache)
    assert cache.tokens == [1, 2, 3, 4, 5]
    assert np.array_equal(cache.layers[0].keys[:, :, :3], keys_before)  # prefix untouched
    assert max_abs(logits, tiny.forward([1, 2, 3, 4, 5])) <= 1e-5
    again = tiny.prefill([1, 2, 3, 4, 5], cache)  # all cached: last position recomputed
    assert len(cache) == 5 and max_abs(again, logits) <= 1e-5


def test_prefill_refuses_a_cache_that_is_not_a_prefix(tiny):
    cache = tiny.new_cache()
    tiny.forward([1, 2, 3, 4], cache)
    with pytest.raises(kvcandle.CacheError, match=r"first difference at position 2\); crop\(2\)"):
        tiny.prefill([1, 2, 9], cache)
    assert cache.tokens == [1, 2, 3, 4]
    with pytest.raises(kvcandle.CacheError, match="first difference at position 3"):
        tiny.prefill([1, 2, 3], cache)  # the cache holds more than the prompt
    cache.crop(2)
    assert max_abs(tiny.prefill([1, 2, 9], cache), tiny.forward([1, 2, 9])) <= 1e-5


def test_forks_share_blocks_and_continue_as_fresh_caches(tmp_path):
    # a prompt of two full blocks and part of a third, forked 8 times, each fork extended
    # by its own tokens: the full blocks stay shared; the first fork to append writes in
    # place, the others copy the one partly filled block; every fork's logits equal, bit
    # for bit, a fresh cache fed the same pieces
    model = kvcandle.load(write_hf_dir(tmp_path / "long", Shape("long", max_pos=300, layers=2)))
    block = kvcandle.BLOCK_LEN
    prompt = np.random.default_rng(1).integers(0, 101, 2 * block + 22).tolist()
    cache = model.new_cache()
    model.forward(prompt, cache)
    forks = [cache.fork() for _ in range(8)]
    assert kvcandle.held_bytes([cache, *forks]) == cache.held_bytes == 3 * block * cache.bytes_per_token
    for i, f in enumerate(forks):
        mine = [i, i + 1, i + 2, 7, 7]
        got = model.forward(mine, f, all_logits=True)
        fresh = model.new_cache()
        model.forward(prompt, fresh)
        assert np.array_equal(got, model.forward(mine, fresh, all_logits=True))
        assert f.tokens == prompt + mine and f.is_shared
    assert kvcandle.held_bytes([cache, *forks]) == (3 + 7) * block * cache.bytes_per_token
    # the original still reads its own positions, and continues as a fresh cache does
    got = model.forward([9], cache)
    fresh = model.new_cache()
    model.forward(prompt, fresh)
    assert np.array_equal(got, model.forward([9], fresh))
    with pytest.raises(TypeError, match=r"caches\[1\]"):
        kvcandle.held_bytes([cache, "x"])


def test_a_fork_extended_past_its_blocks_decodes_as_a_fresh_cache(tmp_path):
    # one token at a time across block boundaries, on a fork and on a fresh cache
    model = kvcandle.load(write_hf_dir(tmp_path / "long", Shape("long", max_pos=300, layers=2)))
    ids = np.random.default_rng(2).integers(0, 101, 200).tolist()
    base = model.new_cache()
    model.forward(ids[:60], base)
    fork, fresh = base.fork(), model.new_cache()
    model.forward(ids[:60], fresh)
    model.forward([1], base)  # the original appends first: the fork must copy
    for t in ids[60:]:
        assert np.array_equal(model.forward([t], fork), model.forward([t], fresh))
    assert np.array_equal(fork.layers[1].keys, fresh.layers[1].keys)
