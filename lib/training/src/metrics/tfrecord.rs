//! TFRecord framing: each record is its length (u64 little-endian), the masked CRC32C of those
//! eight bytes, the data, and the masked CRC32C of the data.

use std::io::{self, Write};

const MASK_DELTA: u32 = 0xa282_ead8;

/// CRC32C rotated right by 15 bits plus a constant, which TFRecord stores so that a CRC of
/// data that itself contains CRCs stays well distributed.
pub fn masked_crc32c(bytes: &[u8]) -> u32 {
    crc32c::crc32c(bytes)
        .rotate_right(15)
        .wrapping_add(MASK_DELTA)
}

/// Writes one framed record.
pub fn write_record(out: &mut impl Write, data: &[u8]) -> io::Result<()> {
    let length = (data.len() as u64).to_le_bytes();
    out.write_all(&length)?;
    out.write_all(&masked_crc32c(&length).to_le_bytes())?;
    out.write_all(data)?;
    out.write_all(&masked_crc32c(data).to_le_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;

    // CRC32C check values: "123456789" → 0xE3069283 (RFC 3720's catalogue value), 32 zero
    // bytes → 0x8A9136AA (RFC 3720 B.4); the empty string → 0. Masked by hand:
    // rotr(0xE3069283, 15) = 0x2507C60D, + 0xA282EAD8 = 0xC78AB0E5;
    // rotr(0x8A9136AA, 15) = 0x6D55_1522, + 0xA282EAD8 = 0x0FD7FFFA (mod 2^32).
    #[test]
    fn masked_crc_of_known_inputs() {
        assert_eq!(masked_crc32c(b""), 0xa282_ead8);
        assert_eq!(masked_crc32c(b"123456789"), 0xc78a_b0e5);
        assert_eq!(masked_crc32c(&[0u8; 32]), 0x0fd7_fffa);
    }

    // The length's masked CRC from TensorBoard's own implementation:
    // python -c "from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c; print(hex(masked_crc32c((9).to_bytes(8, 'little'))))"
    #[test]
    fn record_is_length_crc_data_crc() {
        let mut out = Vec::new();
        write_record(&mut out, b"123456789").unwrap();
        let mut expected = 9u64.to_le_bytes().to_vec();
        expected.extend_from_slice(&0x3971_f937u32.to_le_bytes());
        expected.extend_from_slice(b"123456789");
        expected.extend_from_slice(&0xc78a_b0e5u32.to_le_bytes());
        assert_eq!(out, expected);
    }
}
