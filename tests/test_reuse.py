"""One way to bring a cache in line with a sequence (Model.sync), and prefix reuse
(PromptCache)."""

from __future__ import annotations

import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest

import kvcandle
from builders import ref_logits
from kvcandle import parity

A = [3, 9, 27, 81, 43, 29, 87, 61, 83, 49]


def test_sync_runs_only_what_the_cache_lacks(tiny: kvcandle.Model, tiny_references: dict) -> None:
    cache = tiny.new_cache()
    s = tiny.sync(A[:4], cache)
    assert (s.kept, s.ran, len(cache)) == (0, 4, 4)
    s = tiny.sync(A, cache)
    assert (s.kept, s.ran, cache.tokens) == (4, 6, A)
    # measured against float64, within the bound test_engine_tiny.py holds every path to
    assert np.max(np.abs(s.logits - ref_logits(tiny_references["gqa"], A)[-1])) <= 1e-4
    # everything held: the last position runs again for its logits
    s = tiny.sync(A, cache)
    assert (s.kept, s.ran, cache.tokens) == (9, 1, A)


def test_sync_policy_for_a_cache_that_diverges(tiny: kvcandle.Model) -> None:
    cache = tiny.new_cache()
    tiny.forward(A, cache)
    other = A[:5] + [1, 2]
    with pytest.raises(kvcandle.CacheError, match="first difference at position 5"):
        tiny.sync(other, cache, diverged="raise")
    assert cache.tokens == A  # refused: unchanged
    with pytest.raises(kvcandle.CacheError):
        tiny.prefill(other, cache)
    s = tiny.sync(other, cache, diverged="crop")
    assert (s.kept, s.ran, cache.tokens) == (5, 2, other)
    with pytest.raises(kvcandle.InputError, match="diverged"):
        tiny.sync(other, cache, diverged="keep")  # type: ignore[arg-type]


def test_sync_refuses_before_changing_anything(tiny: kvcandle.Model) -> None:
    cache = tiny.new_cache()
    tiny.forward(A, cache)
    with pytest.raises(kvcandle.TokenIdError):
        tiny.sync(A[:2] + [10**6], cache)
    with pytest.raises(kvcandle.PositionError):
        tiny.sync(A[:2] + [1] * tiny.config.max_position_embeddings, cache)
    with pytest.raises(kvcandle.InputError):
        tiny.sync([], cache)
    assert cache.tokens == A


def test_generate_reports_reused_tokens(default_model: kvcandle.Model) -> None:
    cache = default_model.new_cache()
    prompt = default_model.tokenizer.encode("The capital of France is")
    first = kvcandle.generate(default_model, prompt, max_tokens=3, cache=cache)
    again = kvcandle.generate(default_model, prompt + first.tokens, max_tokens=3, cache=cache)
    assert first.stats.reused_tokens == 0
    # the cache holds the prompt and every generated token but the last
    assert again.stats.reused_tokens == len(prompt) + len(first.tokens) - 1
    assert again.stats.prefill_tokens == 1


def test_prompt_cache_lookup_gives_the_longest_shared_prefix(tiny: kvcandle.Model) -> None:
    pc = kvcandle.PromptCache(tiny, max_bytes=10**9)
    c = tiny.new_cache()
    tiny.forward(A, c)
    assert pc.insert(c) and len(pc) == 1
    assert pc.nbytes == c.held_bytes
    hit = pc.lookup(A[:6] + [5, 5])
    assert hit.tokens == A[:6]
    # the entry is a fork: appending to the found cache never changes it
    tiny.forward([5, 5], hit)
    assert pc.lookup(A).tokens == A
    miss = pc.lookup([7, 7])
    assert len(miss) == 0
    # a prefix of an entry only touches it; an extension replaces it
    short = tiny.new_cache()
    tiny.forward(A[:3], short)
    assert pc.insert(short) and pc.entries() == [A]
    longer = c.fork()
    tiny.forward([11], longer)
    assert pc.insert(longer) and pc.entries() == [A + [11]]


