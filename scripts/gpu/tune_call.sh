#!/usr/bin/env bash
# One device call for tuning the CUDA decode: `h200_all.sh`'s parts in the order that keeps the
# GPU busy while llama.cpp's CUDA build (about 330 s on 16 cores) runs in the background:
#
#   EXTRA="cupti"              # optional h200_all.sh parts first (EXTRABUDGET seconds)
#   AB_DTYPES="q8_0 q6_k"      # `ab` once per weight dtype of built-in "1b" (ABBUDGET seconds each)
#   AB_VARIANTS_ALL="base dn=gemv_q_direct_norm=0 ..."   # variants_tg.py's --variant list
#   CMP=1 CMP_TYPES=q6_k,q8_0 CMP_TUNE=key=value,...    # then `gpucmp` on "1b" (CMPBUDGET seconds)
#   bash scripts/gpu/tune_call.sh
#
# Unlike `h200_all.sh lcppcuda ab`, the A/B does not wait for the build (it runs `nice`d;
# the rounds of one variant stayed within 0.1% of each other beside it). llama.cpp's binaries
# come back under $OUT/lcpp/ in parts (save them as .carry/lcpp-cuda/part-*: a later call
# unpacks them instead of building); the logs stay on the device, so that at most eight files
# come back: $OUT/summary.txt, the JSONs and the parts. Carry what make_carry.sh makes.
set -uo pipefail
out=${OUT:-/tmp/out}; mkdir -p "$out"
logs=/tmp/lowsync-logs; mkdir -p "$logs"
S="$out/summary.txt"
OUT=$out/setup bash scripts/gpu/h200_all.sh none; cat "$out/setup/summary.txt" >>"$S"
export PYTHONPATH=/tmp/site
nv=$(python3 -c 'import nvidia; print(list(nvidia.__path__)[0])' 2>/dev/null || true)
libdirs=/usr/local/cuda/lib64
for d in "$nv"/cu13/lib "$nv"/*/lib; do [ -d "$d" ] && libdirs="$libdirs:$d"; done
export LD_LIBRARY_PATH="$libdirs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
bpid=""
if [ "${CMP:-1}" = 1 ]; then
    if ls .carry/lcpp-cuda/part-* >/dev/null 2>&1; then
        mkdir -p /tmp/lcpp-cuda && cat .carry/lcpp-cuda/part-* | tar xJ -C /tmp/lcpp-cuda
    else
        (mkdir -p /tmp/lcpp-src && tar xzf .carry/src/llama.cpp.tgz -C /tmp/lcpp-src &&
            nice python3 benches/python/compare_llama_cpp_gpu.py --backend cuda --llama-src /tmp/lcpp-src/llama.cpp \
                --build-dir /tmp/lcpp-cuda --models "" --types "" --jobs ${BUILD_JOBS:-14} >"$logs/lcpp-cuda-build.log" 2>&1
         echo "llama.cpp cuda build exit $?" >>"$logs/lcpp-cuda-build.log") &
        bpid=$!
    fi
    (nice python3 -c 'import sys; sys.path.insert(0, "benches/python"); import compare_llama_cpp_gpu as c
c.make_files(c.parse_args(["--backend", "cuda", "--work", "/tmp/gpucmp", "--types", "f16", "--models", "1b"]))' \
        >"$logs/f16-files-early.log" 2>&1) &
fi
if [ -n "${EXTRA:-}" ]; then
    OUT=$out/extra BUDGET=${EXTRABUDGET:-120} bash scripts/gpu/h200_all.sh $EXTRA
    { echo "## $EXTRA"; cat "$out/extra/summary.txt"; } >>"$S"
fi
for dt in ${AB_DTYPES:-q8_0 q6_k}; do
    OUT=$out/ab-$dt BUDGET=${ABBUDGET:-130} AB_DTYPE=$dt AB_MODELS=1b AB_VARIANTS="$AB_VARIANTS_ALL" \
        bash scripts/gpu/h200_all.sh ab
    { echo "## ab $dt"; cat "$out/ab-$dt/summary.txt"; } >>"$S"
done
if [ "${CMP:-1}" = 1 ]; then
    if [ -n "$bpid" ]; then
        wait "$bpid"; tail -2 "$logs/lcpp-cuda-build.log" >>"$S"
        if [ -x /tmp/lcpp-cuda/bin/llama-bench ]; then
            (cd /tmp/lcpp-cuda && strip --strip-unneeded bin/llama-bench bin/llama-quantize bin/*.so* 2>/dev/null
             tar cJ bin/llama-bench bin/llama-quantize $(ls bin/*.so* 2>/dev/null)) |
                { mkdir -p "$out/lcpp" && split -b 15m - "$out/lcpp/part-"; }
        fi
    fi
    OUT=$out/cmp BUDGET=${CMPBUDGET:-140} LOWSYNC_CUDA_TUNE="${CMP_TUNE:-}" GPUCMP_MODELS=1b \
        GPUCMP_TYPES=${CMP_TYPES:-q6_k,q8_0} GPUCMP_R=2 bash scripts/gpu/h200_all.sh gpucmp
    { echo "## cmp tune=${CMP_TUNE:-}"; cat "$out/cmp/summary.txt"; } >>"$S"
fi
# At most 8 files come back: the summary, the JSONs and llama.cpp's parts.
mkdir -p /tmp/keep-logs && for f in "$out"/*/logs.tar.gz; do [ -f "$f" ] && mv "$f" "/tmp/keep-logs/$(basename "$(dirname "$f")").tgz"; done
rm -f "$out"/*/summary.txt
cat "$S"
