"""kvcandle's GGUF tokenizers against the real implementations of their kinds, on a
generated corpus of over 2,000 texts each (``corpus.py``: scripts with and without
combining marks, Vietnamese, CJK, Arabic, emoji sequences, whitespace runs at the start,
middle and end, code, special tokens as chat templates write them).

- "llama" (SentencePiece BPE): the ``sentencepiece`` package trains small BPE models as
  Llama's was trained (identity normalization, dummy prefix, byte fallback, whitespace-only
  pieces, digits split); their pieces, scores and types become GGUF tokenizer metadata as
  llama.cpp's converter writes them, and kvcandle's tokenizer built from that metadata is
  compared with SentencePiece's own encode and decode.
- "gpt2" (byte-level BPE): Hugging Face ``tokenizers`` configured as each model family's
  tokenizer.json configures it (Llama 3: its split and ``ignore_merges``; SmolLM: digits
  alone, then GPT-2's split; GPT-2), on a vocabulary trained by ``tokenizers`` with
  whole-word tokens added that merges cannot reach, and on the default model's own
  vocabulary.
"""

from __future__ import annotations

import io
import json
import random
from functools import lru_cache

import pytest

import corpus
from kvcandle.tokenizer import Tokenizer

N = 2000  # texts per kind (the corpus adds its fixed edge cases)
TEXTS = corpus.texts(N, seed=20261201)
assert len(TEXTS) >= N


# --- SentencePiece ----------------------------------------------------------------------

@lru_cache(maxsize=None)
def sentencepiece_model(*, prefix: bool = True, byte_fallback: bool = True, unused: int = 0) -> bytes:
    """A SentencePiece BPE model trained on the corpus' training texts as Llama 2's
    tokenizer was configured, with a user-defined piece and two control pieces;
    ``unused``: that many merged pieces marked unused afterwards (SentencePiece splits
    them back into the pieces they were merged from)."""
    import sentencepiece as spm
    from sentencepiece import sentencepiece_model_pb2 as pb

    out = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(corpus.training_texts(6000, seed=1)), model_writer=out, model_type="bpe", vocab_size=1500,
        byte_fallback=byte_fallback, split_digits=True, allow_whitespace_only_pieces=True, normalization_rule_name="identity",
        remove_extra_whitespaces=False, add_dummy_prefix=prefix, character_coverage=0.9995, user_defined_symbols=["<|user|>"],
        control_symbols=["<|im_start|>", "<|im_end|>"], hard_vocab_limit=False, num_threads=1, minloglevel=2,
    )  # fmt: skip
    if not unused:
        return out.getvalue()
    proto = pb.ModelProto()
    proto.ParseFromString(out.getvalue())
    merged = [p for p in proto.pieces if p.type == pb.ModelProto.SentencePiece.NORMAL and len(p.piece) > 1]
    for p in random.Random(0).sample(merged, unused):
        p.type = pb.ModelProto.SentencePiece.UNUSED
    return proto.SerializeToString()


def gguf_metadata(model: bytes) -> dict:
    """The tokenizer metadata llama.cpp's converter writes for a SentencePiece model:
    every piece with its score and type (SentencePiece's and GGUF's numbering agree),
    add_space_prefix from the normalizer, BOS and EOS."""
    from sentencepiece import sentencepiece_model_pb2 as pb

    proto = pb.ModelProto()
    proto.ParseFromString(model)
    return {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": [p.piece for p in proto.pieces],
        "tokenizer.ggml.scores": [p.score for p in proto.pieces],
        "tokenizer.ggml.token_type": [int(p.type) for p in proto.pieces],
        "tokenizer.ggml.add_space_prefix": proto.normalizer_spec.add_dummy_prefix,
        "tokenizer.ggml.bos_token_id": proto.trainer_spec.bos_id,
        "tokenizer.ggml.eos_token_id": proto.trainer_spec.eos_id,
    }


def sentencepiece_pair(**options):
    import sentencepiece as spm

    model = sentencepiece_model(**options)
    ours = Tokenizer.from_gguf_metadata(gguf_metadata(model))
    assert ours is not None
    return ours, spm.SentencePieceProcessor(model_proto=model)


SP_MODELS = [
    pytest.param({}, id="llama2-like"),
    pytest.param({"prefix": False}, id="no-dummy-prefix"),
    pytest.param({"byte_fallback": False}, id="no-byte-fallback"),
    pytest.param({"unused": 40}, id="unused-pieces"),
]


