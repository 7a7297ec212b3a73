"""llama.cpp's token ids for kvcandle's tokenizer tests, and a check on real Llama vocabularies.

    python bench/tokenizer_fixtures.py write   # tests/data/llamacpp_tokens.json.gz
    python bench/tokenizer_fixtures.py check   # real Llama 2 / Llama 3 vocabularies

Needs llama-cpp-python (``pip install llama-cpp-python``, compiled natively), which the
test suite never needs: ``write`` runs llama.cpp's own tokenizer (a vocab-only load) over
the corpus of ``tests/corpus.py`` and commits what it gives, for

- the default model's vocabulary (SmolLM2: byte-level, pre-tokenizer "smollm"), and the
  same vocabulary with pre-tokenizer "default" (llama.cpp's split for files that name
  none; no other implementation has it), special tokens parsed and not;
- a SentencePiece BPE model trained as Llama 2's was (no user-defined pieces), special
  tokens parsed (SentencePiece itself never parses them) and not; its pieces, scores and
  types are stored with the ids, so the test rebuilds exactly this vocabulary.

``check`` downloads llama-cpp-python's source (its llama.cpp carries the vocabularies of
Llama 2 and Llama 3 as vocab-only GGUF files with the ids Hugging Face's tokenizers give
for 47 texts) and compares kvcandle with those ids, and with llama.cpp on the corpus.
"""

from __future__ import annotations

import gzip
import io
import json
import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
import corpus  # noqa: E402

FIXTURE = ROOT / "tests" / "data" / "llamacpp_tokens.json.gz"
N = 2000
SEED = 4242


def write_vocab_gguf(path: Path, meta: dict) -> Path:
    """A vocab-only GGUF (llama hyperparameters, no tensors) with tokenizer ``meta``."""
    import gguf

    w = gguf.GGUFWriter(str(path), "llama")
    for key, value in [("block_count", 1), ("context_length", 4096), ("embedding_length", 64), ("feed_forward_length", 128),
                       ("attention.head_count", 1), ("attention.head_count_kv", 1)]:  # fmt: skip
        w.add_uint32(f"llama.{key}", value)
    w.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    for key, value in meta.items():
        if key == "tokenizer.ggml.scores":
            w.add_token_scores(value)
        elif key == "tokenizer.ggml.token_type":
            w.add_token_types(value)
        elif isinstance(value, list):
            w.add_array(key, value)
        elif isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value)
        elif isinstance(value, str):
            w.add_string(key, value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    return path


def llama_cpp_ids(path: Path, texts: list[str], parse_special: bool) -> list[list[int]]:
    import llama_cpp

    vocab = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    return [vocab.tokenize(t.encode("utf-8"), add_bos=False, special=parse_special) for t in texts]


def tokenizer_meta(meta: dict) -> dict:
    return {k: v for k, v in meta.items() if k.startswith("tokenizer.ggml.")}


def sentencepiece_meta() -> dict:
    """A SentencePiece BPE model as Llama 2's (identity normalization, dummy prefix, byte
    fallback, whitespace-only pieces, split digits; <unk> <s> </s>), two control pieces
    added, as llama.cpp's converter writes it."""
    import sentencepiece as spm
    from sentencepiece import sentencepiece_model_pb2 as pb

    out = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(corpus.training_texts(6000, seed=1)), model_writer=out, model_type="bpe", vocab_size=1500,
        byte_fallback=True, split_digits=True, allow_whitespace_only_pieces=True, normalization_rule_name="identity",
        remove_extra_whitespaces=False, add_dummy_prefix=True, character_coverage=0.9995,
        control_symbols=["<|im_start|>", "<|im_end|>"], hard_vocab_limit=False, num_threads=1, minloglevel=2,
    )  # fmt: skip
    proto = pb.ModelProto()
    proto.ParseFromString(out.getvalue())
    return {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": [p.piece for p in proto.pieces],
        "tokenizer.ggml.scores": [p.score for p in proto.pieces],
        "tokenizer.ggml.token_type": [int(p.type) for p in proto.pieces],
        "tokenizer.ggml.add_space_prefix": True,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
    }


