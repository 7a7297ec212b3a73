"""Builders the tests share: tiny random Llama models written as Hugging Face
directories (numpy weights saved as safetensors + config.json) or as GGUF files with
llama.cpp's q/k row order. Imported by conftest.py and by the test modules; test modules
never import each other."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import gguf
import numpy as np
from safetensors.numpy import save_file


@dataclass(frozen=True)
class Shape:
    name: str
    vocab: int = 101
    hidden: int = 48
    intermediate: int = 72
    layers: int = 2
    heads: int = 6
    kv_heads: int = 2
    tie: bool = False
    max_pos: int = 64
    theta: float = 10000.0
    # Llama 3.1 RoPE scaling: (factor, low_freq_factor, high_freq_factor, original context)
    llama3_rope: Optional[tuple[float, float, float, int]] = None

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


SHAPES = [
    Shape("gqa"),  # 6 query heads over 2 KV heads, untied
    Shape("mha_tied", hidden=32, heads=4, kv_heads=4, tie=True),
    Shape("odd_heads", hidden=36, heads=9, kv_heads=3, layers=3, tie=True),  # SmolLM2's 9/3, head_dim 4
    Shape("mqa_odd", hidden=40, heads=5, kv_heads=1, intermediate=56),  # one KV head, 5 query heads
    # Llama 3.1 / 3.2: theta 500,000 and "llama3" RoPE scaling (an original context of 256
    # puts the 4 frequencies of head_dim 8 on every branch of the formula); untied and tied
    Shape("llama3", hidden=64, heads=8, kv_heads=2, intermediate=96, theta=500000.0, max_pos=512, llama3_rope=(8.0, 1.0, 32.0, 256)),
    Shape("llama32_tied", hidden=48, heads=6, kv_heads=2, tie=True, theta=500000.0, max_pos=512, llama3_rope=(32.0, 1.0, 32.0, 256)),
    Shape("tinyllama", hidden=64, heads=8, kv_heads=1, intermediate=96),  # TinyLlama's 8 query heads per KV head
]


def tiny_weights(s: Shape, seed: int = 0) -> dict[str, np.ndarray]:
    """Random Llama weights under their Hugging Face names (float32)."""
    rng = np.random.default_rng(seed)

    def mat(rows: int, cols: int, scale: float = 0.2) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) * scale).astype(np.float32)

    def norm(n: int) -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    d = s.head_dim
    w = {"model.embed_tokens.weight": mat(s.vocab, s.hidden, 1.0), "model.norm.weight": norm(s.hidden)}
    if not s.tie:
        w["lm_head.weight"] = mat(s.vocab, s.hidden)
    for i in range(s.layers):
        p = f"model.layers.{i}"
        w[f"{p}.input_layernorm.weight"] = norm(s.hidden)
        w[f"{p}.post_attention_layernorm.weight"] = norm(s.hidden)
        w[f"{p}.self_attn.q_proj.weight"] = mat(s.heads * d, s.hidden)
        w[f"{p}.self_attn.k_proj.weight"] = mat(s.kv_heads * d, s.hidden)
        w[f"{p}.self_attn.v_proj.weight"] = mat(s.kv_heads * d, s.hidden)
        w[f"{p}.self_attn.o_proj.weight"] = mat(s.hidden, s.heads * d)
        w[f"{p}.mlp.gate_proj.weight"] = mat(s.intermediate, s.hidden)
        w[f"{p}.mlp.up_proj.weight"] = mat(s.intermediate, s.hidden)
        w[f"{p}.mlp.down_proj.weight"] = mat(s.hidden, s.intermediate)
    return w


def hf_config(s: Shape) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": s.vocab,
        "hidden_size": s.hidden,
        "intermediate_size": s.intermediate,
        "num_hidden_layers": s.layers,
        "num_attention_heads": s.heads,
        "num_key_value_heads": s.kv_heads,
        "head_dim": s.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": s.max_pos,
        "rms_norm_eps": 1e-5,
        "rope_theta": s.theta,
        "tie_word_embeddings": s.tie,
        "rope_scaling": None if s.llama3_rope is None else dict(zip(("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"), s.llama3_rope), rope_type="llama3"),
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "float32",
    }


def write_hf_dir(directory: Path, s: Shape, *, shards: int = 1, seed: int = 0, weights: Optional[dict[str, np.ndarray]] = None) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(hf_config(s)))
    weights = tiny_weights(s, seed) if weights is None else weights
    if shards == 1:
        save_file(weights, str(directory / "model.safetensors"))
        return directory
    names = sorted(weights)
    weight_map = {}
    for k in range(shards):
        part = names[k::shards]
        file = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        save_file({n: weights[n] for n in part}, str(directory / file))
        weight_map.update({n: file for n in part})
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return directory


def llama3_rope_factors(s: Shape) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf writes as rope_freqs.weight for "llama3"
    scaling: a divisor per frequency (1 for short wavelengths, the factor for long ones,
    interpolated between)."""
    factor, low, high, original = s.llama3_rope
    out = []
    for i in range(0, s.head_dim, 2):
        freq = 1.0 / s.theta ** (i / s.head_dim)
        wavelen = 2 * np.pi / freq
        if wavelen < original / high:
            out.append(1.0)
        elif wavelen > original / low:
            out.append(factor)
        else:
            smooth = (original / wavelen - low) / (high - low)
            out.append(1.0 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def permute_like_llama_cpp(w: np.ndarray, heads: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf does to q/k rows (HF rotate-half -> interleaved)."""
    rows, cols = w.shape
    return w.reshape(heads, 2, rows // heads // 2, cols).swapaxes(1, 2).reshape(rows, cols)


GGUF_NAMES = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


@dataclass(frozen=True)
class Vocabulary:
    """A GGUF tokenizer as llama.cpp writes one: ``kind`` "gpt2" or "llama", the tokens
    (ids 1 and 2 are BOS and EOS), llama.cpp's token types, and what the kind uses."""

    kind: str
    tokens: list[str]
    types: list[int]
    scores: Optional[list[float]] = None
    merges: Optional[list[str]] = None
    pre: Optional[str] = None
    add_bos: Optional[bool] = None
    chat_template: Optional[str] = None


def write_gguf(
    path,
    s: Shape,
    *,
    arch: str = "llama",
    seed: int = 0,
    tokenizer: "str | Vocabulary" = "gpt2",
    weights: Optional[dict[str, np.ndarray]] = None,
    blocks: Optional[dict[str, tuple[np.ndarray, str]]] = None,
):
    """A tiny GGUF file with llama.cpp's q/k row order and a byte-level tokenizer of kind
    ``tokenizer``; ``blocks`` (Hugging Face name -> (block bytes, type), from
    :func:`quantized_weights`) are written as GGUF blocks instead of float32."""
    w = tiny_weights(s, seed) if weights is None else weights
    blocks = blocks or {}

    def add(name: str, hf: str, t: np.ndarray, permute_heads: int = 0) -> None:
        if hf in blocks:
            data, qtype = blocks[hf]
            data = permute_like_llama_cpp(data, permute_heads) if permute_heads else data
            writer.add_tensor(name, data, raw_dtype=gguf.GGMLQuantizationType[qtype])
        else:
            writer.add_tensor(name, permute_like_llama_cpp(t, permute_heads) if permute_heads else t)

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(s.layers)
    writer.add_context_length(s.max_pos)
    writer.add_embedding_length(s.hidden)
    writer.add_feed_forward_length(s.intermediate)
    writer.add_head_count(s.heads)
    writer.add_head_count_kv(s.kv_heads)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(s.theta)
    writer.add_rope_dimension_count(s.head_dim)
    if isinstance(tokenizer, Vocabulary):
        v = tokenizer
        assert len(v.tokens) == s.vocab, "the shape's vocab must be the vocabulary's size"
        writer.add_tokenizer_model(v.kind)
        writer.add_token_list(v.tokens)
        writer.add_token_types(v.types)
        if v.scores is not None:
            writer.add_token_scores(v.scores)
        if v.merges is not None:
            writer.add_token_merges(v.merges)
        if v.pre is not None:
            writer.add_tokenizer_pre(v.pre)
        if v.add_bos is not None:
            writer.add_add_bos_token(v.add_bos)
        if v.chat_template is not None:
            writer.add_chat_template(v.chat_template)
    else:
        alphabet = [chr(c) for c in range(ord("!"), ord("!") + s.vocab - 3)]
        writer.add_tokenizer_model(tokenizer)
        writer.add_token_list(["<unk>", "<s>", "</s>"] + alphabet)
        writer.add_token_types([3, 3, 3] + [1] * len(alphabet))
        writer.add_token_merges([])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    if s.llama3_rope is not None:
        writer.add_tensor("rope_freqs.weight", llama3_rope_factors(s))
    writer.add_tensor("token_embd.weight", w["model.embed_tokens.weight"])
    writer.add_tensor("output_norm.weight", w["model.norm.weight"])
    if not s.tie:
        add("output.weight", "lm_head.weight", w["lm_head.weight"])
    for i in range(s.layers):
        for hf, g in GGUF_NAMES.items():
            name = f"model.layers.{i}.{hf}.weight"
            heads = {"attn_q": s.heads, "attn_k": s.kv_heads}.get(g, 0)
            add(f"blk.{i}.{g}.weight", name, w[name], heads)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# The GGUF block types kvcandle keeps as stored (Q4_1 and Q8_0 repacked), and the
# 16-bit float types it keeps 16-bit.
BLOCK_TYPES = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "F16", "BF16"]

# gguf-py quantizes the 32-value types but not the K-quants; every bit pattern of a
# K-quant block is a valid block, so those are random bytes with their half-precision
# scale fields (byte offset -> value) set to give weights of about +-0.1.
K_SCALES = {
    "Q2_K": {80: 2e-3, 82: 3e-3},
    "Q3_K": {108: 8e-4},
    "Q4_K": {0: 1e-4, 2: 8e-4},
    "Q5_K": {0: 5e-5, 2: 8e-4},
    "Q6_K": {208: 2.5e-5},
}


def quantized_weights(s: Shape, qtype: str, seed: int = 0) -> tuple[dict[str, np.ndarray], dict[str, tuple[np.ndarray, str]]]:
    """A tiny model whose linear layers (and untied lm_head) are blocks of ``qtype``:
    (float32 weights with those layers dequantized by gguf-py, {name: (block bytes per
    row, qtype)}). Write the first with :func:`write_hf_dir` (the reference) and both
    with :func:`write_gguf`."""
    from gguf import quants

    rng = np.random.default_rng(seed)
    t = gguf.GGMLQuantizationType[qtype]
    per, size = gguf.GGML_QUANT_SIZES[t]
    floats = tiny_weights(s, seed)
    blocks = {}
    for name, w in list(floats.items()):
        if w.ndim != 2 or name == "model.embed_tokens.weight":
            continue
        rows, cols = w.shape
        if qtype in K_SCALES:
            data = rng.integers(0, 256, (rows, cols // per, size), dtype=np.uint8)
            for at, v in K_SCALES[qtype].items():
                data[:, :, at : at + 2] = np.frombuffer(np.float16(v).tobytes(), dtype=np.uint8)
            data = data.reshape(rows, -1)
        else:
            # a quarter of tiny_weights' scale: trained models' size (about 0.05), as the
            # K-quant blocks above; at 0.2 the random layers amplify any rounding chaotically
            data = quants.quantize(0.25 * w, t).view(np.uint8)  # float16 comes back as float16
        blocks[name] = (data, qtype)
        floats[name] = quants.dequantize(data, t).astype(np.float32).reshape(rows, cols)
    return floats, blocks


def float64_reference(path):
    """transformers' LlamaForCausalLM (eager attention) on a tiny model's directory,
    computing in float64: the truth every float32 path is measured against. torch uses
    the thread count kvcandle runs with."""
    import torch
    from transformers import LlamaForCausalLM

    from kvcandle import parity

    torch.set_num_threads(parity.thread_count())
    model = LlamaForCausalLM.from_pretrained(str(path), dtype=torch.float64, attn_implementation="eager").eval()
    parity.compute_in_float64(model)
    return model


def ref_logits(ref, ids: list[int]) -> np.ndarray:
    """Every position's float64 logits of ``ids`` run at once."""
    import torch

    with torch.inference_mode():
        return ref(torch.tensor([ids])).logits[0].numpy()


def max_abs(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.max(np.abs(np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64))))


class RawGGUF:
    """A GGUF file taken apart into its fields, to be changed byte-exactly and written
    back: metadata entries as (key, type id, encoded value), tensor infos as
    [name, dims (fastest first), type id, offset], and the data section. Used to build
    the malformed files a hostile user could hand kvcandle."""

    U32, STRING, ARRAY, U64 = 4, 8, 9, 10
    _SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}

    def __init__(self, path: Path) -> None:
        import struct

        buf = Path(path).read_bytes()
        self._struct = struct
        assert buf[:4] == b"GGUF"
        self.version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
        pos = 24
        self.kvs: list[tuple[str, int, bytes]] = []
        for _ in range(n_kv):
            key, pos = self._string(buf, pos)
            (kind,) = struct.unpack_from("<I", buf, pos)
            end = self._skip(buf, pos + 4, kind)
            self.kvs.append((key, kind, buf[pos + 4 : end]))
            pos = end
        self.tensors: list[list] = []
        for _ in range(n_tensors):
            name, pos = self._string(buf, pos)
            (n_dims,) = struct.unpack_from("<I", buf, pos)
            dims = list(struct.unpack_from(f"<{n_dims}Q", buf, pos + 4))
            kind, offset = struct.unpack_from("<IQ", buf, pos + 4 + 8 * n_dims)
            self.tensors.append([name, dims, kind, offset])
            pos += 4 + 8 * n_dims + 12
        self.alignment = 32
        start = -(-pos // self.alignment) * self.alignment
        self.data = buf[start:]

    def _string(self, buf: bytes, pos: int) -> tuple[str, int]:
        (n,) = self._struct.unpack_from("<Q", buf, pos)
        return buf[pos + 8 : pos + 8 + n].decode("utf-8"), pos + 8 + n

    def _skip(self, buf: bytes, pos: int, kind: int) -> int:
        if kind == self.STRING:
            (n,) = self._struct.unpack_from("<Q", buf, pos)
            return pos + 8 + n
        if kind == self.ARRAY:
            item, count = self._struct.unpack_from("<IQ", buf, pos)
            pos += 12
            for _ in range(count):
                pos = self._skip(buf, pos, item)
            return pos
        return pos + self._SIZES[kind]

    def tensor(self, name: str) -> list:
        return next(t for t in self.tensors if t[0] == name)

    def set(self, key: str, kind: int, value: object) -> None:
        """Sets (or adds) a scalar metadata entry: u32, u64 or string."""
        raw = self.encode(kind, value)
        for i, (k, _, _) in enumerate(self.kvs):
            if k == key:
                self.kvs[i] = (key, kind, raw)
                return
        self.kvs.append((key, kind, raw))

    def remove(self, key: str) -> None:
        self.kvs = [kv for kv in self.kvs if kv[0] != key]

    def encode(self, kind: int, value: object) -> bytes:
        if kind == self.STRING:
            raw = str(value).encode("utf-8")
            return self._struct.pack("<Q", len(raw)) + raw
        return self._struct.pack({self.U32: "<I", self.U64: "<Q"}[kind], value)

    def to_bytes(self) -> bytes:
        pack = self._struct.pack
        out = bytearray(b"GGUF" + pack("<IQQ", self.version, len(self.tensors), len(self.kvs)))
        for key, kind, raw in self.kvs:
            k = key.encode("utf-8")
            out += pack("<Q", len(k)) + k + pack("<I", kind) + raw
        for name, dims, kind, offset in self.tensors:
            n = name.encode("utf-8")
            out += pack("<Q", len(n)) + n + pack("<I", len(dims)) + pack(f"<{len(dims)}Q", *dims) + pack("<IQ", kind, offset)
        out += b"\0" * (-len(out) % self.alignment)
        return bytes(out + self.data)

    def write(self, path: Path) -> Path:
        Path(path).write_bytes(self.to_bytes())
        return Path(path)
