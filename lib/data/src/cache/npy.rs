//! numpy `.npy` files (format 1.0 when writing; 1.0–3.0 when reading), byte-identical to
//! `numpy.save` for the little-endian integer arrays Megatron caches.

use std::fmt::Write as _;
use std::path::Path;

use thiserror::Error;

const MAGIC: &[u8; 6] = b"\x93NUMPY";
/// numpy aligns the start of the data to this many bytes.
const ARRAY_ALIGN: usize = 64;
/// numpy leaves room in the header for the leading dimension to grow to this many digits.
const GROWTH_AXIS_MAX_DIGITS: usize = 21;

#[derive(Debug, Error)]
pub enum NpyError {
    #[error("{path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    #[error("{path}: not a .npy file ({reason})")]
    Format { path: String, reason: String },
    #[error("{path}: holds {found}, expected one of {expected}")]
    Dtype {
        path: String,
        found: String,
        expected: String,
    },
}

/// Element types of index arrays, named by their numpy `descr`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dtype {
    I16,
    I32,
    I64,
    U32,
    U64,
}

impl Dtype {
    pub fn descr(self) -> &'static str {
        match self {
            Dtype::I16 => "<i2",
            Dtype::I32 => "<i4",
            Dtype::I64 => "<i8",
            Dtype::U32 => "<u4",
            Dtype::U64 => "<u8",
        }
    }

    /// numpy's name for the type, as users see it in Megatron's logs.
    pub fn name(self) -> &'static str {
        match self {
            Dtype::I16 => "int16",
            Dtype::I32 => "int32",
            Dtype::I64 => "int64",
            Dtype::U32 => "uint32",
            Dtype::U64 => "uint64",
        }
    }

    fn from_descr(descr: &str) -> Option<Dtype> {
        [Dtype::I16, Dtype::I32, Dtype::I64, Dtype::U32, Dtype::U64]
            .into_iter()
            .find(|d| d.descr() == descr)
    }

    pub fn size(self) -> usize {
        match self {
            Dtype::I16 => 2,
            Dtype::I32 | Dtype::U32 => 4,
            Dtype::I64 | Dtype::U64 => 8,
        }
    }
}

/// An integer array in one of the cached dtypes, kept in that dtype so that a round trip
/// through a file is lossless and memory stays at numpy's footprint.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum IndexArray {
    I16(Vec<i16>),
    I32(Vec<i32>),
    I64(Vec<i64>),
    U32(Vec<u32>),
    U64(Vec<u64>),
}

impl IndexArray {
    pub fn dtype(&self) -> Dtype {
        match self {
            IndexArray::I16(_) => Dtype::I16,
            IndexArray::I32(_) => Dtype::I32,
            IndexArray::I64(_) => Dtype::I64,
            IndexArray::U32(_) => Dtype::U32,
            IndexArray::U64(_) => Dtype::U64,
        }
    }

