"""Saving and loading caches: the round trip is exact, a file of another model is refused
naming what differs, damaged files raise typed errors, and an interrupted save leaves the
earlier file loadable."""

from __future__ import annotations

import json
import os
import signal
import struct
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

import kvcandle

PROMPT = [1, 5, 9, 14, 3, 7, 22, 8]


def same_cache(a: kvcandle.KVCache, b: kvcandle.KVCache) -> bool:
    return a.tokens == b.tokens and all(
        np.array_equal(x.keys, y.keys) and np.array_equal(x.values, y.values) for x, y in zip(a.layers, b.layers)
    )


@pytest.fixture(params=["tiny float32", "tiny float16", "default quantized"])
def model(request: pytest.FixtureRequest, tiny_dirs: dict[str, Path]) -> kvcandle.Model:
    if request.param == "tiny float32":
        return request.getfixturevalue("tiny")
    if request.param == "tiny float16":
        return kvcandle.load(tiny_dirs["gqa"], dtype="float16")
    return request.getfixturevalue("default_quantized")


def test_round_trip_is_exact_and_continues_identically(model: kvcandle.Model, tmp_path: Path) -> None:
    cache = model.new_cache()
    model.forward(PROMPT, cache)
    path = tmp_path / "c.kvcache"
    cache.save(path)
    loaded = kvcandle.load_cache(path, model)
    assert len(loaded) == len(PROMPT) and same_cache(cache, loaded)
    assert loaded.layers[0].keys.dtype == cache.layers[0].keys.dtype
    # the file holds the positions, not the capacity (64 positions at least): the
    # data plus a header (names, shapes, the fingerprint) of a few KB
    data = len(PROMPT) * cache.bytes_per_token
    assert cache.capacity >= 64 and data <= os.path.getsize(path) < data + 16384
    assert np.array_equal(model.forward([4, 6], cache, all_logits=True), model.forward([4, 6], loaded, all_logits=True))
    assert same_cache(cache, loaded)


def test_an_empty_cache_round_trips(tiny: kvcandle.Model, tmp_path: Path) -> None:
    tiny.new_cache().save(tmp_path / "e")
    loaded = kvcandle.load_cache(tmp_path / "e", tiny)
    assert len(loaded) == 0 and loaded.tokens == []
    assert np.array_equal(tiny.forward(PROMPT, loaded), tiny.forward(PROMPT))


def test_a_file_of_another_model_names_what_differs(tiny_models: dict[str, kvcandle.Model], tiny_dirs: dict[str, Path], tmp_path: Path) -> None:
    a = tiny_models["gqa"]
    cache = a.new_cache()
    a.forward(PROMPT, cache)
    cache.save(tmp_path / "c")
    with pytest.raises(kvcandle.CacheError, match="model.architecture.*model.weights"):
        kvcandle.load_cache(tmp_path / "c", tiny_models["mha_tied"])
    with pytest.raises(kvcandle.CacheError, match='model.dtype: the file has "float32", this model "float16"'):
        kvcandle.load_cache(tmp_path / "c", kvcandle.load(tiny_dirs["gqa"], dtype="float16"))


def test_quantized_and_float_caches_are_different_models(default_model: kvcandle.Model, default_quantized: kvcandle.Model, tmp_path: Path) -> None:
    cache = default_quantized.new_cache()
    default_quantized.forward(PROMPT, cache)
    cache.save(tmp_path / "q")
    with pytest.raises(kvcandle.CacheError, match="model.quantized"):
        kvcandle.load_cache(tmp_path / "q", default_model)


def _valid_file(model: kvcandle.Model, path: Path) -> bytes:
    cache = model.new_cache()
    model.forward(PROMPT, cache)
    cache.save(path)
    return path.read_bytes()


def _with_header(data: bytes, edit) -> bytes:
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8 : 8 + n])
    edit(header)
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + data[8 + n :]


def _set_meta(key: str, value: str):
    def edit(h: dict) -> None:
        h["__metadata__"][key] = value
    return edit


def _lie_about_shape(h: dict) -> None:
    h["layers.0.keys"]["shape"] = [1, 2, 10**12, 8]


def _grow_offsets(h: dict) -> None:
    h["layers.0.keys"]["data_offsets"][1] += 4


