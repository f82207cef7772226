//! Element types of the IR: plain types (one element, a fixed number of bytes) and GGUF block
//! types (a block of `block_size()` elements stored in `block_bytes()` bytes).
//!
//! Why: quantized weights keep their GGUF block layout from the file to the device, so a block
//! type is a dtype fact like an element size. Per-element byte sizes are meaningless for block
//! types; every size is computed from whole blocks with [`DType::checked_bytes`] (elements from
//! a block boundary to bytes) or [`DType::row_bytes`], both checked.
//!
//! Invariant: for every dtype, `checked_bytes(n)` is `Some` only when `n` is a whole number of
//! blocks and the byte count fits a `usize`; a plain type is a block type of block size 1.

use std::fmt;
use std::str::FromStr;

use crate::error::{Error, Result};

/// Element type of a tensor.
// The block types keep GGUF's names (`Q4_K`, `IQ4_XS`), the words users know them by.
#[allow(non_camel_case_types)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    F32,
    F16,
    BF16,
    I32,
    /// 32 elements: f16 scale, 16 bytes of 4-bit values (`d * (q - 8)`).
    Q4_0,
    /// 32 elements: f16 scale and min, 16 bytes of 4-bit values (`d * q + m`).
    Q4_1,
    /// 32 elements: f16 scale, 32 high bits, 16 bytes of low nibbles (`d * (q - 16)`).
    Q5_0,
    /// 32 elements: f16 scale and min, 32 high bits, 16 bytes of low nibbles (`d * q + m`).
    Q5_1,
    /// 32 elements: f16 scale, 32 int8 values (`d * q`).
    Q8_0,
    /// 256 elements: 16 4-bit scale/min pairs, 2-bit values, f16 super-scale and super-min.
    Q2_K,
    /// 256 elements: high-bit mask, 2-bit values, 16 6-bit scales, f16 super-scale.
    Q3_K,
    /// 256 elements: f16 super-scale and super-min, 8 6-bit scale/min pairs, 4-bit values.
    Q4_K,
    /// 256 elements: as Q4_K with a fifth bit per value.
    Q5_K,
    /// 256 elements: low nibbles, high 2 bits, 16 int8 scales, f16 super-scale.
    Q6_K,
    /// 32 elements: f16 scale, 4-bit indices into a fixed non-linear table.
    IQ4_NL,
    /// 256 elements: f16 super-scale, 8 6-bit scales, 4-bit indices into IQ4_NL's table.
    IQ4_XS,
}

impl DType {
    /// Bytes per element of a plain type. A block type has no per-element size; this returns
    /// its [`DType::block_bytes`] so that nothing wraps, but element strides must never be
    /// multiplied by it: code that does first refuses block types ([`DType::is_quantized`]),
    /// as the graph builder and every backend's `supports_op` do.
    pub const fn size_bytes(self) -> usize {
        self.block_bytes()
    }

    /// Elements per block (1 for plain types).
    pub const fn block_size(self) -> usize {
        match self {
            DType::F32 | DType::F16 | DType::BF16 | DType::I32 => 1,
            DType::Q4_0 | DType::Q4_1 | DType::Q5_0 | DType::Q5_1 | DType::Q8_0 | DType::IQ4_NL => {
                32
            }
            DType::Q2_K | DType::Q3_K | DType::Q4_K | DType::Q5_K | DType::Q6_K | DType::IQ4_XS => {
                256
            }
        }
    }

    /// Bytes per block (the element size of plain types). The GGUF/ggml sizes.
    pub const fn block_bytes(self) -> usize {
        match self {
            DType::F32 | DType::I32 => 4,
            DType::F16 | DType::BF16 => 2,
            DType::Q4_0 | DType::IQ4_NL => 18,
            DType::Q4_1 => 20,
            DType::Q5_0 => 22,
            DType::Q5_1 => 24,
            DType::Q8_0 => 34,
            DType::Q2_K => 84,
            DType::Q3_K => 110,
            DType::Q4_K => 144,
            DType::Q5_K => 176,
            DType::Q6_K => 210,
            DType::IQ4_XS => 136,
        }
    }

    /// Whether this is a block (quantized) type.
    pub const fn is_quantized(self) -> bool {
        self.block_size() > 1
    }

