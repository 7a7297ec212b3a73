"""The OpenAI API as kvcandle serves it: requests checked field by field into a
:class:`Request` (a bad field is a :class:`RequestError` naming it), and the response
and stream-chunk bodies the official client parses. No web framework here: the app
(:mod:`kvcandle.server.app`) moves bytes, this module decides what they mean.
"""

from __future__ import annotations

import codecs
import json
import math
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Optional

from .._checks import as_int, show
from ..errors import InputError
from ..generation import TokenLogprob
from ..model import Model
from ..sampling import check_settings

#: OpenAI's limits, kept as the API states them
MAX_STOP = 4
MAX_TOP_LOGPROBS_CHAT = 20
MAX_LOGPROBS_COMPLETION = 5
MAX_TEMPERATURE = 2.0
MAX_STOP_CHARS = 256
MAX_PROMPTS = 64

#: kvcandle's finish reasons as the API names them ("context": the cache filled up)
FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length", "context": "length"}

ROLES = ("system", "developer", "user", "assistant")


class RequestError(Exception):
    """A request the server refuses: HTTP ``status`` with an OpenAI-style error body
    naming the field (``param``)."""

    def __init__(self, message: str, param: Optional[str] = None, *, status: int = 400, kind: str = "invalid_request_error", code: Optional[str] = None) -> None:
        super().__init__(message)
        self.message, self.param, self.status, self.kind, self.code = message, param, status, kind, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


@dataclass
class Request:
    """A checked completion request: what to run and how to answer."""

    chat: bool
    prompts: list[list[int]]
    """Token ids of each prompt (a chat request has one)."""
    n: int
    max_tokens: list[int]
    """Per prompt: the tokens it may generate (the request's limit, or the context left)."""
    settings: dict[str, Any]
    """temperature, top_k, top_p, repetition_penalty, seed, stop as BatchGenerator.add takes them."""
    logprobs: Optional[int]
    """None: no logprobs; k: each token's logprob and the k most likely tokens."""
    stream: bool
    include_usage: bool
    model: str
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def choices(self) -> int:
        return len(self.prompts) * self.n


