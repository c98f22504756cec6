//! Where Megatron's distributed optimizer keeps each parameter's state in the `dp_zero` layout
//! (`distrib_optim.pt` of `--ckpt-format torch`, and `torch_dist`'s `dp_zero_gather_scatter`):
//! per model chunk and dtype, one flat float32 tensor each for the main parameters, `exp_avg`
//! and `exp_avg_sq`, holding the chunk's gradient buffer with the padding at the end of every
//! bucket cut off (`get_parameter_state_dp_zero`, core_v0.14.0).
//!
//! The buffer is laid out as `_ParamAndGradBuffer` lays it out: the parameters in the reverse
//! of their registration order (roughly the order backprop produces gradients), each starting
//! at a multiple of 64 elements; a new bucket once a bucket holds `bucket_size` elements; the
//! shared embedding of a pipeline's first or last stage in a bucket of its own. Buckets start
//! at multiples of 128 and of the data-parallel size, so their padding (which the saved tensors
//! drop) never changes where a parameter lies relative to its bucket's start.

/// A parameter of a gradient buffer, in registration order (`named_parameters`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BufferParam {
    pub numel: usize,
    /// Megatron's `shared_embedding`: the tied word embedding or output layer of a pipeline's
    /// first or last stage (pipeline parallel size > 1), which gets a bucket of its own.
    pub shared_embedding: bool,
}

/// Each parameter's first element in the saved flat tensors (in the order given), and the
/// length of those tensors (`numel_unpadded`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DpZeroLayout {
    pub offsets: Vec<usize>,
    pub numel_unpadded: usize,
}

/// Parameters start at multiples of 64 elements (128-byte addresses for 16-bit values).
const PARAM_ALIGNMENT: usize = 64;

fn align(index: usize) -> usize {
    index.div_ceil(PARAM_ALIGNMENT) * PARAM_ALIGNMENT
}

/// The `dp_zero` layout of one gradient buffer holding `params` (registration order), with
/// buckets of `bucket_size` elements (`None`: one bucket, Megatron's choice without
/// `--overlap-grad-reduce`, on pipeline stages after the first, and for model chunks after the
/// first).
pub fn dp_zero_layout(params: &[BufferParam], bucket_size: Option<usize>) -> DpZeroLayout {
    let mut offsets = vec![0; params.len()];
    // Positions relative to the open bucket's start; `saved` counts the elements of closed
    // buckets kept in the flat tensors.
    let mut saved = 0;
    let mut start = 0;
    let mut open = false;
    for (index, param) in params.iter().enumerate().rev() {
        start = align(start);
        if param.shared_embedding && open {
            saved += start;
            start = 0;
        }
        let end = start + param.numel;
        offsets[index] = saved + start;
        open = true;
        let full = bucket_size.is_some_and(|size| end >= size);
        if full || param.shared_embedding {
            saved += end;
            start = 0;
            open = false;
        } else {
            start = end;
        }
    }
    if open {
        saved += start;
    }
    DpZeroLayout {
        offsets,
        numel_unpadded: saved,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(numels: &[usize]) -> Vec<BufferParam> {
        numels
            .iter()
            .map(|&numel| BufferParam {
                numel,
                shared_embedding: false,
            })
            .collect()
    }

    #[test]
    fn parameters_are_laid_out_in_reverse_at_64_element_starts() {
        // Registered a (100), b (64), c (10): the buffer holds c at 0, b at 64, a at 128.
        let layout = dp_zero_layout(&params(&[100, 64, 10]), None);
        assert_eq!(layout.offsets, vec![128, 64, 0]);
        assert_eq!(layout.numel_unpadded, 228);
    }

    #[test]
    fn full_buckets_drop_their_end_padding() {
        // Buckets of 64: c (10) and b (70) fill the first (its unpadded length 64 + 70 = 134),
        // a (100) the second.
        let layout = dp_zero_layout(&params(&[100, 70, 10]), Some(64));
        assert_eq!(layout.offsets, vec![134, 64, 0]);
        assert_eq!(layout.numel_unpadded, 234);
    }

    #[test]
    fn a_shared_embedding_gets_a_bucket_of_its_own() {
        // The first stage of a pipeline: the layers' bucket is closed where the word embedding
        // (registered first) would start, at 64 + 30 aligned to 128, and that position counts as
        // the bucket's unpadded length.
        let mut first_stage = params(&[1000, 30, 20]);
        first_stage[0].shared_embedding = true;
        let layout = dp_zero_layout(&first_stage, None);
        assert_eq!(layout.offsets, vec![128, 64, 0]);
        assert_eq!(layout.numel_unpadded, 1128);
        // The last stage: the output layer (registered last) comes first and alone.
        let mut last_stage = params(&[30, 20, 1000]);
        last_stage[2].shared_embedding = true;
        let layout = dp_zero_layout(&last_stage, None);
        assert_eq!(layout.offsets, vec![1064, 1000, 0]);
        assert_eq!(layout.numel_unpadded, 1094);
    }
}
