"""The ASGI app (Starlette): routes, bodies read within a limit, server-sent events, and
clients that go away. What requests mean is :mod:`.protocol`'s; running them is
:mod:`.scheduler`'s.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, AsyncIterator, Optional

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from ..generation import Piece
from ..model import Model
from . import protocol
from .protocol import FINISH_REASONS, Logprobs, Request, RequestError
from .scheduler import Job, QueueFull, Scheduler


@dataclass(frozen=True)
class Settings:
    """How the server runs (``kvcandle serve``'s options)."""

    served_name: str
    max_batch: int = 8
    max_queue: int = 64
    prompt_cache_bytes: int = 1 << 30
    prompt_cache_dir: Optional[Path] = None
    max_body_bytes: int = 1 << 20


def error_response(e: RequestError) -> JSONResponse:
    headers = {"Retry-After": "1"} if e.status == 503 else None
    return JSONResponse(e.body(), status_code=e.status, headers=headers)


async def read_body(request: HTTPRequest, limit: int) -> bytes:
    """The body, refused once it passes ``limit`` bytes (before it is all read)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise RequestError(f"the body is {declared} bytes; this server takes at most {limit} (--max-body-bytes)", code="body_too_large")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise RequestError(f"the body is over {limit} bytes; this server takes at most {limit} (--max-body-bytes)", code="body_too_large")
        chunks.append(chunk)
    return b"".join(chunks)


class _Events:
    """A job's events, moved from the worker thread to the event loop; a client that
    goes away cancels the job."""

    def __init__(self, scheduler: Scheduler, request: HTTPRequest) -> None:
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[tuple[str, Optional[int], Any]] = asyncio.Queue()
        self.scheduler, self.request = scheduler, request
        self.job: Optional[Job] = None
        self.watch: Optional[asyncio.Task[None]] = None

    def emit(self, kind: str, choice: Optional[int], value: Any) -> None:  # the worker thread
        with contextlib.suppress(RuntimeError):  # the loop is closed: the server is stopping
            self.loop.call_soon_threadsafe(self.queue.put_nowait, (kind, choice, value))

    def start(self, job: Job) -> None:
        self.job = job
        self.scheduler.submit(job)  # QueueFull before anything else starts
        self.watch = asyncio.ensure_future(self._watch())

    async def _watch(self) -> None:
        while True:
            message = await self.request.receive()
            if message["type"] == "http.disconnect":
                self.close()
                await self.queue.put(("disconnect", None, None))
                return

    def close(self) -> None:
        if self.job is not None:
            self.scheduler.cancel(self.job)
        if self.watch is not None and self.watch is not asyncio.current_task():
            self.watch.cancel()

    async def __aiter__(self) -> AsyncIterator[tuple[str, Optional[int], Any]]:
        try:
            while True:
                kind, choice, value = await self.queue.get()
                if kind in ("end", "disconnect"):
                    return
                yield kind, choice, value
        finally:
            self.close()


class _Choices:
    """Each choice's text, tokens, logprobs and finish reason as pieces arrive, and the
    request's usage."""

    def __init__(self, req: Request, logprobs: Logprobs) -> None:
        self.req, self.lp = req, logprobs
        self.text = [""] * req.choices
        self.tokens = [0] * req.choices
        self.entries: list[list[Any]] = [[] for _ in range(req.choices)]
        self.finish: list[Optional[str]] = [None] * req.choices
        self.cached = 0

    def add(self, choice: int, piece: Piece) -> None:
        self.text[choice] += piece.text
        self.tokens[choice] += len(piece.tokens)
        if piece.logprobs:
            self.entries[choice] += piece.logprobs
        if piece.result is not None:
            self.finish[choice] = FINISH_REASONS.get(piece.result.finish_reason, piece.result.finish_reason)
            if choice % self.req.n == 0:
                self.cached += piece.result.stats.reused_tokens

    def logprobs(self, choice: int, entries: list[Any], at: protocol.TextOffsets) -> Optional[dict[str, Any]]:
        if self.req.logprobs is None:
            return None
        return self.lp.chat(entries) if self.req.chat else self.lp.completion(entries, at)

    def usage(self) -> dict[str, Any]:
        return protocol.usage(sum(len(p) for p in self.req.prompts), sum(self.tokens), self.cached)

    def response(self) -> dict[str, Any]:
        choices = []
        for i in range(self.req.choices):
            lp = self.logprobs(i, self.entries[i], protocol.TextOffsets())
            if self.req.chat:
                choices.append({"index": i, "message": {"role": "assistant", "content": self.text[i]}, "logprobs": lp, "finish_reason": self.finish[i]})
            else:
                choices.append({"index": i, "text": self.text[i], "logprobs": lp, "finish_reason": self.finish[i]})
        return protocol.response(self.req, choices, self.usage())


def _sse(data: Any) -> bytes:
    return b"data: " + json.dumps(data, ensure_ascii=False).encode("utf-8") + b"\n\n"


def create_app(model: Model, settings: Settings) -> Starlette:
    """The server's app for ``model``; its lifespan starts and stops the scheduler."""
    scheduler = Scheduler(
        model, max_batch=settings.max_batch, max_queue=settings.max_queue,
        prompt_cache_bytes=settings.prompt_cache_bytes, prompt_cache_dir=settings.prompt_cache_dir,
    )
    logprobs = Logprobs(model)
    created = int(time.time())

    async def completions(request: HTTPRequest, chat: bool) -> Response:
        try:
            body = protocol.parse_json(await read_body(request, settings.max_body_bytes))
            req = await run_in_threadpool(protocol.parse, body, model, settings.served_name, chat=chat, max_choices=settings.max_batch)
        except RequestError as e:
            return error_response(e)
        events = _Events(scheduler, request)
        job = Job(req.prompts, req.n, req.max_tokens, req.settings, req.logprobs, events.emit)
        try:
            events.start(job)
        except QueueFull as e:
            return error_response(RequestError(str(e), status=503, kind="server_busy", code="queue_full"))
        choices = _Choices(req, logprobs)
        if req.stream:
            return StreamingResponse(_stream(req, events, choices), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        async for kind, choice, value in events:
            if kind == "error":
                return error_response(RequestError(value, status=500, kind="server_error"))
            assert choice is not None
            choices.add(choice, value)
        if any(f is None for f in choices.finish):  # the client went away
            return Response(status_code=499)
        return JSONResponse(choices.response())

    async def _stream(req: Request, events: _Events, choices: _Choices) -> AsyncIterator[bytes]:
        if req.chat:
            yield _sse(protocol.chunk(req, [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None} for i in range(req.choices)]))
        offsets = [protocol.TextOffsets() for _ in range(req.choices)]
        async for kind, choice, piece in events:
            if kind == "error":
                yield _sse(RequestError(piece, status=500, kind="server_error").body())
                return
            assert choice is not None
            choices.add(choice, piece)
            if piece.text or piece.tokens:
                lp = choices.logprobs(choice, piece.logprobs or [], offsets[choice])
                if req.chat:
                    body = {"index": choice, "delta": {"content": piece.text}, "logprobs": lp, "finish_reason": None}
                else:
                    body = {"index": choice, "text": piece.text, "logprobs": lp, "finish_reason": None}
                yield _sse(protocol.chunk(req, [body]))
            if piece.result is not None:
                finish = choices.finish[choice]
                body = {"index": choice, "delta": {}, "logprobs": None, "finish_reason": finish} if req.chat else {"index": choice, "text": "", "logprobs": None, "finish_reason": finish}
                yield _sse(protocol.chunk(req, [body]))
        if any(f is None for f in choices.finish):
            return  # the client went away
        if req.include_usage:
            yield _sse(protocol.chunk(req, [], choices.usage()))
        yield b"data: [DONE]\n\n"

    async def chat_route(request: HTTPRequest) -> Response:
        return await completions(request, chat=True)

    async def completion_route(request: HTTPRequest) -> Response:
        return await completions(request, chat=False)

    async def models_route(request: HTTPRequest) -> Response:
        return JSONResponse(protocol.models(settings.served_name, created))

    async def health_route(request: HTTPRequest) -> Response:
        return JSONResponse({"status": "ok", "model": settings.served_name, **scheduler.stats()})

    async def metrics_route(request: HTTPRequest) -> Response:
        lines = []
        for name, value in scheduler.stats().items():
            kind = "counter" if name.endswith("_total") else "gauge"
            lines += [f"# TYPE kvcandle_{name} {kind}", f"kvcandle_{name} {value}"]
        return PlainTextResponse("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")

    async def not_found(request: HTTPRequest, exc: Exception) -> Response:
        status = exc.status_code if isinstance(exc, HTTPException) else 500
        message = "not found" if status == 404 else ("method not allowed" if status == 405 else "internal error")
        return JSONResponse(RequestError(f"{request.method} {request.url.path}: {message}", status=status).body(), status_code=status)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        scheduler.start()
        try:
            yield
        finally:
            await run_in_threadpool(scheduler.stop)

    app = Starlette(
        routes=[
            Route("/v1/chat/completions", chat_route, methods=["POST"]),
            Route("/v1/completions", completion_route, methods=["POST"]),
            Route("/v1/models", models_route, methods=["GET"]),
            Route("/health", health_route, methods=["GET"]),
            Route("/metrics", metrics_route, methods=["GET"]),
        ],
        exception_handlers={HTTPException: not_found},
        lifespan=lifespan,
    )
    app.state.scheduler = scheduler
    return app
