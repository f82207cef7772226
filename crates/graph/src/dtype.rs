//! Element types of the IR.

use std::fmt;
use std::str::FromStr;

use crate::error::{Error, Result};

/// Element type of a tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    F32,
    F16,
    BF16,
    I32,
}

impl DType {
    /// Bytes per element.
    pub const fn size_bytes(self) -> usize {
        match self {
            DType::F32 | DType::I32 => 4,
            DType::F16 | DType::BF16 => 2,
        }
    }

    /// The float types (everything but `i32`).
    pub const fn is_float(self) -> bool {
        !matches!(self, DType::I32)
    }

    /// The name used in Python and in error messages.
    pub const fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
            DType::I32 => "i32",
        }
    }

    /// Every dtype, in a fixed order.
    pub const ALL: [DType; 4] = [DType::F32, DType::F16, DType::BF16, DType::I32];
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
            "f32" | "float32" => Ok(DType::F32),
            "f16" | "float16" => Ok(DType::F16),
            "bf16" | "bfloat16" => Ok(DType::BF16),
            "i32" | "int32" => Ok(DType::I32),
            other => Err(Error::UnknownDType(other.to_string())),
        }
    }
}
