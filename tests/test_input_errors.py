"""Typed failures of the Python layer: a tokenizer that cannot be built (GGUF metadata,
tokenizer.json, tokenizer_config.json) is a ModelLoadError naming the file and the field;
a bad generation or sampling setting is an InputError naming the setting and the value,
raised before the cache is touched. Also: numpy scalars are numbers, and any positive
finite temperature samples without NaN."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Optional

import numpy as np
import pytest

import kvcandle
from builders import SHAPES, write_gguf
from kvcandle.generation import encode_prompt, generate_step
from kvcandle.sampling import check_settings, sample
from kvcandle.tokenizer import Tokenizer

TOKENS = "tokenizer.ggml.tokens"
MERGES = "tokenizer.ggml.merges"


def prefix(source, field=None) -> str:
    """The start of a tokenizer load error, as a regular expression."""
    where = f"{field}: " if field else ""
    return re.escape(f"cannot load tokenizer from {source}: {where}")


# --- tokenizer.json / tokenizer_config.json -------------------------------------------


@pytest.fixture
def tok_dir(tmp_path, tiny_dirs) -> Path:
    """A copy of the tiny GQA directory with a word-level tokenizer.json (a..z, <unk>)."""
    from tokenizers import Tokenizer as HFTokenizer, models, pre_tokenizers

    d = Path(shutil.copytree(tiny_dirs["gqa"], tmp_path / "m"))
    vocab = {chr(ord("a") + i): i for i in range(26)}
    vocab["<unk>"] = 26
    t = HFTokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    t.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    t.save(str(d / "tokenizer.json"))
    return d


def _with_post_processor(d: Path, processor, config: Optional[dict]) -> Path:
    from tokenizers import Tokenizer as HFTokenizer

    t = HFTokenizer.from_file(str(d / "tokenizer.json"))
    vocab = t.get_vocab()
    t.add_special_tokens(["<s>", "</s>"])
    if processor is not None:
        t.post_processor = processor(vocab_size=len(vocab))
    t.save(str(d / "tokenizer.json"))
    if config is not None:
        (d / "tokenizer_config.json").write_text(json.dumps(config))
    return d


def test_the_bos_a_tokenizer_json_adds_itself_is_added(tok_dir):
    """Llama 3's tokenizer.json adds its BOS through its post-processor (a template
    "<|begin_of_text|> $A"), and its tokenizer_config.json has no add_bos_token: the BOS
    was dropped (prompts ran without it). Without add_bos_token, kvcandle's encode now
    gives what ``tokenizers`` gives with ``add_special_tokens`` (the reference), and
    add_bos_token, when the config has it, still decides."""
    from tokenizers import Tokenizer as HFTokenizer, processors

    def template(vocab_size: int):
        return processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", vocab_size)])

    text = "hello"
    cases = [(None, True), ({"bos_token": "<s>"}, True), ({"bos_token": "<s>", "add_bos_token": False}, False), ({"add_bos_token": True, "bos_token": "<s>"}, True)]
    for k, (config, bos) in enumerate(cases):
        d = _with_post_processor(Path(shutil.copytree(tok_dir, tok_dir.parent / f"pp{k}")), template, config)
        reference = HFTokenizer.from_file(str(d / "tokenizer.json"))
        tok = kvcandle.load(d).tokenizer
        assert tok.bos_token_id == reference.token_to_id("<s>")
        want = reference.encode(text, add_special_tokens=bos).ids
        assert tok.encode(text) == want and (want[0] == tok.bos_token_id) == bos, config
        assert tok.encode(text, add_special_tokens=False) == reference.encode(text, add_special_tokens=False).ids
    # no post-processor, no add_bos_token: no BOS, as the reference
    d = _with_post_processor(Path(shutil.copytree(tok_dir, tok_dir.parent / "plain")), None, {"bos_token": "<s>"})
    assert kvcandle.load(d).tokenizer.encode(text) == HFTokenizer.from_file(str(d / "tokenizer.json")).encode(text).ids
    # a post-processor adding more than one BOS: not followed, and said so
    def both(vocab_size: int):
        return processors.TemplateProcessing(single="<s> $A </s>", special_tokens=[("<s>", vocab_size), ("</s>", vocab_size + 1)])

    d = _with_post_processor(Path(shutil.copytree(tok_dir, tok_dir.parent / "both")), both, None)
    with pytest.warns(kvcandle.KVCandleWarning, match="post-processor adds tokens"):
        tok = kvcandle.load(d).tokenizer
    assert tok.encode(text) == HFTokenizer.from_file(str(d / "tokenizer.json")).encode(text, add_special_tokens=False).ids


def test_tok_dir_loads(tok_dir):
    model = kvcandle.load(tok_dir)
    assert model.tokenizer is not None and model.tokenizer.encode("cab") == [2, 0, 1]


@pytest.mark.parametrize(
    "content,reason",
    [
        (b"{not json", ""),  # the tokenizers library's own parse message follows
        (b"[1, 2, 3]", ""),
        (b'{"model": {"type": "NoSuchModel"}}', ""),
        (b'{"version": "1.0", "added_tokens": "\xff\xfe"}', "not UTF-8 text"),
    ],
    ids=["not_json", "array", "unknown_model", "invalid_utf8"],
)
def test_broken_tokenizer_json(tok_dir, content, reason):
    path = tok_dir / "tokenizer.json"
    path.write_bytes(content)
    with pytest.raises(kvcandle.ModelLoadError, match=prefix(path) + reason) as e:
        kvcandle.load(tok_dir)
    assert isinstance(e.value, ValueError) and isinstance(e.value, kvcandle.KVCandleError)


@pytest.mark.parametrize(
    "content,field,reason",
    [
        (b"{not json", None, "invalid JSON: Expecting property name"),
        (b'{"chat_template": "\xff"}', None, r"not UTF-8 text \(byte 19"),
        (b"[1, 2]", None, "the top level must be a JSON object, got list"),
        (b'"add_bos_token"', None, "the top level must be a JSON object, got str"),
        (b'{"chat_template": 42}', "chat_template", "must be a str, .* got 42"),
        (b'{"chat_template": [{"name": "default"}]}', r"chat_template[0]", "must be a str, .* got {'name': 'default'}"),
        (b'{"add_bos_token": "yes"}', "add_bos_token", "must be a bool or null, got 'yes'"),
        (b'{"add_bos_token": 1}', "add_bos_token", "must be a bool or null, got 1"),
        (b'{"bos_token": 5}', "bos_token", "must be a str, .* got 5"),
        (b'{"eos_token": {"content": 5}}', "eos_token", "must be a str, .* got {'content': 5}"),
        (b'{"eos_token": {"lstrip": false}}', "eos_token", "must be a str, .* got {'lstrip': False}"),
    ],
)
def test_broken_tokenizer_config(tok_dir, content, field, reason):
    path = tok_dir / "tokenizer_config.json"
    path.write_bytes(content)
    with pytest.raises(kvcandle.ModelLoadError, match=prefix(path, field) + reason):
        kvcandle.load(tok_dir)


def test_tokenizer_config_fields_of_every_accepted_shape(tok_dir):
    config = {
        "chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}],
        "bos_token": {"content": "a", "lstrip": False, "__type": "AddedToken"},
        "eos_token": None,
        "add_bos_token": True,
    }
    (tok_dir / "tokenizer_config.json").write_text(json.dumps(config))
    tok = kvcandle.load(tok_dir).tokenizer
    assert tok is not None and tok.chat_template == "D"
    assert tok.bos_token_id == 0 and tok.add_bos_token and tok.encode("b") == [0, 1]
    assert tok.eos_token_ids == [2]  # config.json's eos_token_id


# --- GGUF metadata --------------------------------------------------------------------


@pytest.fixture(scope="module")
def meta(default_model) -> dict:
    """The default model's GGUF metadata (SmolLM2's gpt2 tokenizer). Never mutate it: copy."""
    return kvcandle._core.read_gguf_metadata(str(default_model.path))


def with_changed(meta: dict, key: str, change) -> dict:
    """A copy of ``meta`` with ``key`` replaced by ``change(copy of its value)``;
    ``change`` returning ``...`` removes the key."""
    out = dict(meta)
    value = out.get(key)
    new = change(list(value) if isinstance(value, list) else value)
    if new is ...:
        del out[key]
    else:
        out[key] = new
    return out


def setitem(i, v):
    def change(xs):
        xs[i] = v
        return xs

    return change


def test_gguf_metadata_builds_the_model_tokenizer(meta, default_model):
    tok = Tokenizer.from_gguf_metadata(meta, source="x.gguf")
    text = "Hello, wörld <|im_start|>"
    assert tok is not None and tok.encode(text) == default_model.tokenizer.encode(text)


def test_bit_flip_in_a_token_names_the_merge_that_needs_it(meta):
    tokens = list(meta[TOKENS])
    a, b = meta[MERGES][0].split(" ")
    target = tokens.index(a + b)
    vocab = set(tokens)
    flips = [a + b[:-1] + chr(ord(b[-1]) ^ (1 << bit)) for bit in range(8)]
    flipped = next(t for t in flips if t not in vocab)  # a flip that makes a new token
    tokens[target] = flipped
    bad = dict(meta, **{TOKENS: tokens})
    reason = f"{meta[MERGES][0]!r} needs the token {a + b!r}, which is not in {TOKENS}"
    with pytest.raises(kvcandle.ModelLoadError, match=prefix("x.gguf", f"{MERGES}[0]") + re.escape(reason)):
        Tokenizer.from_gguf_metadata(bad, source="x.gguf")


@pytest.mark.parametrize(
    "key,change,field,reason",
    [
        (TOKENS, lambda xs: ..., TOKENS, "is missing"),
        (TOKENS, lambda xs: 5, TOKENS, "must be a list of str, got 5"),
        (TOKENS, lambda xs: "abc", TOKENS, "must be a list of str, got 'abc'"),
        (TOKENS, setitem(3, 7), f"{TOKENS}[3]", "must be a str, got 7"),
        (TOKENS, setitem(40, "<|im_start|>"), f"{TOKENS}[40]", "'<|im_start|>' is already token 1"),
        ("tokenizer.ggml.token_type", setitem(5, "3"), "tokenizer.ggml.token_type[5]", "must be an int, got '3'"),
        ("tokenizer.ggml.token_type", setitem(5, True), "tokenizer.ggml.token_type[5]", "must be an int, got True"),
        ("tokenizer.ggml.token_type", lambda xs: xs[:-1], "tokenizer.ggml.token_type", "has 49151 entries for 49152 tokens"),
        ("tokenizer.ggml.token_type", lambda xs: {"a": 1}, "tokenizer.ggml.token_type", "must be a list of int"),
        (MERGES, setitem(12, 12), f"{MERGES}[12]", "must be a str, got 12"),
        (MERGES, setitem(12, "abc"), f"{MERGES}[12]", "must be two tokens separated by one space, got 'abc'"),
        (MERGES, setitem(12, "a b c"), f"{MERGES}[12]", "must be two tokens separated by one space, got 'a b c'"),
        (MERGES, setitem(12, "a "), f"{MERGES}[12]", "must be two tokens separated by one space, got 'a '"),
        (MERGES, lambda xs: "a b", MERGES, "must be a list of str, got 'a b'"),
        ("tokenizer.ggml.bos_token_id", lambda x: 1.0, "tokenizer.ggml.bos_token_id", "must be an int, got 1.0"),
        ("tokenizer.ggml.bos_token_id", lambda x: True, "tokenizer.ggml.bos_token_id", "must be an int, got True"),
        ("tokenizer.ggml.eos_token_id", lambda x: "2", "tokenizer.ggml.eos_token_id", "must be an int, got '2'"),
        ("tokenizer.ggml.eos_token_id", lambda x: 49152, "tokenizer.ggml.eos_token_id", f"49152 is not a token id: {TOKENS} has 49152 tokens"),
        ("tokenizer.ggml.bos_token_id", lambda x: -1, "tokenizer.ggml.bos_token_id", "-1 is not a token id"),
        ("tokenizer.ggml.add_bos_token", lambda x: 1, "tokenizer.ggml.add_bos_token", "must be a bool, got 1"),
        ("tokenizer.chat_template", lambda x: ["{{ x }}"], "tokenizer.chat_template", "must be a str, got ['{{ x }}']"),
        ("tokenizer.ggml.model", lambda x: 2, "tokenizer.ggml.model", "must be a str, got 2"),
    ],
)
def test_bad_gguf_tokenizer_field(meta, key, change, field, reason):
    bad = with_changed(meta, key, change)
    with pytest.raises(kvcandle.ModelLoadError, match=prefix(Path("/m/x.gguf"), field) + re.escape(reason)):
        Tokenizer.from_gguf_metadata(bad, source=Path("/m/x.gguf"))


def test_backend_failure_names_the_field(meta, monkeypatch):
    from kvcandle import tokenizer

    def refuse(*args, **kwargs):
        raise Exception("Error while initializing BPE: something new")

    monkeypatch.setattr(tokenizer.models, "BPE", refuse)
    with pytest.raises(kvcandle.ModelLoadError, match=prefix("x.gguf", MERGES) + "Error while initializing BPE: something new"):
        Tokenizer.from_gguf_metadata(meta, source="x.gguf")


def test_unsupported_kind_still_warns(meta):
    with pytest.warns(kvcandle.KVCandleWarning, match="tokenizer kind 'bert' is not supported"):
        assert Tokenizer.from_gguf_metadata(dict(meta, **{"tokenizer.ggml.model": "bert"})) is None


def test_corrupted_token_in_a_gguf_file(tmp_path):
    """Through kvcandle.load: one bit of the token "A" (id 35) flipped makes it "@", which
    is already token 34."""
    path = write_gguf(tmp_path / "m.gguf", SHAPES[0])
    data = bytearray(path.read_bytes())
    entry = (1).to_bytes(8, "little") + b"A"  # a GGUF string: u64 length, then the bytes
    at = data.index(entry)
    data[at + 8] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(kvcandle.ModelLoadError, match=prefix(path, f"{TOKENS}[35]") + "'@' is already token 34"):
        kvcandle.load(path)


# --- generation and sampling settings -------------------------------------------------

BAD_SETTINGS = [
    ("temperature", -1),
    ("temperature", -0.5),
    ("temperature", float("nan")),
    ("temperature", float("inf")),
    ("temperature", "0.7"),
    ("temperature", True),
    ("temperature", None),
    ("top_k", 0),
    ("top_k", -3),
    ("top_k", 2.0),
    ("top_k", True),
    ("top_k", np.float32(5)),
    ("top_p", 0),
    ("top_p", 1.5),
    ("top_p", float("nan")),
    ("top_p", False),
    ("top_p", "0.9"),
    ("repetition_penalty", 0),
    ("repetition_penalty", -1.1),
    ("repetition_penalty", float("inf")),
    ("repetition_penalty", True),
    ("seed", -1),
    ("seed", np.int64(-7)),
    ("seed", 1.5),
    ("seed", True),
    ("seed", "3"),
    ("max_tokens", 0),
    ("max_tokens", -5),
    ("max_tokens", 2.5),
    ("max_tokens", True),
    ("max_tokens", np.float32(3)),
    ("max_tokens", None),
    ("stop", ""),
    ("stop", 5),
    ("stop", b"ab"),
]


@pytest.mark.parametrize("name,value", BAD_SETTINGS, ids=lambda v: repr(v))
def test_bad_setting_is_an_input_error_naming_it(default_model, name, value):
    message = re.escape(f"{name} must be ") + ".*" + re.escape(f", got {value!r}")
    with pytest.raises(kvcandle.InputError, match=message) as e:
        kvcandle.generate(default_model, "Hello", **{"max_tokens": 3, name: value})
    assert isinstance(e.value, ValueError)


@pytest.mark.parametrize("stop,name,item", [([""], "stop[0]", ""), (("ok", 5), "stop[1]", 5), (["ok", None], "stop[1]", None)])
def test_bad_stop_string_is_named_by_index(default_model, stop, name, item):
    with pytest.raises(kvcandle.InputError, match=re.escape(f"{name} must be a non-empty str, got {item!r}")):
        kvcandle.generate(default_model, "Hello", max_tokens=3, stop=stop)


@pytest.mark.parametrize(
    "name,value",
    [(n, v) for n, v in BAD_SETTINGS if n in ("temperature", "top_k", "top_p")],
    ids=lambda v: repr(v),
)
def test_sample_checks_its_settings(name, value):
    message = re.escape(f"{name} must be ") + ".*" + re.escape(f", got {value!r}")
    kw = {"temperature": 1.0, name: value}
    with pytest.raises(kvcandle.InputError, match=message):
        sample(np.array([1.0, 2.0, 3.0], dtype=np.float32), **kw)


def test_a_cache_that_is_not_a_cache_is_a_type_error(default_model):
    for call in (kvcandle.generate, kvcandle.stream_generate):
        with pytest.raises(TypeError, match="cache must be a kvcandle.KVCache"):
            list(call(default_model, "Hi", max_tokens=2, cache="not a cache"))
        with pytest.raises(TypeError, match="cache must be a kvcandle.KVCache"):
            list(call(default_model, "Hi", max_tokens=2, cache="not a cache", n=2))


def test_a_flag_that_is_not_a_bool_is_a_type_error(default_model, tiny_dirs):
    """``quantized="no"`` is truthy: taken for its truth value it loaded the model
    quantized. Flags are True or False (numpy bools too), anything else a TypeError
    naming the flag, raised before any work."""
    path = tiny_dirs["gqa"]
    for value in ("no", "yes", 1, 0, None):
        with pytest.raises(TypeError, match=r"quantized must be True or False, got "):
            kvcandle.load(path, quantized=value)
    assert not kvcandle.load(path, quantized=np.bool_(False)).quantized
    cache = default_model.new_cache()
    for value in ("False", 1, None):
        with pytest.raises(TypeError, match="all_logits must be True or False"):
            default_model.forward([1, 2], cache, all_logits=value)
        with pytest.raises(TypeError, match="all_logits must be True or False"):
            default_model.forward_batch([[1, 2]], [cache], all_logits=value)
    assert len(cache) == 0
    assert default_model.forward([1, 2], cache, all_logits=np.bool_(True)).shape == (2, default_model.config.vocab_size)


def test_text_without_a_utf8_form_is_an_input_error(default_model):
    """A str with an unpaired surrogate (what a non-UTF-8 byte read with surrogateescape
    becomes) is refused as an InputError naming it, not a TypeError from the tokenizer."""
    for call in (
        lambda: default_model.tokenizer.encode("a\udc80b"),
        lambda: kvcandle.generate(default_model, "x\udcff", max_tokens=2),
        lambda: kvcandle.Conversation(default_model).send("\ud800", max_tokens=2),
    ):
        with pytest.raises(kvcandle.InputError, match="unpaired surrogate"):
            call()


def test_no_tokenizer_and_empty_prompt_are_input_errors(tiny, default_model):
    with pytest.raises(kvcandle.InputError, match="has no tokenizer, so text cannot be streamed"):
        kvcandle.generate(tiny, [1, 2, 3])
    with pytest.raises(kvcandle.InputError, match="has no tokenizer: pass the prompt as token ids"):
        encode_prompt(tiny, "hello")
    with pytest.raises(kvcandle.InputError, match=r"the prompt is empty: .*, got \[\]"):
        kvcandle.generate(default_model, [])
    with pytest.raises(kvcandle.InputError, match="the prompt is empty: .*, got ''"):
        kvcandle.generate(default_model, "")  # SmolLM2 adds no BOS


def test_numpy_scalars_are_numbers(default_model):
    plain = dict(max_tokens=4, temperature=0.5, top_k=5, top_p=0.9, repetition_penalty=1.25, seed=3)
    numpy = dict(
        max_tokens=np.int32(4), temperature=np.float32(0.5), top_k=np.int64(5), top_p=np.float64(0.9),
        repetition_penalty=np.float32(1.25), seed=np.uint8(3),
    )
    a = kvcandle.generate(default_model, "Hello", **plain)
    b = kvcandle.generate(default_model, "Hello", **numpy)
    assert b.tokens == a.tokens and len(a.tokens) >= 1
    checked = check_settings(np.float32(0.5), np.int64(5), np.float64(0.9), np.float32(1.25), np.int64(3))
    assert checked == (0.5, 5, 0.9, 1.25, 3)
    assert [type(x) for x in checked] == [float, int, float, float, int]
    assert sample(np.array([1.0, 3.0, 2.0]), temperature=np.float32(0.7), top_k=np.int64(1)) == 1


def test_tiny_temperature_is_greedy(default_model):
    greedy = kvcandle.generate(default_model, "Hello", max_tokens=3)
    for kw in ({}, {"top_k": 3}, {"top_p": 0.5}, {"seed": 0}):
        tiny_t = kvcandle.generate(default_model, "Hello", max_tokens=3, temperature=1e-300, **kw)
        assert tiny_t.tokens == greedy.tokens, kw
    logits = np.array([1.0, 3.0, 2.0, 0.5], dtype=np.float32)
    for t in (1e-300, 5e-324, 1e-45):
        assert {sample(logits, temperature=t, rng=np.random.default_rng(s)) for s in range(20)} == {1}


def test_huge_temperature_is_uniform_over_the_kept_tokens():
    logits = np.array([1.0, 3.0, 2.0, 0.5], dtype=np.float32)

    def draws(**kw):
        return [sample(logits, temperature=1e300, rng=np.random.default_rng(s), **kw) for s in range(400)]

    assert set(draws(top_k=2)) == {1, 2}
    assert set(draws(top_p=0.5)) == {1, 2}  # each kept token has probability 1/4 before the cut
    counts = np.bincount(draws(), minlength=4)
    assert counts.min() > 60, counts  # about 100 each
    assert set(draws(top_k=1)) == {1}


REFUSED = [
    {"temperature": -1},
    {"top_k": 0},
    {"top_p": 2},
    {"repetition_penalty": 0},
    {"seed": -1},
    {"max_tokens": 0},
    {"stop": [""]},
]


@pytest.mark.parametrize("kw", REFUSED, ids=lambda kw: "-".join(f"{k}={v!r}" for k, v in kw.items()))
def test_refused_generate_leaves_the_cache_alone(default_model, kw):
    cache = default_model.new_cache()
    default_model.forward(default_model.tokenizer.encode("Once upon a time there was"), cache)
    before = cache.tokens
    # a prompt sharing only a prefix with the cache: accepting it would crop the cache
    with pytest.raises(kvcandle.InputError):
        kvcandle.generate(default_model, "Once upon a hill", cache=cache, **{"max_tokens": 3, **kw})
    assert cache.tokens == before and len(cache) == len(before)


def test_generate_step_checks_before_touching_the_cache(default_model):
    cache = default_model.new_cache()
    default_model.forward([1, 2, 3, 4], cache)
    steps = generate_step(default_model, [1, 2, 9], cache, seed=-1)
    with pytest.raises(kvcandle.InputError, match="seed must be an int >= 0 or None, got -1"):
        next(steps)
    assert cache.tokens == [1, 2, 3, 4]


# --- fuzzing the GGUF tokenizer metadata -----------------------------------------------


def mutate_metadata(meta: dict, draw) -> dict:
    """One hostile change to a copy of a GGUF's tokenizer metadata: a flipped bit or
    byte in a token or a merge, a value of another type, a removed key, a swapped list."""
    from hypothesis import strategies as st

    out = dict(meta)
    key = draw(st.sampled_from(sorted(k for k in meta if k.startswith("tokenizer."))))
    value = out[key]
    kind = draw(st.sampled_from(["flip", "retype", "remove", "shrink"]))
    if kind == "remove":
        del out[key]
    elif kind == "retype":
        out[key] = draw(st.sampled_from([None, 0, -1, 2**40, 1.5, "x", b"x", [], [1, "a"], {"a": 1}, True]))
    elif isinstance(value, list) and value:
        items = list(value)
        i = draw(st.integers(0, len(items) - 1))
        item = items[i]
        if kind == "shrink":
            del items[i]
        elif isinstance(item, str) and item:
            raw = bytearray(item.encode("utf-8"))
            raw[draw(st.integers(0, len(raw) - 1))] ^= 1 << draw(st.integers(0, 7))
            items[i] = raw.decode("utf-8", errors="replace")
        elif isinstance(item, int):
            items[i] = item ^ (1 << draw(st.integers(0, 40)))
        out[key] = items
    elif isinstance(value, str) and value:
        out[key] = value[::-1]
    elif isinstance(value, int) and not isinstance(value, bool):
        out[key] = value ^ (1 << draw(st.integers(0, 40)))
    return out


def test_fuzzed_gguf_tokenizer_metadata_builds_or_is_a_model_load_error(meta):
    """Whatever the mutation, building the tokenizer either works (and then encodes and
    decodes), or raises ModelLoadError naming the file, or warns for a kind it does not
    build: never another exception, never a panic."""
    import warnings

    from hypothesis import HealthCheck, given, settings, strategies as st

    @settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
    @given(st.data())
    def run(data):
        mutated = mutate_metadata(meta, data.draw)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", kvcandle.KVCandleWarning)
            try:
                tok = Tokenizer.from_gguf_metadata(mutated, source="fuzz.gguf")
            except kvcandle.ModelLoadError as e:
                assert str(e).startswith("cannot load tokenizer from fuzz.gguf: ") and "\n" not in str(e), str(e)
                return
        if tok is not None:
            ids = tok.encode("Hello, world <|im_start|>")
            assert isinstance(tok.decode(ids), str)

    run()
