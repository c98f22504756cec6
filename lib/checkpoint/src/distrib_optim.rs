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

/// The gradient buffer as the distributed optimizer pads it: each parameter's range (in the
/// order given) and the buckets, each split evenly over the data-parallel ranks
/// (`_ParamAndGradBuffer` of core_v0.14.0 with `--use-distributed-optimizer`: parameters start
/// at multiples of 64, buckets end at multiples of lcm(data-parallel size, 128)).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShardedBuffer {
    pub ranges: Vec<std::ops::Range<usize>>,
    /// The bucket of each parameter.
    pub bucket_of: Vec<usize>,
    pub buckets: Vec<std::ops::Range<usize>>,
    pub data_parallel: usize,
}

impl ShardedBuffer {
    pub fn new(params: &[BufferParam], bucket_size: Option<usize>, data_parallel: usize) -> Self {
        let divisor = lcm(data_parallel.max(1), 128);
        let pad = |index: usize| index.div_ceil(divisor) * divisor;
        let mut ranges = vec![0..0; params.len()];
        let mut bucket_of = vec![0; params.len()];
        let mut buckets = Vec::new();
        let (mut start, mut bucket_start, mut open) = (0, 0, false);
        for (index, param) in params.iter().enumerate().rev() {
            start = align(start);
            if param.shared_embedding && open {
                let end = pad(start);
                buckets.push(bucket_start..end);
                (bucket_start, start) = (end, end);
            }
            let end = start + param.numel;
            ranges[index] = start..end;
            bucket_of[index] = buckets.len();
            open = true;
            if bucket_size.is_some_and(|size| end - bucket_start >= size) || param.shared_embedding
            {
                let padded = pad(end);
                buckets.push(bucket_start..padded);
                (bucket_start, start, open) = (padded, padded, false);
            } else {
                start = end;
            }
        }
        if open {
            buckets.push(bucket_start..pad(start));
        }
        ShardedBuffer {
            ranges,
            bucket_of,
            buckets,
            data_parallel: data_parallel.max(1),
        }
    }

    /// The part of parameter `index` each data-parallel rank owns: `(rank, range within the
    /// flattened parameter)`, empty parts left out.
    pub fn owned_parts(&self, index: usize) -> Vec<(usize, std::ops::Range<usize>)> {
        let range = &self.ranges[index];
        let bucket = &self.buckets[self.bucket_of[index]];
        let width = bucket.len() / self.data_parallel;
        (0..self.data_parallel)
            .filter_map(|rank| {
                let from = range.start.max(bucket.start + rank * width);
                let to = range.end.min(bucket.start + (rank + 1) * width);
                (from < to).then(|| (rank, from - range.start..to - range.start))
            })
            .collect()
    }
}

fn lcm(a: usize, b: usize) -> usize {
    let gcd = |mut x: usize, mut y: usize| {
        while y != 0 {
            (x, y) = (y, x % y);
        }
        x
    };
    a / gcd(a, b) * b
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

    /// Two data-parallel ranks over a bucket padded to 128: the parameter registered first
    /// (laid out last) is cut where the second rank's half begins; each rank's parts tile it.
    #[test]
    fn sharded_buffer_splits_buckets_evenly_between_ranks() {
        let buffer = ShardedBuffer::new(&params(&[100, 64, 10]), None, 2);
        assert_eq!(buffer.ranges, vec![128..228, 64..128, 0..10]);
        assert_eq!(buffer.buckets, vec![0..256]);
        assert_eq!(buffer.owned_parts(0), vec![(1, 0..100)]);
        assert_eq!(buffer.owned_parts(2), vec![(0, 0..10)]);
        let buffer = ShardedBuffer::new(&params(&[300, 10]), None, 2);
        assert_eq!(buffer.buckets, vec![0..384]);
        assert_eq!(buffer.owned_parts(0), vec![(0, 0..128), (1, 128..300)]);
        // A data-parallel size of 3 pads buckets to lcm(3, 128) = 384.
        let buffer = ShardedBuffer::new(&params(&[10]), None, 3);
        assert_eq!(buffer.buckets, vec![0..384]);
        assert_eq!(buffer.owned_parts(0), vec![(0, 0..10)]);
    }
}