DAMAGE = {
    "empty": lambda d: b"",
    "truncated header": lambda d: d[:20],
    "truncated data": lambda d: d[:-10],
    "huge header length": lambda d: struct.pack("<Q", 2**62) + d[8:],
    "not json": lambda d: d[:8] + b"\xff" * (len(d) - 8),
    "foreign format": lambda d: _with_header(d, _set_meta("format", "something.else")),
    "future version": lambda d: _with_header(d, _set_meta("version", "99")),
    "other dtype": lambda d: _with_header(d, _set_meta("dtype", "bf16")),
    "shape lies": lambda d: _with_header(d, _lie_about_shape),
    "offsets lie": lambda d: _with_header(d, _grow_offsets),
    "no metadata": lambda d: _with_header(d, lambda h: h.pop("__metadata__")),
    "tensor missing": lambda d: _with_header(d, lambda h: h.pop("layers.1.values")),
    "a value flipped": lambda d: d[:-5] + bytes([d[-5] ^ 0x10]) + d[-4:],
    "checksum edited": lambda d: _with_header(d, _set_meta("checksum", "0" * 16)),
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_damaged_files_raise_cache_file_error(damage: str, tiny: kvcandle.Model, tmp_path: Path) -> None:
    data = _valid_file(tiny, tmp_path / "good")
    bad = tmp_path / "bad"
    bad.write_bytes(DAMAGE[damage](data))
    with pytest.raises(kvcandle.CacheFileError):
        kvcandle.load_cache(bad, tiny)


def test_token_ids_outside_the_vocabulary_are_refused(tiny: kvcandle.Model, tmp_path: Path) -> None:
    data = bytearray(_valid_file(tiny, tmp_path / "good"))
    n = struct.unpack("<Q", data[:8])[0]
    start = json.loads(data[8 : 8 + n])["tokens"]["data_offsets"][0] + 8 + n
    data[start : start + 4] = struct.pack("<I", tiny.config.vocab_size)
    (tmp_path / "bad").write_bytes(bytes(data))
    with pytest.raises(kvcandle.CacheFileError, match=f"token id {tiny.config.vocab_size} at index 0"):
        kvcandle.load_cache(tmp_path / "bad", tiny)


def test_missing_file_and_bad_arguments(tiny: kvcandle.Model, tmp_path: Path) -> None:
    with pytest.raises(kvcandle.CacheFileError, match="nowhere"):
        kvcandle.load_cache(tmp_path / "nowhere", tiny)
    with pytest.raises(TypeError):
        kvcandle.load_cache(42, tiny)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        kvcandle.load_cache(tmp_path / "x", "model")  # type: ignore[arg-type]
    with pytest.raises(kvcandle.CacheFileError):
        tiny.new_cache().save(tmp_path / "no-such-dir" / "c")


def test_a_save_killed_mid_write_leaves_the_previous_file_loadable(tmp_path: Path) -> None:
    # a child process saves a short cache, then saves bigger ones over it in a loop; it is
    # killed at some point of a write, and the file must still be one complete save
    path = tmp_path / "c.kvcache"
    ready = tmp_path / "ready"
    script = textwrap.dedent(
        f"""
        import kvcandle
        model = kvcandle.load()
        cache = model.new_cache()
        model.forward(list(range(10, 20)), cache)
        cache.save({str(path)!r})
        model.forward(list(range(100, 1100)), cache)
        open({str(ready)!r}, "w").close()
        while True:
            cache.save({str(path)!r})
        """
    )
    child = subprocess.Popen([sys.executable, "-c", script])
    try:
        deadline = time.monotonic() + 120
        while not ready.exists():
            assert child.poll() is None, "the saving process ended early"
            assert time.monotonic() < deadline, "the saving process never got going"
            time.sleep(0.05)
        time.sleep(0.7)
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    model = kvcandle.load()
    loaded = kvcandle.load_cache(path, model)
    assert loaded.tokens in (list(range(10, 20)), list(range(10, 20)) + list(range(100, 1100)))
    # The next save to the path removes the temporary file the killed process may have
    # left (as large as the cache), and only temporaries of that path whose process no
    # longer runs: made here for certain, beside one of a running process (pid 1), one
    # of this process (another thread of it may be writing) and one of another file.
    dead = child.pid
    made = {
        f".c.kvcache.{dead}-17.tmp": False,
        ".c.kvcache.1-17.tmp": True,
        f".c.kvcache.{os.getpid()}-17.tmp": True,
        f".d.kvcache.{dead}-17.tmp": True,
        f".c.kvcache.{dead}-x.tmp": True,  # not a name a save writes
    }
    for name in made:
        (tmp_path / name).write_bytes(b"partial")
    loaded.save(path)
    for name, stays in made.items():
        assert (tmp_path / name).exists() == stays, name
    assert not [p.name for p in tmp_path.glob(f".c.kvcache.{dead}-*.tmp") if not p.name.endswith("-x.tmp")]
    assert kvcandle.load_cache(path, model).tokens == loaded.tokens
