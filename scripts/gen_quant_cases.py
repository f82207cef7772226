"""Writes crates/backend-cuda/emu/quant_cases.txt: GGUF blocks and gguf-py's dequantization of them.

The CUDA kernel emulation (scripts/kernel_emu.sh, groups `quant_dequant`, `quant_rows`,
`quant_mmv`) checks the CUDA backend's block decoding (kernels/quant.cuh) bit for bit against
these values, and builds its product tests' weights from these blocks. gguf-py
(`gguf.quants.dequantize`) is the reference: it is llama.cpp's own Python reading of the formats.

Blocks are random bytes with their f16 scale fields replaced by finite values of either sign
(among them zero and an f16 subnormal), so every value is finite. Deterministic (fixed seed).
Run with the project's venv: ~/.cache/lowsync-venv/bin/python scripts/gen_quant_cases.py

File format, per block type: a line `NAME CODE BLOCKS` (CODE: the type's dtype code in
kernels/quant.cuh), a line of the blocks' bytes in hex, a line of the dequantized values as f32
bit patterns (8 hex digits each, space separated).
"""

from __future__ import annotations

import pathlib

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize

# (name, dtype code in kernels/quant.cuh, gguf type, byte offsets of the block's f16 fields)
TYPES = [
    ("q4_0", 4, T.Q4_0, [0]),
    ("q4_1", 5, T.Q4_1, [0, 2]),
    ("q5_0", 6, T.Q5_0, [0]),
    ("q5_1", 7, T.Q5_1, [0, 2]),
    ("q8_0", 8, T.Q8_0, [0]),
    ("q2_k", 9, T.Q2_K, [80, 82]),
    ("q3_k", 10, T.Q3_K, [108]),
    ("q4_k", 11, T.Q4_K, [0, 2]),
    ("q5_k", 12, T.Q5_K, [0, 2]),
    ("q6_k", 13, T.Q6_K, [208]),
    ("iq4_nl", 14, T.IQ4_NL, [0]),
    ("iq4_xs", 15, T.IQ4_XS, [0]),
]

# Blocks per type: enough values to cover every chunk position several times, small file.
VALUES = 1024


def blocks(rng: np.random.Generator, qtype: T, f16_at: list[int]) -> np.ndarray:
    """Random blocks of `qtype` with finite f16 scales (one zero, one subnormal)."""
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    n = max(VALUES // block_size, 4)
    raw = rng.integers(0, 256, size=(n, type_size), dtype=np.uint8)
    for off in f16_at:
        mag = np.exp2(rng.uniform(-10.0, -2.0, size=n))
        sign = np.where(rng.random(n) < 0.5, -1.0, 1.0)
        d = (mag * sign).astype(np.float16)
        d[0] = np.float16(0.0) if off == f16_at[0] else d[0]
        d[1] = np.float16(3.0e-6)  # subnormal in f16
        raw[:, off : off + 2] = d.view(np.uint8).reshape(n, 2)
    return raw


def main() -> None:
    rng = np.random.default_rng(33)
    out = [
        "# GGUF blocks and gguf.quants.dequantize of them: scripts/gen_quant_cases.py (do not edit)"
    ]
    for name, code, qtype, f16_at in TYPES:
        raw = blocks(rng, qtype, f16_at)
        vals = dequantize(raw.reshape(-1), qtype).astype(np.float32).reshape(-1)
        assert np.isfinite(vals).all(), name
        out.append(f"{name} {code} {raw.shape[0]}")
        out.append(raw.reshape(-1).tobytes().hex())
        out.append(" ".join(f"{b:08x}" for b in vals.view(np.uint32)))
    root = pathlib.Path(__file__).resolve().parent.parent
    path = root / "crates/backend-cuda/emu/quant_cases.txt"
    path.write_text("\n".join(out) + "\n")
    print(f"wrote {path} ({path.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
