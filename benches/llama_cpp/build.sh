#!/usr/bin/env bash
# Build a CPU-only llama.cpp and link benches/llama_cpp/compare.cpp against it.
#
# Usage: benches/llama_cpp/build.sh [OUTPUT_BINARY]
#   OUTPUT_BINARY defaults to $BUILD_DIR/compare.
# Environment:
#   LLAMA_CPP_SRC  llama.cpp source tree to copy from
#                  (default: /tmp/lcpp-src/llama_cpp_python-0.3.36/vendor/llama.cpp)
#   SRC_COPY       where the source is copied before building (default: /tmp/llamacpp-build-src);
#                  when it names LLAMA_CPP_SRC itself the tree is used in place (cmake builds
#                  out of tree, in BUILD_DIR, so the source is not written to)
#   TOOLS          llama.cpp tool targets to build as well, space-separated, e.g.
#                  "llama-bench llama-quantize llama-completion" (default: none, libllama only);
#                  benches/python/compare_llama_cpp_cpu.py sets it
#   BUILD_DIR      cmake build directory (default: /tmp/llamacpp-build)
#   JOBS           parallel build jobs (default: 2)
#   CMAKE          cmake executable (default: cmake on PATH, else ~/.cache/lowsync-venv/bin/cmake)
#   CXX            C++ compiler for compare.cpp (default: g++)
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
LLAMA_CPP_SRC="${LLAMA_CPP_SRC:-/tmp/lcpp-src/llama_cpp_python-0.3.36/vendor/llama.cpp}"
SRC_COPY="${SRC_COPY:-/tmp/llamacpp-build-src}"
BUILD_DIR="${BUILD_DIR:-/tmp/llamacpp-build}"
JOBS="${JOBS:-2}"
OUT="${1:-$BUILD_DIR/compare}"
CXX="${CXX:-g++}"

if [[ -z "${CMAKE:-}" ]]; then
    if command -v cmake >/dev/null 2>&1; then
        CMAKE=cmake
    elif [[ -x "$HOME/.cache/lowsync-venv/bin/cmake" ]]; then
        CMAKE="$HOME/.cache/lowsync-venv/bin/cmake"
    else
        echo "cmake not found; try: ~/.cache/lowsync-venv/bin/python -m pip install cmake" >&2
        exit 1
    fi
fi

# 1. copy the source (never build inside the original tree)
if [[ ! -f "$SRC_COPY/CMakeLists.txt" ]]; then
    echo "copying $LLAMA_CPP_SRC -> $SRC_COPY"
    mkdir -p "$SRC_COPY"
    cp -a "$LLAMA_CPP_SRC/." "$SRC_COPY/"
fi

# 2. configure + build libllama and ggml (CPU backend, Release), and the TOOLS asked for (they
#    need llama.cpp's `common` library). AMX stays off: with -march=native on a CPU that
#    advertises AMX, ggml's AMX path faulted in the VMs these benches run in.
TOOLS="${TOOLS:-}"
WITH_TOOLS=OFF
if [[ -n "$TOOLS" ]]; then
    WITH_TOOLS=ON
fi
"$CMAKE" -S "$SRC_COPY" -B "$BUILD_DIR" \
    -DCMAKE_BUILD_TYPE=Release \
    -DBUILD_SHARED_LIBS=ON \
    -DGGML_NATIVE=ON \
    -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF \
    -DGGML_CUDA=OFF -DGGML_METAL=OFF -DGGML_VULKAN=OFF \
    -DLLAMA_CURL=OFF \
    -DLLAMA_OPENSSL=OFF \
    -DLLAMA_BUILD_TESTS=OFF \
    -DLLAMA_BUILD_SERVER=OFF \
    -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_BUILD_TOOLS="$WITH_TOOLS" \
    -DLLAMA_BUILD_APP=OFF \
    -DLLAMA_BUILD_COMMON="$WITH_TOOLS"
# shellcheck disable=SC2086  # TOOLS is a list of target names
"$CMAKE" --build "$BUILD_DIR" --config Release --target llama $TOOLS -j "$JOBS"

# 3. link compare.cpp against libllama + ggml
LIBDIR="$(dirname "$(find "$BUILD_DIR" -name 'libllama.so' -print -quit)")"
GGML_LIBDIR="$(dirname "$(find "$BUILD_DIR" -name 'libggml.so' -print -quit)")"
mkdir -p "$(dirname "$OUT")"
"$CXX" -std=c++17 -O2 -Wall -Wextra \
    -I "$SRC_COPY/include" -I "$SRC_COPY/ggml/include" \
    "$HERE/compare.cpp" -o "$OUT" \
    -L "$LIBDIR" -L "$GGML_LIBDIR" -lllama -lggml -lggml-base \
    -Wl,-rpath,"$LIBDIR" -Wl,-rpath,"$GGML_LIBDIR"
echo "built $OUT"
