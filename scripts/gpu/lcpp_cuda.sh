# Sourced by h200_all.sh and tune_call.sh: llama.cpp b11434's CUDA tools (sm_90) in
# /tmp/lcpp-cuda, and the built-in models' F16 files for the side by side in /tmp/gpucmp.
lcpp_cuda=/tmp/lcpp-cuda

# lcpp_cuda_start LOG JOBS [nice]: unpacks the binaries an earlier call returned
# (.carry/lcpp-cuda/part-*) and sets lcpp_cuda_pid to "", or builds llama-bench and
# llama-quantize from the carried source (.carry/src/llama.cpp.tgz, the pruned sdist tree) in
# the background (under `nice` where the third argument says so), with lcpp_cuda_pid the
# build's process.
lcpp_cuda_start() {
    local log=$1 jobs=$2 run=${3:-}
    if ls .carry/lcpp-cuda/part-* >/dev/null 2>&1; then
        mkdir -p $lcpp_cuda && cat .carry/lcpp-cuda/part-* | tar xJ -C $lcpp_cuda
        lcpp_cuda_pid=""
    else
        (mkdir -p /tmp/lcpp-src && tar xzf .carry/src/llama.cpp.tgz -C /tmp/lcpp-src &&
            $run python3 benches/python/compare_llama_cpp_gpu.py --backend cuda --llama-src /tmp/lcpp-src/llama.cpp \
                --build-dir $lcpp_cuda --models "" --types "" --jobs "$jobs" >"$log" 2>&1
            echo "llama.cpp cuda build exit $?" >>"$log") &
        lcpp_cuda_pid=$!
    fi
}

# lcpp_cuda_pack DIR: the tools and their shared libraries, stripped, as parts under the
# device tool's 16 MiB limit in DIR (save them in .carry/lcpp-cuda/ for later calls; the
# build's RPATH is /tmp/lcpp-cuda/bin, where a later call unpacks them).
lcpp_cuda_pack() {
    (cd $lcpp_cuda && strip --strip-unneeded bin/llama-bench bin/llama-quantize bin/*.so* 2>/dev/null
     tar cJ bin/llama-bench bin/llama-quantize $(ls bin/*.so* 2>/dev/null)) |
        { mkdir -p "$1" && split -b 15m - "$1/part-"; }
}

# f16_files MODELS LOG: the models' F16 files written in the background by the compare
# script's own `make_files` (each appears only when complete); files_pid is the writer.
f16_files() {
    nice python3 -c 'import sys; sys.path.insert(0, "benches/python"); import compare_llama_cpp_gpu as c
c.make_files(c.parse_args(["--backend", "cuda", "--work", "/tmp/gpucmp", "--types", "f16",
    "--models", sys.argv[1]]))' "$1" >"$2" 2>&1 &
    files_pid=$!
}
