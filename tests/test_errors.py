"""Every rejected call raises a typed error naming the bad value and leaves the cache
exactly as it was."""

from __future__ import annotations

import subprocess
import sys
import threading

import numpy as np
import pytest

import kvcandle


@pytest.fixture
def used_cache(tiny):
    cache = tiny.new_cache()
    tiny.forward([4, 5, 6], cache)
    return cache


def snapshot(cache):
    return (len(cache), cache.tokens, [(l.keys.copy(), l.values.copy()) for l in cache.layers])


def assert_unchanged(cache, before):
    n, tokens, kv = before
    assert len(cache) == n and cache.tokens == tokens
    for (k, v), layer in zip(kv, cache.layers):
        assert np.array_equal(k, layer.keys) and np.array_equal(v, layer.values)


def test_past_context_length_raises_position_error_naming_the_limit(tiny, used_cache):
    before = snapshot(used_cache)
    with pytest.raises(kvcandle.PositionError, match=r"context length is 64") as e:
        tiny.forward(list(range(62)), used_cache)  # 3 + 62 > 64
    assert "at most 61 more" in str(e.value)
    assert isinstance(e.value, kvcandle.KVCandleError)
    assert_unchanged(used_cache, before)
    tiny.forward(list(range(61)), used_cache)  # exactly fills the context
    assert len(used_cache) == 64
    with pytest.raises(kvcandle.PositionError, match="position 64"):
        tiny.forward([1], used_cache)
    assert len(used_cache) == 64


@pytest.mark.parametrize("bad", [101, 1000, -1, 2**40])
def test_token_id_out_of_vocab_raises_index_error_naming_it(tiny, used_cache, bad):
    before = snapshot(used_cache)
    with pytest.raises(IndexError, match=f"token id {bad} at index 1") as e:
        tiny.forward([7, bad, 8], used_cache)
    assert isinstance(e.value, kvcandle.TokenIdError)
    assert_unchanged(used_cache, before)


def test_empty_ids_raise_value_error(tiny, used_cache):
    before = snapshot(used_cache)
    for empty in ([], np.array([], dtype=np.int64)):
        with pytest.raises(ValueError, match="ids is empty"):
            tiny.forward(empty, used_cache)
    assert_unchanged(used_cache, before)


@pytest.mark.parametrize(
    "bad,message",
    [
        ([1.0, 2.0], r"ids\[0\] must be an int, got float"),
        ([1, True], r"ids\[1\] must be an int, got bool"),
        ("hello", "ids must be a list of ints"),
        (np.array([[1, 2]]), r"1-D array, got shape \(1, 2\)"),
        (np.array([1.0, 2.0]), "integer array, got dtype float64"),
        (7, "ids must be a list of ints"),
    ],
)
def test_ids_of_wrong_type_raise_type_error(tiny, used_cache, bad, message):
    before = snapshot(used_cache)
    with pytest.raises(TypeError, match=message):
        tiny.forward(bad, used_cache)
    assert_unchanged(used_cache, before)


def test_cache_from_another_model_raises_cache_error(tiny_models, used_cache):
    other = tiny_models["mha_tied"]
    before = snapshot(used_cache)
    with pytest.raises(kvcandle.CacheError, match="made by another model"):
        other.forward([1], used_cache)
    assert_unchanged(used_cache, before)


def test_same_file_loaded_twice_gives_distinct_models(tiny_dirs, tiny):
    again = kvcandle.load(tiny_dirs["gqa"])
    cache = again.new_cache()
    with pytest.raises(kvcandle.CacheError):
        tiny.forward([1], cache)


def test_non_cache_argument_raises_type_error(tiny):
    with pytest.raises(TypeError, match="cache must be a kvcandle.KVCache"):
        tiny.forward([1], object())  # type: ignore[arg-type]


def test_upstream_cache_from_another_model_raises(tiny_models):
    a, b = tiny_models["gqa"].upstream(), tiny_models["mha_tied"].upstream()
    with pytest.raises(kvcandle.CacheError):
        b.forward([1], 0, a.new_cache())


def refusals_while_busy(run, uses):
    """Runs ``run`` in a thread and calls each of ``uses`` until each has found the cache
    busy (CacheError) or the thread is done; returns the result and the messages."""
    done = []
    worker = threading.Thread(target=lambda: done.append(run()))
    refused: dict[str, str] = {}
    worker.start()
    while worker.is_alive() and len(refused) < len(uses):
        for name, use in uses.items():
            if name not in refused:
                try:
                    use()
                except kvcandle.CacheError as e:
                    refused[name] = str(e)
    worker.join()
    assert sorted(refused) == sorted(uses), f"never found the cache busy for {set(uses) - set(refused)}"
    assert all("in use by another call" in m for m in refused.values())
    return done, refused


