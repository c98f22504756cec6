//! TensorBoard's `Event` record (tensorflow/core/util/event.proto) for the kinds we write: the
//! file-version header, a scalar summary and a text summary.

use super::protobuf::MessageEncoder;

const EVENT_WALL_TIME: u32 = 1;
const EVENT_STEP: u32 = 2;
const EVENT_FILE_VERSION: u32 = 3;
const EVENT_SUMMARY: u32 = 5;
const SUMMARY_VALUE: u32 = 1;
const VALUE_TAG: u32 = 1;
const VALUE_SIMPLE_VALUE: u32 = 2;
const VALUE_TENSOR: u32 = 8;
const VALUE_METADATA: u32 = 9;
const METADATA_PLUGIN_DATA: u32 = 1;
const PLUGIN_NAME: u32 = 1;
const TENSOR_DTYPE: u32 = 1;
const TENSOR_SHAPE: u32 = 2;
const TENSOR_STRING_VAL: u32 = 8;
const SHAPE_DIM: u32 = 2;
const DIM_SIZE: u32 = 1;
/// `DataType.DT_STRING` (tensorflow/core/framework/types.proto).
const DT_STRING: i64 = 7;

/// The version string TensorBoard expects in the first event of a file.
pub const FILE_VERSION: &str = "brain.Event:2";

/// `Event { wall_time, file_version }`, the first record of every event file.
pub fn file_version_event(wall_time: f64) -> Vec<u8> {
    let mut event = MessageEncoder::new();
    event.double(EVENT_WALL_TIME, wall_time);
    event.string(EVENT_FILE_VERSION, FILE_VERSION);
    event.into_bytes()
}

/// `Event { wall_time, step, summary { value { tag, simple_value } } }`.
pub fn scalar_event(wall_time: f64, step: i64, tag: &str, value: f32) -> Vec<u8> {
    let mut summary_value = MessageEncoder::new();
    summary_value.string(VALUE_TAG, tag);
    summary_value.float(VALUE_SIMPLE_VALUE, value);
    summary_event(wall_time, step, summary_value)
}

/// `Event { wall_time, step, summary { value { tag, metadata { plugin_data { plugin_name:
/// "text" } }, tensor { dtype: DT_STRING, tensor_shape { dim { size: 1 } }, string_val } } } }`:
/// what TensorBoard's text plugin shows (and PyTorch's `add_text` writes).
pub fn text_event(wall_time: f64, step: i64, tag: &str, text: &str) -> Vec<u8> {
    let mut plugin = MessageEncoder::new();
    plugin.string(PLUGIN_NAME, "text");
    let mut metadata = MessageEncoder::new();
    metadata.message(METADATA_PLUGIN_DATA, plugin);
    let mut dim = MessageEncoder::new();
    dim.int64(DIM_SIZE, 1);
    let mut shape = MessageEncoder::new();
    shape.message(SHAPE_DIM, dim);
    let mut tensor = MessageEncoder::new();
    tensor.int64(TENSOR_DTYPE, DT_STRING);
    tensor.message(TENSOR_SHAPE, shape);
    tensor.string(TENSOR_STRING_VAL, text);
    let mut summary_value = MessageEncoder::new();
    summary_value.string(VALUE_TAG, tag);
    summary_value.message(VALUE_TENSOR, tensor);
    summary_value.message(VALUE_METADATA, metadata);
    summary_event(wall_time, step, summary_value)
}

/// `Event { wall_time, step, summary { value } }` around one summary value.
fn summary_event(wall_time: f64, step: i64, summary_value: MessageEncoder) -> Vec<u8> {
    let mut summary = MessageEncoder::new();
    summary.message(SUMMARY_VALUE, summary_value);
    let mut event = MessageEncoder::new();
    event.double(EVENT_WALL_TIME, wall_time);
    event.int64(EVENT_STEP, step);
    event.message(EVENT_SUMMARY, summary);
    event.into_bytes()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scalar_event_matches_the_wire_format_built_by_hand() {
        let expected: Vec<u8> = [
            // field 1, fixed64: wall_time 1.5
            &[0x09, 0, 0, 0, 0, 0, 0, 0xf8, 0x3f][..],
            // field 2, varint: step 3
            &[0x10, 0x03],
            // field 5, length 13: Summary
            &[0x2a, 0x0d],
            // Summary field 1, length 11: Value
            &[0x0a, 0x0b],
            // Value field 1, length 4: tag "loss"
            &[0x0a, 0x04, b'l', b'o', b's', b's'],
            // Value field 2, fixed32: simple_value 2.5
            &[0x15, 0, 0, 0x20, 0x40],
        ]
        .concat();
        assert_eq!(scalar_event(1.5, 3, "loss", 2.5), expected);
    }

    #[test]
    fn file_version_event_matches_the_wire_format_built_by_hand() {
        let mut expected = vec![0x09, 0, 0, 0, 0, 0, 0, 0xf8, 0x3f, 0x1a, 13];
        expected.extend_from_slice(b"brain.Event:2");
        assert_eq!(file_version_event(1.5), expected);
    }
}
