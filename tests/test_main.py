"""The main job: `python -m kvcandle` greedily continues the prompt with the default model."""

from __future__ import annotations

import subprocess
import sys


def test_main_job_prints_text_and_cache(default_model):
    r = subprocess.run([sys.executable, "-m", "kvcandle"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("The capital of France is Paris")
    assert "cache: len=24 keys[0].shape=(1, 3, 24, 64)" in r.stdout


def test_main_job_bad_model_is_one_line_error(tmp_path):
    r = subprocess.run(
        [sys.executable, "-m", "kvcandle", "--model", str(tmp_path / "missing.gguf")],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 1
    assert r.stderr.startswith("kvcandle: error: model not found:") and r.stderr.count("\n") == 1