def test_cache_used_by_another_thread_during_forward_is_a_cache_error(default_model):
    """While one thread's forward holds the cache (the GIL released), every other use of
    it raises CacheError naming the reason, never PyO3's generic RuntimeError."""
    cache = default_model.new_cache()
    uses = {
        "len": lambda: len(cache),
        "tokens": lambda: cache.tokens,
        "keys": lambda: cache.layers[0].keys,
        "fork": cache.fork,
        "crop": lambda: cache.crop(0),
        "reset": cache.reset,
        "forward": lambda: default_model.forward([1], cache),
        "forward_batch": lambda: default_model.forward_batch([[1], [1]], [other, cache]),
    }
    other = default_model.new_cache()
    done, refused = refusals_while_busy(lambda: default_model.forward(list(range(1000, 1400)), cache), uses)
    assert done and done[0].shape == (49152,)  # the forward itself completed
    assert refused["forward_batch"].startswith("sequence 1: "), refused["forward_batch"]  # names the sequence
    assert len(other) == 0


CTRL_C_IN_FIRST_FORWARD = """
import os, signal, threading, kvcandle
model = kvcandle.load()
cache = model.new_cache()
threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT)).start()
try:
    model.forward(list(range(1000, 3000)), cache)
    print("finished")
except KeyboardInterrupt:
    print("interrupted", len(cache))
"""


def test_ctrl_c_during_a_forward_is_a_keyboard_interrupt_and_changes_nothing(default_model):
    """A process's first forward, interrupted by a real SIGINT: a KeyboardInterrupt (numpy's
    C API was loaded lazily by the first result and panicked on the pending signal), and
    the cache as it was before the call (its logits are lost, so its positions go too)."""
    del default_model  # installed
    out = subprocess.run([sys.executable, "-c", CTRL_C_IN_FIRST_FORWARD], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and out.stdout.split() == ["interrupted", "0"], (out.stdout, out.stderr[-2000:])
    assert "panicked" not in out.stderr, out.stderr[-2000:]


def test_upstream_cache_used_by_another_thread_is_a_cache_error(default_model):
    up = default_model.upstream()
    cache = up.new_cache(True)
    uses = {"clone": cache.clone, "use_kv_cache": lambda: cache.use_kv_cache, "forward": lambda: up.forward([1], 0, cache)}
    done, _ = refusals_while_busy(lambda: up.forward(list(range(1000, 1400)), 0, cache), uses)
    assert done and done[0].shape == (49152,)


@pytest.mark.parametrize(
    "ids,error,message",
    [
        ([2**63], kvcandle.TokenIdError, f"token id {2**63} at index 0"),
        ([5, 2**64 - 1], kvcandle.TokenIdError, f"token id {2**64 - 1} at index 1"),
        (np.array([7, 2**64 - 1], dtype=np.uint64), kvcandle.TokenIdError, f"token id {2**64 - 1} at index 1"),
        ([-(2**70)], kvcandle.TokenIdError, f"token id {-(2**70)} at index 0"),
    ],
)
def test_ids_no_integer_type_holds_are_token_id_errors(tiny, used_cache, ids, error, message):
    """Never OverflowError: an id too large for any integer type is out of the vocabulary."""
    before = snapshot(used_cache)
    with pytest.raises(error, match=message):
        tiny.forward(ids, used_cache)
    assert_unchanged(used_cache, before)


def refused_generate_cases(model):
    vocab, limit = model.config.vocab_size, model.config.max_position_embeddings
    other = kvcandle.load(model.path)  # the same file loaded again: another model
    return [
        (dict(prompt=[1, 2, vocab]), kvcandle.TokenIdError, f"token id {vocab} at index 2"),
        (dict(prompt=[1] * (limit + 1)), kvcandle.PositionError, f"cannot run {limit + 1} token"),
        (dict(prompt=[1, 2], model=other), kvcandle.CacheError, "made by another model"),
    ]


def test_refused_generate_leaves_the_cache_exactly_as_it_was_and_the_next_call_is_right(default_model):
    """generate crops a reused cache to its common prefix with the prompt; a prompt it
    refuses must not have cropped it first. After each refusal the cache continues
    exactly as a fresh run does."""
    model = default_model
    cache = model.new_cache()
    model.forward([4, 5, 6, 7], cache)
    for kwargs, error, message in refused_generate_cases(model):
        with pytest.raises(error, match=message):
            kvcandle.generate(kwargs.get("model", model), kwargs["prompt"], cache=cache, max_tokens=2)
        assert cache.tokens == [4, 5, 6, 7]
    fresh = model.new_cache()
    model.forward([4, 5, 6, 7], fresh)  # the same pieces: the same arithmetic, bit for bit
    assert np.array_equal(model.forward([8], cache), model.forward([8], fresh))
