"""quantized=True on the default model (a Q4_1 file; every other block type: test_block_types.py): linear layers run from their blocks with int8
activations (llama.cpp's approach). Not bit-parity with float32, so the checks are that
it is the same model (top-1 agreement along the reference sequence), that the cache
behaves exactly as in float mode, and that it refuses what it cannot do."""

from __future__ import annotations

import numpy as np
import pytest

import kvcandle
from builders import SHAPES, max_abs, write_gguf

SEQ = [504, 3575, 282, 4649, 314, 7042, 30, 198, 198, 504, 2988, 314, 42, 216, 34, 32, 33, 40, 29, 32, 33, 29, 34, 34]


def test_same_model_as_float(default_quantized, default_model):
    assert default_quantized.quantized and not default_model.quantized
    assert default_quantized.config == default_model.config
    cq, cf = default_quantized.new_cache(), default_model.new_cache()
    # int8 activations: an 8-bit cache by default (README: the default cache per model)
    assert (cq.dtype, cf.dtype) == ("q8_0", "float32")
    rq = np.stack([default_quantized.forward(SEQ[:5], cq)] + [default_quantized.forward([t], cq) for t in SEQ[5:]])
    rf = np.stack([default_model.forward(SEQ[:5], cf)] + [default_model.forward([t], cf) for t in SEQ[5:]])
    agree = int((rq.argmax(-1) == rf.argmax(-1)).sum())
    print(f"quantized vs float32: top-1 {agree}/20, max|diff| {max_abs(rq, rf):.3f}")
    assert agree >= 18
    assert max_abs(rq, rf) < 8.0  # int8 activations: logits move by a few units at most
    assert cq.layers[0].keys.shape == cf.layers[0].keys.shape == (1, 3, 24, 64)
    r = kvcandle.generate(default_quantized, "The capital of France is", max_tokens=8)
    assert r.text.startswith(" Paris")


def test_cache_semantics_are_unchanged(default_quantized):
    prefix = SEQ[:3]
    base = default_quantized.new_cache()
    default_quantized.forward(prefix, base)
    branch = base.fork()
    a = default_quantized.forward([4649, 314], base)
    b = default_quantized.forward([9407, 314], branch)
    fresh_a = default_quantized.forward(prefix + [4649, 314], default_quantized.new_cache())
    fresh_b = default_quantized.forward(prefix + [9407, 314], default_quantized.new_cache())
    # chunks of up to SMALL_CHUNK tokens run as rows of decode steps: chunking is exact
    assert np.array_equal(a, fresh_a) and np.array_equal(b, fresh_b)
    base.crop(3)
    assert np.array_equal(default_quantized.forward([4649, 314], base), fresh_a)


def test_long_prompt_uses_the_float_path(default_quantized, default_model):
    ids = SEQ + SEQ  # 48 rows: dequantized blocks, float matmul, as the float model
    # with the float model's cache (the quantized model's default cache is 8-bit)
    a = default_quantized.forward(ids, default_quantized.new_cache("float32"), all_logits=True)
    b = default_model.forward(ids, all_logits=True)
    assert max_abs(a, b) <= 1e-3


def test_upstream_refuses_kept_weights(default_quantized):
    with pytest.raises(kvcandle.InputError, match="upstream Llama runs float weights"):
        default_quantized.upstream()


def test_float32_directory_loads_quantized_as_float(tiny_dirs, tiny_models):
    """quantized=True keeps what the file stores: float32 safetensors stay float32."""
    q, f = kvcandle.load(tiny_dirs["gqa"], quantized=True), tiny_models["gqa"]
    assert not q.quantized and q.weight_bytes == f.weight_bytes
    assert max_abs(q.forward([1, 2, 3]), f.forward([1, 2, 3])) == 0.0


def test_float_gguf_loads_quantized_as_float(tmp_path):
    path = write_gguf(tmp_path / "f32.gguf", SHAPES[0])  # float32 tensors: nothing to keep quantized
    q, f = kvcandle.load(path, quantized=True), kvcandle.load(path)
    assert max_abs(q.forward([1, 2, 3]), f.forward([1, 2, 3])) == 0.0