def write() -> None:
    import llama_cpp

    from kvcandle import _core
    from kvcandle._default import default_model_path

    texts = corpus.texts(N, seed=SEED)
    cases = []
    tmp = Path(tempfile.mkdtemp())
    smollm = tokenizer_meta(_core.read_gguf_metadata(str(default_model_path())))
    for name, meta, path in [
        ("smollm2", smollm, default_model_path()),
        ("smollm2-default-split", None, None),
        ("sentencepiece", sentencepiece_meta(), None),
    ]:
        stored = None  # the vocabulary the test rebuilds, when it is not the default model's
        if name == "smollm2-default-split":
            meta = {k: v for k, v in smollm.items() if k != "tokenizer.ggml.pre"} | {"tokenizer.ggml.pre": "default"}
            stored = {"tokenizer.ggml.pre": "default"}  # the default model's, this one key changed
        if path is None:
            path = write_vocab_gguf(tmp / f"{name}.gguf", meta)
        if name == "sentencepiece":
            stored = meta
        cases.append({
            "name": name,
            "vocabulary": stored,
            "parsed": llama_cpp_ids(path, texts, True),
            "literal": llama_cpp_ids(path, texts, False),
        })  # fmt: skip
    data = {"llama_cpp": llama_cpp.__version__, "texts": texts, "cases": cases}
    FIXTURE.parent.mkdir(parents=True, exist_ok=True)
    part = FIXTURE.with_suffix(".partial")
    with gzip.open(part, "wt", encoding="utf-8", compresslevel=9) as f:
        json.dump(data, f, ensure_ascii=False, separators=(",", ":"))
    os.replace(part, FIXTURE)
    print(f"wrote {FIXTURE} ({FIXTURE.stat().st_size} bytes): llama.cpp {llama_cpp.__version__}, {len(texts)} texts, {[c['name'] for c in cases]}")


def llama_vocabularies() -> Path:
    """llama.cpp's vocab-only GGUF files of Llama 2 and Llama 3 with their test texts and
    ids, from llama-cpp-python's source distribution (kept in the temporary directory)."""
    import llama_cpp

    where = Path(tempfile.gettempdir()) / f"kvcandle-llama-vocabs-{llama_cpp.__version__}"
    if (where / "ggml-vocab-llama-spm.gguf").exists():
        return where
    where.mkdir(exist_ok=True)
    dl = Path(tempfile.mkdtemp())
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", "llama-cpp-python",
                    f"llama-cpp-python=={llama_cpp.__version__}", "-d", str(dl)], check=True)  # fmt: skip
    (sdist,) = dl.glob("*.tar.gz")
    with tarfile.open(sdist) as tar:
        for m in tar.getmembers():
            name = Path(m.name).name
            if name.startswith(("ggml-vocab-llama-spm.gguf", "ggml-vocab-llama-bpe.gguf")):
                (where / name).write_bytes(tar.extractfile(m).read())  # type: ignore[union-attr]
    return where


def check() -> None:
    import llama_cpp

    from kvcandle.tokenizer import Tokenizer

    where = llama_vocabularies()
    texts = corpus.texts(N, seed=SEED)
    print(f"llama.cpp {llama_cpp.__version__}; corpus of {len(texts)} texts")
    for name in ["llama-spm", "llama-bpe"]:
        path = where / f"ggml-vocab-{name}.gguf"
        tok = Tokenizer.from_gguf_file(path)
        assert tok is not None
        inputs = path.with_suffix(".gguf.inp").read_text(encoding="utf-8").split("\n__ggml_vocab_test__\n")
        outputs = path.with_suffix(".gguf.out").read_text(encoding="utf-8").split("\n")
        pairs = list(zip(inputs, outputs))
        same = sum(tok.encode(t, add_special_tokens=False, parse_special=False) == [int(x) for x in o.split()] for t, o in pairs)
        print(f"{name}: Hugging Face's ids (llama.cpp's test set): {same} of {len(pairs)} texts the same")
        for parse in (False, True):
            theirs = llama_cpp_ids(path, texts, parse)
            ours = [tok.encode(t, add_special_tokens=False, parse_special=parse) for t in texts]
            diff = [t for t, a, b in zip(texts, ours, theirs) if a != b]
            print(f"{name}: llama.cpp, special tokens {'parsed' if parse else 'as text'}: {len(texts) - len(diff)} of {len(texts)} the same")
            for t in diff[:5]:
                print("   differs:", repr(t))
        round_trip = sum(tok.decode(tok.encode(t, add_special_tokens=False)) == t for t in texts)
        print(f"{name}: decode(encode(text)) == text for {round_trip} of {len(texts)}")


if __name__ == "__main__":
    {"write": write, "check": check}[sys.argv[1] if len(sys.argv) > 1 else "check"]()
