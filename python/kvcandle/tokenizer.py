"""Tokenizers: built from a GGUF file's ``tokenizer.ggml.*`` metadata, or loaded from a
Hugging Face directory's ``tokenizer.json``. Backed by Hugging Face ``tokenizers``."""

from __future__ import annotations

import json
import warnings
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Sequence

from tokenizers import AddedToken, Tokenizer as _HFTokenizer, decoders, models, pre_tokenizers

from ._ids import as_ids
from .errors import KVCandleWarning, TokenIdError

if TYPE_CHECKING:
    from . import _core

# llama.cpp's token types
_CONTROL = 3
_USER_DEFINED = 4


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


@lru_cache(maxsize=8)
def _compile_template(source: str) -> Any:
    """A Jinja template compiled in a sandbox with the helpers chat templates expect."""
    from datetime import datetime

    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    def tojson(value: Any, indent: Optional[int] = None) -> str:
        return json.dumps(value, indent=indent, ensure_ascii=False)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


class Tokenizer:
    """Text to token ids and back.

    Attributes:
        bos_token_id: the beginning-of-sequence id, if the model has one.
        eos_token_ids: the ids that end generation.
        chat_template: the Jinja chat template stored with the model, if any.
    """

    def __init__(
        self,
        backend: _HFTokenizer,
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
        return self._backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``. Special tokens written in the text (``<|im_start|>``)
        become their ids; a BOS id is prepended only where the model asks for one."""
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        ids = self._backend.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self.add_bos_token and self.bos_token_id is not None:
            ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        """Text of ``ids``."""
        checked = as_ids(ids)
        n = self.vocab_size
        for i, t in enumerate(checked):
            if not 0 <= t < n:
                raise TokenIdError(f"token id {t} at index {i} is out of range: the vocabulary has {n} ids (0..{n})")
        return self._backend.decode(checked, skip_special_tokens=skip_special_tokens)

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

        try:
            text = _compile_template(self.chat_template).render(
                messages=list(messages),
                add_generation_prompt=add_generation_prompt,
                bos_token=self.id_to_token(self.bos_token_id) if self.bos_token_id is not None else "",
                eos_token=self.id_to_token(self.eos_token_ids[0]) if self.eos_token_ids else "",
                **extra,
            )
        except (TemplateError, TypeError, KeyError) as e:
            raise ValueError(f"the chat template cannot render these messages: {e}") from e
        return self.encode(text, add_special_tokens=False) if tokenize else text

    def token_to_id(self, token: str) -> Optional[int]:
        return self._backend.token_to_id(token)

    def id_to_token(self, id: int) -> Optional[str]:
        return self._backend.id_to_token(id)

    @classmethod
    def from_gguf_metadata(cls, meta: dict[str, Any]) -> Optional["Tokenizer"]:
        """Builds the tokenizer a GGUF file describes, or None (with a warning) for a
        tokenizer kind kvcandle does not build yet."""
        kind = meta.get("tokenizer.ggml.model")
        if kind != "gpt2":
            warnings.warn(f"GGUF tokenizer kind {kind!r} is not supported yet; model.tokenizer is None", KVCandleWarning, stacklevel=3)
            return None
        tokens: list[str] = meta["tokenizer.ggml.tokens"]
        types: list[int] = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
        alphabet = _byte_alphabet()
        letters = set(alphabet.values())

        def spell(token: str) -> str:
            # Tokens written outside the byte alphabet are respelled byte by byte.
            return token if set(token) <= letters else "".join(alphabet[b] for b in token.encode("utf-8"))

        vocab = {spell(t): i for i, t in enumerate(tokens)}
        merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
        backend = _HFTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        backend.decoder = decoders.ByteLevel()
        special = [
            AddedToken(t, normalized=False, special=True)
            for t, ty in zip(tokens, types)
            if ty == _CONTROL and set(t) <= letters
        ]
        backend.add_special_tokens(special)
        user = [AddedToken(t, normalized=False, special=False) for t, ty in zip(tokens, types) if ty == _USER_DEFINED]
        if user:
            backend.add_tokens(user)
        eos = meta.get("tokenizer.ggml.eos_token_id")
        return cls(
            backend,
            bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=[eos] if eos is not None else [],
            add_bos_token=bool(meta.get("tokenizer.ggml.add_bos_token", False)),
            chat_template=meta.get("tokenizer.chat_template"),
        )

    @classmethod
    def from_directory(cls, directory: Path, eos_token_ids: Sequence[int] = ()) -> Optional["Tokenizer"]:
        """Loads ``tokenizer.json`` (and ``tokenizer_config.json`` if present), or None."""
        path = directory / "tokenizer.json"
        if not path.is_file():
            return None
        backend = _HFTokenizer.from_file(str(path))
        config: dict[str, Any] = {}
        config_path = directory / "tokenizer_config.json"
        if config_path.is_file():
            config = json.loads(config_path.read_text(encoding="utf-8"))

        def token_id(name: str) -> Optional[int]:
            token = config.get(name)
            if isinstance(token, dict):
                token = token.get("content")
            return backend.token_to_id(token) if isinstance(token, str) else None

        bos = token_id("bos_token")
        eos = list(eos_token_ids) or [t for t in [token_id("eos_token")] if t is not None]
        template = config.get("chat_template")
        return cls(
            backend,
            bos_token_id=bos,
            eos_token_ids=eos,
            add_bos_token=bool(config.get("add_bos_token", False)),
            chat_template=template if isinstance(template, str) else None,
        )

    @classmethod
    def for_model(cls, inner: "_core.Model", path: Path) -> Optional["Tokenizer"]:
        if inner.format == "gguf":
            return cls.from_gguf_metadata(inner.gguf_metadata())
        return cls.from_directory(path, inner.config()["eos_token_ids"])

    def __repr__(self) -> str:
        return f"Tokenizer(vocab_size={self.vocab_size})"
