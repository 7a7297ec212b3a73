"""The native engine against transformers' LlamaForCausalLM in float64 (kvcandle's float32
measured against the truth, never against another float32 result) on tiny random models
of several shapes (GQA, MHA, tied, odd head counts): logits with and without cache,
chunked prefill, and the cache's keys and values."""

from __future__ import annotations

import inspect

import numpy as np
import pytest
import torch
from transformers import DynamicCache

import kvcandle

from builders import SHAPES, Shape, float64_reference, max_abs, ref_logits, write_hf_dir


def sequence(vocab: int, n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, vocab, n).tolist()


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: s.name)
def test_all_positions_match_transformers(shape, tiny_models, tiny_references):
    model, ref = tiny_models[shape.name], tiny_references[shape.name]
    ids = sequence(shape.vocab, 20, 1)
    ours = model.forward(ids, model.new_cache(), all_logits=True)
    assert ours.shape == (20, shape.vocab) and ours.dtype == np.float32
    assert max_abs(ours, ref_logits(ref, ids)) <= 1e-4


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: s.name)
def test_decode_with_cache_matches_no_cache(shape, tiny_models, tiny_references):
    model, ref = tiny_models[shape.name], tiny_references[shape.name]
    ids = sequence(shape.vocab, 16, 2)
    full = ref_logits(ref, ids)
    cache = model.new_cache()
    rows = [model.forward(ids[:4], cache)]
    for t in ids[4:]:
        rows.append(model.forward([t], cache))
    assert len(cache) == 16 and cache.tokens == ids
    assert max_abs(np.stack(rows), full[3:]) <= 1e-4
    assert (np.stack(rows).argmax(-1) == full[3:].argmax(-1)).all()


@pytest.mark.parametrize("chunks", [[3, 2], [1, 1, 1, 1, 1], [5], [2, 7, 1, 4]])
def test_chunked_prefill_equals_one_shot(chunks, tiny):
    ids = sequence(101, sum(chunks), 3)
    one_shot = tiny.forward(ids, tiny.new_cache(), all_logits=True)
    cache, rows, start = tiny.new_cache(), [], 0
    for n in chunks:
        rows.append(tiny.forward(ids[start : start + n], cache, all_logits=True))
        start += n
    assert len(cache) == len(ids)
    assert max_abs(np.concatenate(rows), one_shot) <= 1e-5


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: s.name)
def test_cache_keys_values_match_dynamic_cache(shape, tiny_models, tiny_references):
    model, ref = tiny_models[shape.name], tiny_references[shape.name]
    ids = sequence(shape.vocab, 9, 4)
    cache = model.new_cache()
    model.forward(ids[:5], cache)
    model.forward(ids[5:], cache)
    dyn = DynamicCache(config=ref.config)
    # transformers >= 5.24 names the argument `cache`; earlier 5.x `past_key_values`
    kw = "cache" if "cache" in inspect.signature(ref.forward).parameters else "past_key_values"
    with torch.inference_mode():
        ref(torch.tensor([ids]), **{kw: dyn}, use_cache=True)
    assert len(cache.layers) == len(dyn.layers) == shape.layers
    for ours, theirs in zip(cache.layers, dyn.layers):
        assert ours.keys.shape == tuple(theirs.keys.shape) == (1, shape.kv_heads, 9, shape.head_dim)
        assert max_abs(ours.keys, theirs.keys.numpy()) <= 1e-5
        assert max_abs(ours.values, theirs.values.numpy()) <= 1e-5


def test_long_input_runs_in_chunks_and_matches_transformers(tmp_path):
    shape = Shape("long", max_pos=1300, layers=1)
    path = write_hf_dir(tmp_path / "long", shape)
    model = kvcandle.load(path)
    ref = float64_reference(path)
    ids = sequence(shape.vocab, 1200, 5)  # 512 + 512 + 176 inside forward
    cache = model.new_cache()
    ours = model.forward(ids, cache, all_logits=True)
    assert ours.shape == (1200, shape.vocab) and len(cache) == 1200
    assert max_abs(ours, ref_logits(ref, ids)) <= 1e-4
    last = model.forward(ids, model.new_cache())
    assert max_abs(last, ours[-1]) <= 1e-5