    pub fn len(&self) -> usize {
        match self {
            IndexArray::I16(v) => v.len(),
            IndexArray::I32(v) => v.len(),
            IndexArray::I64(v) => v.len(),
            IndexArray::U32(v) => v.len(),
            IndexArray::U64(v) => v.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Element `i` widened to i64.
    #[inline]
    pub fn get(&self, i: usize) -> i64 {
        match self {
            IndexArray::I16(v) => i64::from(v[i]),
            IndexArray::I32(v) => i64::from(v[i]),
            IndexArray::I64(v) => v[i],
            IndexArray::U32(v) => i64::from(v[i]),
            IndexArray::U64(v) => v[i] as i64,
        }
    }

    pub fn to_i64_vec(&self) -> Vec<i64> {
        (0..self.len()).map(|i| self.get(i)).collect()
    }

    fn to_le_bytes(&self) -> Vec<u8> {
        match self {
            IndexArray::I16(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
            IndexArray::I32(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
            IndexArray::I64(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
            IndexArray::U32(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
            IndexArray::U64(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        }
    }

    fn from_le_bytes(dtype: Dtype, bytes: &[u8]) -> IndexArray {
        match dtype {
            Dtype::I16 => IndexArray::I16(
                bytes
                    .chunks_exact(2)
                    .map(|c| i16::from_le_bytes([c[0], c[1]]))
                    .collect(),
            ),
            Dtype::I32 => IndexArray::I32(
                bytes
                    .chunks_exact(4)
                    .map(|c| i32::from_le_bytes(c.try_into().expect("4-byte chunk")))
                    .collect(),
            ),
            Dtype::I64 => IndexArray::I64(
                bytes
                    .chunks_exact(8)
                    .map(|c| i64::from_le_bytes(c.try_into().expect("8-byte chunk")))
                    .collect(),
            ),
            Dtype::U32 => IndexArray::U32(
                bytes
                    .chunks_exact(4)
                    .map(|c| u32::from_le_bytes(c.try_into().expect("4-byte chunk")))
                    .collect(),
            ),
            Dtype::U64 => IndexArray::U64(
                bytes
                    .chunks_exact(8)
                    .map(|c| u64::from_le_bytes(c.try_into().expect("8-byte chunk")))
                    .collect(),
            ),
        }
    }
}

/// A C-order array with its shape.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NpyArray {
    pub shape: Vec<usize>,
    pub data: IndexArray,
}

impl NpyArray {
    pub fn new(shape: Vec<usize>, data: IndexArray) -> Self {
        assert_eq!(
            shape.iter().product::<usize>(),
            data.len(),
            "shape {shape:?} does not match {} elements",
            data.len()
        );
        NpyArray { shape, data }
    }

    pub fn vector(data: IndexArray) -> Self {
        NpyArray::new(vec![data.len()], data)
    }

    /// The complete file contents as `numpy.save` writes them.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut header = format!(
            "{{'descr': '{}', 'fortran_order': False, 'shape': {}, }}",
            self.data.dtype().descr(),
            python_shape_repr(&self.shape)
        );
        if let Some(first) = self.shape.first() {
            let digits = first.to_string().len();
            header.push_str(&" ".repeat(GROWTH_AXIS_MAX_DIGITS.saturating_sub(digits)));
        }
        let unpadded = MAGIC.len() + 2 + 2 + header.len() + 1;
        let padding = ARRAY_ALIGN - unpadded % ARRAY_ALIGN;
        header.push_str(&" ".repeat(padding));
        header.push('\n');
        let header_len = u16::try_from(header.len()).expect("npy header fits in 64 KiB");

        let mut bytes = Vec::with_capacity(unpadded + padding + self.data.len() * 8);
        bytes.extend_from_slice(MAGIC);
        bytes.extend_from_slice(&[1, 0]);
        bytes.extend_from_slice(&header_len.to_le_bytes());
        bytes.extend_from_slice(header.as_bytes());
        bytes.extend_from_slice(&self.data.to_le_bytes());
        bytes
    }

    pub fn from_bytes(bytes: &[u8], path: &str) -> Result<NpyArray, NpyError> {
        let format_error = |reason: &str| NpyError::Format {
            path: path.to_string(),
            reason: reason.to_string(),
        };
        if bytes.len() < 10 || &bytes[..6] != MAGIC {
            return Err(format_error("missing \\x93NUMPY magic"));
        }
        let (header_len, header_start) = match bytes[6] {
            1 => (usize::from(u16::from_le_bytes([bytes[8], bytes[9]])), 10),
            2 | 3 if bytes.len() >= 12 => (
                u32::from_le_bytes(bytes[8..12].try_into().expect("4 bytes")) as usize,
                12,
            ),
            major => return Err(format_error(&format!("unsupported format version {major}"))),
        };
        let data_start = header_start + header_len;
        let header = bytes
            .get(header_start..data_start)
            .and_then(|h| std::str::from_utf8(h).ok())
            .ok_or_else(|| format_error("truncated or non-text header"))?;
        let fields = HeaderFields::parse(header).map_err(|r| format_error(&r))?;
        if fields.fortran_order {
            return Err(format_error("Fortran-order arrays are not supported"));
        }
        let dtype = Dtype::from_descr(&fields.descr).ok_or_else(|| NpyError::Dtype {
            path: path.to_string(),
            found: fields.descr.clone(),
            expected: "<i2, <i4, <i8, <u4, <u8".to_string(),
        })?;
        let count: usize = fields.shape.iter().product();
        let data = &bytes[data_start..];
        if data.len() != count * dtype.size() {
            return Err(format_error(&format!(
                "shape {:?} needs {} data bytes, file has {}",
                fields.shape,
                count * dtype.size(),
                data.len()
            )));
        }
        Ok(NpyArray::new(
            fields.shape,
            IndexArray::from_le_bytes(dtype, data),
        ))
    }

    pub fn read(path: &Path) -> Result<NpyArray, NpyError> {
        let display = path.display().to_string();
        let bytes = std::fs::read(path).map_err(|source| NpyError::Io {
            path: display.clone(),
            source,
        })?;
        NpyArray::from_bytes(&bytes, &display)
    }
}

/// Python's `repr` of a shape tuple: `()`, `(5,)`, `(5, 2)`.
fn python_shape_repr(shape: &[usize]) -> String {
    let mut out = String::from("(");
    for (i, dim) in shape.iter().enumerate() {
        if i > 0 {
            out.push_str(", ");
        }
        write!(out, "{dim}").expect("writing to a String");
    }
    if shape.len() == 1 {
        out.push(',');
    }
    out.push(')');
    out
}

/// The three keys of a `.npy` header dict.
struct HeaderFields {
    descr: String,
    fortran_order: bool,
    shape: Vec<usize>,
}

impl HeaderFields {
    fn parse(header: &str) -> Result<HeaderFields, String> {
        let value_after = |key: &str| -> Result<&str, String> {
            let pattern = format!("'{key}':");
            let at = header
                .find(&pattern)
                .ok_or_else(|| format!("header has no '{key}' key"))?;
            Ok(header[at + pattern.len()..].trim_start())
        };
        let descr_text = value_after("descr")?;
        let descr = descr_text
            .strip_prefix('\'')
            .and_then(|rest| rest.split('\'').next())
            .ok_or("descr is not a quoted string")?
            .to_string();
        let fortran_order = value_after("fortran_order")?.starts_with("True");
        let shape_text = value_after("shape")?;
        let inner = shape_text
            .strip_prefix('(')
            .and_then(|rest| rest.split(')').next())
            .ok_or("shape is not a tuple")?;
        let shape = inner
            .split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(|s| {
                s.parse::<usize>()
                    .map_err(|_| format!("bad shape entry {s:?}"))
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(HeaderFields {
            descr,
            fortran_order,
            shape,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_is_padded_to_64_bytes_with_growth_room() {
        let bytes = NpyArray::vector(IndexArray::I32(vec![1, 2, 3])).to_bytes();
        assert_eq!(bytes.len(), 128 + 12);
        let header = std::str::from_utf8(&bytes[10..128]).unwrap();
        assert!(header.starts_with("{'descr': '<i4', 'fortran_order': False, 'shape': (3,), }"));
        assert!(header.ends_with(" \n"));
        assert_eq!(u16::from_le_bytes([bytes[8], bytes[9]]), 118);
    }

    #[test]
    fn round_trips_every_dtype_and_2d_shapes() {
        let arrays = [
            NpyArray::vector(IndexArray::I16(vec![-3, 0, 7])),
            NpyArray::new(vec![2, 2], IndexArray::I32(vec![0, 0, 1, 5])),
            NpyArray::vector(IndexArray::I64(vec![i64::MIN, i64::MAX])),
            NpyArray::vector(IndexArray::U32(vec![u32::MAX])),
            NpyArray::vector(IndexArray::I32(vec![])),
        ];
        for array in arrays {
            let back = NpyArray::from_bytes(&array.to_bytes(), "mem").unwrap();
            assert_eq!(back, array);
        }
    }

    #[test]
    fn rejects_truncated_data_and_unknown_dtypes() {
        let mut bytes = NpyArray::vector(IndexArray::I64(vec![1, 2])).to_bytes();
        bytes.pop();
        assert!(matches!(
            NpyArray::from_bytes(&bytes, "x.npy"),
            Err(NpyError::Format { .. })
        ));
        let float = NpyArray::vector(IndexArray::I32(vec![1]))
            .to_bytes()
            .iter()
            .map(|&b| if b == b'i' { b'f' } else { b })
            .collect::<Vec<_>>();
        assert!(matches!(
            NpyArray::from_bytes(&float, "x.npy"),
            Err(NpyError::Dtype { .. })
        ));
    }
}
