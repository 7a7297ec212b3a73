"""The SIMD level of kvcandle's own kernels: the best the CPU runs, or the one
``KVCANDLE_SIMD`` forces (read once, when a kernel first runs), so that every path can be
tested and measured on one machine. ``scripts/test.sh`` runs the suite again under each
level below the best; here: the level is reported, forced, and a bad value refused."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

import kvcandle

PROBE = """
import kvcandle, numpy as np
print(kvcandle.simd_level())
model = kvcandle.load()
cache = model.new_cache()
ids = model.tokenizer.encode("The capital of France is")
model.forward(ids[:-1], cache)
print(model.tokenizer.decode([int(np.argmax(model.forward([ids[-1]], cache)))]))
"""


def run(code: str, value: str | None, var: str = kvcandle.SIMD_ENV) -> subprocess.CompletedProcess[str]:
    """``code`` in a fresh interpreter with the environment variable ``var`` set to
    ``value`` (or unset)."""
    env = {k: v for k, v in os.environ.items() if k != var}
    if value is not None:
        env[var] = value
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)


def test_levels_are_reported():
    levels = kvcandle.simd_levels()
    assert levels[0] == "portable" and set(levels) <= {"portable", "avx2", "avx512"}
    assert kvcandle.simd_level() in levels
    if os.environ.get(kvcandle.SIMD_ENV):
        assert kvcandle.simd_level() == os.environ[kvcandle.SIMD_ENV].strip().lower()
    else:
        assert kvcandle.simd_level() == levels[-1]  # the best, unforced


@pytest.mark.parametrize("level", ["portable", "avx2", "avx512"])
def test_each_level_can_be_forced(level):
    if level not in kvcandle.simd_levels():
        pytest.skip(f"this CPU cannot run {level} (it runs {kvcandle.simd_levels()})")
    got = run(PROBE, level)
    assert got.returncode == 0, got.stderr
    reported, word = got.stdout.splitlines()[:2]
    assert reported == level
    assert word.strip() == "Paris"


@pytest.mark.parametrize("value", ["sse9", "avx-512", "fast"])
def test_a_bad_level_is_refused_by_name(value):
    got = run("import kvcandle\ntry:\n    kvcandle.load()\nexcept kvcandle.DeviceError as e:\n    print('DeviceError', e)\n", value)
    assert got.returncode == 0, got.stderr
    assert got.stdout.startswith("DeviceError") and value in got.stdout and "avx512, avx2, portable" in got.stdout


def test_a_level_the_cpu_lacks_is_refused():
    missing = [level for level in ("avx2", "avx512") if level not in kvcandle.simd_levels()]
    if not missing:
        pytest.skip(f"this CPU runs every level ({kvcandle.simd_levels()}): none to refuse")
    got = run("import kvcandle\ntry:\n    kvcandle.simd_level()\nexcept kvcandle.DeviceError as e:\n    print('DeviceError', e)\n", missing[0])
    assert got.stdout.startswith("DeviceError") and "cannot run" in got.stdout, got.stdout + got.stderr


def test_info_names_the_level():
    got = subprocess.run([sys.executable, "-m", "kvcandle", "info"], capture_output=True, text=True, timeout=300)
    assert got.returncode == 0, got.stderr
    line = next(l for l in got.stdout.splitlines() if l.startswith("SIMD level"))
    assert kvcandle.simd_level() in line and kvcandle.SIMD_ENV in line


def setting_probe(setting: str) -> str:
    """Code that prints ``kvcandle.<setting>()``, then the bits of the logits of a batch
    (13 rows: several passes over tiles of rows on every SIMD level) and of one
    sequence's decode steps (every product with one input)."""
    return f"""
import kvcandle, numpy as np
print(kvcandle.{setting}())
model = kvcandle.load()
base = model.new_cache()
ids = model.tokenizer.encode("The capital of France is")
model.forward(ids[:-1], base)
caches = [base.fork() for _ in range(4)]
logits = model.forward_batch([[ids[-1]], [ids[-1], 11], [7], list(range(100, 109))], caches)
one = base.fork()
logits += [model.forward([t], one) for t in (ids[-1], 11, 7)]
print(np.concatenate([np.asarray(l, dtype=np.float32).ravel() for l in logits]).tobytes().hex())
"""


# The float32 products' software prefetches (KVCANDLE_PREFETCH): every level gives the
# same bits (a prefetch moves no data a kernel computes with), and the default follows
# the CPU (bad values and `info`: SETTINGS below).
PREFETCH_PROBE = setting_probe("prefetch_level")


