"""Tokenizers: built from a GGUF file's ``tokenizer.ggml.*`` metadata, or loaded from a
Hugging Face directory's ``tokenizer.json``. Backed by Hugging Face ``tokenizers``."""

from __future__ import annotations

import json
import re
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Sequence, Union

from tokenizers import AddedToken, Regex, Tokenizer as _HFTokenizer, decoders, models, pre_tokenizers

from . import _core
from ._checks import as_int, int_arg, show
from ._ids import as_ids
from .errors import InputError, KVCandleWarning, ModelLoadError, TokenIdError

# llama.cpp's token types
_CONTROL = 3
_USER_DEFINED = 4

# GGUF metadata keys
_FIELD_PREFIX = "tokenizer.ggml."
_KIND = "tokenizer.ggml.model"
_TOKENS = "tokenizer.ggml.tokens"
_TYPES = "tokenizer.ggml.token_type"
_MERGES = "tokenizer.ggml.merges"
_SCORES = "tokenizer.ggml.scores"
_PRE = "tokenizer.ggml.pre"
_ADD_SPACE = "tokenizer.ggml.add_space_prefix"
_BOS = "tokenizer.ggml.bos_token_id"
_EOS = "tokenizer.ggml.eos_token_id"
_ADD_BOS = "tokenizer.ggml.add_bos_token"
_TEMPLATE = "tokenizer.chat_template"

Source = Union[str, Path]

# How a byte-level ("gpt2") vocabulary turns text into tokens, by the pre-tokenizer name
# llama.cpp writes (tokenizer.ggml.pre), for the Llama-family names, as llama.cpp reads
# them: the patterns that split text before merges (each applied in turn to the pieces the
# one before left), whether a piece found whole in the vocabulary is one token without
# merges (Llama 3's `ignore_merges`), and whether BOS is added when the file does not say.
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@dataclass(frozen=True)
class _PreTokenizer:
    splits: tuple[str, ...]
    ignore_merges: bool = False
    add_bos: bool = False


_LLAMA3 = _PreTokenizer((_LLAMA3_SPLIT,), ignore_merges=True, add_bos=True)
_GPT2 = _PreTokenizer((_GPT2_SPLIT,))
_PRE_TOKENIZERS = {
    "llama3": _LLAMA3,
    "llama-v3": _LLAMA3,
    "llama-bpe": _LLAMA3,
    "smaug-bpe": _PreTokenizer((_LLAMA3_SPLIT,)),  # Llama 3's split, merges always applied
    "smollm": _PreTokenizer((r"\p{N}", _GPT2_SPLIT)),  # every digit alone, then GPT-2's split
    "gpt-2": _GPT2,
    # llama.cpp's "default", also what it takes when the file names none
    "default": _PreTokenizer((r"[\p{P}\$\+<=>\^~\|]+", _GPT2_SPLIT, r"\p{N}+", "[0-9][0-9][0-9]")),
}


def _load_error(source: Source, field: Optional[str], reason: str) -> ModelLoadError:
    """The one format of a tokenizer that cannot be built:
    ``cannot load tokenizer from {file}: {field}: {reason}`` (no field when the whole
    file is bad)."""
    where = f"{field}: " if field else ""
    return ModelLoadError(f"cannot load tokenizer from {source}: {where}{reason}")


@contextmanager
def _backend_errors(source: Source, field: Optional[str]) -> Iterator[None]:
    """Turns what the ``tokenizers`` library raises (a bare ``Exception``, or a Rust
    panic, which is a ``BaseException``) into a ModelLoadError naming ``field``."""
    try:
        yield
    except Exception as e:
        raise _load_error(source, field, str(e)) from e
    except BaseException as e:  # pyo3's PanicException; let KeyboardInterrupt and the like through
        if type(e).__name__ != "PanicException":
            raise
        raise _load_error(source, field, f"the tokenizers library failed: {e}") from e


def _is_str(value: object) -> bool:
    return isinstance(value, str)


def _is_int(value: object) -> bool:
    return as_int(value) is not None


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_bool(value: object) -> bool:
    return isinstance(value, bool)


