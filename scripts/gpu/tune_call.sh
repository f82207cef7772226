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
# shellcheck source=scripts/gpu/lcpp_cuda.sh
source scripts/gpu/lcpp_cuda.sh
lcpp_cuda_pid=""
if [ "${CMP:-1}" = 1 ]; then
    lcpp_cuda_start "$logs/lcpp-cuda-build.log" "${BUILD_JOBS:-14}" nice
    f16_files 1b "$logs/f16-files-early.log"
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
    if [ -n "$lcpp_cuda_pid" ]; then
        wait "$lcpp_cuda_pid"; tail -2 "$logs/lcpp-cuda-build.log" >>"$S"
        [ -x $lcpp_cuda/bin/llama-bench ] && lcpp_cuda_pack "$out/lcpp"
    fi
    OUT=$out/cmp BUDGET=${CMPBUDGET:-140} LOWSYNC_CUDA_TUNE="${CMP_TUNE:-}" GPUCMP_MODELS=1b \
        GPUCMP_TYPES=${CMP_TYPES:-q6_k,q8_0} GPUCMP_R=2 bash scripts/gpu/h200_all.sh gpucmp
    { echo "## cmp tune=${CMP_TUNE:-}"; cat "$out/cmp/summary.txt"; } >>"$S"
fi
# At most 8 files come back: the summary, the JSONs and llama.cpp's parts.
mkdir -p /tmp/keep-logs && for f in "$out"/*/logs.tar.gz; do [ -f "$f" ] && mv "$f" "/tmp/keep-logs/$(basename "$(dirname "$f")").tgz"; done
rm -f "$out"/*/summary.txt
cat "$S"
