"""The hand-written `_core.pyi` matches the compiled module (mypy's stubtest), and the
package type-checks against it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # mypy runs in a subprocess: about 40 s

ROOT = Path(__file__).resolve().parents[1]


def test_stubtest_core():
    r = subprocess.run(
        [sys.executable, "-m", "mypy.stubtest", "kvcandle._core"],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert r.returncode == 0, r.stdout + r.stderr


def test_package_type_checks():
    r = subprocess.run(
        [sys.executable, "-m", "mypy", "--ignore-missing-imports", str(ROOT / "python" / "kvcandle")],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert r.returncode == 0, r.stdout + r.stderr
