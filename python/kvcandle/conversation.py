"""A chat over one KV cache: each turn runs only the new message's tokens.

    chat = kvcandle.Conversation(model, system="You are terse.")
    print(chat.send("What is the capital of France?").text)
    other = chat.fork()             # shares the cache copy-on-write
    chat.undo()                     # back to before the last exchange (O(1) crop)
    chat.save("chat.kvcache")       # the cache and the conversation, one atomic file
    chat = kvcandle.Conversation.load("chat.kvcache", model)
"""

from __future__ import annotations

import json
import os
from typing import Any, Generator, Optional, Sequence, Union

from .cache import KVCache
from .errors import CacheFileError, InputError
from .generation import GenerationResult, Piece, Stats, stream_generate
from .model import Model

#: the metadata key of a saved conversation's state, and that state's layout version
_KEY = "kvcandle.conversation"
_VERSION = 1


class Conversation:
    """Messages, the token ids the model saw and wrote for them, and the cache holding
    those ids.

    Each :meth:`send` renders the chat template over the messages, tokenizes only the
    part after what was already said (so the ids the model wrote itself are kept as it
    wrote them) or, when the template renders earlier turns otherwise than they were said
    (Llama 2's strips replies), the whole rendering, and brings the cache in line with
    :meth:`kvcandle.Model.sync`.

    Raises:
        InputError: the model has no tokenizer with a chat template.
    """

    def __init__(self, model: Model, system: Optional[str] = None) -> None:
        if not isinstance(model, Model):
            raise TypeError(f"model must be a kvcandle.Model, got {type(model).__name__}")
        if model.tokenizer is None or not model.tokenizer.chat_template:
            raise InputError(f"{model.path} has no tokenizer with a chat template, so it cannot chat")
        if system is not None and not isinstance(system, str):
            raise TypeError(f"system must be a str or None, got {type(system).__name__}")
        self._model = model
        self._system = system
        self._messages: list[dict[str, str]] = self._base()
        self._history: list[int] = []  # the conversation's ids, as the model saw and wrote them
        # (len(history), len(messages), len(cache)) as each exchange began: undo restores
        # the cache to exactly that state, so what follows computes what a conversation
        # that never had the exchange computes
        self._turns: list[tuple[int, int, int]] = []
        self._cache = model.new_cache()
        self._end = self._end_of_turn()

    def _base(self) -> list[dict[str, str]]:
        return [{"role": "system", "content": self._system}] if self._system else []

    def _end_of_turn(self) -> Optional[int]:
        tok = self._model.tokenizer
        assert tok is not None
        ids = tok.eos_token_ids or self._model.config.eos_token_ids
        return ids[0] if ids else None

    @property
    def model(self) -> Model:
        return self._model

    @property
    def system(self) -> Optional[str]:
        return self._system

    @property
    def messages(self) -> list[dict[str, str]]:
        """The messages so far (a copy), the system message first when there is one."""
        return [dict(m) for m in self._messages]

    @property
    def tokens(self) -> list[int]:
        """The conversation's token ids, as the model saw and wrote them."""
        return list(self._history)

    @property
    def turns(self) -> int:
        """Exchanges (a user message and its reply) so far."""
        return len(self._turns)

    @property
    def cache(self) -> KVCache:
        """The cache (holds a prefix of :attr:`tokens`)."""
        return self._cache

    def turn_starts(self) -> list[int]:
        """Where each exchange begins in :attr:`tokens`."""
        return [h for h, _, _ in self._turns]

    def _prompt(self, text: str) -> list[int]:
        tok = self._model.tokenizer
        assert tok is not None
        rendered = tok.apply_chat_template([*self._messages, {"role": "user", "content": text}], add_generation_prompt=True)
        said = tok.decode(self._history)
        if self._history and rendered.startswith(said):
            # the conversation's ids as the model saw and wrote them, then the new text;
            # kept only if they spell the rendering (a SentencePiece text encoded on its
            # own starts with its dummy prefix, which is wrong after text)
            ids = self._history + tok.encode(rendered[len(said):], add_special_tokens=False)
            if tok.decode(ids) == rendered:
                return ids
        return tok.encode(rendered, add_special_tokens=False)

    def stream(self, text: str, *, max_tokens: int = 256, **sampling: Any) -> Generator[Piece, None, None]:
        """Sends ``text`` as the user and yields the reply piece by piece (as
        :func:`kvcandle.stream_generate`; ``sampling``: temperature, top_k, top_p,
        repetition_penalty, seed, stop, draft, num_draft). The exchange is recorded when the stream ends,
        also when the caller stops early (the reply so far).

        Raises:
            InputError: ``text`` is empty, or a setting is bad (before anything changes).
            TypeError: ``text`` is not a str.
        """
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        if not text.strip():
            raise InputError(f"text must be a non-empty message, got {text!r}")
        return self._exchange(text, max_tokens, sampling)

    def _exchange(self, text: str, max_tokens: int, sampling: dict[str, Any]) -> Generator[Piece, None, None]:
        ids = self._prompt(text)
        pieces = stream_generate(self._model, ids, max_tokens=max_tokens, cache=self._cache, stats=sampling.pop("stats", None), **sampling)
        reply: list[int] = []
        given: list[str] = []
        start = (len(self._history), len(self._messages), len(self._cache))
        began = False
        try:
            for piece in pieces:
                began = True
                reply.extend(piece.tokens)
                given.append(piece.text)
                yield piece
        finally:
            if began:
                self._turns.append(start)
                self._messages.append({"role": "user", "content": text})
                # the reply as the caller got it: without a stop string or a character
                # cut by max_tokens, which the tokens still hold (the next prompt then
                # renders the text as given, and the cache is synced to it)
                self._messages.append({"role": "assistant", "content": "".join(given)})
                self._history = ids + reply + ([self._end] if self._end is not None else [])

    def send(self, text: str, *, max_tokens: int = 256, **sampling: Any) -> GenerationResult:
        """Sends ``text`` as the user; returns the reply as :func:`kvcandle.generate` does."""
        stats = Stats()
        parts: list[str] = []
        tokens: list[int] = []
        reason = "length"
        for piece in self.stream(text, max_tokens=max_tokens, stats=stats, **sampling):
            parts.append(piece.text)
            tokens.extend(piece.tokens)
            if piece.finish_reason is not None:
                reason = piece.finish_reason
        return GenerationResult("".join(parts), tokens, reason, stats)

    def undo(self) -> bool:
        """Forgets the last exchange; the cache is cropped back to where it began (O(1)).
        Returns False when there was nothing to undo."""
        if not self._turns:
            return False
        h, m, c = self._turns.pop()
        del self._history[h:], self._messages[m:]
        self._cache.crop(min(len(self._cache), c))
        return True

    def reset(self) -> None:
        """Back to the system message alone; the cache is emptied."""
        self._messages, self._history, self._turns = self._base(), [], []
        self._cache.reset()

    def fork(self) -> "Conversation":
        """A new conversation with the same past, sharing the cache copy-on-write:
        what either says afterwards, the other never sees."""
        other = Conversation.__new__(Conversation)
        other._model, other._system, other._end = self._model, self._system, self._end
        other._messages = [dict(m) for m in self._messages]
        other._history, other._turns = list(self._history), list(self._turns)
        other._cache = self._cache.fork()
        return other

    def save(self, path: Union[str, "os.PathLike[str]"]) -> None:
        """Writes the conversation and its cache to one file, atomically (a cache file,
        as :meth:`KVCache.save`, with the messages in its metadata)."""
        state = {
            "version": _VERSION,
            "system": self._system,
            "messages": self._messages,
            "tokens": self._history,
            "turns": self._turns,
        }
        self._cache._save(path, {_KEY: json.dumps(state)})

    @classmethod
    def load(cls, path: Union[str, "os.PathLike[str]"], model: Model) -> "Conversation":
        """A conversation saved with :meth:`save`, for ``model``.

        Raises:
            CacheError: the file was saved from another model.
            CacheFileError: the file is damaged or holds no conversation.
        """
        cache, metadata = model._load_cache(path)
        where = os.fspath(path)
        try:
            state = json.loads(metadata[_KEY])
            if state.get("version") != _VERSION:
                raise CacheFileError(f"{where}: conversation version {state.get('version')!r}; this kvcandle reads {_VERSION}")
            system = state["system"]
            messages = state["messages"]
            history = state["tokens"]
            turns = [(int(h), int(m), int(c)) for h, m, c in state["turns"]]
            ok = (
                (system is None or isinstance(system, str))
                and _messages_ok(messages)
                and isinstance(history, list)
                and all(isinstance(t, int) and not isinstance(t, bool) for t in history)
                and all(0 <= c <= h <= len(history) and 0 <= m <= len(messages) for h, m, c in turns)
                and cache.tokens == history[: len(cache)]
            )
        except KeyError as e:
            raise CacheFileError(f"{where}: no conversation in this cache file (missing {e})") from None
        except (ValueError, TypeError, AttributeError) as e:
            raise CacheFileError(f"{where}: the conversation state is malformed ({e})") from None
        if not ok:
            raise CacheFileError(f"{where}: the conversation state does not fit its cache")
        chat = cls(model, system)
        chat._messages, chat._history, chat._turns, chat._cache = messages, history, turns, cache
        return chat

    def __repr__(self) -> str:
        return f"Conversation(turns={self.turns}, tokens={len(self._history)}, cached={len(self._cache)})"


def _messages_ok(messages: Sequence[Any]) -> bool:
    return isinstance(messages, list) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in messages
    )


__all__ = ["Conversation"]
