"""The tokenizers a GGUF file describes, built by kvcandle from a GGUF file's metadata:
small hand-made vocabularies written into real files, the split each pre-tokenizer name
makes, BOS, refusals; the chat template the file holds, rendered and tokenized, and a
conversation with a quantized model of each kind. (The comparison with the reference
implementations on a large corpus is ``test_tokenizer_reference.py``.)

- "llama": SentencePiece BPE (Llama 1/2, TinyLlama, Mistral), as SentencePiece encodes.
- "gpt2": byte-level BPE, text split and merged as llama.cpp reads the pre-tokenizer
  name the file gives.

transformers' own GGUF tokenizer conversion (AutoTokenizer with ``gguf_file=``) is
compared where it follows the reference: byte-level vocabularies split as GPT-2 or
Llama 3 split, and chat templates rendered. Where it differs, kvcandle follows the
reference and the conversion is not compared: a SentencePiece vocabulary's dummy prefix
before leading spaces and after special tokens, and its decoding after them; SmolLM's
digits, one token each (its tokenizer.json); llama.cpp's "default" split for files that
name none; BOS for Llama 3's names, which llama.cpp adds when the file does not say.
"""

from __future__ import annotations

import dataclasses

import pytest

import kvcandle
from builders import Shape, Vocabulary, quantized_weights, write_gguf

TEXTS = [
    "the thin hat",
    "The world is and",
    "  two leading spaces",
    "tabs\tand\nnewlines\n\n\n",
    "你好，世界",
    "emoji 😀 here",
    "<s>inside</s> text",
    "<|user|>hi<|end|>",
    "numbers 12345 and 1,000",
    "it's IT'S they'll",
    "",
    " ",
    "trailing   ",
]

SPACE = "\u2581"


def sentencepiece() -> Vocabulary:
    pieces = [SPACE] + list("thenisaorwdlcumgTHNW12345,") + ["你", "好"]
    pieces += [SPACE + "t", "th", "he", SPACE + "th", SPACE + "the", "in", SPACE + "in", "is", SPACE + "is", SPACE + "a", "an"]
    pieces += [SPACE + "an", "and", SPACE + "and", SPACE * 2, SPACE * 4, "er", "on", "你好", "12", "123", SPACE + "w", "or", "ld"]
    pieces += [SPACE + "wor", SPACE + "world", "<|user|>", "<|end|>"]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces
    types = [2, 3, 3] + [6] * 256 + [1] * (len(pieces) - 2) + [4, 3]
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces))]
    return Vocabulary("llama", tokens, types, scores=scores)


def byte_level(pre) -> Vocabulary:
    from kvcandle.tokenizer import _byte_alphabet

    letters = list(_byte_alphabet().values())
    merges = ["Ġ t", "h e", "Ġt he", "1 2", "3 4", "12 3", "4 5", "i n", "Ġ in", "' s", "Ċ Ċ", "Ġ Ġ", "ĠĠ ĠĠ"]
    merged = [m.replace(" ", "") for m in merges]
    special = ["<|pad|>", "<|begin_of_text|>", "<|eot_id|>", "<|user|>", "<|end|>"]
    tokens = special[:3] + letters + merged + special[3:]
    types = [3, 3, 3] + [1] * (len(letters) + len(merged)) + [4, 3]
    return Vocabulary("gpt2", tokens, types, merges=merges, pre=pre)


def build(tmp_path, name: str, vocab: Vocabulary):
    from transformers import AutoTokenizer

    path = write_gguf(tmp_path / f"{name}.gguf", Shape(name, vocab=len(vocab.tokens), hidden=32, heads=4, kv_heads=2), tokenizer=vocab)
    return kvcandle.load(path).tokenizer, AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)


@pytest.mark.parametrize("name,pre", [("llama3", "llama-bpe"), ("gpt2", "gpt-2")])
def test_byte_level_same_ids_and_text_as_transformers(tmp_path, name, pre):
    ours, theirs = build(tmp_path, name, byte_level(pre))
    assert ours is not None
    for text in TEXTS:
        ids = ours.encode(text, add_special_tokens=False)
        assert ids == theirs.encode(text, add_special_tokens=False), f"{name}: {text!r}"
        assert ours.decode(ids) == theirs.decode(ids) == text, f"{name}: {text!r}"


