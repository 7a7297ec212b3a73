"""``kvcandle serve``: an OpenAI-compatible HTTP server (needs ``pip install
'kvcandle[server]'``).

    kvcandle serve --port 8000
    client = openai.OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="unused")

Requests are decoded together as they arrive and leave (continuous batching over a
:class:`kvcandle.BatchGenerator`), prompts are reused across requests through one
:class:`kvcandle.PromptCache` (saved to ``--prompt-cache-dir`` and found again after a
restart), and a client that goes away stops its work within one step.
"""

from __future__ import annotations

import socket
import sys
from pathlib import Path
from typing import IO, Optional

from ..model import Model
from .app import Settings, create_app
from .process import READY

__all__ = ["Settings", "create_app", "default_name", "serve"]


def serve(model: Model, settings: Settings, *, host: str = "127.0.0.1", port: int = 8000, log: IO[str] = sys.stderr) -> None:
    """Serves ``model`` until interrupted (Ctrl-C or SIGTERM: running requests end, the
    prompt cache is saved). ``port=0`` takes a free port; the line
    ``kvcandle serve: listening on http://HOST:PORT`` says which, once requests are
    taken."""
    import uvicorn

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    bound = sock.getsockname()[1]
    app = create_app(model, settings)
    config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5, lifespan="on")
    server = uvicorn.Server(config)

    original = server.startup

    async def startup(sockets: Optional[list[socket.socket]] = None) -> None:
        await original(sockets=sockets)
        shown = f"[{host}]" if family == socket.AF_INET6 else host
        print(f"kvcandle serve: {READY}{shown}:{bound} (model {settings.served_name})", file=log, flush=True)

    server.startup = startup  # type: ignore[method-assign]
    server.run(sockets=[sock])


def default_name(model: Model) -> str:
    """The model's id in the API: its file or directory name without ``.gguf`` and the
    quantization suffix (``SmolLM2-135M-Instruct``)."""
    name = Path(model.path).name
    if name.endswith(".gguf"):
        name = name[: -len(".gguf")]
        head, dot, tail = name.rpartition(".")
        if dot and tail.upper().startswith(("Q", "F", "BF", "IQ")):
            name = head
    return name
