//! Element types, by the names each format gives them.

use std::fmt;

use anyhow::{bail, Result};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DType {
    F64,
    F32,
    F16,
    BF16,
    I64,
    I32,
    I16,
    I8,
    U8,
    Bool,
}

impl DType {
    pub fn size(self) -> usize {
        match self {
            DType::F64 | DType::I64 => 8,
            DType::F32 | DType::I32 => 4,
            DType::F16 | DType::BF16 | DType::I16 => 2,
            DType::I8 | DType::U8 | DType::Bool => 1,
        }
    }

    /// `torch.BFloat16Storage` → BF16 (the storage class `torch.save` names in a persistent id).
    pub fn from_storage_class(name: &str) -> Option<DType> {
        Some(match name {
            "DoubleStorage" => DType::F64,
            "FloatStorage" => DType::F32,
            "HalfStorage" => DType::F16,
            "BFloat16Storage" => DType::BF16,
            "LongStorage" => DType::I64,
            "IntStorage" => DType::I32,
            "ShortStorage" => DType::I16,
            "CharStorage" => DType::I8,
            "ByteStorage" => DType::U8,
            "BoolStorage" => DType::Bool,
            _ => return None,
        })
    }

    pub fn storage_class(self) -> &'static str {
        match self {
            DType::F64 => "DoubleStorage",
            DType::F32 => "FloatStorage",
            DType::F16 => "HalfStorage",
            DType::BF16 => "BFloat16Storage",
            DType::I64 => "LongStorage",
            DType::I32 => "IntStorage",
            DType::I16 => "ShortStorage",
            DType::I8 => "CharStorage",
            DType::U8 => "ByteStorage",
            DType::Bool => "BoolStorage",
        }
    }

    /// `torch.bfloat16` → BF16 (as `torch.dtype` globals are named).
    pub fn from_torch_name(name: &str) -> Option<DType> {
        Some(match name.trim_start_matches("torch.") {
            "float64" | "double" => DType::F64,
            "float32" | "float" => DType::F32,
            "float16" | "half" => DType::F16,
            "bfloat16" => DType::BF16,
            "int64" | "long" => DType::I64,
            "int32" | "int" => DType::I32,
            "int16" | "short" => DType::I16,
            "int8" => DType::I8,
            "uint8" => DType::U8,
            "bool" => DType::Bool,
            _ => return None,
        })
    }

    /// `bfloat16`, `float32`, ...: torch's (and our metadata's) name.
    pub fn torch_name(self) -> &'static str {
        match self {
            DType::F64 => "float64",
            DType::F32 => "float32",
            DType::F16 => "float16",
            DType::BF16 => "bfloat16",
            DType::I64 => "int64",
            DType::I32 => "int32",
            DType::I16 => "int16",
            DType::I8 => "int8",
            DType::U8 => "uint8",
            DType::Bool => "bool",
        }
    }

    /// safetensors' dtype string (`BF16`, `F32`, ...).
    pub fn safetensors_name(self) -> &'static str {
        match self {
            DType::F64 => "F64",
            DType::F32 => "F32",
            DType::F16 => "F16",
            DType::BF16 => "BF16",
            DType::I64 => "I64",
            DType::I32 => "I32",
            DType::I16 => "I16",
            DType::I8 => "I8",
            DType::U8 => "U8",
            DType::Bool => "BOOL",
        }
    }

    pub fn from_safetensors_name(name: &str) -> Result<DType> {
        Ok(match name {
            "F64" => DType::F64,
            "F32" => DType::F32,
            "F16" => DType::F16,
            "BF16" => DType::BF16,
            "I64" => DType::I64,
            "I32" => DType::I32,
            "I16" => DType::I16,
            "I8" => DType::I8,
            "U8" => DType::U8,
            "BOOL" => DType::Bool,
            other => bail!("safetensors dtype {other} is not supported"),
        })
    }

    pub fn is_float(self) -> bool {
        matches!(self, DType::F64 | DType::F32 | DType::F16 | DType::BF16)
    }

    /// One element (little-endian bytes) as f64, for comparisons and summaries.
    pub fn read_f64(self, bytes: &[u8]) -> f64 {
        match self {
            DType::F64 => f64::from_le_bytes(bytes[..8].try_into().unwrap()),
            DType::F32 => f32::from_le_bytes(bytes[..4].try_into().unwrap()) as f64,
            DType::BF16 => {
                f32::from_bits((u16::from_le_bytes([bytes[0], bytes[1]]) as u32) << 16) as f64
            }
            DType::F16 => half_to_f32(u16::from_le_bytes([bytes[0], bytes[1]])) as f64,
            DType::I64 => i64::from_le_bytes(bytes[..8].try_into().unwrap()) as f64,
            DType::I32 => i32::from_le_bytes(bytes[..4].try_into().unwrap()) as f64,
            DType::I16 => i16::from_le_bytes([bytes[0], bytes[1]]) as f64,
            DType::I8 => bytes[0] as i8 as f64,
            DType::U8 | DType::Bool => bytes[0] as f64,
        }
    }
}

fn half_to_f32(bits: u16) -> f32 {
    let sign = ((bits >> 15) as u32) << 31;
    let exponent = ((bits >> 10) & 0x1f) as u32;
    let mantissa = (bits & 0x3ff) as u32;
    let value = match exponent {
        0 => {
            let magnitude = mantissa as f32 * 2f32.powi(-24);
            return if sign != 0 { -magnitude } else { magnitude };
        }
        0x1f => sign | 0x7f80_0000 | (mantissa << 13),
        _ => sign | ((exponent + 112) << 23) | (mantissa << 13),
    };
    f32::from_bits(value)
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.torch_name())
    }
}
