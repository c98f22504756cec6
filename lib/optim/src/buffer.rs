//! Where parameters live in the contiguous buffers that data-parallel communication and the
//! distributed optimizer work on (Megatron's `ParamAndGradBuffer`): parameters are laid out in
//! reverse order (the order backward produces their gradients), grouped into buckets that each
//! start at a parameter boundary and are padded to a multiple of the data-parallel size, so
//! each data-parallel rank owns an equal contiguous slice (its shard) of every bucket.
//! Routed experts' parameters (Mixture-of-Experts layers) lie in buckets of their own, reduced
//! and sharded over the expert-data-parallel group instead (Megatron's expert buffers).

use std::ops::Range;

use megatron_models::{NamedParameter, ParamAttributes};

use super::groups::ParamGroup;

/// Alignment of every bucket's shard, in elements (keeps shards 256-byte aligned in fp32).
const SHARD_ALIGNMENT: usize = 64;

/// Alignment of every parameter's start, in elements, as Megatron pads its buffers: cuBLASLt's
/// Hopper GEMMs need 16-byte aligned operands, and one odd-sized parameter (BERT's two-class
/// head) used to shift every later gradient view off that, sending the fused weight-gradient
/// GEMMs to slow Ampere kernels.
const PARAM_ALIGNMENT: usize = 64;

/// One parameter's place in the buffers.
#[derive(Debug, Clone)]
pub struct Slot {
    pub name: String,
    pub shape: Vec<i64>,
    pub range: Range<usize>,
    /// Index into [`BufferLayout::buckets`] of the bucket holding it.
    pub bucket: usize,
    pub group: ParamGroup,
    pub attributes: ParamAttributes,
}

/// A part of this rank's shard that belongs to one parameter.
#[derive(Debug, Clone)]
pub struct Segment {
    /// Index into [`BufferLayout::slots`].
    pub slot: usize,
    /// Where the segment lies in the full buffer.
    pub buffer: Range<usize>,
    /// Where it lies in the concatenation of this rank's shards.
    pub shard: Range<usize>,
}

#[derive(Debug, Clone)]
pub struct Bucket {
    pub range: Range<usize>,
    /// Holds routed experts' parameters: its group is the expert-data-parallel one.
    pub expert: bool,
    /// This rank's slice of the bucket.
    pub shard: Range<usize>,
}

#[derive(Debug, Clone)]
pub struct BufferLayout {
    pub slots: Vec<Slot>,
    pub buckets: Vec<Bucket>,
    pub len: usize,
    /// Total length of this rank's shards.
    pub shard_len: usize,
    pub segments: Vec<Segment>,
}

/// A parameter as the layout sees it.
pub struct ParamShape<'a> {
    pub name: &'a str,
    pub shape: Vec<i64>,
    pub attributes: ParamAttributes,
}

impl<'a> ParamShape<'a> {
    /// The layout's view of each of `parameters`.
    pub fn of_all(parameters: &'a [NamedParameter]) -> Vec<ParamShape<'a>> {
        parameters
            .iter()
            .map(|p| ParamShape {
                name: &p.name,
                shape: p.tensor.size(),
                attributes: p.attributes,
            })
            .collect()
    }
}

/// A rank's place in the group a bucket is reduced and sharded over.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ShardGroup {
    pub rank: usize,
    pub size: usize,
}

impl BufferLayout {
    /// Lays out `params` (in model order) for data-parallel rank `rank` of `size`; buckets hold
    /// at least `bucket_size` elements (the last may hold fewer). With `sharded` false every
    /// rank's shard is the whole bucket (the non-distributed optimizer).
    pub fn new(
        params: &[ParamShape],
        bucket_size: usize,
        rank: usize,
        size: usize,
        sharded: bool,
    ) -> Self {
        let group = ShardGroup { rank, size };
        Self::with_experts(params, bucket_size, group, group, sharded)
    }

