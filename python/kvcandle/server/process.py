"""``kvcandle serve`` as a child process: started on a free port, found by the line it
prints once it takes requests, and stopped as Ctrl-C would (SIGTERM: running requests
end, the prompt cache is saved). For tests, benchmarks and scripts that want a real
server for a while:

    with kvcandle.server.process.spawn("--max-batch", "4") as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
"""

from __future__ import annotations

import contextlib
import queue
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Iterator

#: what ``kvcandle serve`` prints once it takes requests, before the URL
READY = "listening on http://"


@dataclass
class ServerProcess:
    proc: "subprocess.Popen[str]"
    host: str
    port: int
    lines: "queue.Queue[str]"
    """What the server printed on stderr after its listening line."""

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


@contextlib.contextmanager
def spawn(*options: str, host: str = "127.0.0.1", start_seconds: float = 180, stop_seconds: float = 60) -> Iterator[ServerProcess]:
    """Runs ``python -m kvcandle serve --host HOST --port 0 *options`` until the block
    ends, then stops it (SIGTERM, then SIGKILL after ``stop_seconds``).

    Raises:
        RuntimeError: the server exited, or did not print its listening line within
            ``start_seconds`` (the message holds what it printed).
    """
    cmd = [sys.executable, "-m", "kvcandle", "serve", "--host", host, "--port", "0", *options]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    lines: queue.Queue[str] = queue.Queue()

    def drain() -> None:  # the pipe never fills, whatever the server prints
        assert proc.stderr is not None
        for line in proc.stderr:
            lines.put(line)

    threading.Thread(target=drain, daemon=True).start()
    try:
        deadline, port = time.monotonic() + start_seconds, None
        seen: list[str] = []
        while port is None:
            left = deadline - time.monotonic()
            if left <= 0 or proc.poll() is not None:
                raise RuntimeError(f"kvcandle serve did not start (exit status {proc.poll()}): {''.join(seen)}")
            try:
                line = lines.get(timeout=min(left, 0.5))
            except queue.Empty:
                continue
            seen.append(line)
            if READY in line:
                port = int(line.split(READY)[1].split()[0].rsplit(":", 1)[1])
        yield ServerProcess(proc, host, port, lines)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=stop_seconds)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=stop_seconds)
