"""Regression corpus of hostile model files: each case is a file a user could be handed
(numbers that wrap, duplicate names, lying lengths, tables that do not add up), and each
must give the exact typed error, on one line even with RUST_BACKTRACE=1, with resident
memory bounded by a small multiple of the file size, or (for the cases that are valid)
load and run within that bound.

Every case runs in its own Python process: an abort (a failed allocation) cannot take
the suite down with it, and the process's peak resident memory is the case's alone."""

from __future__ import annotations

import json
import re
import os
import struct
import subprocess
import sys
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import pytest

import kvcandle
from safetensors.numpy import save_file

from builders import SHAPES, RawGGUF, hf_config, tiny_weights, write_gguf, write_hf_dir

GQA = SHAPES[0]  # vocab 101, hidden 48, intermediate 72, 2 layers: 21 tensors
# Peak resident memory a case may add over an idle `import kvcandle`: a fixed allowance
# for the allocator, thread pools and the tokenizer, plus a small multiple of the file.
MEMORY_ALLOWANCE = 64 << 20
MEMORY_FACTOR = 4

PROBE = r"""
import json, resource, sys
import kvcandle

def peak():
    # VmHWM: this process's own peak (ru_maxrss would carry the forking parent's peak over exec)
    try:
        with open("/proc/self/status") as f:
            return next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmHWM:"))
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)

base = peak()
out = {}
try:
    model = kvcandle.load(sys.argv[1])
    out["logits"] = list(model.forward([1, 2, 3]).shape)
    cache = model.new_cache()
    model.forward([4, 5], cache)
    out["continued"] = list(model.forward([6], cache).shape)
except BaseException as e:
    out.update(error=type(e).__name__, message=str(e), is_exception=isinstance(e, Exception))
out["peak"] = peak() - base
print(json.dumps(out))
"""


