#!/usr/bin/env bash
# The project's whole test run: Rust checks and tests, the CUDA kernels emulated on the CPU, the
# wheel, Python lint/types/stubs, pytest.
#
# Expects cargo (with clippy, rustfmt; cargo-nextest if present; rustup for the aarch64 lints),
# g++ and a Python environment that has maturin, ruff, mypy and pytest (`.ci/run` makes one at
# $HOME/.cache/lowsync-venv). The wheel is built outside the repository and installed into that
# environment, so pytest imports the built `lowsync`, never the source tree.
set -euxo pipefail

cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python}"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/lowsync-target}"

# 1. Rust: format, lints, docs (no broken or private links), tests.
cargo fmt --all -- --check
cargo clippy --workspace --all-targets --all-features -- -D warnings
# The same lints for aarch64 (the CPU backend's NEON bodies of the quantized products are
# compiled only there; the criterion benches need a C cross compiler and are left out), then
# the CPU backend's quantized-product tests on aarch64 under qemu-user (`.ci/run` installs it
# and the cross linker). One of those tests runs its own binary again as a child, which
# qemu-user cannot do without binfmt_misc: it is left out there (x86-64 runs it below).
# Each part is skipped, and says so, where what it needs cannot be installed.
if rustup target add aarch64-unknown-linux-gnu; then
    PYO3_CROSS=1 cargo clippy --workspace --exclude lowsync-benches --all-targets --all-features \
        --target aarch64-unknown-linux-gnu -- -D warnings
    if command -v qemu-aarch64 >/dev/null && command -v aarch64-linux-gnu-gcc >/dev/null; then
        CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_LINKER=aarch64-linux-gnu-gcc \
            CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_RUNNER="qemu-aarch64 -L /usr/aarch64-linux-gnu" \
            cargo test -p lowsync-cpu --target aarch64-unknown-linux-gnu --lib quant -- \
            --skip a_bad_decode_act_is_an_error_naming_the_variable
    else
        echo "skipped: the aarch64 tests need qemu-aarch64 and aarch64-linux-gnu-gcc"
    fi
else
    echo "skipped: the aarch64-unknown-linux-gnu standard library could not be installed"
fi
RUSTDOCFLAGS="-D warnings" cargo doc --workspace --no-deps --all-features
if cargo nextest --version >/dev/null 2>&1; then
    cargo nextest run --workspace --all-features
else
    cargo test --workspace --all-features
fi

# The CUDA decode kernels' source, run on the CPU against float64 references (no GPU needed).
bash scripts/kernel_emu.sh

# 2. The wheel, installed into the active environment.
wheel_dir="$CARGO_TARGET_DIR/wheels"
mkdir -p "$wheel_dir"
rm -f "$wheel_dir"/lowsync-*.whl
"$PYTHON" -m maturin build --release --interpreter "$PYTHON" -o "$wheel_dir"
wheels=("$wheel_dir"/lowsync-*.whl)
test "${#wheels[@]}" -eq 1
"$PYTHON" -m pip install --force-reinstall --no-deps "${wheels[0]}"

# 3. Python: lint, format, types, the stub against the built module.
"$PYTHON" -m ruff check python tests benches/python benches/profile scripts
"$PYTHON" -m ruff format --check python tests benches/python benches/profile scripts
"$PYTHON" -m mypy python/lowsync
"$PYTHON" -m mypy.stubtest lowsync._native

# 4. pytest; its exit status is the script's (5, "no tests collected", fails the run).
"$PYTHON" -m pytest