    /// [`new`](Self::new) with the routed experts' parameters in buckets of their own, sharded
    /// over `experts` (this rank's place in the expert-data-parallel group) rather than `data`.
    pub fn with_experts(
        params: &[ParamShape],
        bucket_size: usize,
        data: ShardGroup,
        experts: ShardGroup,
        sharded: bool,
    ) -> Self {
        let group_of = |expert: bool| if expert { experts } else { data };
        let mut slots = Vec::with_capacity(params.len());
        let mut buckets = Vec::new();
        let mut offset = 0;
        let mut bucket_start = 0;
        let mut expert_bucket = false;
        let pad = |len: usize, expert: bool| {
            let multiple = if sharded {
                group_of(expert).size * SHARD_ALIGNMENT
            } else {
                1
            };
            len.div_ceil(multiple) * multiple
        };
        let close = |offset: &mut usize,
                     bucket_start: &mut usize,
                     expert: bool,
                     buckets: &mut Vec<Bucket>| {
            let end = *bucket_start + pad(*offset - *bucket_start, expert);
            buckets.push(Bucket {
                range: *bucket_start..end,
                expert,
                shard: 0..0,
            });
            *offset = end;
            *bucket_start = end;
        };
        for (i, param) in params.iter().enumerate().rev() {
            let expert = param.attributes.expert;
            if expert != expert_bucket && offset > bucket_start {
                close(&mut offset, &mut bucket_start, expert_bucket, &mut buckets);
            }
            expert_bucket = expert;
            let numel = param.shape.iter().product::<i64>() as usize;
            // The two stages' copies of tied embeddings are summed after the data-parallel
            // reduction; in a bucket of their own both copies are sharded alike (Megatron
            // does the same with the distributed optimizer).
            let alone = sharded && param.attributes.tied_across_stages;
            if alone && offset > bucket_start {
                close(&mut offset, &mut bucket_start, expert, &mut buckets);
            }
            offset = offset.next_multiple_of(PARAM_ALIGNMENT);
            slots.push(Slot {
                name: param.name.to_string(),
                shape: param.shape.clone(),
                range: offset..offset + numel,
                bucket: buckets.len(),
                group: ParamGroup::of(param.name, &param.shape),
                attributes: param.attributes,
            });
            offset += numel;
            if alone || offset - bucket_start >= bucket_size || i == 0 {
                close(&mut offset, &mut bucket_start, expert, &mut buckets);
            }
        }
        for bucket in &mut buckets {
            let group = group_of(bucket.expert);
            let width = if sharded {
                bucket.range.len() / group.size
            } else {
                bucket.range.len()
            };
            let start = bucket.range.start + if sharded { group.rank * width } else { 0 };
            bucket.shard = start..start + width;
        }
        let mut segments = Vec::new();
        let mut shard_offset = 0;
        for bucket in &buckets {
            for (index, slot) in slots.iter().enumerate() {
                let start = slot.range.start.max(bucket.shard.start);
                let end = slot.range.end.min(bucket.shard.end);
                if start < end {
                    let in_shard = shard_offset + (start - bucket.shard.start);
                    segments.push(Segment {
                        slot: index,
                        buffer: start..end,
                        shard: in_shard..in_shard + (end - start),
                    });
                }
            }
            shard_offset += bucket.shard.len();
        }
        BufferLayout {
            slots,
            buckets,
            len: offset,
            shard_len: shard_offset,
            segments,
        }
    }