def probe(path: Path) -> dict:
    env = dict(os.environ, RUST_BACKTRACE="1")  # candle attaches backtraces to its errors
    run = subprocess.run([sys.executable, "-c", PROBE, str(path)], capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, f"the process died (exit {run.returncode}):\n{run.stderr[-3000:]}"
    return json.loads(run.stdout.strip().splitlines()[-1])


def size_of(path: Path) -> int:
    return sum(f.stat().st_size for f in path.iterdir()) if path.is_dir() else path.stat().st_size


def check(path: Path, error: Optional[str], match: str = "") -> dict:
    out = probe(path)
    if error is None:
        assert "error" not in out, out
        assert out["logits"] == [GQA.vocab] and out["continued"] == [GQA.vocab]
    else:
        assert out.get("error") == error, out
        assert out["is_exception"], f"{out['error']} is a BaseException, not an Exception"
        assert "\n" not in out["message"] and "backtrace" not in out["message"].lower(), out["message"]
        assert re.search(match, out["message"]), out["message"]
    limit = MEMORY_ALLOWANCE + MEMORY_FACTOR * size_of(path)
    assert out["peak"] <= limit, f"peak resident memory grew by {out['peak'] >> 20} MiB (limit {limit >> 20} MiB)"
    return out


# --- GGUF: each edit takes apart a valid tiny GGUF and changes it ---------------------


def wrap_rows(r: RawGGUF, extra: int) -> None:
    # 48 * 2^60 and 48 * 2^63 are multiples of 2^64: the element count wraps back to the real one
    r.tensor("token_embd.weight")[1][1] += extra


def wrap_ffn(r: RawGGUF) -> None:
    big = GQA.intermediate + 2**60
    r.set("llama.feed_forward_length", RawGGUF.U64, big)
    for i in range(GQA.layers):
        r.tensor(f"blk.{i}.ffn_gate.weight")[1][1] = big
        r.tensor(f"blk.{i}.ffn_up.weight")[1][1] = big
        r.tensor(f"blk.{i}.ffn_down.weight")[1][0] = big


def lying_length(key: str, new_length: int) -> Callable[[RawGGUF], None]:
    def edit(r: RawGGUF) -> None:
        i = next(i for i, kv in enumerate(r.kvs) if kv[0] == key)
        k, kind, raw = r.kvs[i]
        at = 4 if kind == RawGGUF.ARRAY else 0  # an array's count follows its item type
        r.kvs[i] = (k, kind, raw[:at] + struct.pack("<Q", new_length) + raw[at + 8 :])

    return edit


def flip_offset_bit(bit: int) -> Callable[[RawGGUF], None]:
    def edit(r: RawGGUF) -> None:
        r.tensor("blk.0.attn_k.weight")[3] ^= 1 << bit

    return edit


def set_tensor(name: str, field: int, value: object) -> Callable[[RawGGUF], None]:
    def edit(r: RawGGUF) -> None:
        r.tensor(name)[field] = value

    return edit


INCONSISTENT = "tensor table is inconsistent"
GGUF_CASES: list[tuple[str, Callable[[RawGGUF], None], Optional[str], str]] = [
    ("embedding rows + 2^60 (product wraps)", lambda r: wrap_rows(r, 2**60), "ModelLoadError", r"tensor token_embd.weight has dimensions \[48, \d+\] whose product overflows"),
    ("embedding rows + 2^63 (product wraps)", lambda r: wrap_rows(r, 2**63), "ModelLoadError", r"tensor token_embd.weight has dimensions \[48, \d+\] whose product overflows"),
    ("feed_forward_length and ffn tensors + 2^60", wrap_ffn, "ModelLoadError", r"tensor blk.0.ffn_gate.weight has dimensions .* overflows"),
    ("feed_forward_length + 2^58 alone", lambda r: r.set("llama.feed_forward_length", RawGGUF.U64, 72 + 2**58), "ModelLoadError", r"intermediate_size \d+ is implausibly large"),
    ("context_length 2^24 (valid: no table sized by it)", lambda r: r.set("llama.context_length", RawGGUF.U32, 2**24), None, ""),
    ("context_length 2^24 + 1", lambda r: r.set("llama.context_length", RawGGUF.U32, 2**24 + 1), "ModelLoadError", "max_position_embeddings 16777217 is implausibly large"),
    ("block_count 10^9", lambda r: r.set("llama.block_count", RawGGUF.U32, 10**9), "ModelLoadError", "num_hidden_layers 1000000000 is implausibly large"),
    ("block_count 5 with 21 tensors", lambda r: r.set("llama.block_count", RawGGUF.U32, 5), "ModelLoadError", r"5 layers \(9 weights each\) but the file holds only 21 tensors"),
    ("block_count 3 with 2 layers of tensors", lambda r: r.set("llama.block_count", RawGGUF.U32, 3), "ModelLoadError", r"3 layers \(9 weights each\) but the file holds only 21 tensors"),
    ("a tensor renamed", set_tensor("blk.1.ffn_up.weight", 0, "blk.1.ffn_upx.weight"), "ModelLoadError", r"tensor blk.1.ffn_up.weight \(model.layers.1.mlp.up_proj.weight\) is missing"),
    ("duplicate tensor name", set_tensor("blk.1.attn_q.weight", 0, "blk.0.attn_q.weight"), "ModelLoadError", "tensor blk.0.attn_q.weight appears twice"),
    ("duplicate llama.block_count", lambda r: r.kvs.append(("llama.block_count", RawGGUF.U32, r.encode(RawGGUF.U32, 1))), "ModelLoadError", "metadata key llama.block_count appears twice"),
    ("overlapping tensors", lambda r: r.tensor("blk.0.attn_k.weight").__setitem__(3, r.tensor("blk.0.attn_q.weight")[3]), "ModelLoadError", INCONSISTENT),
    ("offset bit 0 flipped", flip_offset_bit(0), "ModelLoadError", "offset .* is not a multiple of the alignment 32"),
    ("offset bit 5 flipped", flip_offset_bit(5), "ModelLoadError", INCONSISTENT),
    ("offset bit 13 flipped", flip_offset_bit(13), "ModelLoadError", INCONSISTENT + "|needs bytes"),
    ("offset bit 40 flipped", flip_offset_bit(40), "ModelLoadError", INCONSISTENT),
    ("type F32 -> F16", set_tensor("token_embd.weight", 2, 1), "ModelLoadError", "but tensor token_embd.weight before it ends at 9696: the " + INCONSISTENT),
    ("last tensor's type F32 -> F16", lambda r: set_tensor(r.tensors[-1][0], 2, 1)(r), "ModelLoadError", "bytes follow the data of tensor blk.1.ffn_down.weight, the last one"),
    ("type F32 -> Q8_0 (rows not whole blocks)", set_tensor("token_embd.weight", 2, 8), "ModelLoadError", "rows of 48 values, not a multiple of Q8_0's block of 32"),
    ("unknown type id", set_tensor("output_norm.weight", 2, 99), "ModelLoadError", "not a valid GGUF file: tensor output_norm.weight has unknown type id 99"),
    # a type ggml defines and kvcandle does not read: named as such, not as a broken file
    ("IQ4_NL tensor", set_tensor("output_norm.weight", 2, 20), "ModelLoadError", r"\.gguf: tensor output_norm.weight is IQ4_NL \(GGUF type 20\), a type kvcandle does not read"),
    ("five dimensions", set_tensor("output_norm.weight", 1, [48, 1, 1, 1, 1]), "ModelLoadError", r"tensor output_norm.weight has 5 dimensions \(1 to 4 allowed\)"),
    ("zero dimension", set_tensor("output_norm.weight", 1, [0]), "ModelLoadError", r"tensor output_norm.weight has a zero dimension \[0\]"),
    ("alignment 3", lambda r: r.set("general.alignment", RawGGUF.U32, 3), "ModelLoadError", "general.alignment must be a power of two"),
    ("alignment 0", lambda r: r.set("general.alignment", RawGGUF.U32, 0), "ModelLoadError", "general.alignment must be a power of two"),
    ("string length 2^62", lying_length("general.architecture", 2**62), "ModelLoadError", r"metadata general.architecture needs 4611686018427387904 bytes"),
    ("token array count 2^40", lying_length("tokenizer.ggml.tokens", 2**40), "ModelLoadError", "metadata tokenizer.ggml.tokens declares 1099511627776 items"),
    ("architecture gpt2", lambda r: r.set("general.architecture", RawGGUF.STRING, "gpt2"), "ModelLoadError", 'unsupported architecture "gpt2"'),
]


@pytest.mark.parametrize("name,edit,error,match", GGUF_CASES, ids=[c[0] for c in GGUF_CASES])
def test_hostile_gguf(tmp_path, name, edit, error, match):
    raw = RawGGUF(write_gguf(tmp_path / "seed.gguf", GQA))
    edit(raw)
    check(raw.write(tmp_path / "case.gguf"), error, match)


def test_header_counts_past_the_file(tmp_path):
    data = bytearray(write_gguf(tmp_path / "seed.gguf", GQA).read_bytes())
    data[16:24] = struct.pack("<Q", 2**40)  # the metadata entry count
    (tmp_path / "case.gguf").write_bytes(bytes(data))
    check(tmp_path / "case.gguf", "ModelLoadError", "declares 1099511627776 metadata entries")


# --- Hugging Face directories ----------------------------------------------------------

LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 32}


