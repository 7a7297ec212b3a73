"""llama.cpp's quantizer (through llama-cpp-python), shared by the benchmarks: the default
model as an all-float32 GGUF, and that file re-quantized to another type. Files are
written once into the temporary directory and reused."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Optional


def requantize(src: Path, dst: Path, ftype: int, threads: int) -> bool:
    """``src`` written as llama.cpp's file type ``ftype`` (LLAMA_FTYPE_*) at ``dst``,
    atomically; False when the quantizer fails."""
    import llama_cpp

    if dst.exists():
        return True
    p = llama_cpp.llama_model_quantize_default_params()
    p.ftype = ftype
    p.allow_requantize = True
    p.nthread = threads
    tmp = dst.with_suffix(".partial")
    saved = os.dup(2)  # the quantizer prints every tensor on stderr
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
            rc = llama_cpp.llama_model_quantize(str(src).encode(), str(tmp).encode(), p)
    finally:
        os.dup2(saved, 2)
        os.close(saved)
    if rc != 0:
        return False
    os.replace(tmp, dst)
    return True


def write_f32_gguf(src: Path, threads: int) -> Optional[Path]:
    """The default model as an all-float32 GGUF (LLAMA_FTYPE_ALL_F32)."""
    dst = Path(tempfile.gettempdir()) / f"kvcandle-bench-{src.stem}.f32.gguf"
    return dst if requantize(src, dst, 0, threads) else None
