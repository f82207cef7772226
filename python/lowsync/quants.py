"""Quantized (GGUF block) weights in Python: their dtype facts, quantizing and widening.

Why: a quantized weight travels as its raw blocks from the GGUF file (or from a quantizer) to
the device, and the Python side must agree with the graph IR on what those bytes are: a numpy
`uint8` array of GGUF's byte shape `[..., row_bytes]` whose logical shape (in elements) is
`[..., row_bytes // block_bytes * block_size]`. Backends without quantized kernels (CUDA and
Vulkan today) still run such a model: its weights are widened once, at graph build.

Strategy: the block facts are GGUF's (`lowsync.gguf_reader.GGML_TYPES`); dequantizing is the
native CPU reference (`lowsync._native.dequantize`, bit-exact against `gguf.quants`);
quantizing uses the `gguf` package's own quantizers (imported on first use) for Q4_0, Q4_1,
Q5_0, Q5_1 and Q8_0, and simple round-to-nearest quantizers written here for Q4_K and Q6_K
(min/max scales per sub-block, no search: enough for benchmarks and tests, not llama.cpp's
quality).

Invariants: `byte_shape` and `logical_shape` are inverse on valid shapes and raise
`ValueError` (a `ModelError` at the model layer) on shapes that are not whole blocks.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from lowsync._native import dequantize
from lowsync.gguf_reader import GGML_TYPES

Array = npt.NDArray[Any]

__all__ = [
    "QUANTIZABLE",
    "QUANT_DTYPES",
    "block_facts",
    "byte_shape",
    "logical_shape",
    "quantize",
    "widen",
]

# The block dtypes of the graph IR (lowercase GGUF names), in the IR's order.
QUANT_DTYPES: tuple[str, ...] = (
    "q4_0",
    "q4_1",
    "q5_0",
    "q5_1",
    "q8_0",
    "q2_k",
    "q3_k",
    "q4_k",
    "q5_k",
    "q6_k",
    "iq4_nl",
    "iq4_xs",
)

# What `quantize` can make: the gguf package's quantizers, then this module's own.
QUANTIZABLE: tuple[str, ...] = ("q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q4_k", "q6_k")

_FACTS = {t.name.lower(): (t.block, t.block_bytes) for t in GGML_TYPES.values()}
_F16_MAX = float(np.finfo(np.float16).max)


def block_facts(dtype: str) -> tuple[int, int]:
    """(elements per block, bytes per block) of a block dtype."""
    if dtype not in QUANT_DTYPES:
        raise ValueError(
            f"{dtype!r} is not a block dtype (block dtypes: {', '.join(QUANT_DTYPES)})"
        )
    return _FACTS[dtype]


def byte_shape(shape: tuple[int, ...], dtype: str) -> tuple[int, ...]:
    """GGUF's byte shape of a tensor of logical `shape`: the last axis counted in bytes."""
    block, nbytes = block_facts(dtype)
    if not shape or shape[-1] <= 0 or shape[-1] % block:
        raise ValueError(
            f"a {dtype} tensor needs a last axis that is a positive multiple of {block}, "
            f"got shape {shape}"
        )
    return (*shape[:-1], shape[-1] // block * nbytes)


def logical_shape(shape: tuple[int, ...], dtype: str) -> tuple[int, ...]:
    """The logical shape (elements) of raw blocks of byte shape `shape`."""
    block, nbytes = block_facts(dtype)
    if not shape or shape[-1] <= 0 or shape[-1] % nbytes:
        raise ValueError(
            f"{dtype} blocks need a last axis of whole {nbytes}-byte blocks, got byte shape {shape}"
        )
    return (*shape[:-1], shape[-1] // nbytes * block)


def quantize(values: Array, dtype: str) -> Array:
    """`values` (float, last axis whole blocks) as raw `dtype` blocks of GGUF's byte shape.

    Uses the `gguf` package's quantizers (as llama.cpp's reference `quantize_row_*`) and, for
    Q4_K and Q6_K, simple ones of this module; the types are `QUANTIZABLE`, any other dtype is
    a `ValueError`.
    """
    if dtype not in QUANTIZABLE:
        raise ValueError(
            f"lowsync cannot quantize to {dtype!r} (it quantizes {', '.join(QUANTIZABLE)}; "
            "load other types from a GGUF file)"
        )
    if dtype in ("q4_k", "q6_k"):
        shape = byte_shape(tuple(values.shape), dtype)
        blocks = np.asarray(values, np.float32).reshape(-1, 256)
        raw = _q4_k(blocks) if dtype == "q4_k" else _q6_k(blocks)
        return raw.reshape(shape)
    try:
        import gguf
    except ModuleNotFoundError as e:  # pragma: no cover - depends on the environment
        raise ModuleNotFoundError(
            f"quantizing to {dtype} needs the `gguf` package: pip install 'lowsync[gguf]'",
            name="gguf",
        ) from e
    byte_shape(tuple(values.shape), dtype)  # the shape check, with lowsync's message
    qtype = gguf.GGMLQuantizationType[dtype.upper()]
    out: Array = np.ascontiguousarray(gguf.quants.quantize(np.asarray(values, np.float32), qtype))
    return out


def _f16_bytes(x: Array) -> Array:
    """Each value of `x` (shape [n]) as its 2 little-endian f16 bytes ([n, 2])."""
    out: Array = np.asarray(x, "<f2").reshape(-1, 1).view(np.uint8)
    return out


def _q4_k(x: Array) -> Array:
    """Q4_K blocks of `x` [n, 256]: per 32-element sub-block `x ~ d*sc*q - dmin*m`, q 4 bits,
    sc and m 6 bits, d and dmin f16 (layout as `gguf.quants.Q4_K`)."""
    n = x.shape[0]
    sub = x.reshape(n, 8, 32)
    lo = np.minimum(sub.min(-1), 0.0)  # the min subtracted, as a non-negative m
    scale = (sub.max(-1) - lo) / 15.0
    d = (scale.max(-1) / 63.0).astype(np.float16).astype(np.float32)
    dmin = ((-lo).max(-1) / 63.0).astype(np.float16).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(d[:, None] > 0, np.rint(scale / d[:, None]), 0).clip(0, 63).astype(np.uint8)
        m = np.where(dmin[:, None] > 0, np.rint(-lo / dmin[:, None]), 0).clip(0, 63)
        m = m.astype(np.uint8)
        step = d[:, None, None] * sc[..., None]
        base = dmin[:, None, None] * m[..., None]
        q = np.where(step > 0, np.rint((sub + base) / step), 0).clip(0, 15).astype(np.uint8)
    s = np.zeros((n, 12), np.uint8)
    s[:, 0:4] = (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6)
    s[:, 4:8] = (m[:, :4] & 63) | ((m[:, 4:] >> 4) << 6)
    s[:, 8:12] = (sc[:, 4:] & 15) | ((m[:, 4:] & 15) << 4)
    pairs = q.reshape(n, 4, 2, 32)
    qs = (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).reshape(n, 128)
    out: Array = np.concatenate([_f16_bytes(d), _f16_bytes(dmin), s, qs], axis=1)
    return out


def _q6_k(x: Array) -> Array:
    """Q6_K blocks of `x` [n, 256]: per 16-element sub-block `x ~ d*sc*(q - 32)`, q 6 bits, sc
    int8, d f16 (layout as `gguf.quants.Q6_K`)."""
    n = x.shape[0]
    sub = x.reshape(n, 16, 16)
    scale = np.abs(sub).max(-1) / 31.0
    d = (scale.max(-1) / 127.0).astype(np.float16).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(d[:, None] > 0, np.rint(scale / d[:, None]), 0).clip(-128, 127)
        step = d[:, None, None] * sc[..., None]
        q = np.where(step != 0, np.rint(sub / step), 0).clip(-32, 31) + 32
    q = q.astype(np.uint8).reshape(n, 2, 4, 32)  # [half, group of 32, element]
    ql = np.zeros((n, 2, 64), np.uint8)
    ql[:, :, 0:32] = (q[:, :, 0] & 15) | ((q[:, :, 2] & 15) << 4)
    ql[:, :, 32:64] = (q[:, :, 1] & 15) | ((q[:, :, 3] & 15) << 4)
    hi = q >> 4
    qh = hi[:, :, 0] | (hi[:, :, 1] << 2) | (hi[:, :, 2] << 4) | (hi[:, :, 3] << 6)
    scales = sc.astype(np.int8).view(np.uint8)
    out: Array = np.concatenate(
        [ql.reshape(n, 128), qh.reshape(n, 64), scales, _f16_bytes(d)], axis=1
    )
    return out


def widen(data: Array, dtype: str) -> tuple[Array, str]:
    """Raw `dtype` blocks as plain values: f16, or f32 when a value is beyond f16's range
    (65504, where f16 would give inf). Returns the array and its dtype name."""
    values = np.asarray(dequantize(data, dtype))
    finite = values[np.isfinite(values)]
    if finite.size and float(np.abs(finite).max()) > _F16_MAX:
        return values, "f32"
    return values.astype(np.float16), "f16"
