use std::path::Path;

use super::{DType, IndexError};

/// The nine bytes every current `.idx` file starts with: "MMIDIDX" and two NULs.
pub const MAGIC: &[u8; 9] = b"MMIDIDX\x00\x00";
/// Magic of the pre-2023 "lazy"/"cached" format, recognised only to name it in errors.
const LEGACY_TNT_MAGIC: &[u8; 8] = b"TNTIDX\x00\x00";
/// Bytes before the lengths array; 34 leaves the i64 arrays unaligned.
pub const HEADER_LEN: usize = 34;
const VERSION: u64 = 1;

/// The fixed part of a `.idx` file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IndexHeader {
    pub dtype: DType,
    /// Number of sequences (`S`).
    pub sequence_count: u64,
    /// Length of the document index, which includes its leading 0 (`D` = documents + 1).
    pub document_index_len: u64,
}

impl IndexHeader {
    /// Parses and checks the header at the start of `bytes`, the whole `.idx` file at `path`.
    pub fn parse(bytes: &[u8], path: &Path) -> Result<Self, IndexError> {
        if bytes.starts_with(LEGACY_TNT_MAGIC) {
            return Err(IndexError::Foreign {
                path: path.into(),
                reason: "this is the legacy lazy/cached (TNTIDX) format, removed from Megatron in 2023; \
                         re-run preprocess_data to produce MMIDIDX files"
                    .into(),
            });
        }
        if bytes.len() < HEADER_LEN {
            if !MAGIC.starts_with(&bytes[..bytes.len().min(MAGIC.len())]) {
                return Err(IndexError::Foreign {
                    path: path.into(),
                    reason: "wrong magic bytes (expected \"MMIDIDX\\0\\0\")".into(),
                });
            }
            return Err(IndexError::Size {
                path: path.into(),
                reason: format!(
                    "file is {} bytes, shorter than the {HEADER_LEN}-byte header (truncated?)",
                    bytes.len()
                ),
            });
        }
        if &bytes[..9] != MAGIC {
            return Err(IndexError::Foreign {
                path: path.into(),
                reason: "wrong magic bytes (expected \"MMIDIDX\\0\\0\")".into(),
            });
        }
        let version = u64::from_le_bytes(bytes[9..17].try_into().unwrap());
        if version != VERSION {
            return Err(IndexError::Version {
                path: path.into(),
                version,
            });
        }
        let dtype = DType::from_code(bytes[17]).map_err(|e| IndexError::Corrupt {
            path: path.into(),
            reason: e.to_string(),
        })?;
        let sequence_count = u64::from_le_bytes(bytes[18..26].try_into().unwrap());
        let document_index_len = u64::from_le_bytes(bytes[26..34].try_into().unwrap());
        if document_index_len == 0 {
            return Err(IndexError::Corrupt {
                path: path.into(),
                reason: "document index length is 0 (it always holds at least the leading 0)"
                    .into(),
            });
        }
        Ok(IndexHeader {
            dtype,
            sequence_count,
            document_index_len,
        })
    }

    /// Byte size of the whole `.idx` for this header, or `None` on overflow.
    pub fn file_len(&self, multimodal: bool) -> Option<u64> {
        let per_sequence = if multimodal { 13 } else { 12 };
        self.sequence_count
            .checked_mul(per_sequence)?
            .checked_add(self.document_index_len.checked_mul(8)?)?
            .checked_add(HEADER_LEN as u64)
    }

    pub fn lengths_offset(&self) -> usize {
        HEADER_LEN
    }

    pub fn pointers_offset(&self) -> usize {
        HEADER_LEN + 4 * self.sequence_count as usize
    }

    pub fn document_indices_offset(&self) -> usize {
        HEADER_LEN + 12 * self.sequence_count as usize
    }

    pub fn modes_offset(&self) -> usize {
        self.document_indices_offset() + 8 * self.document_index_len as usize
    }

    pub fn to_bytes(&self) -> [u8; HEADER_LEN] {
        let mut out = [0u8; HEADER_LEN];
        out[..9].copy_from_slice(MAGIC);
        out[9..17].copy_from_slice(&VERSION.to_le_bytes());
        out[17] = self.dtype.code();
        out[18..26].copy_from_slice(&self.sequence_count.to_le_bytes());
        out[26..34].copy_from_slice(&self.document_index_len.to_le_bytes());
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_round_trips() {
        let h = IndexHeader {
            dtype: DType::U16,
            sequence_count: 3,
            document_index_len: 3,
        };
        let bytes = h.to_bytes();
        assert_eq!(IndexHeader::parse(&bytes, Path::new("x.idx")).unwrap(), h);
        assert_eq!(h.file_len(false), Some(94));
        assert_eq!(h.file_len(true), Some(97));
    }

    #[test]
    fn rejects_foreign_and_future_files() {
        let p = Path::new("x.idx");
        let mut bytes = IndexHeader {
            dtype: DType::I32,
            sequence_count: 0,
            document_index_len: 1,
        }
        .to_bytes();
        bytes[9] = 2;
        assert!(matches!(
            IndexHeader::parse(&bytes, p),
            Err(IndexError::Version { version: 2, .. })
        ));
        let err =
            IndexHeader::parse(b"TNTIDX\x00\x00 and more bytes of an old file", p).unwrap_err();
        assert!(err.to_string().contains("TNTIDX"), "{err}");
        let err =
            IndexHeader::parse(b"{\"text\": \"hello\"} plus padding bytes....", p).unwrap_err();
        assert!(err.to_string().contains("wrong magic"), "{err}");
        let err = IndexHeader::parse(&MAGIC[..], p).unwrap_err();
        assert!(err.to_string().contains("truncated"), "{err}");
    }
}
