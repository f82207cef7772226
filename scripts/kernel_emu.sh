#!/usr/bin/env bash
# Runs the CUDA backend's decode kernels on the CPU and checks them against float64 references
# (crates/backend-cuda/emu): the kernels' logic is tested on every CI run, which has no GPU.
#
# Copies kernels/*.cu, the fused families' src/fusion/*.cu, common.cuh and quant.cuh to a scratch folder, with the two f16 conversions of inline
# PTX replaced by C++ ones and `extern __shared__` arrays made static, compiles the test with
# g++ (C++20: std::barrier) and runs it. Needs g++ (Debian: apt-get install g++).
# Arguments name test groups to run alone (`bash scripts/kernel_emu.sh attention_nan`); none:
# every group. KERNEL_EMU_KDEFS: kernel source variants to build the kernels with (names as
# `LOWSYNC_CUDA_TUNE=kdef=` takes them, `+`-separated; docs/tuning.md).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
kernels="$root/crates/backend-cuda/kernels"
fused="$root/crates/backend-cuda/src/fusion"
emu="$root/crates/backend-cuda/emu"
command -v g++ >/dev/null || { echo "kernel_emu: g++ is not installed (apt-get install g++)" >&2; exit 1; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python3 - "$kernels" "$fused" "$work" <<'PY'
import pathlib, re, sys
src, fused, dst = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2]), pathlib.Path(sys.argv[3])
common = (src / "common.cuh").read_text()
for ptx, cpp in [
    ('asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));', "f = emu_h2f(h);"),
    ('asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));', "h = emu_f2h(f);"),
]:
    if ptx not in common:
        sys.exit(f"kernel_emu: common.cuh no longer has `{ptx}`: update scripts/kernel_emu.sh")
    common = common.replace(ptx, cpp)
(dst / "common.h").write_text(common)
for cu in [*src.glob("*.cu"), *fused.glob("*.cu"), src / "quant.cuh"]:
    if (dst / cu.name).exists():
        sys.exit(f"kernel_emu: two kernel files are named {cu.name}")
    text = re.sub(r"extern __shared__ (\w+) (\w+)\[\];", r"static \1 \2[16384];", cu.read_text())
    (dst / cu.name).write_text(text)
PY
kdefs=()
kd=${KERNEL_EMU_KDEFS:-}
for d in ${kd//+/ }; do
    [[ $d =~ ^[A-Z][A-Z0-9_]*$ ]] || { echo "kernel_emu: KERNEL_EMU_KDEFS: bad name '$d'" >&2; exit 2; }
    kdefs+=("-DLS_KDEF_$d")
done
g++ -std=c++20 -O1 -ffp-contract=off -pthread -DLOWSYNC_EMU -DLOWSYNC_EMU_DIR="\"$emu\"" "${kdefs[@]}" \
    -I"$work" -I"$emu" -o "$work/kernels_test" "$emu/kernels_test.cpp"
"$work/kernels_test" "$@"