@pytest.mark.parametrize("options", SP_MODELS)
def test_sentencepiece_encodes_and_decodes_as_sentencepiece(options):
    ours, sp = sentencepiece_pair(**options)
    round_trips = 0
    for text in TEXTS:
        want = sp.encode(text)
        assert ours.encode(text, add_special_tokens=False, parse_special=False) == want, repr(text)
        assert ours.encode(text, parse_special=False) == sp.encode(text, add_bos=True), repr(text)
        assert ours.decode(want, skip_special_tokens=True) == sp.decode(want), repr(text)
        if sp.decode(want) == text:  # where SentencePiece gives the text back, so does kvcandle
            round_trips += 1
            assert ours.decode(ours.encode(text, add_special_tokens=False, parse_special=False)) == text, repr(text)
    if options.get("byte_fallback", True):  # identity normalization with bytes: every text comes back
        assert round_trips == len(TEXTS)


def special_parts(text: str, specials: list[str]) -> list[str]:
    """``text`` cut at the special pieces written in it, longest first (llama.cpp's
    partition of a text before it tokenizes the pieces between special tokens)."""
    parts: list[str] = [text]
    for s in sorted(specials, key=len, reverse=True):
        cut: list[str] = []
        for p in parts:
            if p in specials:
                cut.append(p)
                continue
            pieces = p.split(s)
            for i, q in enumerate(pieces):
                if i:
                    cut.append(s)
                if q:
                    cut.append(q)
        parts = cut
    return parts


@pytest.mark.parametrize("options", SP_MODELS[:2])
def test_sentencepiece_special_tokens_parsed(options):
    # parsed, each piece of text between special tokens is encoded as SentencePiece
    # encodes it on its own (llama.cpp's rule, and how Meta's Llama 2 code built its
    # prompts); decoding writes the special tokens and gives the text back
    ours, sp = sentencepiece_pair(**options)
    specials = [sp.id_to_piece(i) for i in range(sp.get_piece_size()) if sp.is_control(i) or sp.is_unknown(i)]
    assert {"<s>", "</s>", "<unk>", "<|im_start|>", "<|im_end|>"} <= set(specials)
    seen = 0
    for text in TEXTS:
        parts = special_parts(text, specials)
        want = [i for p in parts for i in ([sp.piece_to_id(p)] if p in specials else sp.encode(p))]
        seen += len(parts) > 1
        ids = ours.encode(text, add_special_tokens=False)
        assert ids == want, repr(text)
        assert ours.decode(ids) == text, repr(text)
    assert seen > 100


@pytest.mark.parametrize("options", SP_MODELS)
def test_sentencepiece_decodes_any_ids_as_sentencepiece(options):
    # random ids, control, unknown and byte pieces among them (bytes that are no UTF-8)
    ours, sp = sentencepiece_pair(**options)
    rng = random.Random(7)
    n = sp.get_piece_size()
    bytes_ = [i for i in range(n) if sp.is_byte(i)]
    special = [i for i in range(n) if sp.is_control(i) or sp.is_unknown(i)]
    for _ in range(N):
        ids = [rng.choice([rng.randrange(n), rng.choice(bytes_ or [0]), rng.choice(special)]) for _ in range(rng.randint(1, 12))]
        assert ours.decode(ids, skip_special_tokens=True) == sp.decode(ids), ids
        # with special tokens written, each run between them decodes as SentencePiece decodes it
        runs, run = [], []
        for i in ids:
            if i in special:
                runs += [sp.decode(run), sp.id_to_piece(i)]
                run = []
            else:
                run.append(i)
        assert ours.decode(ids) == "".join(runs) + sp.decode(run), ids


def test_sentencepiece_streams_a_continuation():
    # a stream continues a text: its first piece keeps its space, and joined the pieces
    # are what the ids add to the text before them
    ours, sp = sentencepiece_pair()
    rng = random.Random(3)
    checked = 0
    for text in TEXTS[:500]:
        ids = sp.encode(text)
        if len(ids) < 2:
            continue
        k = rng.randrange(1, len(ids))
        full, head = ours.decode(ids), ours.decode(ids[:k])
        if not full.startswith(head) or full.endswith("\ufffd"):  # the cut split a character
            continue
        stream = ours.decode_stream()
        assert "".join(stream.add(i) for i in ids[k:]) == full[len(head):], repr(text)
        checked += 1
    assert checked > 300


