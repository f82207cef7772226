#!/usr/bin/env bash
# Everything lowsync runs on the GPU machine, in one call (each fresh machine starts bare).
#
# Carried (git-ignored): .carry/wheels/lowsync-*.whl (the abi3 wheel, features cuda+vulkan),
# .carry/cuda-tests/ and .carry/vulkan-tests/ (prebuilt test binaries), .whl/ (gguf wheel and
# the pruned llama-cpp-python sdist), .gl/ (the Vulkan loader .debs), .carry/src/llama.cpp.tgz
# (llama.cpp b11434's pruned source) and .carry/vkbuild/ (Debian's glslc, libshaderc1,
# libvulkan-dev and spirv-headers .debs, for `vkcmp`).
# `scripts/gpu/make_carry.sh` makes all of these on the CPU machine.
# Output: $OUT/summary.txt (what a closing note quotes) and $OUT/logs.tar.gz (everything).
#
#   bash scripts/gpu/h200_all.sh [cuda] [vulkan] [coldstart] [bench] [compare] [llamacpp] [vkcmp] [rebar] [attn] [ktrace] [ab] [ubsweep] [torch] ...
set -uo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
cd "$root"
out=${OUT:-/tmp/out}
logs=/tmp/lowsync-logs
mkdir -p "$out" "$logs"
summary="$out/summary.txt"
parts=${*:-cuda vulkan bench compare}
export PYTHONUNBUFFERED=1
say() { echo "$@" | tee -a "$summary"; }
# Whether part $1 was asked for (whole words: `lcppcuda` is not `cuda`).
has() { [[ " $parts " == *" $1 "* ]]; }
# shellcheck source=scripts/gpu/lcpp_cuda.sh
source scripts/gpu/lcpp_cuda.sh
# BUDGET (seconds, default unlimited): the whole call ends inside it, so what ran comes back
# even when a device call's limit is near. `tl N`: a part's timeout, N or what is left less a
# margin for the log archive; `wait_for PID`: waits for a background build, killing it at the
# deadline (the part after it then finds no binaries and says so).
deadline=$((SECONDS + ${BUDGET:-1000000}))
tl() { local left=$((deadline - SECONDS - 20)); ((left < 5)) && left=5; echo $(($1 < left ? $1 : left)); }
wait_for() {
    while kill -0 "$1" 2>/dev/null; do
        if ((SECONDS > deadline - 60)); then
            say "budget: stopped background job $1"; pkill -P "$1"; kill "$1"; break
        fi
        sleep 2
    done
    wait "$1"
}

# Python packages: the lowsync wheel and gguf into /tmp/site.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .carry/wheels/lowsync-*.whl .whl/*.whl >"$logs/pip.log" 2>&1 || { cat "$logs/pip.log"; exit 1; }
export PYTHONPATH=/tmp/site
# The CUDA modules precompiled for sm_90 (make_carry.sh's `cubins`), so NVRTC compiles none.
if [ -f .carry/cubins.txz ]; then
    cache=${XDG_CACHE_HOME:-$HOME/.cache}/lowsync/cuda
    mkdir -p "$cache" && tar xJf .carry/cubins.txz -C "$cache" --strip-components=1