    /// The slot of the parameter `name`.
    pub fn slot(&self, name: &str) -> Option<&Slot> {
        self.slots.iter().find(|s| s.name == name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params() -> Vec<ParamShape<'static>> {
        [
            ("a.weight", vec![10, 10]),
            ("a.bias", vec![10]),
            ("b.weight", vec![300]),
            ("c.weight", vec![7, 3]),
        ]
        .into_iter()
        .map(|(name, shape)| ParamShape {
            name,
            shape,
            attributes: ParamAttributes::default(),
        })
        .collect()
    }

    #[test]
    fn reverse_order_buckets_at_parameter_boundaries() {
        let layout = BufferLayout::new(&params(), 250, 0, 1, false);
        let order: Vec<&str> = layout.slots.iter().map(|s| s.name.as_str()).collect();
        assert_eq!(order, ["c.weight", "b.weight", "a.bias", "a.weight"]);
        // Every parameter starts 64-element aligned: c at 0 (21), b at 64 (300) reach 250 →
        // first bucket; a.bias at 384 and a.weight at 448 form the second.
        let starts: Vec<usize> = layout.slots.iter().map(|s| s.range.start).collect();
        assert_eq!(starts, [0, 64, 384, 448]);
        assert_eq!(
            layout
                .buckets
                .iter()
                .map(|b| b.range.clone())
                .collect::<Vec<_>>(),
            [0..364, 364..548]
        );
        assert_eq!(layout.shard_len, 548);
        assert_eq!(layout.segments.len(), 4);
        assert_eq!(layout.slot("a.bias").unwrap().group, ParamGroup::NotDecayed);
    }

    #[test]
    fn shards_split_every_bucket_evenly_and_cover_each_parameter_once() {
        let size = 2;
        let layouts: Vec<BufferLayout> = (0..size)
            .map(|rank| BufferLayout::new(&params(), 250, rank, size, true))
            .collect();
        for layout in &layouts {
            for slot in &layout.slots {
                assert!(layout.buckets[slot.bucket]
                    .range
                    .contains(&slot.range.start));
            }
            for bucket in &layout.buckets {
                assert_eq!(bucket.range.len() % (size * SHARD_ALIGNMENT), 0);
                assert_eq!(bucket.shard.len() * size, bucket.range.len());
            }
        }
        let mut covered = vec![0; layouts[0].len];
        for layout in &layouts {
            for segment in &layout.segments {
                let slot = &layout.slots[segment.slot];
                assert!(
                    slot.range.start <= segment.buffer.start
                        && segment.buffer.end <= slot.range.end
                );
                assert_eq!(segment.buffer.len(), segment.shard.len());
                covered[segment.buffer.clone()]
                    .iter_mut()
                    .for_each(|c| *c += 1);
            }
        }
        for slot in &layouts[0].slots {
            assert!(
                covered[slot.range.clone()].iter().all(|&c| c == 1),
                "{} covered unevenly",
                slot.name
            );
        }
    }

    /// Experts' parameters (here b and c, between ordinary ones) lie in buckets of their own,
    /// sharded over the expert-data-parallel group, the others over the data-parallel group.
    #[test]
    fn expert_parameters_get_buckets_sharded_over_their_own_group() {
        let mut params = params();
        params[2].attributes.expert = true;
        params[3].attributes.expert = true;
        let data = ShardGroup { rank: 1, size: 4 };
        let experts = ShardGroup { rank: 0, size: 2 };
        let layout = BufferLayout::with_experts(&params, 10_000, data, experts, true);
        let kinds: Vec<bool> = layout.buckets.iter().map(|b| b.expert).collect();
        assert_eq!(kinds, [true, false]);
        for slot in &layout.slots {
            assert_eq!(
                layout.buckets[slot.bucket].expert, slot.attributes.expert,
                "{}",
                slot.name
            );
        }
        let (expert, dense) = (&layout.buckets[0], &layout.buckets[1]);
        assert_eq!(expert.range.len() % (2 * SHARD_ALIGNMENT), 0);
        assert_eq!(expert.shard.len() * 2, expert.range.len());
        assert_eq!(expert.shard.start, expert.range.start);
        assert_eq!(dense.range.len() % (4 * SHARD_ALIGNMENT), 0);
        assert_eq!(dense.shard.len() * 4, dense.range.len());
        assert_eq!(dense.shard.start, dense.range.start + dense.shard.len());
    }

    #[test]
    fn tied_embeddings_get_a_bucket_of_their_own_when_sharded() {
        let mut params = params();
        params[2].attributes.tied_across_stages = true;
        let layout = BufferLayout::new(&params, 10_000, 1, 2, true);
        let b = layout.slot("b.weight").unwrap();
        let alone: Vec<&Bucket> = layout
            .buckets
            .iter()
            .filter(|k| k.range.start <= b.range.start && b.range.end <= k.range.end)
            .collect();
        assert_eq!(alone.len(), 1);
        assert_eq!(
            alone[0].range.start, b.range.start,
            "b.weight starts its bucket"
        );
        assert_eq!(
            alone[0].range.len(),
            300usize.div_ceil(2 * SHARD_ALIGNMENT) * 2 * SHARD_ALIGNMENT
        );
        assert_eq!(layout.buckets.len(), 3);
        // Unsharded, the big bucket size keeps everything together.
        assert_eq!(
            BufferLayout::new(&params, 10_000, 1, 2, false)
                .buckets
                .len(),
            1
        );
    }
}