def test_prompt_cache_continuation_equals_a_fresh_prefill(default_model: kvcandle.Model) -> None:
    tok = default_model.tokenizer
    doc = tok.encode("A long shared document about the history of the Roman Empire. " * 8)
    question = tok.encode(" Who was the first emperor?")
    pc = kvcandle.PromptCache(default_model, max_bytes=10**9)
    c = default_model.new_cache()
    default_model.forward(doc + tok.encode(" Where was Rome?"), c)
    pc.insert(c)
    found = pc.lookup(doc + question)
    assert len(found) >= len(doc)
    got = default_model.sync(doc + question, found).logits
    want = default_model.forward(doc + question)
    # two float32 paths (other chunks), each held within parity.TOLERANCE of float64 by
    # test_parity.py: they differ by at most twice that (2e-5 seen here)
    margin = 2 * parity.TOLERANCE
    assert np.max(np.abs(got - want)) <= margin
    top2 = np.sort(want)[-2:]
    assert top2[1] - top2[0] > 2 * margin, "the prompt must have a clear next token for the argmax check"
    assert int(np.argmax(got)) == int(np.argmax(want))


def test_prompt_cache_evicts_least_recently_used(tiny: kvcandle.Model) -> None:
    caches = []
    for start in (1, 2, 3):
        c = tiny.new_cache()
        tiny.forward([start] * 10, c)
        caches.append(c)
    per = caches[0].held_bytes  # one block
    pc = kvcandle.PromptCache(tiny, max_bytes=2 * per)
    pc.insert(caches[0])
    pc.insert(caches[1])
    pc.lookup([1] * 4)  # the first becomes the most recently used
    pc.insert(caches[2])
    assert pc.entries() == [[1] * 10, [3] * 10]
    assert pc.nbytes <= pc.max_bytes
    assert not kvcandle.PromptCache(tiny, max_bytes=per - 1).insert(caches[0])
    with pytest.raises(kvcandle.InputError, match="max_bytes"):
        kvcandle.PromptCache(tiny, max_bytes=-1)


def test_prompt_cache_refuses_other_models_caches(tiny_models: dict[str, kvcandle.Model]) -> None:
    pc = kvcandle.PromptCache(tiny_models["gqa"], max_bytes=10**9)
    c = tiny_models["mha_tied"].new_cache()
    tiny_models["mha_tied"].forward([1, 2], c)
    with pytest.raises(kvcandle.CacheError):
        pc.insert(c)


def test_prompt_cache_saves_and_loads_a_directory(tiny: kvcandle.Model, tiny_models: dict[str, kvcandle.Model], tmp_path: Path) -> None:
    pc = kvcandle.PromptCache(tiny, max_bytes=10**9)
    for start in (1, 2):
        c = tiny.new_cache()
        tiny.forward([start] * 6, c)
        pc.insert(c)
    # another model's entries in the same directory are left alone
    other = kvcandle.PromptCache(tiny_models["mha_tied"], max_bytes=10**9)
    oc = tiny_models["mha_tied"].new_cache()
    tiny_models["mha_tied"].forward([4, 4], oc)
    other.insert(oc)
    other.save(tmp_path)
    pc.save(tmp_path)
    back = kvcandle.PromptCache.load(tmp_path, tiny, max_bytes=10**9)
    assert sorted(back.entries()) == [[1] * 6, [2] * 6]
    assert np.array_equal(back.lookup([2] * 6).layers[0].keys, pc.lookup([2] * 6).layers[0].keys)
    pc.clear()
    pc.save(tmp_path)  # entries no longer held are removed; the other model's stay
    assert len(kvcandle.PromptCache.load(tmp_path, tiny, max_bytes=10**9)) == 0
    assert len(kvcandle.PromptCache.load(tmp_path, tiny_models["mha_tied"], max_bytes=10**9)) == 1
    # a damaged entry is skipped with a warning naming it
    c = tiny.new_cache()
    tiny.forward([9] * 3, c)
    pc.insert(c)
    before = set(tmp_path.iterdir())  # the other model's file
    pc.save(tmp_path)
    (victim,) = set(tmp_path.iterdir()) - before
    victim.write_bytes(victim.read_bytes()[:50])
    with pytest.warns(kvcandle.KVCandleWarning, match=victim.name):
        assert len(kvcandle.PromptCache.load(tmp_path, tiny, max_bytes=10**9)) == 0