    /// The plain float types (f32, f16, bf16): what element-wise kernels read and write.
    pub const fn is_float(self) -> bool {
        matches!(self, DType::F32 | DType::F16 | DType::BF16)
    }

    /// Bytes of `n` elements counted from a block boundary; `None` when `n` is not a whole
    /// number of blocks or the count overflows.
    pub const fn checked_bytes(self, n: usize) -> Option<usize> {
        let bs = self.block_size();
        if !n.is_multiple_of(bs) {
            return None;
        }
        (n / bs).checked_mul(self.block_bytes())
    }

    /// Bytes of one row of `k` elements (`k` whole blocks); `None` otherwise or on overflow.
    pub const fn row_bytes(self, k: usize) -> Option<usize> {
        self.checked_bytes(k)
    }

    /// The name used in Python and in error messages.
    pub const fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
            DType::I32 => "i32",
            DType::Q4_0 => "q4_0",
            DType::Q4_1 => "q4_1",
            DType::Q5_0 => "q5_0",
            DType::Q5_1 => "q5_1",
            DType::Q8_0 => "q8_0",
            DType::Q2_K => "q2_k",
            DType::Q3_K => "q3_k",
            DType::Q4_K => "q4_k",
            DType::Q5_K => "q5_k",
            DType::Q6_K => "q6_k",
            DType::IQ4_NL => "iq4_nl",
            DType::IQ4_XS => "iq4_xs",
        }
    }

    /// Every dtype, in a fixed order.
    pub const ALL: [DType; 16] = [
        DType::F32,
        DType::F16,
        DType::BF16,
        DType::I32,
        DType::Q4_0,
        DType::Q4_1,
        DType::Q5_0,
        DType::Q5_1,
        DType::Q8_0,
        DType::Q2_K,
        DType::Q3_K,
        DType::Q4_K,
        DType::Q5_K,
        DType::Q6_K,
        DType::IQ4_NL,
        DType::IQ4_XS,
    ];

    /// The block types, in [`DType::ALL`]'s order.
    pub const QUANTIZED: [DType; 12] = [
        DType::Q4_0,
        DType::Q4_1,
        DType::Q5_0,
        DType::Q5_1,
        DType::Q8_0,
        DType::Q2_K,
        DType::Q3_K,
        DType::Q4_K,
        DType::Q5_K,
        DType::Q6_K,
        DType::IQ4_NL,
        DType::IQ4_XS,
    ];
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for DType {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "f32" | "float32" => return Ok(DType::F32),
            "f16" | "float16" => return Ok(DType::F16),
            "bf16" | "bfloat16" => return Ok(DType::BF16),
            "i32" | "int32" => return Ok(DType::I32),
            _ => {}
        }
        // Block types by their lowercase name, or GGUF's uppercase one ("Q4_K").
        DType::QUANTIZED
            .into_iter()
            .find(|d| d.name().eq_ignore_ascii_case(s))
            .ok_or_else(|| Error::UnknownDType(s.to_string()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn block_types_have_gguf_sizes_and_checked_row_bytes() {
        assert_eq!(DType::Q4_0.block_size(), 32);
        assert_eq!(DType::Q4_K.block_bytes(), 144);
        assert_eq!(DType::Q6_K.row_bytes(512), Some(420));
        assert_eq!(DType::Q4_0.row_bytes(48), None);
        assert_eq!(DType::F16.row_bytes(3), Some(6));
        assert_eq!(DType::Q8_0.checked_bytes(usize::MAX / 32 * 32), None);
        assert!(DType::QUANTIZED
            .iter()
            .all(|d| d.is_quantized() && !d.is_float()));
        assert!(!DType::F32.is_quantized());
    }

    #[test]
    fn names_round_trip_and_gguf_names_parse() {
        for d in DType::ALL {
            assert_eq!(d.name().parse::<DType>(), Ok(d));
        }
        assert_eq!("Q4_K".parse::<DType>(), Ok(DType::Q4_K));
        assert_eq!("IQ4_XS".parse::<DType>(), Ok(DType::IQ4_XS));
        assert!("q8_1".parse::<DType>().is_err());
    }
}