def with_config(**changes: object) -> Callable[[Path], None]:
    def edit(d: Path) -> None:
        (d / "config.json").write_text(json.dumps(hf_config(GQA) | changes))

    return edit


def int_weight(d: Path) -> None:
    w = tiny_weights(GQA)
    w["model.norm.weight"] = np.ones(GQA.hidden, dtype=np.int32)
    save_file(w, str(d / "model.safetensors"))


def duplicate_across_shards(d: Path) -> None:
    index = json.loads((d / "model.safetensors.index.json").read_text())
    first, second = sorted(set(index["weight_map"].values()))
    from safetensors.numpy import load_file

    a, b = load_file(str(d / first)), load_file(str(d / second))
    name = sorted(a)[0]
    save_file(b | {name: a[name]}, str(d / second))


HF_CASES: list[tuple[str, Callable[[Path], None], int, Optional[str], str]] = [
    ("llama3 rope_scaling factor 0", with_config(rope_scaling=LLAMA3_SCALING | {"factor": 0.0}), 1, "ModelLoadError", "rope_scaling.factor must be a positive number, got 0"),
    ("llama3 rope_scaling low == high", with_config(rope_scaling=LLAMA3_SCALING | {"high_freq_factor": 1.0}), 1, "ModelLoadError", "0 < low_freq_factor < high_freq_factor"),
    ("llama3 rope_scaling (valid)", with_config(rope_scaling=LLAMA3_SCALING), 1, None, ""),
    ("integer weights", int_weight, 1, "ModelLoadError", "tensor model.norm.weight holds I32 values; weights must be floats"),
    ("num_hidden_layers 10^9", with_config(num_hidden_layers=10**9), 1, "ModelLoadError", "num_hidden_layers 1000000000 is implausibly large"),
    ("num_hidden_layers 1000", with_config(num_hidden_layers=1000), 1, "ModelLoadError", r"1000 layers \(9 weights each\) but the file holds only 21 tensors"),
    ("max_position_embeddings 2^24 (valid)", with_config(max_position_embeddings=2**24), 1, None, ""),
    ("vocab_size 2^40", with_config(vocab_size=2**40), 1, "ModelLoadError", "vocab_size 1099511627776 is implausibly large"),
    ("head_dim * heads overflow", with_config(head_dim=2**62), 1, "ModelLoadError", "head_dim 4611686018427387904 is implausibly large"),
    ("a tensor in two shards", duplicate_across_shards, 2, "ModelLoadError", "appears in both"),
]