def parse_json(body: bytes) -> dict[str, Any]:
    """The request body as a JSON object.

    Raises:
        RequestError: not UTF-8 JSON, or not an object.
    """
    try:
        value = json.loads(body.decode("utf-8"), parse_constant=_no_constant)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise RequestError(f"the body is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise RequestError(f"the body must be a JSON object, got {type(value).__name__}")
    return value


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _bool(body: dict[str, Any], name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise RequestError(f"{name} must be a boolean, got {show(value)}", name)
    return value


def _int(body: dict[str, Any], name: str, low: int, high: Optional[int], default: Optional[int]) -> Optional[int]:
    value = body.get(name)
    if value is None:
        return default
    n = as_int(value)
    if n is None or n < low or (high is not None and n > high):
        rule = f"an integer from {low} to {high}" if high is not None else f"an integer >= {low}"
        raise RequestError(f"{name} must be {rule}, got {show(value)}", name)
    return n


def _setting(name: str, value: Any, **given: Any) -> Any:
    """``value`` checked by kvcandle's own rule for sampling setting ``name``."""
    args = {"temperature": 0.0, "top_k": None, "top_p": None, "repetition_penalty": None, "seed": None, name: value}
    try:
        return getattr(check_settings(**args), name)
    except InputError as e:
        raise RequestError(str(e), name) from None


def _unsupported(body: dict[str, Any], name: str, default: Any) -> None:
    value = body.get(name)
    if value is not None and value != default:
        raise RequestError(f"{name} is not supported by kvcandle serve (only {default!r}), got {show(value)}", name)


def _stop(body: dict[str, Any]) -> list[str]:
    value = body.get("stop")
    if value is None:
        return []
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or len(stops) > MAX_STOP:
        raise RequestError(f"stop must be a string or a list of at most {MAX_STOP} strings, got {show(value)}", "stop")
    for i, s in enumerate(stops):
        if not isinstance(s, str) or not s or len(s) > MAX_STOP_CHARS:
            raise RequestError(f"stop[{i}] must be a non-empty string of at most {MAX_STOP_CHARS} characters, got {show(s)}", "stop")
    return stops


def _sampling(body: dict[str, Any]) -> dict[str, Any]:
    """temperature (OpenAI's default 1), top_p, top_k, repetition_penalty, seed, stop."""
    temperature = body.get("temperature")
    temperature = 1.0 if temperature is None else _setting("temperature", temperature)
    if temperature > MAX_TEMPERATURE:
        raise RequestError(f"temperature must be from 0 to {MAX_TEMPERATURE}, got {show(body.get('temperature'))}", "temperature")
    top_p = None if body.get("top_p") is None else _setting("top_p", body.get("top_p"))  # checked first: `true == 1`
    settings = {
        "temperature": temperature,
        "top_p": None if top_p == 1 else top_p,
        "top_k": _setting("top_k", body.get("top_k")),
        "repetition_penalty": _setting("repetition_penalty", body.get("repetition_penalty")),
        "seed": _setting("seed", body.get("seed")),
        "stop": _stop(body),
    }
    for name in ("frequency_penalty", "presence_penalty"):
        _unsupported(body, name, 0)
    _unsupported(body, "logit_bias", {})
    _unsupported(body, "tools", [])
    return settings


def _model(body: dict[str, Any], served: str) -> str:
    name = body.get("model")
    if name is None:
        return served
    if not isinstance(name, str) or name != served:
        raise RequestError(f"the model {show(name)} does not exist: this server serves {served!r}", "model", code="model_not_found")
    return name


def _content(message: dict[str, Any], i: int) -> str:
    content = message.get("content")
    if isinstance(content, str):
        return content
    if content is None and message.get("role") == "assistant":
        return ""
    if isinstance(content, list):  # content parts: only text
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise RequestError(f"messages[{i}].content[{j}] must be a text part {{'type': 'text', 'text': ...}}, got {show(part)}", f"messages[{i}].content")
            texts.append(part["text"])
        return "".join(texts)
    raise RequestError(f"messages[{i}].content must be a string or a list of text parts, got {show(content)}", f"messages[{i}].content")


def chat_prompt(body: dict[str, Any], model: Model) -> list[int]:
    """The token ids of ``messages`` rendered with the model's chat template."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError(f"messages must be a non-empty list of messages, got {show(messages)}", "messages")
    rendered = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise RequestError(f"messages[{i}] must be an object with a role and content, got {show(m)}", f"messages[{i}]")
        role = m.get("role")
        if role not in ROLES:
            raise RequestError(f"messages[{i}].role must be one of {', '.join(ROLES)}, got {show(role)}", f"messages[{i}].role")
        rendered.append({"role": "system" if role == "developer" else role, "content": _content(m, i)})
    tok = model.tokenizer
    assert tok is not None
    try:
        return tok.apply_chat_template(rendered, add_generation_prompt=True, tokenize=True)
    except ValueError as e:
        raise RequestError(f"messages: {e}", "messages") from None


def completion_prompts(body: dict[str, Any], model: Model) -> list[list[int]]:
    """``prompt``: a string, token ids, or a list of either (one choice set each)."""
    prompt = body.get("prompt")
    vocab = model.config.vocab_size
    tok = model.tokenizer
    assert tok is not None

    def one(p: Any, where: str) -> list[int]:
        if isinstance(p, str):
            try:
                ids = tok.encode(p)
            except InputError as e:  # text no tokenizer takes (an unpaired surrogate)
                raise RequestError(f"{where}: {e}", "prompt") from None
        elif isinstance(p, list) and all(as_int(t) is not None for t in p):
            ids = [int(t) for t in p]
            bad = next((t for t in ids if not 0 <= t < vocab), None)
            if bad is not None:
                raise RequestError(f"{where} holds the token id {bad}, outside the vocabulary (0..{vocab - 1})", "prompt")
        else:
            raise RequestError(f"{where} must be a string or a list of token ids, got {show(p)}", "prompt")
        if not ids:
            raise RequestError(f"{where} is empty: a completion needs at least one prompt token", "prompt")
        return ids

    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        if len(prompt) > MAX_PROMPTS:
            raise RequestError(f"prompt may hold at most {MAX_PROMPTS} prompts, got {len(prompt)}", "prompt")
        return [one(p, f"prompt[{i}]") for i, p in enumerate(prompt)]
    return [one(prompt, "prompt")]


def parse(body: dict[str, Any], model: Model, served: str, *, chat: bool, max_choices: int) -> Request:
    """A request body checked into a :class:`Request`.

    Raises:
        RequestError: the first bad field, named.
    """
    name = _model(body, served)
    stream = _bool(body, "stream", False)
    options = body.get("stream_options")
    if options is not None and (not isinstance(options, dict) or not isinstance(options.get("include_usage", False), bool)):
        raise RequestError(f"stream_options must be an object like {{'include_usage': true}}, got {show(options)}", "stream_options")
    include_usage = bool(options and options.get("include_usage"))
    n = _int(body, "n", 1, max_choices, 1)
    assert n is not None
    settings = _sampling(body)
    if chat:
        logprobs = None
        if _bool(body, "logprobs", False):
            logprobs = _int(body, "top_logprobs", 0, MAX_TOP_LOGPROBS_CHAT, 0)
        elif body.get("top_logprobs") is not None:
            raise RequestError("top_logprobs needs logprobs: true", "top_logprobs")
        limit_name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
        prompts = [chat_prompt(body, model)]
    else:
        logprobs = _int(body, "logprobs", 0, MAX_LOGPROBS_COMPLETION, None)
        _unsupported(body, "echo", False)
        _unsupported(body, "suffix", None)
        _unsupported(body, "best_of", 1)
        limit_name = "max_tokens"
        prompts = completion_prompts(body, model)
    if len(prompts) * n > max_choices:
        raise RequestError(f"{len(prompts)} prompts times n = {n} is {len(prompts) * n} sequences; this server runs at most {max_choices} at once (--max-batch)", "n")
    limit = _int(body, limit_name, 1, None, None)
    if limit_name != "max_tokens":
        _int(body, "max_tokens", 1, None, None)  # not used, but a bad one is still refused
    context = model.config.max_position_embeddings
    max_tokens = []
    for ids in prompts:
        room = context - len(ids)
        if room < 1:
            raise RequestError(f"the prompt is {len(ids)} tokens; the model's context holds {context}", "messages" if chat else "prompt")
        if limit is not None and limit > room:
            raise RequestError(f"{limit_name} is {limit}, but the context has room for {room} tokens after the {len(ids)}-token prompt ({context} in all)", limit_name)
        max_tokens.append(limit if limit is not None else room)
    return Request(chat, prompts, n, max_tokens, settings, logprobs, stream, include_usage, name)


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


class TextOffsets:
    """Where each token of one completion starts in its text, in characters: the text
    the tokens before it decode to, a character split across tokens counted once it is
    whole (as the text is streamed). One per choice, fed every token in order, so the
    offsets are the same streamed or not."""

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._at = 0

    def take(self, token_bytes: bytes) -> int:
        """The offset of the token whose bytes these are (the next one)."""
        start = self._at
        self._at += len(self._decoder.decode(token_bytes))
        return start


class Logprobs:
    """Turns :class:`TokenLogprob` entries into the API's logprobs objects (chat's
    ``content`` list, or the completions API's parallel lists)."""

    def __init__(self, model: Model) -> None:
        self._tok = model.tokenizer
        self._bytes: dict[int, bytes] = {}

    def bytes_of(self, token: int) -> bytes:
        if token not in self._bytes:
            assert self._tok is not None
            self._bytes[token] = self._tok.token_bytes(token)
        return self._bytes[token]

    def text_of(self, token: int) -> str:
        return self.bytes_of(token).decode("utf-8", errors="replace")

    def chat(self, entries: list[TokenLogprob]) -> dict[str, Any]:
        def one(token: int, logprob: float) -> dict[str, Any]:
            return {"token": self.text_of(token), "logprob": _finite(logprob), "bytes": list(self.bytes_of(token))}

        return {"content": [{**one(e.token, e.logprob), "top_logprobs": [one(t, lp) for t, lp in e.top]} for e in entries]}

    def completion(self, entries: list[TokenLogprob], at: TextOffsets) -> dict[str, Any]:
        return {
            "tokens": [self.text_of(e.token) for e in entries],
            "token_logprobs": [_finite(e.logprob) for e in entries],
            "top_logprobs": [{self.text_of(t): _finite(lp) for t, lp in e.top} for e in entries],
            "text_offset": [at.take(self.bytes_of(e.token)) for e in entries],
        }


def _finite(x: float) -> float:
    # JSON has no -inf: a token the model gives no chance at all gets the lowest float
    return x if math.isfinite(x) else -3.4028234663852886e38


def chunk(req: Request, choices: list[dict[str, Any]], usage_: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    """A stream chunk (chat.completion.chunk or text_completion)."""
    out = _envelope(req, "chat.completion.chunk" if req.chat else "text_completion", choices)
    if req.include_usage:
        out["usage"] = usage_
    return out


def response(req: Request, choices: list[dict[str, Any]], usage_: dict[str, Any]) -> dict[str, Any]:
    """A whole (non-streamed) response."""
    return {**_envelope(req, "chat.completion" if req.chat else "text_completion", choices), "usage": usage_}


def _envelope(req: Request, kind: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
    """What every response and stream chunk of ``req`` carries."""
    return {
        "id": ("chatcmpl-" if req.chat else "cmpl-") + req.id,
        "object": kind,
        "created": req.created,
        "model": req.model,
        "system_fingerprint": None,
        "choices": choices,
    }


def models(served: str, created: int) -> dict[str, Any]:
    return {"object": "list", "data": [{"id": served, "object": "model", "created": created, "owned_by": "kvcandle"}]}
