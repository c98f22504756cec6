/// A dtype code outside Megatron's table.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("unknown dtype code {0} (valid codes are 1..=8)")]
pub struct UnknownDType(pub u8);

/// Element type of the token ids in a `.bin` file, with Megatron's `.idx` dtype codes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DType {
    U8,
    I8,
    I16,
    I32,
    I64,
    F64,
    F32,
    U16,
}

impl DType {
    pub const ALL: [DType; 8] = [
        DType::U8,
        DType::I8,
        DType::I16,
        DType::I32,
        DType::I64,
        DType::F64,
        DType::F32,
        DType::U16,
    ];

    /// The code stored in byte 17 of the `.idx` header.
    pub fn code(self) -> u8 {
        match self {
            DType::U8 => 1,
            DType::I8 => 2,
            DType::I16 => 3,
            DType::I32 => 4,
            DType::I64 => 5,
            DType::F64 => 6,
            DType::F32 => 7,
            DType::U16 => 8,
        }
    }

    pub fn from_code(code: u8) -> Result<Self, UnknownDType> {
        DType::ALL
            .into_iter()
            .find(|d| d.code() == code)
            .ok_or(UnknownDType(code))
    }

    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DType::U8 | DType::I8 => 1,
            DType::I16 | DType::U16 => 2,
            DType::I32 | DType::F32 => 4,
            DType::I64 | DType::F64 => 8,
        }
    }

    /// numpy's name for the type, as users see it in Megatron logs.
    pub fn name(self) -> &'static str {
        match self {
            DType::U8 => "uint8",
            DType::I8 => "int8",
            DType::I16 => "int16",
            DType::I32 => "int32",
            DType::I64 => "int64",
            DType::F64 => "float64",
            DType::F32 => "float32",
            DType::U16 => "uint16",
        }
    }

    /// Megatron's `DType.optimal_dtype`: uint16 below 65500 distinct ids, else int32.
    /// The threshold is 65500, not 65536, to match the files Megatron writes.
    pub fn optimal_for_vocab(vocab_size: usize) -> Self {
        if vocab_size < 65500 {
            DType::U16
        } else {
            DType::I32
        }
    }

    /// Decodes the little-endian element at the start of `bytes` (which holds at least `size()` bytes).
    /// Float data is truncated toward zero, like numpy's cast to an integer type.
    pub(crate) fn read_le(self, bytes: &[u8]) -> i64 {
        match self {
            DType::U8 => bytes[0] as i64,
            DType::I8 => bytes[0] as i8 as i64,
            DType::I16 => i16::from_le_bytes([bytes[0], bytes[1]]) as i64,
            DType::U16 => u16::from_le_bytes([bytes[0], bytes[1]]) as i64,
            DType::I32 => i32::from_le_bytes(bytes[..4].try_into().unwrap()) as i64,
            DType::F32 => f32::from_le_bytes(bytes[..4].try_into().unwrap()) as i64,
            DType::I64 => i64::from_le_bytes(bytes[..8].try_into().unwrap()),
            DType::F64 => f64::from_le_bytes(bytes[..8].try_into().unwrap()) as i64,
        }
    }

    /// Appends `value` in this dtype, little-endian; `None` if it is not representable.
    pub(crate) fn write_le(self, value: i64, out: &mut Vec<u8>) -> Option<()> {
        match self {
            DType::U8 => out.push(u8::try_from(value).ok()?),
            DType::I8 => out.extend_from_slice(&i8::try_from(value).ok()?.to_le_bytes()),
            DType::I16 => out.extend_from_slice(&i16::try_from(value).ok()?.to_le_bytes()),
            DType::U16 => out.extend_from_slice(&u16::try_from(value).ok()?.to_le_bytes()),
            DType::I32 => out.extend_from_slice(&i32::try_from(value).ok()?.to_le_bytes()),
            DType::I64 => out.extend_from_slice(&value.to_le_bytes()),
            DType::F32 => {
                let f = value as f32;
                if f as i64 != value {
                    return None;
                }
                out.extend_from_slice(&f.to_le_bytes())
            }
            DType::F64 => {
                let f = value as f64;
                if f as i64 != value {
                    return None;
                }
                out.extend_from_slice(&f.to_le_bytes())
            }
        }
        Some(())
    }
}

impl std::fmt::Display for DType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_round_trip_and_match_megatron_table() {
        let expected = [
            (1, 1),
            (2, 1),
            (3, 2),
            (4, 4),
            (5, 8),
            (6, 8),
            (7, 4),
            (8, 2),
        ];
        for (code, size) in expected {
            let d = DType::from_code(code).unwrap();
            assert_eq!(d.code(), code);
            assert_eq!(d.size(), size);
        }
        assert!(DType::from_code(0).is_err());
        assert!(DType::from_code(9).is_err());
    }

    #[test]
    fn optimal_dtype_threshold_is_65500() {
        assert_eq!(DType::optimal_for_vocab(50257), DType::U16);
        assert_eq!(DType::optimal_for_vocab(65499), DType::U16);
        assert_eq!(DType::optimal_for_vocab(65500), DType::I32);
        assert_eq!(DType::optimal_for_vocab(128256), DType::I32);
    }

    #[test]
    fn write_rejects_values_outside_the_type() {
        let mut out = Vec::new();
        assert!(DType::U16.write_le(65536, &mut out).is_none());
        assert!(DType::U8.write_le(-1, &mut out).is_none());
        assert!(DType::I32.write_le(1 << 40, &mut out).is_none());
        for d in DType::ALL {
            out.clear();
            d.write_le(100, &mut out).unwrap();
            assert_eq!(out.len(), d.size());
            assert_eq!(d.read_le(&out), 100);
        }
    }
}