def test_prefetch_levels_give_the_same_bits():
    got = {value: run(PREFETCH_PROBE, value, kvcandle.PREFETCH_ENV) for value in ("l1", "L2 ", "l2-batch", "L1+l2")}
    for value, g in got.items():
        assert g.returncode == 0, g.stderr
        assert g.stdout.splitlines()[0] == value.strip().lower()
    bits = {value: g.stdout.splitlines()[1] for value, g in got.items()}
    assert len(set(bits.values())) == 1, {value: b[:64] for value, b in bits.items()}


def test_the_default_prefetch_level_follows_the_cpu():
    """The second level on AMD x86-64 CPUs of family 19h with AVX-512 (Zen 4), the first
    on AMD family 1Ah and later (Zen 5) and on family 17h (Zen 1, Zen 2), the second for
    batches only on other AMD CPUs (Zen 3), both on other x86-64 CPUs (Intel), the first
    on any other (ARM)."""
    got = run("import kvcandle; print(kvcandle.prefetch_level())", None, kvcandle.PREFETCH_ENV)
    assert got.returncode == 0, got.stderr
    amd = avx512 = False
    family = None
    x86 = platform.machine().lower() in ("x86_64", "amd64")
    if x86:
        if not os.path.exists("/proc/cpuinfo"):
            pytest.skip("the CPU vendor is read from /proc/cpuinfo (Linux) here")
        with open("/proc/cpuinfo") as f:
            lines = f.read().splitlines()
        amd = any(line.startswith("vendor_id") and "AuthenticAMD" in line for line in lines)
        avx512 = any(line.startswith("flags") and "avx512f" in line.split() for line in lines)
        family = next(int(line.split(":")[1]) for line in lines if line.startswith("cpu family"))
    zen4 = amd and avx512 and family == 0x19
    zen5_on_or_zen1_2 = amd and (family >= 0x1A or family == 0x17)
    assert got.stdout.strip() == ("l2" if zen4 else "l1" if zen5_on_or_zen1_2 else "l2-batch" if amd else "l1+l2" if x86 else "l1")


# The rows a float32 product of one input reads side by side (KVCANDLE_ROWS): 1 and 8
# give the same bits (every row has the same arithmetic either way), and 1 is the
# default (bad values and `info`: SETTINGS below).
ROWS_PROBE = setting_probe("one_input_rows")


def test_row_counts_give_the_same_bits():
    got = {value: run(ROWS_PROBE, value, kvcandle.ROWS_ENV) for value in ("1", " 8 ")}
    for value, g in got.items():
        assert g.returncode == 0, g.stderr
        assert g.stdout.splitlines()[0] == value.strip()
    assert got["1"].stdout.splitlines()[1] == got[" 8 "].stdout.splitlines()[1]


def test_one_row_at_a_time_is_the_default():
    got = run("import kvcandle; print(kvcandle.one_input_rows())", None, kvcandle.ROWS_ENV)
    assert got.returncode == 0, got.stderr
    assert got.stdout.strip() == "1"


# Both settings (KVCANDLE_PREFETCH, KVCANDLE_ROWS): (environment variable, the text each
# choice appears in within the refusal, bad values, `info`'s line).
SETTINGS = {
    "prefetch_level": (kvcandle.PREFETCH_ENV, ("l1", "l2", "l2-batch", "l1+l2"), ["l3", "t0", "fast", "l2batch", "l1l2", "l2+l1"], "prefetch level"),
    "one_input_rows": (kvcandle.ROWS_ENV, ("1, 8",), ["2", "0", "-1", "eight", "1.0"], "one-input rows"),
}


@pytest.mark.parametrize("setting,value", [(setting, value) for setting, (_, _, bad, _) in SETTINGS.items() for value in bad])
def test_a_bad_setting_is_refused_by_name(setting, value):
    var, choices, _, _ = SETTINGS[setting]
    code = f"import kvcandle\nfor f in (kvcandle.load, kvcandle.{setting}):\n    try:\n        f()\n    except kvcandle.DeviceError as e:\n        print('DeviceError', e)\n"
    got = run(code, value, var)
    assert got.returncode == 0, got.stderr
    lines = got.stdout.splitlines()
    assert len(lines) == 2 and all(l.startswith("DeviceError") and f'{var}="{value}"' in l and all(c in l for c in choices) for l in lines), got.stdout


@pytest.mark.parametrize("setting", SETTINGS)
def test_info_names_the_setting(setting):
    var, _, _, label = SETTINGS[setting]
    got = subprocess.run([sys.executable, "-m", "kvcandle", "info"], capture_output=True, text=True, timeout=300)
    assert got.returncode == 0, got.stderr
    line = next(l for l in got.stdout.splitlines() if l.startswith(label))
    assert str(getattr(kvcandle, setting)()) in line and var in line