def test_prompt_cache_save_removes_temporaries_killed_saves_left(tiny: kvcandle.Model, tiny_models: dict[str, kvcandle.Model], tmp_path: Path) -> None:
    """A save killed between writing and renaming leaves a hidden temporary file as large
    as the cache; an entry evicted since is never saved again, so the next
    ``PromptCache.save`` removes this model's temporaries whose process has ended, and
    nothing else."""
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    pc = kvcandle.PromptCache(tiny, max_bytes=10**9)
    c = tiny.new_cache()
    tiny.forward([3] * 4, c)
    pc.insert(c)
    pc.save(tmp_path)
    (entry,) = tmp_path.iterdir()
    other = kvcandle.PromptCache(tiny_models["mha_tied"], max_bytes=10**9)
    oc = tiny_models["mha_tied"].new_cache()
    tiny_models["mha_tied"].forward([4, 4], oc)
    other.insert(oc)
    other.save(tmp_path)
    (other_entry,) = set(tmp_path.iterdir()) - {entry}
    prefix = entry.name[: entry.name.index("-") + 1]
    assert not other_entry.name.startswith(prefix)
    made = {
        f".{prefix}0123abcd.kvcache.safetensors.{gone.pid}-5.tmp": False,  # an evicted entry's, its process gone
        f".{entry.name}.{gone.pid}-6.tmp": False,
        f".{prefix}0123abcd.kvcache.safetensors.1-5.tmp": True,  # a running process's
        f".{other_entry.name}.{gone.pid}-5.tmp": True,  # another model's
    }
    for name in made:
        (tmp_path / name).write_bytes(b"partial")
    pc.save(tmp_path)
    for name, stays in made.items():
        assert (tmp_path / name).exists() == stays, name
    assert entry.exists() and other_entry.exists()


def test_prompt_cache_files_of_two_loads_of_one_file_are_apart(default_model: kvcandle.Model, default_quantized: kvcandle.Model, tmp_path: Path) -> None:
    """The float32 and quantized loads of one GGUF file are two models (a cache of one
    does not load into the other): each keeps its own files in a shared directory, even
    for the same tokens, and saving one never removes the other's."""
    ids = default_model.tokenizer.encode("The capital of France is Paris, and the capital of Italy is")
    for model in (default_model, default_quantized):
        pc = kvcandle.PromptCache(model, max_bytes=10**9)
        c = model.new_cache()
        model.forward(ids, c)
        pc.insert(c)
        pc.save(tmp_path)
    assert len(list(tmp_path.iterdir())) == 2
    for model in (default_model, default_quantized):
        back = kvcandle.PromptCache.load(tmp_path, model, max_bytes=10**9)
        assert back.entries() == [ids]
        assert len(back.lookup(ids)) == len(ids)
        back.clear()
        back.save(tmp_path)  # removes its own file only
    assert list(tmp_path.iterdir()) == []