def _gguf_list(meta: dict[str, Any], key: str, source: Source, item_ok: Callable[[object], bool], item_type: str) -> Optional[list[Any]]:
    """GGUF array ``key`` (None if absent), every item of which must pass ``item_ok``
    (be an ``item_type``)."""
    value = meta.get(key)
    if value is None:
        return None
    if not isinstance(value, (list, tuple)):
        raise _load_error(source, key, f"must be a list of {item_type}, got {show(value)}")
    if not all(map(item_ok, value)):
        i = next(i for i, x in enumerate(value) if not item_ok(x))
        article = "an" if item_type[0] in "aeiou" else "a"
        raise _load_error(source, f"{key}[{i}]", f"must be {article} {item_type}, got {show(value[i])}")
    return list(value)


def _gguf_value(meta: dict[str, Any], key: str, source: Source, ok: Callable[[object], bool], rule: str) -> Any:
    """GGUF scalar ``key`` (None if absent), which must pass ``ok``."""
    value = meta.get(key)
    if value is not None and not ok(value):
        raise _load_error(source, key, f"must be {rule}, got {show(value)}")
    return value


def _gguf_token_id(meta: dict[str, Any], key: str, source: Source, vocab_size: int) -> Optional[int]:
    """GGUF token id ``key`` (None if absent): an int naming one of the tokens."""
    value = _gguf_value(meta, key, source, _is_int, "an int")
    if value is None:
        return None
    if not 0 <= value < vocab_size:
        raise _load_error(source, key, f"{value} is not a token id: {_TOKENS} has {vocab_size} tokens")
    return int(value)


def _read_text(path: Path) -> str:
    """The UTF-8 text of a tokenizer file."""
    try:
        data = path.read_bytes()
    except OSError as e:
        raise _load_error(path, None, f"cannot read it: {e.strerror or e}") from e
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise _load_error(path, None, f"not UTF-8 text (byte {e.start}: {e.reason})") from e


def _read_json_object(path: Path) -> dict[str, Any]:
    """A JSON file whose top level is an object."""
    try:
        value = json.loads(_read_text(path))
    except json.JSONDecodeError as e:
        raise _load_error(path, None, f"invalid JSON: {e}") from e
    if not isinstance(value, dict):
        raise _load_error(path, None, f"the top level must be a JSON object, got {type(value).__name__} {show(value)}")
    return value


def _config_token(config: dict[str, Any], name: str, path: Path) -> Optional[str]:
    """A special token of ``tokenizer_config.json``: a str, {"content": str, ...} or null."""
    token = config.get(name)
    if token is None:
        return None
    content = token.get("content") if isinstance(token, dict) else token
    if not isinstance(content, str):
        raise _load_error(path, name, f'must be a str, {{"content": str, ...}} or null, got {show(token)}')
    return content


def _config_chat_template(config: dict[str, Any], path: Path) -> Optional[str]:
    """``chat_template`` of ``tokenizer_config.json``: a str, null, or (as transformers
    writes several) a list of {"name": str, "template": str}, of which "default" is used."""
    template = config.get("chat_template")
    if template is None or isinstance(template, str):
        return template
    rule = 'must be a str, a list of {"name": str, "template": str} or null'
    if not isinstance(template, list):
        raise _load_error(path, "chat_template", f"{rule}, got {show(template)}")
    named = {}
    for i, entry in enumerate(template):
        if not (isinstance(entry, dict) and isinstance(entry.get("name"), str) and isinstance(entry.get("template"), str)):
            raise _load_error(path, f"chat_template[{i}]", f"{rule}, got {show(entry)}")
        named[entry["name"]] = entry["template"]
    return named.get("default")


