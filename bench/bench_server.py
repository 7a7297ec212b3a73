"""``kvcandle serve`` against llama-cpp-python's server (``llama_cpp.server``), both real
servers on loopback, driven by the official ``openai`` client; the engines take turns,
figures are medians over rounds.

  - time to first token of a chat's second turn, whose 2,000-token first turn (a
    document in the system message) the server has seen, over the first turn's;
  - aggregate generated tokens per second of four concurrent clients over one client
    running the same requests one after another.

    python bench/bench_server.py [--quantized] [--rounds 3] [--threads N] [--no-llama-cpp]

kvcandle in float32 is compared with llama.cpp on an all-float32 GGUF of the same
weights, ``--quantized`` with llama.cpp on the Q4_1 file itself. llama-cpp-python's
server needs ``pip install 'llama-cpp-python[server]'``; without it only kvcandle runs.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Iterator, Optional

import openai

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _llamacpp import write_f32_gguf  # noqa: E402
from _machine import cpu_features  # noqa: E402

import kvcandle  # noqa: E402
from kvcandle.server.process import spawn  # noqa: E402
from kvcandle.tokenizer import Tokenizer  # noqa: E402

CLIENTS = 4
MAX_TOKENS = 64
DOC_TOKENS = 2000


def document(tok: Tokenizer, round_: int) -> str:
    """About DOC_TOKENS tokens of text, different for every round (so a first turn is
    never cached)."""
    words = ["river", "mountain", "harbour", "library", "orchard", "lantern", "glacier", "market", "violin", "compass"]
    out, i = [], 0
    while len(tok.encode(" ".join(out))) < DOC_TOKENS:
        a, b = words[(i + round_) % len(words)], words[(3 * i + 7 * round_) % len(words)]
        out.append(f"Note {round_}.{i}: the {a} stands near the {b}, and its story is told again.")
        i += 1
    return " ".join(out)


def first_token_seconds(client: openai.OpenAI, model: str, messages: list[dict[str, str]]) -> tuple[float, str]:
    """Seconds to the first streamed content, and the whole reply."""
    start, first, text = time.perf_counter(), None, ""
    for chunk in client.chat.completions.create(model=model, messages=messages, max_tokens=16, temperature=0, stream=True):
        if chunk.choices and chunk.choices[0].delta.content:
            if first is None:
                first = time.perf_counter() - start
            text += chunk.choices[0].delta.content
    return (first if first is not None else time.perf_counter() - start), text


def turns(client: openai.OpenAI, model: str, tok: Tokenizer, round_: int) -> tuple[float, float]:
    messages = [{"role": "system", "content": document(tok, round_)}, {"role": "user", "content": "What stands near the river?"}]
    t1, reply = first_token_seconds(client, model, messages)
    messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": "And near the library?"}]
    t2, _ = first_token_seconds(client, model, messages)
    return t1, t2


def throughput(client: openai.OpenAI, model: str, clients: int, round_: int) -> float:
    """Generated tokens per second of ``CLIENTS`` requests (counting prompts that run to
    MAX_TOKENS) sent by ``clients`` clients at once."""

    def one(k: int) -> int:
        start = 100 * round_ + 10 * k
        prompt = ", ".join(str(start + j) for j in range(4)) + ","
        r = client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
        return r.usage.completion_tokens

    clock = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        tokens = sum(pool.map(one, range(CLIENTS)))
    return tokens / (time.perf_counter() - clock)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def llama_cpp_server(path: Path, threads: int) -> Iterator[Optional[str]]:
    """llama-cpp-python's server on ``path`` (None when it is not installed or does not
    start in two minutes)."""
    try:
        import llama_cpp.server  # noqa: F401
    except ImportError as e:
        print(f"llama_cpp.server not installed ({e}): kvcandle only")
        yield None
        return
    port = free_port()
    cmd = [sys.executable, "-m", "llama_cpp.server", "--model", str(path), "--host", "127.0.0.1", "--port", str(port),
           "--n_ctx", "4096", "--n_threads", str(threads), "--n_threads_batch", str(threads)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}/v1"
    try:
        client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=5)
        deadline = time.monotonic() + 120
        while True:
            try:
                client.models.list()
                break
            except openai.APIConnectionError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    print("llama_cpp.server did not start: kvcandle only")
                    yield None
                    return
                time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quantized", action="store_true", help="kvcandle --quantized against llama.cpp on the Q4_1 file")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--no-llama-cpp", action="store_true")
    args = ap.parse_args()
    os.environ["RAYON_NUM_THREADS"] = str(args.threads)
    path = kvcandle.default_model_path()
    tok = Tokenizer.from_gguf_file(path)
    assert tok is not None
    print(f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs ({cpu_features()}), {args.threads} threads, "
          f"{'quantized (Q4_1)' if args.quantized else 'float32'}, {args.rounds} rounds")
    lcp_file = path if args.quantized else (None if args.no_llama_cpp else write_f32_gguf(path, args.threads))
    options = ["--quantized"] if args.quantized else []
    results: dict[str, dict[str, list[float]]] = {}
    with contextlib.ExitStack() as stack:
        kv = stack.enter_context(spawn(*options, "--max-batch", "8"))
        engines: dict[str, tuple[openai.OpenAI, str]] = {
            "kvcandle": (openai.OpenAI(base_url=kv.url + "/v1", api_key="unused", max_retries=0, timeout=600), "SmolLM2-135M-Instruct"),
        }
        if lcp_file is not None and not args.no_llama_cpp:
            url = stack.enter_context(llama_cpp_server(lcp_file, args.threads))
            if url is not None:
                engines["llama.cpp"] = (openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=600), str(lcp_file))
        for name, (client, model) in engines.items():  # warm up: the first requests of a process are slower
            throughput(client, model, CLIENTS, 99)
        for r in range(args.rounds):
            for name, (client, model) in engines.items():
                got = results.setdefault(name, {})
                t1, t2 = turns(client, model, tok, r)
                got.setdefault("first turn TTFT (s)", []).append(t1)
                got.setdefault("second turn TTFT (s)", []).append(t2)
                got.setdefault("second / first", []).append(t2 / t1)
                one = throughput(client, model, 1, r)
                four = throughput(client, model, CLIENTS, r)
                got.setdefault("1 client tok/s", []).append(one)
                got.setdefault(f"{CLIENTS} clients tok/s", []).append(four)
                got.setdefault(f"{CLIENTS} clients / 1", []).append(four / one)
                print(f"round {r + 1} {name}: TTFT {t1:.3f}s -> {t2:.3f}s, {one:.1f} -> {four:.1f} tok/s", flush=True)
    names = list(results)
    rows = list(results[names[0]])
    print()
    print("| median | " + " | ".join(names) + " |")
    print("|---|" + "---|" * len(names))
    for row in rows:
        print(f"| {row} | " + " | ".join(f"{statistics.median(results[n][row]):.3g}" for n in names) + " |")
    if "llama.cpp" in results:
        median: Callable[[str, str], float] = lambda n, row: statistics.median(results[n][row])
        print(f"\n4 clients, kvcandle / llama.cpp: {median('kvcandle', f'{CLIENTS} clients tok/s') / median('llama.cpp', f'{CLIENTS} clients tok/s'):.2f}x")


if __name__ == "__main__":
    main()