def test_llama2_leading_spaces():
    # the cases the issue names, on a vocabulary where "▁Hello" and "▁▁" are pieces
    ours, sp = sentencepiece_pair()
    for text in [" Hello world", "  Hello", " ", "  ", "   ", "Hello world", "\n", " \n "]:
        ids = ours.encode(text, add_special_tokens=False, parse_special=False)
        assert ids == sp.encode(text), repr(text)
        assert ours.decode(ids) == text
    assert [ours.id_to_token(i) for i in ours.encode(" ", add_special_tokens=False)] == ["▁▁"]


# --- byte-level BPE ----------------------------------------------------------------------

LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
BYTE_LEVEL = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}
# the pre-tokenizers and model settings of each family's tokenizer.json
FAMILIES = {
    "llama-bpe": ({"type": "Sequence", "pretokenizers": [{"type": "Split", "pattern": {"Regex": LLAMA3_SPLIT}, "behavior": "Isolated", "invert": False}, BYTE_LEVEL]}, True),
    "smaug-bpe": ({"type": "Sequence", "pretokenizers": [{"type": "Split", "pattern": {"Regex": LLAMA3_SPLIT}, "behavior": "Isolated", "invert": False}, BYTE_LEVEL]}, False),
    "smollm": ({"type": "Sequence", "pretokenizers": [{"type": "Digits", "individual_digits": True}, dict(BYTE_LEVEL, use_regex=True)]}, False),
    "gpt-2": (dict(BYTE_LEVEL, use_regex=True), False),
}
SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>", "<|im_start|>", "<|im_end|>"]


def reference(vocab: dict[str, int], merges: list[str], family: str, specials: list[str]):
    """Hugging Face ``tokenizers`` loading a tokenizer.json as the family writes it."""
    from tokenizers import Tokenizer as HF

    pre, ignore_merges = FAMILIES[family]
    spec = {
        "version": "1.0",
        "added_tokens": [{"id": vocab[s], "content": s, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False, "special": True} for s in specials],
        "normalizer": None,
        "pre_tokenizer": pre,
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None, "end_of_word_suffix": None,
                  "fuse_unk": False, "byte_fallback": False, "ignore_merges": ignore_merges, "vocab": vocab, "merges": merges},
    }  # fmt: skip
    return HF.from_str(json.dumps(spec))


def byte_level_metadata(tokens: list[str], merges: list[str], specials: list[str], pre: str) -> dict:
    """GGUF tokenizer metadata as llama.cpp's converter writes a byte-level vocabulary."""
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [3 if t in specials else 1 for t in tokens],
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.add_bos_token": False,
    }


@lru_cache(maxsize=None)
def trained_byte_level() -> tuple[list[str], list[str], list[str]]:
    """A byte-level BPE vocabulary trained by ``tokenizers`` on the corpus' training
    texts, with whole words added that its merges cannot reach (as Llama 3's vocabulary
    has " Việt" with no merge leading to it): pre-tokens of the test texts that are not
    in the trained vocabulary. Returns the tokens (by id, the special tokens last), the
    merges and the words added."""
    from tokenizers import Regex, Tokenizer as HF, models, pre_tokenizers, trainers

    hf = HF(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=1200, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    hf.train_from_iterator(corpus.training_texts(6000, seed=1), trainer)
    model = json.loads(hf.to_str())["model"]
    tokens = sorted(model["vocab"], key=model["vocab"].get)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    split = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(LLAMA3_SPLIT), "isolated"), pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    known = set(tokens)
    added: list[str] = []
    for text in TEXTS:
        for word, _ in split.pre_tokenize_str(text):
            if len(word) > 2 and word not in known and len(added) < 60:
                known.add(word)
                added.append(word)
    return tokens + added + SPECIALS, merges, added


@pytest.mark.parametrize("family", list(FAMILIES))
def test_byte_level_as_the_families_tokenizers(family):
    tokens, merges, _ = trained_byte_level()
    theirs = reference({t: i for i, t in enumerate(tokens)}, merges, family, SPECIALS)
    literal = reference({t: i for i, t in enumerate(tokens)}, merges, family, SPECIALS)
    literal.encode_special_tokens = True
    ours = Tokenizer.from_gguf_metadata(byte_level_metadata(tokens, merges, SPECIALS, family))
    assert ours is not None
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == theirs.encode(text, add_special_tokens=False).ids, repr(text)
        assert ours.encode(text, parse_special=False) == literal.encode(text, add_special_tokens=False).ids, repr(text)
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=False) == text, repr(text)
        assert ours.decode(ids, skip_special_tokens=True) == theirs.decode(ids, skip_special_tokens=True), repr(text)