@lru_cache(maxsize=1)
def _byte_alphabet() -> dict[int, str]:
    """GPT-2's printable spelling of each byte, as byte-level BPE vocabularies use it."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    spelling = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in spelling:
            spelling[b] = chr(256 + extra)
            extra += 1
    return spelling


def _checked_merges(merge_list: list[str], vocab: dict[str, int], source: Source) -> list[tuple[str, str]]:
    merges: list[tuple[str, str]] = []
    for i, m in enumerate(merge_list):
        pair = m.split(" ")
        if len(pair) != 2 or not pair[0] or not pair[1]:
            raise _load_error(source, f"{_MERGES}[{i}]", f"must be two tokens separated by one space, got {show(m)}")
        a, b = pair
        if a not in vocab or b not in vocab or a + b not in vocab:  # the backend would fail (or panic) without the index
            missing = next(t for t in (a, b, a + b) if t not in vocab)
            raise _load_error(source, f"{_MERGES}[{i}]", f"{show(m)} needs the token {show(missing)}, which is not in {_TOKENS}")
        merges.append((a, b))
    return merges


def _byte_level_bpe(meta: dict[str, Any], tokens: list[str], source: Source) -> tuple[_HFTokenizer, Callable[[str], bool], bool]:
    """A "gpt2" vocabulary: byte-level BPE, text split as its pre-tokenizer name says.
    Returns the backend, the test of a token spelled in the byte alphabet, and whether
    BOS is added when the file does not say."""
    alphabet = _byte_alphabet()
    letters = set(alphabet.values())

    def spell(token: str) -> str:
        # Tokens written outside the byte alphabet are respelled byte by byte.
        return token if set(token) <= letters else "".join(alphabet[b] for b in token.encode("utf-8"))

    pre_name = _gguf_value(meta, _PRE, source, _is_str, "a str")
    pre = _PRE_TOKENIZERS.get("default" if pre_name is None else pre_name)
    if pre is None:
        warnings.warn(f"{source}: GGUF pre-tokenizer {pre_name!r} ({_PRE}) is not one kvcandle knows; text is split as GPT-2 splits it", KVCandleWarning, stacklevel=4)
        pre = _GPT2
    vocab = {spell(t): i for i, t in enumerate(tokens)}
    merges = _checked_merges(_gguf_list(meta, _MERGES, source, _is_str, "str") or [], vocab, source)
    with _backend_errors(source, _MERGES):
        backend = _HFTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False, ignore_merges=pre.ignore_merges))
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in pre.splits] + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    backend.decoder = decoders.ByteLevel()
    return backend, lambda t: set(t) <= letters, pre.add_bos


def _sentencepiece(meta: dict[str, Any], tokens: list[str], types: list[int], source: Source) -> _core.SentencePiece:
    """A "llama" vocabulary (SentencePiece BPE: Llama 1/2, TinyLlama, Mistral), encoded
    and decoded as SentencePiece does, from the pieces' scores and types (merges, if the
    file has them, are not what SentencePiece uses). The file has no normalizer: the
    identity one of the Llama family is taken, with the dummy prefix unless
    ``tokenizer.ggml.add_space_prefix`` is false."""
    scores = _gguf_list(meta, _SCORES, source, _is_number, "float")
    if scores is None:
        raise _load_error(source, _SCORES, "is missing (a SentencePiece vocabulary merges by its pieces' scores)")
    if len(scores) != len(tokens):
        raise _load_error(source, _SCORES, f"has {len(scores)} entries for {len(tokens)} tokens")
    prefix = _gguf_value(meta, _ADD_SPACE, source, _is_bool, "a bool")
    try:
        return _core.SentencePiece(tokens, types, [float(x) for x in scores], True if prefix is None else prefix)
    except InputError as e:  # the message names the list and index: "token_type[7]: ..."
        raise _load_error(source, None, f"{_FIELD_PREFIX}{e}") from e
    except OverflowError as e:  # a type or score no 64-bit integer or float holds
        raise _load_error(source, None, f"{_TYPES} or {_SCORES}: {e}") from e


@lru_cache(maxsize=8)
def _compile_template(source: str) -> Any:
    """A Jinja template compiled in a sandbox with the helpers chat templates expect."""
    from datetime import datetime

    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    from jinja2 import nodes
    from jinja2.ext import Extension

    def tojson(value: Any, ensure_ascii: bool = False, indent: Optional[int] = None, separators: Any = None, sort_keys: bool = False) -> str:
        # transformers' filter (Jinja's own escapes HTML characters), with its options
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    class Generation(Extension):
        """``{% generation %}...{% endgeneration %}``, which transformers' templates use to
        mark the assistant's tokens: rendered as its body (kvcandle returns no masks)."""

        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.Scope(body).set_lineno(lineno)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, "jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


