"""Every GGUF block type kvcandle keeps (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K..Q6_K, and the
16-bit floats F16 and BF16, kept 16-bit and multiplied in float32): a
tiny model whose linear layers and lm_head are blocks of that type, loaded with
``quantized=True``, against transformers in float64 on the same weights dequantized by
gguf-py (an independent reading of the formats).

- Prompts of more than ``kvcandle.SMALL_CHUNK`` tokens dequantize tiles of blocks and
  multiply in float32: the float parity bound holds.
- Single-token steps (and shorter chunks, which run as rows of one) multiply the blocks
  with int8 activations (as llama.cpp does):
  each activation is rounded to 1/254 of its block's largest, so logits move by up to
  about a per cent of their range; the bound is stated relative to that range.
- The blocks are kept: the weights held are the file's tensor bytes (Q8_0: repacked with
  float32 scales, a little more).
- fork and crop stay exact.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest

import kvcandle
from builders import BLOCK_TYPES, Shape, float64_reference, max_abs, quantized_weights, ref_logits, write_gguf, write_hf_dir

# K-quant blocks hold 256 values: every input width a multiple of 256
SHAPE = Shape("blocks", hidden=256, intermediate=512, heads=4, kv_heads=2, layers=2, max_pos=64)
# more ids than a chunk that runs as rows of a single-token step: the prefill path
IDS = np.random.default_rng(12).integers(0, 101, kvcandle.SMALL_CHUNK + 8).tolist()
PARITY = 1e-4  # float32 paths against float64, as for float models
INT8_ACTIVATIONS = 2e-2  # of the logits' range; measured worst 0.56 % (Q5_1), K-quants 0.25-0.34 %


@pytest.fixture(scope="module", params=BLOCK_TYPES)
def case(request, tmp_path_factory):
    qtype = request.param
    d = tmp_path_factory.mktemp(qtype)
    floats, blocks = quantized_weights(SHAPE, qtype, seed=3)
    path = write_gguf(d / f"{qtype}.gguf", SHAPE, weights=floats, blocks=blocks)
    ref = float64_reference(write_hf_dir(d / "hf", SHAPE, weights=floats))
    return qtype, path, kvcandle.load(path, quantized=True), ref_logits(ref, IDS)


def test_blocks_are_kept(case):
    qtype, path, model, _ = case
    assert model.quantized
    file_bytes = sum(int(t.n_bytes) for t in gguf.GGUFReader(str(path)).tensors)
    if qtype == "Q8_0":
        # repacked: a float32 instead of a float16 scale
        assert file_bytes < model.weight_bytes <= 1.2 * file_bytes
    else:
        assert model.weight_bytes == file_bytes


def test_prefill_from_dequantized_tiles_matches_float64(case):
    qtype, _, model, want = case
    # a float32 cache: the products' parity (a block type's default cache is 8-bit)
    got = model.forward(IDS, model.new_cache("float32"), all_logits=True)
    err = max_abs(got, want)
    print(f"{qtype}: prefill vs float64 {err:.2e}")
    assert err <= PARITY


def test_decode_steps_on_blocks_match_float64(case):
    qtype, _, model, want = case
    cache = model.new_cache()
    # int8 activations: an 8-bit cache by default (float16 where heads are not whole
    # blocks of 32), whose rounding the bound below covers; kept 16-bit floats multiply
    # float32 activations and keep a float32 cache
    int8 = qtype not in ("F16", "BF16")
    eight_bit = model.config.head_dim % 32 == 0
    assert cache.dtype == model.default_cache_dtype == (("q8_0" if eight_bit else "float16") if int8 else "float32")
    got = np.stack([model.forward([t], cache) for t in IDS])
    span = float(want.max() - want.min())
    err = max_abs(got, want)
    print(f"{qtype}: decode vs float64 {err:.2e} ({err / span:.2%} of the logits' range)")
    assert err <= INT8_ACTIVATIONS * span
    if qtype in ("F16", "BF16"):
        assert err <= PARITY  # float32 activations: no int8 rounding
    # the top token agrees wherever float64's top two are further apart than the error
    top2 = np.sort(want, axis=-1)[:, -2:]
    clear = top2[:, 1] - top2[:, 0] > 2 * err
    assert clear.sum() >= len(IDS) // 2
    assert (got.argmax(-1) == want.argmax(-1))[clear].all()


def test_fork_and_crop_stay_exact(case):
    _, _, model, _ = case
    base = model.new_cache()
    model.forward(IDS[:4], base)
    branch = base.fork()
    a = [model.forward([t], base) for t in IDS[4:7]]
    b = [model.forward([t], branch) for t in IDS[8:11]]
    fresh = model.new_cache()
    model.forward(IDS[:4], fresh)
    assert all(np.array_equal(x, model.forward([t], fresh)) for x, t in zip(a, IDS[4:7]))
    base.crop(4)
    assert all(np.array_equal(x, model.forward([t], base)) for x, t in zip(b, IDS[8:11]))


@pytest.mark.parametrize("half", ["float16", "bfloat16"])
def test_sixteen_bit_safetensors_stay_sixteen_bit(tmp_path, half):
    """A Hugging Face directory of 16-bit weights with ``quantized=True``: linear layers
    held as stored (2 bytes a weight), widened as they are multiplied, so prefill and
    decode keep the float32 bound against float64; the default load widens them."""
    import torch
    from safetensors.torch import save_file

    floats, _ = quantized_weights(SHAPE, "F16" if half == "float16" else "BF16", seed=5)
    ref = ref_logits(float64_reference(write_hf_dir(tmp_path / "ref", SHAPE, weights=floats)), IDS)
    d = write_hf_dir(tmp_path / half, SHAPE, weights=floats)
    linear = {n for n, w in floats.items() if w.ndim == 2 and n != "model.embed_tokens.weight"}
    stored = {n: torch.from_numpy(w).to(getattr(torch, half) if n in linear else torch.float32) for n, w in floats.items()}
    assert all(torch.equal(stored[n].float(), torch.from_numpy(floats[n])) for n in linear)  # exact in 16 bits
    save_file(stored, str(d / "model.safetensors"))

    kept, widened = kvcandle.load(d, quantized=True), kvcandle.load(d)
    assert kept.quantized and not widened.quantized
    half_bytes = sum(floats[n].size for n in linear) * 2
    assert kept.weight_bytes == widened.weight_bytes - half_bytes
    prefill = max_abs(kept.forward(IDS, all_logits=True), ref)
    cache = kept.new_cache()
    decode = max_abs(np.stack([kept.forward([t], cache) for t in IDS]), ref)
    print(f"{half} safetensors kept: prefill {prefill:.2e}, decode {decode:.2e} vs float64")
    assert prefill <= PARITY and decode <= PARITY
