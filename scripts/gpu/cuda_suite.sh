#!/usr/bin/env bash
# The CUDA backend's GPU test suite, built on a machine without a GPU and run on one with it.
#
#   scripts/gpu/cuda_suite.sh            # here: build the release test binaries of lowsync-cuda,
#                                        # strip them and copy them to .carry/cuda-tests/
#   scripts/gpu/cuda_suite.sh --run      # there: run every binary in .carry/cuda-tests/ with
#                                        # LOWSYNC_REQUIRE_CUDA=1 (a missing device fails), the
#                                        # CUDA libraries on LD_LIBRARY_PATH, logs to $OUT
#
# The GPU machine needs no cargo: the binaries load libcuda, libnvrtc and libcublas at run time
# (cudarc dynamic loading). Libraries are looked up in /usr/local/cuda/lib64 and in the
# nvidia/*/lib folders of python3's site-packages (the nvidia-cuda-nvrtc / nvidia-cublas wheels).
set -euo pipefail

root=$(cd "$(dirname "$0")/../.." && pwd)
dest="$root/.carry/cuda-tests"
mode=${1:---build}

case "$mode" in
--build | build)
    export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$HOME/.cache/lowsync-target}
    rm -rf "$dest"
    mkdir -p "$dest"
    cd "$root"
    cargo test -p lowsync-cuda --release --no-run --message-format=json |
        python3 "$root/scripts/gpu/test_executables.py" | while read -r name exe; do
        # The library's unit tests are named after the crate; integration tests after their file.
        out="$dest/$name"
        cp "$exe" "$out"
        strip "$out" 2>/dev/null || true
        echo "built $out ($(du -h "$out" | cut -f1))"
    done
    ls "$dest" >/dev/null
    echo "carry .carry/cuda-tests and run: bash scripts/gpu/cuda_suite.sh --run"
    ;;
--run | run)
    [ -d "$dest" ] || { echo "no $dest: build first (scripts/gpu/cuda_suite.sh)"; exit 2; }
    logs=${OUT:-$root/cuda-logs}
    mkdir -p "$logs"
    libdirs=/usr/local/cuda/lib64
    nv=$(python3 -c 'import nvidia; print(list(nvidia.__path__)[0])' 2>/dev/null || true)
    if [ -n "$nv" ]; then
        for d in "$nv"/cu13/lib "$nv"/*/lib; do
            [ -d "$d" ] && libdirs="$libdirs:$d"
        done
    fi
    export LD_LIBRARY_PATH="$libdirs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    export LOWSYNC_REQUIRE_CUDA=1
    # A fresh kernel cache per run, so NVRTC compilation is exercised too.
    export XDG_CACHE_HOME=${XDG_CACHE_HOME:-$(mktemp -d)}
    {
        echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
        nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 || true
    } | tee "$logs/env.txt"
    failed=()
    for t in "$dest"/*; do
        name=$(basename "$t")
        chmod +x "$t"
        echo "=== $name"
        # A bound per binary: an ordering bug that deadlocks must not eat the whole lease.
        if timeout "${CUDA_SUITE_TIMEOUT_S:-240}" "$t" --include-ignored --test-threads=1 >"$logs/$name.log" 2>&1; then
            grep -E "^test result" "$logs/$name.log" | tail -1
        else
            failed+=("$name")
            tail -40 "$logs/$name.log"
        fi
    done
    if [ ${#failed[@]} -gt 0 ]; then
        echo "FAILED: ${failed[*]} (logs in $logs)"
        exit 1
    fi
    echo "all CUDA test binaries passed (logs in $logs)"
    ;;
*)
    echo "usage: $0 [--build | --run]" >&2
    exit 2
    ;;
esac