class _HuggingFace:
    """A Hugging Face ``tokenizers`` tokenizer (byte-level GGUF vocabularies and
    ``tokenizer.json`` files) behind the methods ``_core.SentencePiece`` has."""

    __slots__ = ("_hf", "_literal")

    def __init__(self, hf: _HFTokenizer) -> None:
        self._hf = hf
        self._literal: Optional[_HFTokenizer] = None  # a copy that reads special tokens as text

    @property
    def vocab_size(self) -> int:
        return self._hf.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, parse_special: bool) -> list[int]:
        if parse_special:
            return self._hf.encode(text, add_special_tokens=False).ids
        if self._literal is None:
            literal = _HFTokenizer.from_str(self._hf.to_str())
            literal.encode_special_tokens = True  # user-defined tokens are still taken whole, as llama.cpp takes them
            self._literal = literal
        return self._literal.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int], skip_special: bool, continuation: bool) -> str:
        # a byte-level piece reads the same wherever it stands
        return self._hf.decode(ids, skip_special_tokens=skip_special)

    def id_to_piece(self, id: int) -> Optional[str]:
        return self._hf.id_to_token(id)

    def piece_to_id(self, piece: str) -> Optional[int]:
        return self._hf.token_to_id(piece)


_Backend = Union[_HuggingFace, _core.SentencePiece]