def test_the_split_follows_the_pre_tokenizer(tmp_path):
    # "12345": Llama 3 splits digits in threes ("123" "45"); GPT-2 keeps the run, and the
    # merge "3 4" then comes before "12 3"; SmolLM takes every digit alone; llama.cpp's
    # default splits GPT-2's run in threes
    spell = lambda tok, text: [tok.id_to_token(i) for i in tok.encode(text, add_special_tokens=False)]  # noqa: E731
    for name, pre, want in [("a", "llama-bpe", ["123", "45"]), ("b", "gpt-2", ["12", "34", "5"]), ("c", "smollm", list("12345")), ("d", None, ["123", "45"])]:
        tok, _ = build(tmp_path, name, byte_level(pre))
        assert spell(tok, "12345") == want, pre


def test_bos_as_the_file_or_llama_cpp_says(tmp_path):
    # Llama 3's names add BOS unless the file says not to; SentencePiece too; others do not
    for name, vocab, adds in [("a", byte_level("llama-bpe"), True), ("b", byte_level("smollm"), False), ("c", sentencepiece(), True)]:
        tok, _ = build(tmp_path, name, vocab)
        assert (tok.encode("hi")[:1] == [tok.bos_token_id]) == adds, name
        said, _ = build(tmp_path, name + "x", dataclasses.replace(vocab, add_bos=not adds))
        assert (said.encode("hi")[:1] == [said.bos_token_id]) == (not adds), name


def test_sentencepiece_leading_spaces_and_special_tokens(tmp_path):
    # the dummy prefix comes before the text's own spaces; special tokens are text unless
    # parsed, and parsed, the text after one is encoded on its own (with its prefix)
    tok, _ = build(tmp_path, "sp", sentencepiece())
    spell = lambda ids: [tok.id_to_token(i) for i in ids]  # noqa: E731
    assert spell(tok.encode(" ", add_special_tokens=False)) == [SPACE * 2]
    assert spell(tok.encode("  two", add_special_tokens=False))[:2] == [SPACE * 2, SPACE + "t"]
    assert spell(tok.encode("<s>and", add_special_tokens=False)) == ["<s>", SPACE + "and"]
    assert "<s>" not in spell(tok.encode("<s>and", add_special_tokens=False, parse_special=False))
    for text in TEXTS:
        assert tok.decode(tok.encode(text, add_special_tokens=False)) == text


def test_sentencepiece_adds_bos_and_falls_back_to_bytes(tmp_path):
    tok, _ = build(tmp_path, "sp", sentencepiece())
    ids = tok.encode("你好世")
    assert ids[0] == tok.bos_token_id == 1
    assert [tok.id_to_token(i) for i in ids[1:]] == [SPACE, "你好", "<0xE4>", "<0xB8>", "<0x96>"]
    assert tok.decode(ids, skip_special_tokens=True) == "你好世"


def test_unknown_pre_tokenizer_warns(tmp_path):
    path = write_gguf(tmp_path / "x.gguf", Shape("x", vocab=len(byte_level("qwen2").tokens), hidden=32, heads=4, kv_heads=2), tokenizer=byte_level("qwen2"))
    with pytest.warns(kvcandle.KVCandleWarning, match="pre-tokenizer 'qwen2'"):
        assert kvcandle.load(path).tokenizer is not None


def test_sentencepiece_without_scores_or_merges_is_refused(tmp_path):
    v = sentencepiece()
    bad = Vocabulary("llama", v.tokens, v.types)
    path = write_gguf(tmp_path / "bad.gguf", Shape("bad", vocab=len(v.tokens), hidden=32, heads=4, kv_heads=2), tokenizer=bad)
    with pytest.raises(kvcandle.ModelLoadError, match="tokenizer.ggml.scores"):
        kvcandle.load(path)


def _sp_types(change):
    v = sentencepiece()
    types, scores, tokens = list(v.types), list(v.scores or []), list(v.tokens)
    change(tokens, types, scores)
    return Vocabulary("llama", tokens, types, scores=scores)


@pytest.mark.parametrize(
    "change,field",
    [
        (lambda t, ty, s: ty.__setitem__(300, 9), r"tokenizer\.ggml\.token_type\[300\]: 9 is not a SentencePiece piece type"),
        (lambda t, ty, s: s.__setitem__(300, float("nan")), r"tokenizer\.ggml\.scores\[300\]: NaN"),
        (lambda t, ty, s: ty.__setitem__(3 + 0x41, 1), r"tokenizer\.ggml\.tokens: the byte piece <0x41> is missing"),
        (lambda t, ty, s: ty.__setitem__(1, 2), r"tokenizer\.ggml\.token_type\[1\]: a second unknown piece"),
        (lambda t, ty, s: (ty.__setitem__(0, 1), ty.__setitem__(slice(3, 259), [1] * 256)), r"no unknown piece .* and no byte pieces"),
        (lambda t, ty, s: t.__setitem__(3, "<0xZZ>"), r"tokenizer\.ggml\.tokens\[3\]: a byte piece must be written <0xAB>"),
    ],
)
def test_bad_sentencepiece_vocabularies_are_refused(tmp_path, change, field):
    vocab = _sp_types(change)
    path = write_gguf(tmp_path / "bad.gguf", Shape("bad", vocab=len(vocab.tokens), hidden=32, heads=4, kv_heads=2), tokenizer=vocab)
    with pytest.raises(kvcandle.ModelLoadError, match=field) as e:
        kvcandle.load(path)
    assert str(path) in str(e.value) and "\n" not in str(e.value)


