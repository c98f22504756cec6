//! The few protobuf wire-format encodings TensorBoard's `Event` needs, written by hand so that
//! metrics need no protobuf toolchain.
//!
//! Fields follow proto3 implicit presence: a scalar equal to its default (0, +0.0, "") is
//! left out, as every protobuf library serialises it, so our events are byte-identical to the
//! ones TensorFlow's and PyTorch's writers produce.

const WIRE_VARINT: u32 = 0;
const WIRE_FIXED64: u32 = 1;
const WIRE_LENGTH_DELIMITED: u32 = 2;
const WIRE_FIXED32: u32 = 5;

/// One protobuf message under construction.
#[derive(Debug, Default)]
pub struct MessageEncoder {
    bytes: Vec<u8>,
}

impl MessageEncoder {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn into_bytes(self) -> Vec<u8> {
        self.bytes
    }

    fn varint(&mut self, mut value: u64) {
        while value >= 0x80 {
            self.bytes.push((value as u8) | 0x80);
            value >>= 7;
        }
        self.bytes.push(value as u8);
    }

    fn key(&mut self, field: u32, wire_type: u32) {
        self.varint(u64::from(field << 3 | wire_type));
    }

    /// A `double` field (64-bit little-endian).
    pub fn double(&mut self, field: u32, value: f64) {
        if value.to_bits() != 0 {
            self.key(field, WIRE_FIXED64);
            self.bytes.extend_from_slice(&value.to_le_bytes());
        }
    }

    /// A `float` field (32-bit little-endian).
    pub fn float(&mut self, field: u32, value: f32) {
        if value.to_bits() != 0 {
            self.key(field, WIRE_FIXED32);
            self.bytes.extend_from_slice(&value.to_le_bytes());
        }
    }

    /// An `int64` field: a varint of the two's-complement value, so negatives take 10 bytes.
    pub fn int64(&mut self, field: u32, value: i64) {
        if value != 0 {
            self.key(field, WIRE_VARINT);
            self.varint(value as u64);
        }
    }

    /// A `string` field.
    pub fn string(&mut self, field: u32, value: &str) {
        if !value.is_empty() {
            self.length_delimited(field, value.as_bytes());
        }
    }

    /// An embedded message field; present even when empty, as set message fields are.
    pub fn message(&mut self, field: u32, message: MessageEncoder) {
        self.length_delimited(field, &message.bytes);
    }

    fn length_delimited(&mut self, field: u32, payload: &[u8]) {
        self.key(field, WIRE_LENGTH_DELIMITED);
        self.varint(payload.len() as u64);
        self.bytes.extend_from_slice(payload);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn encoded(build: impl FnOnce(&mut MessageEncoder)) -> Vec<u8> {
        let mut encoder = MessageEncoder::new();
        build(&mut encoder);
        encoder.into_bytes()
    }

    #[test]
    fn varints_use_seven_bits_per_byte_low_group_first() {
        // 300 = 0b10_0101100: groups 0101100, 10 (the protobuf documentation's own example).
        assert_eq!(encoded(|e| e.int64(2, 300)), [0x10, 0xac, 0x02]);
        assert_eq!(encoded(|e| e.int64(2, 127)), [0x10, 0x7f]);
    }

    #[test]
    fn negative_int64_takes_ten_bytes() {
        assert_eq!(
            encoded(|e| e.int64(2, -1)),
            [0x10, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x01]
        );
    }

    #[test]
    fn fixed_width_fields_are_little_endian() {
        // 1.5 = 0x3FF8_0000_0000_0000 as a double, 2.5 = 0x4020_0000 as a float.
        assert_eq!(
            encoded(|e| e.double(1, 1.5)),
            [0x09, 0, 0, 0, 0, 0, 0, 0xf8, 0x3f]
        );
        assert_eq!(encoded(|e| e.float(2, 2.5)), [0x15, 0, 0, 0x20, 0x40]);
    }

    #[test]
    fn default_scalars_are_omitted_but_negative_zero_is_kept() {
        assert!(encoded(|e| {
            e.int64(2, 0);
            e.double(1, 0.0);
            e.float(2, 0.0);
            e.string(3, "");
        })
        .is_empty());
        assert_eq!(encoded(|e| e.float(2, -0.0)), [0x15, 0, 0, 0, 0x80]);
    }

    #[test]
    fn strings_and_messages_are_length_prefixed() {
        let mut inner = MessageEncoder::new();
        inner.string(1, "ab");
        assert_eq!(
            encoded(|e| e.message(5, inner)),
            [0x2a, 0x04, 0x0a, 0x02, b'a', b'b']
        );
        assert_eq!(
            encoded(|e| e.message(5, MessageEncoder::new())),
            [0x2a, 0x00]
        );
    }
}