class Tokenizer:
    """Text to token ids and back.

    Attributes:
        bos_token_id: the beginning-of-sequence id, if the model has one.
        eos_token_ids: the ids that end generation.
        chat_template: the Jinja chat template stored with the model, if any.
    """

    def __init__(
        self,
        backend: _Backend,
        *,
        bos_token_id: Optional[int] = None,
        eos_token_ids: Sequence[int] = (),
        add_bos_token: bool = False,
        chat_template: Optional[str] = None,
    ) -> None:
        self._backend = backend
        self.bos_token_id = bos_token_id
        self.eos_token_ids = list(eos_token_ids)
        self.add_bos_token = add_bos_token
        self.chat_template = chat_template

    @property
    def vocab_size(self) -> int:
        return self._backend.vocab_size

    def encode(self, text: str, *, add_special_tokens: bool = True, parse_special: bool = True) -> list[int]:
        """Token ids of ``text``, as the vocabulary's reference tokenizer gives them
        (SentencePiece for "llama" GGUF vocabularies, Hugging Face ``tokenizers`` for the
        others). A BOS id is prepended only where the model asks for one.

        Args:
            add_special_tokens: prepend BOS where the model asks for it.
            parse_special: special (control) tokens written in the text, such as
                ``<|im_start|>`` or ``<s>``, become their ids, as chat templates need;
                False encodes them as the characters they are written with. User-defined
                tokens are taken whole either way.

        Raises:
            TypeError: ``text`` is not a str.
            InputError: ``text`` has an unpaired surrogate (no UTF-8 form).
        """
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:  # a lone surrogate ("\udc80"): no tokenizer takes it
            raise InputError(f"text has no UTF-8 form: {text[e.start:e.end]!r} at index {e.start} is an unpaired surrogate") from None
        ids = self._backend.encode(text, parse_special)
        if add_special_tokens and self.add_bos_token and self.bos_token_id is not None:
            ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        """Text of ``ids``: ``decode(encode(text))`` is ``text`` wherever the reference
        tokenizer gives the text back. With ``skip_special_tokens`` special tokens are
        left out (for a SentencePiece vocabulary this is SentencePiece's own decoding);
        without it they are written as their text, and after one a SentencePiece text
        starts anew (the inverse of encoding with special tokens parsed)."""
        checked = as_ids(ids)
        n = self.vocab_size
        for i, t in enumerate(checked):
            if not 0 <= t < n:
                raise TokenIdError(f"token id {t} at index {i} is out of range: the vocabulary has {n} ids (0..{n})")
        return self._backend.decode(checked, skip_special_tokens, False)

    def decode_stream(self) -> "DecodeStream":
        """A decoder for ids that continue a text, arriving one at a time (generation):
        ``add(id)`` returns the text that id completes, costing the same however much
        text came before. Joined, the pieces are the text the ids add to what came before
        them, without an incomplete character at the end: for a SentencePiece vocabulary
        the first piece keeps its leading space (" Paris" after "The capital of France
        is"), where ``decode`` of the ids alone drops it as the start of a text."""
        return DecodeStream(self)

    def apply_chat_template(
        self,
        messages: Sequence[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tokenize: bool = False,
        **extra: Any,
    ) -> Any:
        """Renders ``messages`` ([{"role": ..., "content": ...}]) with the model's chat
        template (Jinja, sandboxed), as transformers' ``apply_chat_template`` does.

        Returns:
            The prompt text, or its token ids with ``tokenize=True``.

        Raises:
            ValueError: the model has no chat template, or the template rejects the messages.
        """
        if not self.chat_template:
            raise ValueError("this model has no chat template (tokenizer.chat_template in GGUF, chat_template in tokenizer_config.json)")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or "role" not in m:
                raise ValueError(f"messages[{i}] must be a dict with a 'role', got {m!r}")
        from jinja2.exceptions import TemplateError

        # as transformers renders: keys whose value is None left out (an OpenAI-style
        # message's content=None would print "None"), tools and documents None unless given
        context = {"tools": None, "documents": None, **extra}
        try:
            text = _compile_template(self.chat_template).render(
                messages=[{k: v for k, v in m.items() if v is not None} for m in messages],
                add_generation_prompt=add_generation_prompt,
                bos_token=self.id_to_token(self.bos_token_id) if self.bos_token_id is not None else "",
                eos_token=self.id_to_token(self.eos_token_ids[0]) if self.eos_token_ids else "",
                **context,
            )
        except (TemplateError, TypeError, KeyError) as e:
            raise ValueError(f"the chat template cannot render these messages: {e}") from e
        return self.encode(text, add_special_tokens=False) if tokenize else text

    def token_bytes(self, id: int) -> bytes:
        """The bytes token ``id`` adds to a text it continues (a leading space
        included): what the OpenAI API's ``logprobs`` give as a token's ``bytes``. A
        token holding part of a character gives that part.

        Raises:
            TokenIdError: ``id`` is not in the vocabulary.
        """
        id = self._checked_id(id)
        text = self._backend.decode([id], False, True)
        if "\ufffd" not in text:
            return text.encode("utf-8")
        piece = self._backend.id_to_piece(int(id)) or ""
        byte = re.fullmatch(r"<0x([0-9A-Fa-f]{2})>", piece)
        if byte is not None:  # a SentencePiece byte piece
            return bytes([int(byte.group(1), 16)])
        inverse = {c: b for b, c in _byte_alphabet().items()}
        if piece and all(c in inverse for c in piece):  # a byte-level piece
            return bytes(inverse[c] for c in piece)
        return text.encode("utf-8")

    def token_to_id(self, token: str) -> Optional[int]:
        return self._backend.piece_to_id(token)

    def _checked_id(self, id: object) -> int:
        """``id`` as a Python int if it is one of the vocabulary's ids.

        Raises:
            TokenIdError: otherwise (a bool or a value that is not an int included).
        """
        n, token = self.vocab_size, as_int(id)
        if token is None or not 0 <= token < n:
            raise TokenIdError(f"token id {show(id)} is out of range: the vocabulary has {n} ids (0..{n})")
        return token

    def id_to_token(self, id: int) -> Optional[str]:
        """The vocabulary's piece for ``id``; None for an int outside the vocabulary (as
        Hugging Face ``tokenizers`` answers).

        Raises:
            TypeError: ``id`` is not an int (a bool is not).
        """
        id = int_arg(id, "id")
        return self._backend.id_to_piece(id) if 0 <= id < self.vocab_size else None

    @classmethod
    def from_gguf_metadata(cls, meta: dict[str, Any], *, source: Source = "GGUF metadata") -> Optional["Tokenizer"]:
        """Builds the tokenizer a GGUF file describes: "gpt2" (byte-level BPE, text split
        and merged as llama.cpp reads its pre-tokenizer name: Llama 3's split with whole
        words kept, SmolLM's, GPT-2's, llama.cpp's default) or "llama" (SentencePiece
        BPE, as SentencePiece encodes and decodes: Llama 1/2, TinyLlama, Mistral); None
        (with a warning) for a kind kvcandle does not build yet.

        Args:
            meta: the file's ``tokenizer.*`` (and ``general.*``) metadata.
            source: the file, used only in messages.

        Raises:
            ModelLoadError: a field is missing, of the wrong type, or inconsistent (a merge
                naming a token that is not in the vocabulary, a token listed twice, token
                types of another length, a BOS/EOS id outside the vocabulary, a
                SentencePiece vocabulary without scores, with an unknown piece type, two
                unknown pieces, an incomplete set of byte pieces, or neither an unknown piece
                nor byte pieces); the message names ``source`` and the field.
        """
        kind = _gguf_value(meta, _KIND, source, _is_str, "a str")
        if kind not in ("gpt2", "llama"):
            warnings.warn(f"GGUF tokenizer kind {kind!r} is not supported yet; model.tokenizer is None", KVCandleWarning, stacklevel=3)
            return None
        tokens: Optional[list[str]] = _gguf_list(meta, _TOKENS, source, _is_str, "str")
        if tokens is None:
            raise _load_error(source, _TOKENS, "is missing")
        if len(set(tokens)) != len(tokens):
            first: dict[str, int] = {}
            for i, t in enumerate(tokens):
                if t in first:
                    raise _load_error(source, f"{_TOKENS}[{i}]", f"{show(t)} is already token {first[t]}")
                first[t] = i
        types = _gguf_list(meta, _TYPES, source, _is_int, "int")
        if types is None:
            types = [1] * len(tokens)
        elif len(types) != len(tokens):
            raise _load_error(source, _TYPES, f"has {len(types)} entries for {len(tokens)} tokens")
        bos = _gguf_token_id(meta, _BOS, source, len(tokens))
        eos = _gguf_token_id(meta, _EOS, source, len(tokens))
        add_bos = _gguf_value(meta, _ADD_BOS, source, _is_bool, "a bool")
        template = _gguf_value(meta, _TEMPLATE, source, _is_str, "a str")
        backend: _Backend
        if kind == "llama":
            backend = _sentencepiece(meta, tokens, types, source)
            # llama.cpp (and transformers) add BOS to a SentencePiece vocabulary unless told not to
            add_bos = True if add_bos is None else add_bos
        else:
            hf, spelled, bos_by_default = _byte_level_bpe(meta, tokens, source)
            add_bos = bos_by_default if add_bos is None else add_bos
            # control tokens written in the text become their ids when parsed; a "control"
            # token spelled outside the byte alphabet is a mislabel, left out; user-defined
            # tokens are always taken whole
            special = [AddedToken(t, normalized=False, special=True) for t, ty in zip(tokens, types) if ty == _CONTROL and spelled(t)]
            user = [AddedToken(t, normalized=False, special=False) for t, ty in zip(tokens, types) if ty == _USER_DEFINED]
            with _backend_errors(source, _TOKENS):
                hf.add_special_tokens(special)
                if user:
                    hf.add_tokens(user)
            backend = _HuggingFace(hf)
        return cls(
            backend,
            bos_token_id=bos,
            eos_token_ids=[eos] if eos is not None else [],
            add_bos_token=bool(add_bos),
            chat_template=template,
        )

    @classmethod
    def from_directory(cls, directory: Path, eos_token_ids: Sequence[int] = ()) -> Optional["Tokenizer"]:
        """Loads ``tokenizer.json`` (and ``tokenizer_config.json`` if present), or None
        when the directory has no ``tokenizer.json``.

        Raises:
            ModelLoadError: either file cannot be read, is not UTF-8 or not valid JSON,
                ``tokenizer.json`` is not a tokenizer the ``tokenizers`` library can load,
                or a field of ``tokenizer_config.json`` (``chat_template``,
                ``add_bos_token``, ``bos_token``, ``eos_token``) has the wrong type; the
                message names the file and, for a bad field, the field.
        """
        path = directory / "tokenizer.json"
        if not path.is_file():
            return None
        text = _read_text(path)
        with _backend_errors(path, None):
            hf = _HFTokenizer.from_str(text)
        config: dict[str, Any] = {}
        config_path = directory / "tokenizer_config.json"
        if config_path.is_file():
            config = _read_json_object(config_path)
        add_bos = config.get("add_bos_token")
        if add_bos is not None and not isinstance(add_bos, bool):
            raise _load_error(config_path, "add_bos_token", f"must be a bool or null, got {show(add_bos)}")
        template = _config_chat_template(config, config_path)
        bos_token = _config_token(config, "bos_token", config_path)
        eos_token = _config_token(config, "eos_token", config_path)

        def token_id(token: Optional[str]) -> Optional[int]:
            return hf.token_to_id(token) if token is not None else None

        bos_id, eos_id = token_id(bos_token), token_id(eos_token)
        if add_bos is None:
            # tokenizer.json's own post-processor then says (Llama 3's adds
            # <|begin_of_text|> so, with no add_bos_token in its tokenizer_config.json)
            bos_id, add_bos = _bos_of_post_processor(hf, bos_id, path)
        return cls(
            _HuggingFace(hf),
            bos_token_id=bos_id,
            eos_token_ids=list(eos_token_ids) or ([eos_id] if eos_id is not None else []),
            add_bos_token=bool(add_bos),
            chat_template=template,
        )

    @classmethod
    def from_gguf_file(cls, path: Path) -> Optional["Tokenizer"]:
        """The tokenizer stored in a GGUF file, read from its header (no tensor data).

        Raises:
            ModelNotFoundError: the file does not exist.
            ModelLoadError: as :meth:`from_gguf_metadata`, or a header that is not a
                Llama model's.
        """
        return cls.from_gguf_metadata(_core.read_gguf_metadata(str(path)), source=path)

    def __repr__(self) -> str:
        return f"Tokenizer(vocab_size={self.vocab_size})"


def _bos_of_post_processor(hf: _HFTokenizer, bos_id: Optional[int], path: Path) -> tuple[Optional[int], bool]:
    """The BOS id and whether ``encode`` adds it, as ``tokenizer.json``'s post-processor
    has it (what ``tokenizers`` and transformers add with ``add_special_tokens``): a
    single special token it puts before a text is the BOS (``bos_id`` if the config
    named none). Anything else it adds (a token after the text, several before it) is
    not added by kvcandle, with a warning naming the file."""
    with_specials, plain = hf.encode("a", add_special_tokens=True).ids, hf.encode("a", add_special_tokens=False).ids
    starts = [i for i in range(len(with_specials) - len(plain) + 1) if with_specials[i:i + len(plain)] == plain]
    if not starts:
        return bos_id, False
    before, after = with_specials[: starts[0]], with_specials[starts[0] + len(plain):]
    if len(before) == 1 and not after and (bos_id is None or before[0] == bos_id):
        return before[0], True
    if before or after:
        warnings.warn(
            f"{path}: its post-processor adds tokens {before} before and {after} after a text; kvcandle adds none of them (only a single BOS before it)",
            KVCandleWarning,
            stacklevel=3,
        )
    return bos_id, False


class DecodeStream:
    """Incremental decoding: see :meth:`Tokenizer.decode_stream`. Each id is decoded
    with the one before it (the context a SentencePiece piece or a byte needs), and the
    text is given out once its bytes no longer end inside a character (a text that ends
    in a real U+FFFD, the three bytes EF BF BD, is complete)."""

    __slots__ = ("_tokenizer", "_ids", "_text")

    def __init__(self, tokenizer: "Tokenizer") -> None:
        self._tokenizer = tokenizer
        self._ids: list[int] = []  # the last id given out, and those after it
        self._text = ""  # the text of that last id, given out already

    def add(self, id: int) -> str:
        """The text ``id`` completes ("" while a character is still incomplete).

        Raises:
            TypeError: ``id`` is not an int (a bool is not).
            TokenIdError: ``id`` is not in the vocabulary.
            Either leaves the stream as it was.
        """
        tok = self._tokenizer
        token = tok._checked_id(int_arg(id, "id"))
        backend = tok._backend
        ids = [*self._ids, token]
        text = backend.decode(ids, False, True)
        self._ids = ids
        if len(text) <= len(self._text) or not text.startswith(self._text):
            return ""
        # the bytes after the last id given out (all of them before the first)
        pending = ids[1:] if self._text else ids
        if text.endswith("\ufffd") and _ends_inside_a_character(b"".join(tok.token_bytes(i) for i in pending)):
            return ""
        self._ids = [token]
        new, self._text = text[len(self._text):], backend.decode(self._ids, False, True)
        return new


def _ends_inside_a_character(data: bytes) -> bool:
    """Whether ``data`` ends with the first bytes of a UTF-8 character whose other bytes
    may still come (a lead byte followed by fewer continuation bytes than it announces).
    Bytes no later byte can complete (a stray continuation byte, an invalid lead) are
    not: they stay U+FFFD."""
    for back in range(1, min(4, len(data)) + 1):
        byte = data[-back]
        if byte & 0xC0 == 0x80:  # a continuation byte: look further back for its lead
            continue
        needs = 2 if byte & 0xE0 == 0xC0 else 3 if byte & 0xF0 == 0xE0 else 4 if byte & 0xF8 == 0xF0 else 1
        return back < needs
    return False