@pytest.mark.parametrize("name,edit,shards,error,match", HF_CASES, ids=[c[0] for c in HF_CASES])
def test_hostile_directory(tmp_path, name, edit, shards, error, match):
    d = write_hf_dir(tmp_path / "case", GQA, shards=shards)
    edit(d)
    check(d, error, match)


def test_the_probe_sees_a_memory_blow_up(tmp_path):
    """The memory bound can fail: a case that allocates 256 MiB is over it."""
    hungry = tmp_path / "hungry.py"
    hungry.write_text("x = bytearray(256 << 20); x[::4096] = b'1' * len(x[::4096])\n")
    env = dict(os.environ, PYTHONSTARTUP="")
    code = PROBE.replace("base = peak()", f"base = peak()\nexec(open({str(hungry)!r}).read())")
    run = subprocess.run([sys.executable, "-c", code, str(write_hf_dir(tmp_path / "ok", GQA))], capture_output=True, text=True, env=env)
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["peak"] > MEMORY_ALLOWANCE + MEMORY_FACTOR * size_of(tmp_path / "ok")


def test_upstream_cache_tables_are_bounded_by_the_weights(tmp_path):
    """candle's own Cache precomputes RoPE tables for the whole context length; for a file
    claiming 2^24 positions that is 512 MiB for a 170 KB model: refused, typed."""
    raw = RawGGUF(write_gguf(tmp_path / "seed.gguf", GQA))
    raw.set("llama.context_length", RawGGUF.U32, 2**24)
    upstream = kvcandle.load(raw.write(tmp_path / "long.gguf")).upstream()
    with pytest.raises(kvcandle.InputError, match=r"RoPE tables for all 16777216 positions of the context length \(536870912 bytes\)"):
        upstream.new_cache(True)
    short = kvcandle.load(tmp_path / "seed.gguf").upstream()
    cache = short.new_cache(True)
    for bad in (-1, 2**63):
        with pytest.raises(kvcandle.InputError, match=f"index_pos must be a non-negative int below 2\\*\\*63, got {bad}"):
            short.forward([1], bad, cache)
    assert short.forward([1, 2], 0, cache).shape == (GQA.vocab,)