def test_prompt_cache_files_of_the_earlier_naming_are_read_and_renamed(default_model: kvcandle.Model, default_quantized: kvcandle.Model, tmp_path: Path) -> None:
    """Until 2026-12-07 a prompt cache's files were named by the weights' hash alone (the
    float32 and quantized loads of one file shared it). Each model's load reads its own
    of them (the other's are left alone, with no warning) and the next save to the
    directory writes them under the current naming and removes them."""
    ids = {m: m.tokenizer.encode(text) for m, text in ((default_model, "The capital of France is"), (default_quantized, "The capital of Italy is"))}
    current = {}
    for model in (default_model, default_quantized):
        pc = kvcandle.PromptCache(model, max_bytes=10**9)
        c = model.new_cache()
        model.forward(ids[model], c)
        pc.insert(c)
        before = set(tmp_path.iterdir())
        pc.save(tmp_path)
        (path,) = set(tmp_path.iterdir()) - before
        current[model] = path.name
        # the same file as the earlier naming had it: the weights' hash, then the entry's digest
        earlier = model.fingerprint["model.weights"][:16] + path.name[path.name.index("-"):]
        path.rename(tmp_path / earlier)
    assert len(list(tmp_path.iterdir())) == 2
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the other model's earlier file is not "damaged"
        back = kvcandle.PromptCache.load(tmp_path, default_model, max_bytes=10**9)
    assert back.entries() == [ids[default_model]]
    assert np.array_equal(back.lookup(ids[default_model]).layers[3].values, _prefilled(default_model, ids[default_model]).layers[3].values)
    back.save(tmp_path)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert current[default_model] in names and len(names) == 2  # renamed; the quantized model's untouched
    back_q = kvcandle.PromptCache.load(tmp_path, default_quantized, max_bytes=10**9)
    assert back_q.entries() == [ids[default_quantized]]
    back_q.save(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(current.values())


def _prefilled(model: kvcandle.Model, ids: list[int]) -> kvcandle.KVCache:
    cache = model.new_cache()
    model.forward(ids, cache)
    return cache


def test_prompt_cache_an_entry_that_never_fits_evicts_nothing(default_model: kvcandle.Model) -> None:
    small, big = default_model.new_cache(), default_model.new_cache()
    default_model.forward([1] * 10, small)
    default_model.forward([1] * 10 + [2] * 100, big)  # an extension of the entry, two blocks
    pc = kvcandle.PromptCache(default_model, max_bytes=small.held_bytes)
    assert pc.insert(small)
    assert not pc.insert(big)
    assert pc.entries() == [[1] * 10] and pc.nbytes == small.held_bytes


def test_prompt_cache_directory_errors_are_cache_file_errors(tiny: kvcandle.Model, tmp_path: Path) -> None:
    pc = kvcandle.PromptCache(tiny, max_bytes=10**9)
    c = tiny.new_cache()
    tiny.forward([5] * 4, c)
    pc.insert(c)
    a_file = tmp_path / "a-file"
    a_file.write_text("not a directory")
    with pytest.raises(kvcandle.CacheFileError, match="a-file"):
        pc.save(a_file)
    with pytest.raises(kvcandle.CacheFileError, match="not a directory"):
        kvcandle.PromptCache.load(a_file, tiny, max_bytes=10**9)
    folder = tmp_path / "folder"
    pc.save(folder)
    (entry,) = folder.iterdir()
    entry.unlink()
    entry.mkdir()  # a directory where the entry's file goes
    (entry / "x").write_text("")
    pc.clear()
    with pytest.raises(kvcandle.CacheFileError, match="folder"):
        pc.save(folder)  # cannot remove it: refused by name, not an OSError
    assert a_file.read_text() == "not a directory"


def test_generate_with_a_prompt_cache(default_model: kvcandle.Model) -> None:
    doc = "Notes: the meeting is on Tuesday at noon in room 4. " * 6
    pc = kvcandle.PromptCache(default_model, max_bytes=10**9)
    first = kvcandle.generate(default_model, doc + "When is the meeting?", max_tokens=4, prompt_cache=pc)
    second = kvcandle.generate(default_model, doc + "Where is the meeting?", max_tokens=4, prompt_cache=pc)
    assert first.stats.reused_tokens == 0
    assert second.stats.reused_tokens >= len(default_model.tokenizer.encode(doc)) - 2
    # the same steps on one plain cache (kept and cropped to the shared prefix by sync):
    # the prompt cache's fork computes exactly that
    cache = default_model.new_cache()
    kvcandle.generate(default_model, doc + "When is the meeting?", max_tokens=4, cache=cache)
    plain = kvcandle.generate(default_model, doc + "Where is the meeting?", max_tokens=4, cache=cache)
    assert (second.tokens, second.stats.reused_tokens) == (plain.tokens, plain.stats.reused_tokens)


def test_prompt_cache_counts_shared_blocks_once(tmp_path) -> None:
    from builders import Shape, write_hf_dir

    model = kvcandle.load(write_hf_dir(tmp_path / "long", Shape("long", max_pos=300, layers=1)))
    block = kvcandle.BLOCK_LEN
    prompt = [i % 100 + 1 for i in range(2 * block)]  # two full blocks
    base = model.new_cache()
    model.forward(prompt, base)
    a, b = base.fork(), base.fork()
    model.forward([3, 3], a)
    model.forward([4, 4], b)
    pc = kvcandle.PromptCache(model, max_bytes=10**9)
    assert pc.insert(a) and pc.insert(b) and len(pc) == 2
    # two full blocks shared, and each entry's own third block
    assert pc.nbytes == 4 * block * base.bytes_per_token < a.held_bytes + b.held_bytes
    # a budget of the four blocks keeps both entries; one block less drops the older
    assert kvcandle.PromptCache(model, max_bytes=pc.nbytes).insert(a)
    small = kvcandle.PromptCache(model, max_bytes=pc.nbytes - 1)
    small.insert(a)
    small.insert(b)
    assert small.entries() == [prompt + [4, 4]]
