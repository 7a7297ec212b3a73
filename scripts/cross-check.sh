#!/usr/bin/env bash
# Builds kvcandle for the platforms this machine cannot run natively, so their code paths
# never rot: clippy (warnings are errors) on the host, on macOS arm64 and x86_64 (Metal +
# Accelerate, compiled and linted, not linked or run), and the Rust unit tests (kernels,
# cache) for aarch64 Linux, run under qemu. Installs the toolchain pieces it needs
# (Debian packages, rustup targets) when they are missing.
set -euo pipefail
cd "$(dirname "$0")/.."

need_pkgs=()
command -v clang >/dev/null || need_pkgs+=(clang)
command -v pkg-config >/dev/null || need_pkgs+=(pkg-config)
[ -e /usr/include/oniguruma.h ] || need_pkgs+=(libonig-dev)
command -v aarch64-linux-gnu-gcc >/dev/null || need_pkgs+=(gcc-aarch64-linux-gnu)
command -v qemu-aarch64 >/dev/null || need_pkgs+=(qemu-user)
if [ ${#need_pkgs[@]} -gt 0 ]; then
    if [ "$(id -u)" != 0 ]; then
        echo "cross-check: missing Debian packages ${need_pkgs[*]} (install them, or run as root)" >&2
        exit 1
    fi
    echo "cross-check: installing ${need_pkgs[*]}"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need_pkgs[@]}" >/dev/null
fi
rustup target add aarch64-apple-darwin x86_64-apple-darwin aarch64-unknown-linux-gnu >/dev/null
rustup component add clippy >/dev/null

step() { echo; echo "== cross-check: $*"; }
# Each target gets its own build directory: pyo3's build configuration for a cross target
# is written beside the host build scripts, which Cargo shares between targets in one
# directory, and a second target can then read the first one's (seen as "failed to parse
# PyO3 config: missing value for version" in numpy's build script).
base_dir=${CARGO_TARGET_DIR:-$PWD/target}

step "clippy, $(rustc -vV | sed -n 's/^host: //p')"
cargo clippy --release --features python --all-targets -- -D warnings

for target in aarch64-apple-darwin x86_64-apple-darwin; do
    step "clippy, $target (Metal + Accelerate)"
    # oniguruma (a C dependency of the tokenizers crate) is taken from Debian's headers:
    # checking does not link, and no macOS SDK is needed for that.
    CARGO_TARGET_DIR="$base_dir/cross-$target" RUSTONIG_SYSTEM_LIBONIG=1 PKG_CONFIG_ALLOW_CROSS=1 \
        PYO3_CROSS_PYTHON_VERSION=3.11 CC_aarch64_apple_darwin=clang CC_x86_64_apple_darwin=clang \
        cargo clippy --release --target "$target" --features python --all-targets -- -D warnings
done

step "unit tests, aarch64-unknown-linux-gnu under qemu"
CARGO_TARGET_DIR="$base_dir/cross-aarch64-unknown-linux-gnu" \
CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_LINKER=aarch64-linux-gnu-gcc \
CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_RUNNER="qemu-aarch64 -L /usr/aarch64-linux-gnu" \
CC_aarch64_unknown_linux_gnu=aarch64-linux-gnu-gcc \
    cargo test --release --target aarch64-unknown-linux-gnu --lib