fi
# CUDA libraries (NVRTC, cuBLAS) for dlopen.
nv=$(python3 -c 'import nvidia; print(list(nvidia.__path__)[0])' 2>/dev/null || true)
libdirs=/usr/local/cuda/lib64
for d in "$nv"/cu13/lib "$nv"/*/lib; do [ -d "$d" ] && libdirs="$libdirs:$d"; done
export LD_LIBRARY_PATH="$libdirs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
# The Vulkan loader (the machine has none of its own), where .gl/ was carried.
for f in .gl/*.deb; do [ -f "$f" ] && dpkg -x "$f" /; done
ldconfig
icd=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
[ -f "$icd" ] && export VK_DRIVER_FILES=$icd

if [[ " $parts " == *" keep "* ]]; then
    mkdir -p /tmp/keep && cp .carry/m1/* /tmp/keep/ && say "kept: $(du -sh /tmp/keep)"
fi
say "== $(date -u) $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>&1)"
say "available: $(python3 -c 'import lowsync; print(lowsync.available_backends())' 2>&1)"

if has llamacpp; then
    # Build llama-cpp-python (CPU) in the background while the GPU suites run.
    (mkdir -p /tmp/lcpp && tar xzf .whl/llama_cpp_python-*-pruned.tar.gz -C /tmp/lcpp &&
        CMAKE_ARGS="-DGGML_NATIVE=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF" \
        python3 -m pip install --no-index --no-deps --no-build-isolation --target /tmp/lcpp-site /tmp/lcpp/llama_cpp_python-* \
        >"$logs/llamacpp-build.log" 2>&1; echo "llama-cpp-python build exit $?" >>"$logs/llamacpp-build.log") &
    lcpp_pid=$!
fi

if has lcppcuda; then
    # llama.cpp b11434 with its CUDA backend (sm_90): llama-bench and llama-quantize, built from
    # the carried source in the background, or unpacked from what an earlier call returned
    # (scripts/gpu/lcpp_cuda.sh).
    lcpp_cuda_start "$logs/lcpp-cuda-build.log" 16
    [ -z "$lcpp_cuda_pid" ] && say "llama.cpp cuda: unpacked $(ls $lcpp_cuda/bin | tr '\n' ' ')"
fi

if has vkcmp; then
    # llama.cpp b11434 with its Vulkan backend, built from the carried source in the background:
    # glslc, the Vulkan and SPIR-V headers and the loader come from Debian 12's packages
    # (.carry/vkbuild/: glslc, libshaderc1, libvulkan-dev, spirv-headers; .gl/libvulkan1),
    # unpacked under /tmp/vkroot, not /, and found by CMake through VULKAN_SDK.
    mkdir -p /tmp/vkroot
    for f in .carry/vkbuild/*.deb .gl/libvulkan1*.deb; do [ -f "$f" ] && dpkg -x "$f" /tmp/vkroot; done
    ln -sf x86_64-linux-gnu/libvulkan.so /tmp/vkroot/usr/lib/libvulkan.so
    (export VULKAN_SDK=/tmp/vkroot/usr PATH=/tmp/vkroot/usr/bin:$PATH \
        LD_LIBRARY_PATH=/tmp/vkroot/usr/lib/x86_64-linux-gnu:$LD_LIBRARY_PATH
        mkdir -p /tmp/lcpp-src && tar xzf .carry/src/llama.cpp.tgz -C /tmp/lcpp-src &&
            nice python3 benches/python/compare_llama_cpp_gpu.py --backend vulkan --llama-src /tmp/lcpp-src/llama.cpp \
                --build-dir /tmp/lcpp-vk --models "" --types "" --jobs 14 >"$logs/lcpp-vk-build.log" 2>&1
        echo "llama.cpp vulkan build exit $?" >>"$logs/lcpp-vk-build.log") &
    lcpp_vk_pid=$!
fi

if has gpucmp || has vkcmp; then
    # The built-in models' F16 files for the side by side (1b: 2.1 GB), written by the compare
    # script's own `make_files` while the builds and the earlier parts run; each appears only
    # when complete, and the comparisons wait for this first.
    want=""
    has gpucmp && want="$want,${GPUCMP_MODELS:-1b,tiny}"
    has vkcmp && want="$want,${VKCMP_MODELS:-1b,tiny}"
    f16_files "$want" "$logs/f16-files.log"
fi

run_suite() { # name dir
    local name=$1 dir=$2
    [ -d "$dir" ] || { say "$name: no binaries carried"; return; }
    for t in "$dir"/*; do
        chmod +x "$t"
        timeout "$(tl 300)" "$t" --include-ignored --test-threads=1 >"$logs/$name-$(basename "$t").log" 2>&1
        say "$name $(basename "$t"): exit $? $(grep -E '^test result' "$logs/$name-$(basename "$t").log" | tail -1)"
        grep -E "^test .* FAILED|panicked" "$logs/$name-$(basename "$t").log" | head -5 | tee -a "$summary"
    done
}
# The CUDA suites start from an empty kernel cache (every module compiled by NVRTC, as on a
# user's first open), or with CUDA_TEST_CUBINS=1 from the carried cubins (a quick check of a
# change, minutes of device time less). CUDA_TESTS: the folder of test binaries.
if [ "${CUDA_TEST_CUBINS:-0}" = 1 ]; then test_cache=${XDG_CACHE_HOME:-$HOME/.cache}; else test_cache=$(mktemp -d); fi
has cuda && LOWSYNC_REQUIRE_CUDA=1 XDG_CACHE_HOME=$test_cache run_suite cuda "${CUDA_TESTS:-.carry/cuda-tests}"
# No validation layer on the GPU machine: the tests would otherwise refuse to start.
has vulkan && LOWSYNC_REQUIRE_VULKAN=1 LOWSYNC_VK_VALIDATION=${LOWSYNC_VK_VALIDATION:-0} run_suite vulkan .carry/vulkan-tests

if has coldstart; then
    # The first CUDA open on a bare machine: every kernel module compiled by NVRTC, none cached.
    # Once per wheel of COLD_WHEELS (default: the carried one), each with its own empty cache;
    # then a second open in the same process (the cubins it kept). Wheel i stays installed in
    # /tmp/cold-i with its cache in /tmp/cold-i-cache, for later commands of the call.
    i=0
    for w in ${COLD_WHEELS:-.carry/wheels/lowsync-*.whl}; do
        i=$((i + 1))
        python3 -m pip install -q --no-index --no-deps --no-compile --target "/tmp/cold-$i" "$w" >/dev/null 2>&1
        cache=/tmp/cold-$i-cache
        rm -rf "$cache" && mkdir -p "$cache"
        XDG_CACHE_HOME=$cache PYTHONPATH=/tmp/cold-$i timeout "$(tl 400)" python3 -c 'import time, lowsync as ls
t = time.perf_counter(); ls.Context(["cuda"]); a = time.perf_counter() - t
t = time.perf_counter(); ls.Context(["cuda"]); b = time.perf_counter() - t
print(f"first open {a:.1f} s, second {b:.2f} s")' >"$logs/cold-$i.txt" 2>&1
        say "cold start $w: exit $? $(tail -1 "$logs/cold-$i.txt"); $(ls "$cache/lowsync/cuda" 2>/dev/null | wc -l) cubins cached"
    done
fi
if has bench; then
    for m in tiny 1b; do
        if [ $m = tiny ]; then bk=${BENCH_TINY_BACKENDS:-cuda,vulkan}; else bk=${BENCH_1B_BACKENDS:-cuda,vulkan}; fi
        timeout "$(tl 400)" python3 -m lowsync.cli bench -m $m -t f16 --backend "$bk" -p 32 -n ${BENCH_N:-64} \
            >"$logs/bench-$m.txt" 2>"$logs/bench-$m.err"
        say "bench $m: exit $?"; cat "$logs/bench-$m.txt" | tee -a "$summary"; tail -3 "$logs/bench-$m.err"
    done
fi
if has compare; then
    timeout "$(tl 300)" python3 benches/python/compare_transformers.py --model tiny --backends cpu,cuda,vulkan \
        >"$logs/compare-transformers.txt" 2>&1
    say "transformers: exit $?"; grep -v "_tokens" "$logs/compare-transformers.txt" | tail -5 | tee -a "$summary"
    grep -o '"backend": "[a-z]*", "logits_max_rel_diff": [0-9.e-]*, "same_greedy_tokens": [a-z]*' \
        "$logs/compare-transformers.txt" | tee -a "$summary"
fi
if has mmvab; then
    for knob in 0 8; do
        LOWSYNC_CUDA_TUNE=mmv_max_m=$knob timeout "$(tl 300)" python3 -m lowsync.cli bench -m 1b -t f16 --backend cuda --policy stock,staged \
            -p 32 -n ${BENCH_N:-64} >"$logs/bench-mmv$knob.txt" 2>/dev/null
        say "1b cuda, LOWSYNC_CUDA_TUNE=mmv_max_m=$knob: exit $?"; grep -E '^\| 1b ' "$logs/bench-mmv$knob.txt" | tee -a "$summary"
    done
fi
if has pytest; then
    timeout "$(tl 400)" python3 -m pytest -q -p no:cacheprovider tests/test_gpu_backends.py >"$logs/pytest-gpu.txt" 2>&1
    say "pytest gpu: exit $? $(tail -1 "$logs/pytest-gpu.txt")"
fi
if has pytestq; then
    # The quantized-weight tests on every GPU backend present (CUDA and Vulkan cases).
    LOWSYNC_REQUIRE_CUDA=1 timeout "$(tl ${PYTESTQ_TIMEOUT:-400})" python3 -m pytest -q -p no:cacheprovider -m "cuda or vulkan or vulkan_gpu" \
        tests/test_quant.py tests/test_gpu_backends.py >"$logs/pytest-quant.txt" 2>&1
    say "pytest quant: exit $? $(tail -1 "$logs/pytest-quant.txt")"
    grep -E "^(FAILED|ERROR)" "$logs/pytest-quant.txt" | head -20 | tee -a "$summary"
fi
if has benchq; then
    # Built-in models quantized by lowsync (gguf-py's quantizer), decode on CUDA.
    for mt in ${BENCHQ:-tiny:q4_0 1b:q4_0 1b:f16}; do
        timeout "$(tl 300)" python3 -m lowsync.cli bench -m ${mt%%:*} -t ${mt##*:} --backend ${BENCHQ_BACKENDS:-cuda} --policy staged \
            -p 32 -n ${BENCH_N:-64} >"$logs/benchq-${mt/:/-}.txt" 2>"$logs/benchq-${mt/:/-}.err"
        say "bench $mt: exit $?"; grep -E '^\| (tiny|1b) ' "$logs/benchq-${mt/:/-}.txt" | tee -a "$summary"
        tail -2 "$logs/benchq-${mt/:/-}.err"
    done
fi
if has text; then
    # SmolLM2-135M-Instruct Q4_1 (98 MB) travels in two halves, over the carry limit of one call:
    # `keep` copies a half into /tmp/keep (it stays while the machine is warm), `text` joins it
    # with the half carried now and runs issue 30's acceptance tests on every backend present.
    data=/tmp/lowsync-data/smollm2
    mkdir -p "$data"
    cat /tmp/keep/* .carry/m2/* >"$data/SmolLM2-135M-Instruct.Q4_1.gguf"
    say "smollm2: $(sha256sum "$data/SmolLM2-135M-Instruct.Q4_1.gguf" | cut -c1-16)"
    LOWSYNC_TEST_DATA=/tmp/lowsync-data LOWSYNC_REQUIRE_CUDA=1 python3 -m pytest -q -p no:cacheprovider \
        -k "smollm2 or sampl" tests/test_cli_run.py tests/test_llm.py tests/test_gpu_backends.py \
        >"$logs/pytest-text.txt" 2>&1
    say "pytest text: exit $? $(tail -1 "$logs/pytest-text.txt")"
    grep -E "^(FAILED|ERROR)" "$logs/pytest-text.txt" | head -10 | tee -a "$summary"
    for b in cuda vulkan; do
        timeout "$(tl 120)" python3 -m lowsync.cli run -m "$data/SmolLM2-135M-Instruct.Q4_1.gguf" \
            -p "The capital of France is" -n 8 --temp 0 --backend $b >"$logs/run-$b.txt" 2>&1
        say "lowsync run ($b): exit $?: $(tr '\n' ' ' <"$logs/run-$b.txt" | tail -c 300)"
    done
fi
if has vkpaths; then
    for m in tiny 1b; do
        LOWSYNC_VK_NO_HOST_VISIBLE_VRAM=1 timeout "$(tl 300)" python3 -m lowsync.cli bench -m $m -t f16 --backend vulkan \
            --policy stock,staged -p 32 -n ${BENCH_N:-64} >"$logs/bench-norebar-$m.txt" 2>/dev/null
        say "bench no-ReBAR vulkan $m: exit $?"; grep -E '^\| (tiny|1b) ' "$logs/bench-norebar-$m.txt" | tee -a "$summary"
    done
fi
if has rebar; then
    # ReBAR against no-ReBAR in one process, alternated ("1b" Q4_0 and F16, 128- and 512-token
    # prompts: the Vulkan issue's "within 5%", and an F16 128-token prompt that ran 2.7x
    # slower under ReBAR on an H200), then where that prompt's device time goes either way.
    for case in ${REBAR_CASES:-q4_0:128 q4_0:512 f16:128 f16:512}; do
        dt=${case%%:*} p=${case##*:}
        {
            timeout "$(tl 150)" python3 benches/profile/variants_tg.py --backend vulkan --models 1b --dtype $dt \
                --variant rebar --variant norebar=LOWSYNC_VK_NO_HOST_VISIBLE_VRAM=1 --rounds 2 -p $p -n 64 \
                >"$logs/rebar-$dt-$p.txt" 2>&1
            say "rebar $dt pp$p: exit $?"; grep '^|' "$logs/rebar-$dt-$p.txt" | tee -a "$summary"
        }
    done
    for nr in ${REBAR_PROFILE-0 1}; do
        LOWSYNC_VK_NO_HOST_VISIBLE_VRAM=$nr timeout "$(tl 120)" python3 benches/profile/vk_profile.py --model 1b \
            --dtype f16 --prefill -p 128 --kv-dtype f16 >"$logs/rebar-prof-$nr.txt" 2>&1
        say "profile f16 pp128 no-ReBAR=$nr: exit $?"; head -16 "$logs/rebar-prof-$nr.txt" | tee -a "$summary"
    done
fi
if has checks; then
    timeout "$(tl 300)" python3 benches/python/gpu_checks.py --backends cuda,vulkan >"$logs/gpu-checks.txt" 2>&1
    say "gpu checks: exit $?"; grep '^{' "$logs/gpu-checks.txt" | tee -a "$summary"; tail -3 "$logs/gpu-checks.txt"
fi
if has cupti; then
    inc=$(find / -name cupti.h -path '*include*' 2>/dev/null | head -1)
    lib=$(find / -name 'libcupti.so*' 2>/dev/null | head -1)
    say "cupti: header ${inc:-none}, library ${lib:-none}"
    if [ -n "$inc" ] && [ -n "$lib" ]; then
        cudainc=$(find / -name cuda.h -path '*include*' 2>/dev/null | head -1)
        cc -shared -fPIC -O2 -I"$(dirname "$inc")" ${cudainc:+-I"$(dirname "$cudainc")"} scripts/gpu/cupti_counter.c \
            "$lib" -Wl,-rpath,"$(dirname "$lib")" -o /tmp/libcupti_counter.so >"$logs/cupti-build.log" 2>&1
        say "cupti build: exit $?"; tail -3 "$logs/cupti-build.log"
        CUDA_INJECTION64_PATH=/tmp/libcupti_counter.so timeout "$(tl 300)" python3 benches/python/cupti_check.py \
            >"$logs/cupti.txt" 2>&1
        say "cupti check: exit $?"; grep '^{' "$logs/cupti.txt" | tee -a "$summary"; tail -3 "$logs/cupti.txt"
    fi
fi
if has llamacpp; then
    wait_for "$lcpp_pid"; tail -2 "$logs/llamacpp-build.log" | tee -a "$summary"
    for m in tiny small; do
        PYTHONPATH=/tmp/site:/tmp/lcpp-site timeout "$(tl 300)" python3 benches/python/compare_llama_cpp.py \
            --model $m --dtype f16 --speed -n 32 >"$logs/compare-llamacpp-$m.txt" 2>&1
        say "llama.cpp $m: exit $?"
        sed -E 's/"(lowsync|llama_cpp)_tokens": \[[^]]*\], //g' "$logs/compare-llamacpp-$m.txt" | tail -3 | tee -a "$summary"
    done
fi
if has gpucmp; then
    # lowsync against llama.cpp's CUDA backend on identical files (the built-in models'
    # llama-quantize files, and GPUCMP_FILES: GGUF paths on the device, comma-separated).
    [ -n "${lcpp_cuda_pid:-}" ] && wait_for "$lcpp_cuda_pid"
    wait_for "$files_pid"
    tail -2 "$logs/lcpp-cuda-build.log" 2>/dev/null | tee -a "$summary"
    if [ -n "${lcpp_cuda_pid:-}" ] && [ -x "$lcpp_cuda/bin/llama-bench" ]; then
        # The tools back to the caller in parts, for later calls.
        lcpp_cuda_pack "$out/lcpp"
        say "llama.cpp cuda binaries: $(du -sh "$out/lcpp" | cut -f1)"
    fi
    timeout "$(tl ${GPUCMP_TIMEOUT:-420})" python3 benches/python/compare_llama_cpp_gpu.py --backend cuda --no-build \
        --build-dir "$lcpp_cuda" --work /tmp/gpucmp --models ${GPUCMP_MODELS:-1b,tiny} \
        --types ${GPUCMP_TYPES:-f16,q4_0,q4_k_m,q6_k,q8_0} --files "${GPUCMP_FILES:-}" -p ${GPUCMP_P:-512} -n ${GPUCMP_N:-128} \
        --repeats ${GPUCMP_R:-2} --json "$out/gpucmp.json" >"$logs/gpucmp.txt" 2>"$logs/gpucmp.err"
    say "gpu compare (cuda): exit $?"; grep -E '^[|{]' "$logs/gpucmp.txt" | tee -a "$summary"; tail -5 "$logs/gpucmp.err"
fi
if has vkcmp; then
    # lowsync against llama.cpp's Vulkan backend on identical files (the Vulkan issue's figures).
    wait_for "$lcpp_vk_pid"; wait_for "$files_pid"
    tail -1 "$logs/lcpp-vk-build.log" | tee -a "$summary"
    GGML_VK_VISIBLE_DEVICES=0 timeout "$(tl ${VKCMP_TIMEOUT:-420})" python3 benches/python/compare_llama_cpp_gpu.py \
        --backend vulkan --no-build --build-dir /tmp/lcpp-vk --work /tmp/gpucmp --models ${VKCMP_MODELS:-1b,tiny} \
        --types ${VKCMP_TYPES:-f16,q4_0} -p ${VKCMP_P:-128} -n ${VKCMP_N:-64} --repeats ${VKCMP_R:-1} \
        --json "$out/vkcmp.json" >"$logs/vkcmp.txt" 2>"$logs/vkcmp.err"
    say "gpu compare (vulkan): exit $?"; grep -E '^[|{]' "$logs/vkcmp.txt" | tee -a "$summary"; tail -5 "$logs/vkcmp.err"
fi
if has qacc; then
    # Logits of llama-quantize files of every block type on each backend against float64.
    [ -n "${lcpp_cuda_pid:-}" ] && wait_for "$lcpp_cuda_pid"
    timeout "$(tl ${QACC_TIMEOUT:-300})" python3 benches/python/quant_accuracy.py --llama-quantize "$lcpp_cuda/bin/llama-quantize" \
        --backends ${QACC_BACKENDS:-cpu,cuda,vulkan} --json "$out/qacc.json" >"$logs/qacc.txt" 2>&1
    say "quant accuracy: exit $?"; grep '^|' "$logs/qacc.txt" | tee -a "$summary"; grep -v '^[|{]' "$logs/qacc.txt" | tail -5
fi
if has profile; then
    timeout "$(tl 400)" python3 benches/profile/cuda_profile.py --models ${PROFILE_MODELS:-tiny,1b} -n ${PROFILE_N:-128} ${PROFILE_SETTINGS:+--settings $PROFILE_SETTINGS} \
        --json "$out/cuda-profile.json" >"$logs/cuda-profile.txt" 2>&1
    say "cuda profile: exit $?"; cat "$logs/cuda-profile.txt" | tail -12 | tee -a "$summary"
fi
if has attn; then
    timeout "$(tl 300)" python3 benches/profile/attn_kernels.py --windows ${ATTN_WINDOWS:-72:40,172:100,172:8,2048:100} \
        >"$logs/attn-kernels.txt" 2>&1
    say "attention kernels: exit $?"; tee -a "$summary" <"$logs/attn-kernels.txt"
fi
# Builds the CUPTI kernel-trace library (/tmp/libcupti_kernels.so) once; fails without CUPTI.
cupti_lib() {
    [ -f /tmp/libcupti_kernels.so ] && return 0
    local inc lib krec mrec cudainc
    inc=$(find / -name cupti_activity.h -path '*include*' 2>/dev/null | head -1)
    lib=$(find / -name 'libcupti.so*' 2>/dev/null | head -1)
    if [ -z "$inc" ] || [ -z "$lib" ]; then
        say "ktrace: no CUPTI (header ${inc:-none}, library ${lib:-none})"
        return 1
    fi
    krec=$(grep -o 'CUpti_ActivityKernel[0-9]*' "$inc" | sort -V | tail -1)
    mrec=$(grep -o 'CUpti_ActivityMemcpy[0-9]*' "$inc" | sort -V | tail -1)
    cudainc=$(find / -name cuda.h -path '*include*' 2>/dev/null | head -1)
    # KTRACE_MEMCPY=1 in the environment records the copies between graphs too.
    cc -shared -fPIC -O2 -DKREC="$krec" -DMREC="$mrec" -I"$(dirname "$inc")" ${cudainc:+-I"$(dirname "$cudainc")"} \
        scripts/gpu/cupti_kernels.c "$lib" -Wl,-rpath,"$(dirname "$lib")" -o /tmp/libcupti_kernels.so \
        >"$logs/ktrace-build.log" 2>&1
    local rc=$?
    say "ktrace build ($krec): exit $rc"; tail -3 "$logs/ktrace-build.log"
    return $rc
}
if has ab; then
    # Backend settings side by side in one process (benches/profile/variants_tg.py): AB_VARIANTS
    # is its --variant list (NAME or NAME=SETTING,...; space-separated), on AB_MODELS (built-in,
    # AB_DTYPE weights) and AB_FILES (GGUF paths, e.g. the gpucmp part's /tmp/gpucmp files);
    # AB_TOKENS greedy tokens of each variant compared with the first's before the timing
    # (default 32; 0: none).
    [ -n "${lcpp_cuda_pid:-}" ] && wait_for "$lcpp_cuda_pid"
    vargs=()
    for v in ${AB_VARIANTS:-typed generic=gemv_q_typed=0}; do vargs+=(--variant "$v"); done
    timeout "$(tl ${AB_TIMEOUT:-300})" python3 benches/profile/variants_tg.py --backend ${AB_BACKEND:-cuda} \
        --models "${AB_MODELS-1b}" --dtype ${AB_DTYPE:-q4_0} --files "${AB_FILES:-}" "${vargs[@]}" \
        --rounds ${AB_ROUNDS:-3} -p ${AB_P:-512} -n ${AB_N:-128} --tokens ${AB_TOKENS:-32} \
        --json "$out/ab.json" >"$logs/ab.txt" 2>&1
    say "settings side by side: exit $?"; grep '^|' "$logs/ab.txt" | tee -a "$summary"; tail -3 "$logs/ab.txt"
fi
if has pftrace; then
    # Per-kernel device time of one prefill (PFTRACE_P tokens) per model and weight dtype.
    if cupti_lib; then
        CUDA_INJECTION64_PATH=/tmp/libcupti_kernels.so timeout "$(tl 400)" python3 benches/profile/prefill_trace.py \
            --models ${PFTRACE_MODELS:-1b} --dtypes ${PFTRACE_DTYPES:-q4_0,f16} -p ${PFTRACE_P:-512} \
            --csv-dir "$logs" >"$logs/pftrace.txt" 2>&1
        say "prefill trace: exit $?"; tee -a "$summary" <"$logs/pftrace.txt" | tail -80
    fi
fi
if has ktrace; then
    if cupti_lib; then
        # KTRACE_VARIANTS: NAME=SETTING,... entries (a SETTING is VAR=value or a tuning key
        # key=value of LOWSYNC_CUDA_TUNE) traced side by side in one process (KTRACE_ROUNDS
        # rounds, interleaved; one model build, one table of ratios).
        if [ -n "${KTRACE_VARIANTS:-}" ]; then
            vargs=()
            for v in $KTRACE_VARIANTS; do vargs+=(--variant "$v"); done
            CUDA_INJECTION64_PATH=/tmp/libcupti_kernels.so timeout "$(tl 500)" \
                python3 benches/profile/kernel_trace.py --models ${KTRACE_MODELS:-1b} -n ${KTRACE_N:-64} \
                --rounds ${KTRACE_ROUNDS:-3} "${vargs[@]}" ${KTRACE_ARGS:-} --csv-dir "$logs" \
                >"$logs/ktrace-variants.txt" 2>&1
            say "kernel trace variants ($KTRACE_VARIANTS): exit $?"
            sed -n '/variants side by side/,$p' "$logs/ktrace-variants.txt" | tee -a "$summary"
        fi
        # KTRACE_ENVS: one trace per entry (a process each), each a ;-separated list of
        # VAR=value (LOWSYNC_CUDA_TUNE's own value is comma-separated); by default one trace of
        # the defaults ("default"), none when only variants are asked for.
        kenvs=${KTRACE_ENVS:-}
        [ -z "$kenvs" ] && [ -z "${KTRACE_VARIANTS:-}" ] && kenvs=default
        for envs in $kenvs; do
            tag=$(echo "$envs" | tr ',=;' '___')
            vars=()
            [ "$envs" = default ] || IFS=';' read -r -a vars <<<"$envs"
            env "${vars[@]}" CUDA_INJECTION64_PATH=/tmp/libcupti_kernels.so timeout "$(tl 300)" \
                python3 benches/profile/kernel_trace.py --models ${KTRACE_MODELS:-1b} -n ${KTRACE_N:-64} ${KTRACE_ARGS:-} \
                --csv-dir "$logs" >"$logs/ktrace-$tag.txt" 2>&1
            say "kernel trace ($envs): exit $?"; tail -${KTRACE_TAIL:-75} "$logs/ktrace-$tag.txt" | tee -a "$summary"
        done
    fi
fi
if has nsys; then
    # An nsys whose QdstrmImporter sits next to it (the copy inside nsight-compute has none).
    nsys=""
    for c in $(command -v nsys) $(find / -name nsys -type f -perm -u+x 2>/dev/null); do
        [ -n "$(find "$(dirname "$c")" -maxdepth 2 -name 'QdstrmImporter*' 2>/dev/null | head -1)" ] && { nsys=$c; break; }
    done
    say "nsys: ${nsys:-none with an importer} (all: $(find / -name nsys -type f 2>/dev/null | tr '\n' ' '))"
    if [ -n "$nsys" ]; then
        timeout "$(tl 300)" "$nsys" profile -o /tmp/prof -f true --stats=false \
            python3 benches/profile/cuda_profile.py --models 1b --settings eager+fused -n 32 >"$logs/nsys-run.txt" 2>&1
        "$nsys" stats -r cuda_gpu_kern_sum -f csv /tmp/prof.nsys-rep >"$logs/nsys-kern.csv" 2>"$logs/nsys-stats.err"
        say "nsys kernels (eager, fused; 1b): exit $?"; head -25 "$logs/nsys-kern.csv" | cut -c1-220 | tee -a "$summary"
    fi
fi
if [[ " $parts " == *" ncu "* ]]; then
    ncu=$(command -v ncu || find / -name ncu -type f -perm -u+x 2>/dev/null | head -1)
    say "ncu: ${ncu:-none}"
    if [ -n "$ncu" ]; then
        # One decode step's kernels (eager launches, so each is its own launch), skipping the
        # prompt and the first steps.
        timeout "$(tl 400)" "$ncu" --csv --clock-control none --cache-control none --launch-skip ${NCU_SKIP:-3100} --launch-count ${NCU_COUNT:-298} \
            --metrics gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,dram__bytes_read.sum \
            python3 benches/profile/cuda_profile.py --models 1b --settings ${NCU_SETTING:-eager+fused} -n 16 --n-ctx 172 \
            >"$logs/ncu.csv" 2>"$logs/ncu.err"
        say "ncu: exit $?"; python3 scripts/gpu/ncu_summary.py "$logs/ncu.csv" 2>&1 | head -30 | tee -a "$summary"
        tail -3 "$logs/ncu.err"
    fi
fi
if has ncudetail; then
    # Launch statistics, occupancy and stall reasons of chosen kernels (eager, fused, 1b).
    ncu=$(command -v ncu || find / -name ncu -type f -perm -u+x 2>/dev/null | head -1)
    if [ -n "$ncu" ]; then
        timeout "$(tl 400)" "$ncu" --kernel-name "regex:${NCUD_KERNELS:-attn_decode|fused_gemv1}" --launch-skip ${NCUD_SKIP:-40} \
            --launch-count ${NCUD_COUNT:-5} --section LaunchStats --section Occupancy --section WarpStateStats \
            --section SpeedOfLight --section MemoryWorkloadAnalysis ${NCUD_SECTIONS:-} \
            --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio" \
            python3 benches/profile/cuda_profile.py --models 1b --settings eager+fused -n 16 --n-ctx 172 ${NCU_PROFILE_ARGS:-} \
            >"$logs/ncud.txt" 2>&1
        say "ncu detail: exit $?"
        # Stall reasons per kernel launch, largest first (warps stalled per issued instruction).
        awk '/^  [a-z_0-9]+\(/ {k=$1} /issue_stalled/ && $NF+0 > 0.05 {print k, $1, $NF}' "$logs/ncud.txt" |
            sort -k1,1 -k3,3gr | awk '{if (c[$1]++ < 8) print}' | tee -a "$summary"
        grep -E "^  [a-z_0-9]+\(|attn_decode|fused_gemv1|Duration|Registers Per|Achieved Occupancy|Theoretical Occupancy|Block Limit|Warp Cycles Per Issued|DRAM Throughput|Memory Throughput|Stall|stall|Static Shared|Dynamic Shared|Grid Size|Waves Per SM" \
            "$logs/ncud.txt" | cut -c1-200 | head -${NCUD_LINES:-120} | tee -a "$summary"
    fi
fi
if has ncusource; then
    # Stall samples per SASS instruction of chosen decode kernels (eager, fused, 1b): where in
    # the code the warps wait. One report per kernel name; the source page as CSV.
    ncu=$(command -v ncu || find / -name ncu -type f -perm -u+x 2>/dev/null | head -1)
    if [ -n "$ncu" ]; then
        # NCUS_SKIPS: launches of the kernel to skip, one report each (a decode step of "1b"
        # launches the product kernel 4 times a layer: q/k/v, o, gate/up, down, then the head).
        for kn in ${NCUS_KERNELS:-attn_decode}; do
          for sk in ${NCUS_SKIPS:-20}; do
            f="$logs/src-$kn-$sk"
            timeout "$(tl 300)" "$ncu" -f -o "$f" --kernel-name "$kn" --launch-skip "$sk" --launch-count 1 \
                --section SourceCounters --section WarpStateStats --section LaunchStats --import-source no \
                python3 benches/profile/cuda_profile.py --models 1b --settings eager+fused -n 16 --n-ctx 172 \
                ${NCU_PROFILE_ARGS:-} >"$f.txt" 2>&1
            "$ncu" -i "$f.ncu-rep" --page source --csv --print-source sass >"$f.csv" 2>>"$f.txt"
            say "ncu source $kn (launch $sk): exit $? ($(wc -l <"$f.csv") lines)"
            "$ncu" -i "$f.ncu-rep" --page details 2>/dev/null | grep -E "Grid Size|Block Size|Registers Per|Duration|Warp Cycles Per Issued|Issued Ipc|Executed Instructions " |
                head -12 | tee -a "$summary"
            python3 scripts/gpu/ncu_source.py "$f.csv" 2>&1 | head -${NCUS_LINES:-40} | tee -a "$summary"
          done
        done
    fi
fi
if has ubsweep; then
    # One GPU's prompt rate at each ubatch (docs/multi-gpu.md: what two pipeline stages can gain
    # on a 512-token prompt needs r(U), one GPU's rate at ubatch U): `lowsync bench` on the
    # built-in UB_MODEL (default 1b) with UB_T weights (default q4_k), -p 512, for each U of
    # UB_LIST.
    for u in ${UB_LIST:-32 64 128 256 512}; do
        timeout "$(tl 120)" python3 -m lowsync.cli bench -m ${UB_MODEL:-1b} -t ${UB_T:-q4_k} --backend cuda \
            --policy staged --launch-ahead 1 -r ${UB_R:-2} --json -ub "$u" -p 512 -n 4 -ctk f16 \
            >"$logs/ub-$u.json" 2>"$logs/ub-$u.err"
        say "ubatch $u: exit $? $(python3 -c 'import json, sys
rows = json.loads(sys.stdin.read())
print(" ".join("pp %.0f" % float(r["pp_tps"]) for r in rows))' <"$logs/ub-$u.json" 2>&1 | tail -1)"
    done
fi
if has gemvspeed; then
    LOWSYNC_REQUIRE_CUDA=1 timeout "$(tl 200)" .carry/cuda-tests/gemv_speed --ignored --nocapture --test-threads=1 \
        >"$logs/gemv-speed.txt" 2>&1
    say "gemv speed: exit $?"; grep -E "GB/s|panicked" "$logs/gemv-speed.txt" | tee -a "$summary"
fi
if has torch; then
    timeout "$(tl ${TORCH_TIMEOUT:-550})" python3 benches/python/compare_torch.py --models ${TORCH_MODELS:-tiny,1b} --json "$out/compare-torch-${TORCH_MODELS:-all}.json" \
        >"$logs/compare-torch.txt" 2>"$logs/compare-torch.err"
    say "compare torch: exit $?"; tee -a "$summary" <"$logs/compare-torch.txt"; tail -5 "$logs/compare-torch.err"
fi
tar czf "$out/logs.tar.gz" -C "$logs" .