# Llama 2's chat template (as its tokenizer_config.json has it), and a Llama 3 style one
LLAMA2_TEMPLATE = (
    "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}{% set system_message = messages[0]['content'] %}"
    "{% else %}{% set loop_messages = messages %}{% set system_message = false %}{% endif %}"
    "{% for message in loop_messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if loop.index0 == 0 and system_message != false %}{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}"
    "{% else %}{% set content = message['content'] %}{% endif %}"
    "{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ ' ' + content.strip() + ' ' + eos_token }}{% endif %}{% endfor %}"
)
MISTRAL_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}{{ '[INST] ' + m['content'] + ' [/INST]' }}"
    "{% else %}{{ m['content'] + eos_token }}{% endif %}{% endfor %}"
)
LLAMA3_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ '<|user|>' if m['role'] == 'user' else '<|end|>' }}{{ m['content'] }}"
    "{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}{% endfor %}{% if add_generation_prompt %}<|end|>{% endif %}"
)


@pytest.mark.parametrize(
    "name,vocab,template",
    [
        ("sentencepiece", sentencepiece(), LLAMA2_TEMPLATE),
        ("sentencepiece", sentencepiece(), MISTRAL_TEMPLATE),
        ("llama3", byte_level("llama-bpe"), LLAMA3_TEMPLATE),
    ],
)
def test_a_quantized_model_chats_with_the_files_template(tmp_path, name, vocab, template):
    from transformers import AutoTokenizer

    shape = Shape(name, vocab=len(vocab.tokens), hidden=256, intermediate=512, heads=4, kv_heads=2, layers=1, max_pos=256)
    floats, blocks = quantized_weights(shape, "Q4_K", seed=1)
    path = write_gguf(tmp_path / f"{name}.gguf", shape, tokenizer=dataclasses.replace(vocab, chat_template=template), weights=floats, blocks=blocks)
    model = kvcandle.load(path, quantized=True)
    theirs = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    tok = model.tokenizer
    assert model.quantized and tok is not None and tok.chat_template == template

    said = [{"role": "user", "content": "the thin hat"}, {"role": "assistant", "content": "and the world"}, {"role": "user", "content": " 你好 12345 "}]
    for n in (1, 3):
        want = theirs.apply_chat_template(said[:n], add_generation_prompt=True, tokenize=False)
        assert tok.apply_chat_template(said[:n], add_generation_prompt=True) == want
        if name != "sentencepiece":  # the conversion's SentencePiece ids differ (see the top)
            assert tok.encode(want, add_special_tokens=False) == theirs.encode(want, add_special_tokens=False)

    # each turn, the ids the model is given spell the template's rendering of the
    # conversation so far; where the template renders earlier turns as they were said (the
    # Llama 3 style one), the model's own ids are kept as it wrote them
    chat = kvcandle.Conversation(model)
    for text in ("the thin hat", "and the world"):
        before, kept = chat.messages + [{"role": "user", "content": text}], list(chat.tokens)
        reply = chat.send(text, max_tokens=3)
        seen = chat.tokens[: len(chat.tokens) - len(reply.tokens) - 1]  # less the reply and the end of turn
        assert tok.decode(seen) == tok.apply_chat_template(before, add_generation_prompt=True)
        assert len(chat.cache) >= len(seen)
        if template == LLAMA3_TEMPLATE:
            assert chat.tokens[: len(kept)] == kept
    assert chat.turns == 2


def test_token_bytes_join_to_the_text(default_model):
    tok = default_model.tokenizer
    for text in ["Hello world", " Paris", "你好，世界", "emoji 🙂 here", "<|im_end|>", "tabs\tand\nlines"]:
        ids = tok.encode(text, add_special_tokens=False)
        assert b"".join(tok.token_bytes(i) for i in ids) == text.encode("utf-8"), text
    with pytest.raises(kvcandle.TokenIdError, match="out of range"):
        tok.token_bytes(tok.vocab_size)
