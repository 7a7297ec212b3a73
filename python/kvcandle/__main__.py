"""``kvcandle`` / ``python -m kvcandle``: greedy continuation of a prompt with a KV cache.

    kvcandle ["The capital of France is"] [--model PATH] [--max-tokens 20]

Prints the continuation, then the cache's length and layer-0 key shape.
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

from .errors import KVCandleError
from .model import load

DEFAULT_PROMPT = "The capital of France is"


def greedy(model, prompt: str, max_tokens: int):
    """Prefills ``prompt`` on a new cache and decodes ``max_tokens`` greedy tokens; the
    last token is returned but not fed back, so the cache holds prompt + max_tokens - 1."""
    if model.tokenizer is None:
        raise KVCandleError(f"{model.path} has no tokenizer, so a text prompt cannot be encoded")
    cache = model.new_cache()
    logits = model.forward(model.tokenizer.encode(prompt), cache)
    tokens = [int(logits.argmax())]
    while len(tokens) < max_tokens:
        logits = model.forward([tokens[-1]], cache)
        tokens.append(int(logits.argmax()))
    return tokens, cache


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="kvcandle", description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("prompt", nargs="?", default=DEFAULT_PROMPT)
    parser.add_argument("--model", default=None, help="GGUF file or Hugging Face directory (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--max-tokens", type=int, default=20)
    args = parser.parse_args(argv)
    if args.max_tokens < 1:
        parser.error(f"--max-tokens must be at least 1, got {args.max_tokens}")
    try:
        model = load(args.model)
        tokens, cache = greedy(model, args.prompt, args.max_tokens)
    except (KVCandleError, OSError) as e:
        print(f"kvcandle: error: {e}", file=sys.stderr)
        return 1
    assert model.tokenizer is not None
    print(args.prompt + model.tokenizer.decode(tokens))
    print(f"cache: len={len(cache)} keys[0].shape={cache.layers[0].keys.shape} nbytes={cache.nbytes}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