def test_llama3_takes_whole_words_its_merges_cannot_reach():
    # a word in the vocabulary that no merge leads to is one token for Llama 3 (its
    # tokenizer.json's ignore_merges), and pieces for a split that applies merges
    tokens, merges, added = trained_byte_level()
    llama3 = Tokenizer.from_gguf_metadata(byte_level_metadata(tokens, merges, SPECIALS, "llama-bpe"))
    smaug = Tokenizer.from_gguf_metadata(byte_level_metadata(tokens, merges, SPECIALS, "smaug-bpe"))
    assert llama3 is not None and smaug is not None and len(added) >= 20
    for word in added:
        text = llama3.decode([tokens.index(word)])
        assert llama3.encode(text, parse_special=False) == [tokens.index(word)], repr(text)
        assert len(smaug.encode(text, parse_special=False)) > 1, repr(text)


def test_default_model_vocabulary_as_smollm2s_tokenizer():
    # SmolLM2's tokenizer.json: every digit alone, then byte-level with GPT-2's split
    from kvcandle import _core
    from kvcandle._default import default_model_path

    meta = _core.read_gguf_metadata(str(default_model_path()))
    assert meta["tokenizer.ggml.pre"] == "smollm"
    tokens, types = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.token_type"]
    specials = [t for t, ty in zip(tokens, types) if ty == 3]
    theirs = reference({t: i for i, t in enumerate(tokens)}, meta["tokenizer.ggml.merges"], "smollm", specials)
    ours = Tokenizer.from_gguf_metadata(meta)
    assert ours is not None and "<|im_start|>" in specials
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == theirs.encode(text, add_special_tokens=False).ids, repr(text)
        assert ours.decode(ids) == text, repr(text)


# --- llama.cpp ---------------------------------------------------------------------------

def llama_cpp_fixture() -> dict:
    """llama.cpp's ids for a corpus, written by ``bench/tokenizer_fixtures.py write``."""
    import gzip
    from pathlib import Path

    with gzip.open(Path(__file__).parent / "data" / "llamacpp_tokens.json.gz", "rt", encoding="utf-8") as f:
        return json.load(f)


FIXTURE = llama_cpp_fixture()


@pytest.mark.parametrize("case", FIXTURE["cases"], ids=[c["name"] for c in FIXTURE["cases"]])
def test_same_ids_as_llama_cpp(case):
    # the default model's vocabulary (pre-tokenizer "smollm"), the same with llama.cpp's
    # "default" split, and a Llama 2 style SentencePiece model: special tokens parsed
    # (which SentencePiece itself never does) and as text
    from kvcandle import _core
    from kvcandle._default import default_model_path

    texts = FIXTURE["texts"]
    assert len(texts) >= N
    meta = case["vocabulary"]
    if meta is None or case["name"].startswith("smollm2"):
        meta = _core.read_gguf_metadata(str(default_model_path())) | (meta or {})
    ours = Tokenizer.from_gguf_metadata(meta)
    assert ours is not None
    for text, parsed, literal in zip(texts, case["parsed"], case["literal"]):
        assert ours.encode(text, add_special_tokens=False) == parsed, repr(text)
        assert ours.encode(text, add_special_tokens=False, parse_special=False) == literal, repr(text)


@pytest.mark.parametrize("options", SP_MODELS)
def test_sentencepiece_token_bytes_are_its_pieces_bytes(options):
    # a piece's bytes as SentencePiece spells it: "▁" is a space, <0xNN> is one byte
    ours, sp = sentencepiece_pair(**options)
    for text in TEXTS:
        for i in sp.encode(text):
            piece = sp.id_to_piece(i)
            want = bytes([int(piece[3:5], 16)]) if sp.is_byte(i) else piece.replace("\u2581", " ").encode("utf-8")
            if sp.is_unknown(i):
                continue  # an unknown piece stands for text SentencePiece no longer has
            assert ours.token_bytes(i) == want, (text, i, piece)
