//! The fused decode attention kernel (norm + QKV projection + KV store + attention of a decode
//! step as one kernel, a cluster of blocks per key/value group): on a Hopper GPU it equals
//! the same layer in libtorch's operations on shuffled blocks of a pool with rows of 1 to 2,000
//! positions, 1 to 8 rows, grouped-query heads, head dims 64 and 128, LayerNorm and RMSNorm, in
//! fp32, bf16 and fp16, and a row's result is the same bits alone and beside other rows.

use megatron_kernels::ops::decode_attention::{
    self, decode_qkv_attention, reference, AttentionShape, CacheStep, SOURCE,
};
use megatron_kernels::ops::decode_gemv::{self, InputNorm};
use megatron_models::config::Normalization;
use megatron_models::layers::BLOCK_SIZE;
use tch::{Device, Kind, Tensor};

/// A layer's weights and a pool whose blocks are shuffled among rows of the given lengths.
struct Case {
    input: Tensor,
    weight: Tensor,
    bias: Tensor,
    gamma: Tensor,
    beta: Tensor,
    norm: Normalization,
    pool: Tensor,
    tables: Tensor,
    positions: Tensor,
    write_slots: Tensor,
    heads: i64,
}

impl Case {
    fn new(lengths: &[i64], shape: (i64, i64, i64, i64), norm: Normalization, kind: Kind) -> Case {
        let (heads, groups, d, hidden) = shape;
        let device = Device::Cuda(0);
        let random = |shape: &[i64], scale: f64| {
            (Tensor::randn(shape, (Kind::Float, device)) * scale).to_kind(kind)
        };
        let needs: Vec<i64> = lengths.iter().map(|l| l / BLOCK_SIZE + 1).collect();
        let total: i64 = needs.iter().sum::<i64>() + 1;
        let per_row = *needs.iter().max().unwrap();
        // Blocks 1.. in a random order (block 0 pads the tables).
        let order =
            Vec::<i64>::try_from(Tensor::randperm(total - 1, (Kind::Int64, Device::Cpu)) + 1)
                .unwrap();
        let mut next = order.into_iter();
        let mut tables = vec![0i64; lengths.len() * per_row as usize];
        for (r, &need) in needs.iter().enumerate() {
            for b in 0..need as usize {
                tables[r * per_row as usize + b] = next.next().unwrap();
            }
        }
        let write: Vec<i64> = lengths
            .iter()
            .enumerate()
            .map(|(r, &l)| {
                let p = l - 1;
                tables[r * per_row as usize + (p / BLOCK_SIZE) as usize] * BLOCK_SIZE
                    + p % BLOCK_SIZE
            })
            .collect();
        let on = |v: &[i64]| Tensor::from_slice(v).to_device(device);
        let rows = lengths.len() as i64;
        let width = (heads / groups + 2) * d;
        Case {
            input: random(&[rows, hidden], 1.0) + 0.5,
            weight: random(&[groups * width, hidden], 1.0 / (hidden as f64).sqrt()),
            bias: random(&[groups * width], 0.1),
            gamma: random(&[hidden], 0.2) + 1.0,
            beta: random(&[hidden], 0.1),
            norm,
            pool: random(&[total * BLOCK_SIZE, groups, 2 * d], 1.0),
            tables: on(&tables).view([rows, per_row]),
            positions: on(&lengths.iter().map(|l| l - 1).collect::<Vec<_>>()),
            write_slots: on(&write),
            heads,
        }
    }

    fn input_norm(&self) -> InputNorm<'_> {
        InputNorm {
            kind: self.norm,
            weight: &self.gamma,
            bias: (self.norm == Normalization::LayerNorm).then_some(&self.beta),
            eps: 1e-5,
            one_plus: false,
        }
    }

    /// The kernel's context and the pool after it.
    fn kernel(&self, rows: std::ops::Range<i64>) -> (Tensor, Tensor) {
        let mut pool = self.pool.copy();
        let count = rows.end - rows.start;
        let context = decode_qkv_attention(
            &self.input.narrow(0, rows.start, count),
            &self.weight,
            Some(&self.bias),
            &self.input_norm(),
            CacheStep {
                pool: &mut pool,
                tables: &self.tables.narrow(0, rows.start, count),
                positions: &self.positions.narrow(0, rows.start, count),
                write_slots: &self.write_slots.narrow(0, rows.start, count),
            },
            self.heads,
        )
        .unwrap();
        (context, pool)
    }

    /// libtorch's context (float32) and the pool after it.
    fn reference(&self) -> (Tensor, Tensor) {
        let mut pool = self.pool.copy();
        let context = reference(
            &self.input,
            &self.weight,
            Some(&self.bias),
            &self.input_norm(),
            CacheStep {
                pool: &mut pool,
                tables: &self.tables,
                positions: &self.positions,
                write_slots: &self.write_slots,
            },
            self.heads,
        )
        .unwrap();
        (context, pool)
    }
}

fn on_hopper() -> bool {
    if !tch::Cuda::is_available() {
        eprintln!("skipped: no CUDA device");
        return false;
    }
    let module = megatron_kernels::runtime::nvrtc::kernels(&SOURCE, 0).unwrap();
    if !module.has_clusters() {
        eprintln!("skipped: the GPU has no thread-block clusters (before Hopper)");
        return false;
    }
    true
}

const LENGTHS: [i64; 8] = [2000, 1, 37, 500, 129, 16, 17, 999];

#[test]
fn the_fused_decode_attention_kernel_equals_libtorchs_layer_on_a_gpu() {
    if !on_hopper() {
        return;
    }
    tch::manual_seed(11);
    // (heads, groups, head dim, hidden): GPT-345M's layer (16-bit only: its fp32 weight slice
    // does not fit beside other kernels), grouped queries with both head dims.
    let shapes = [
        (16, 16, 64, 1024),
        (8, 2, 64, 128),
        (2, 1, 128, 128),
        (4, 4, 128, 192),
    ];
    for kind in [Kind::Float, Kind::BFloat16, Kind::Half] {
        let (absolute, relative) = decode_gemv::tolerance(kind);
        for shape in shapes {
            if kind == Kind::Float && shape.3 == 1024 {
                continue;
            }
            for rows in [1usize, 2, 3, 5, 8] {
                for norm in [Normalization::LayerNorm, Normalization::RMSNorm] {
                    let case = Case::new(&LENGTHS[..rows], shape, norm, kind);
                    let (heads, groups, d, hidden) = shape;
                    let usable = decode_attention::usable(
                        Device::Cuda(0),
                        kind,
                        &AttentionShape {
                            rows: rows as i64,
                            hidden,
                            heads,
                            groups,
                            head_dim: d,
                        },
                    );
                    assert!(
                        usable,
                        "{kind:?} {shape:?} {rows} rows: the kernel is not used"
                    );
                    let (got, got_pool) = case.kernel(0..rows as i64);
                    let (want, want_pool) = case.reference();
                    let stored =
                        decode_gemv::excess_difference(&got_pool, &want_pool, absolute, relative);
                    assert_eq!(
                        stored, 0.0,
                        "{kind:?} {shape:?} {rows} rows {norm:?}: stored keys and values"
                    );
                    let excess = decode_gemv::excess_difference(
                        &got,
                        &want,
                        decode_attention::tolerance(kind) / 2.0,
                        relative,
                    );
                    assert_eq!(
                        excess, 0.0,
                        "{kind:?} {shape:?} {rows} rows {norm:?}: the context is off"
                    );
                }
            }
        }
    }
    for kind in [Kind::Float, Kind::BFloat16, Kind::Half] {
        for d in [64, 128] {
            decode_attention::self_check(0, kind, d).unwrap();
        }
    }
}

#[test]
fn a_row_of_the_fused_decode_attention_is_the_same_alone_and_batched_on_a_gpu() {
    if !on_hopper() {
        return;
    }
    tch::manual_seed(12);
    for kind in [Kind::BFloat16, Kind::Float] {
        let case = Case::new(&LENGTHS, (8, 2, 64, 128), Normalization::LayerNorm, kind);
        let (batched, batched_pool) = case.kernel(0..8);
        for row in [0, 3, 7] {
            let (alone, _) = case.kernel(row..row + 1);
            assert!(
                alone.equal(&batched.narrow(0, row, 1)),
                "{kind:?}: row {row} alone differs from the same row in a batch of 8"
            );
        }
        // Batches of 3 and 5 rows use other kernels than 8; each row is still the same.
        let (first, _) = case.kernel(0..3);
        let (rest, _) = case.kernel(3..8);
        assert!(
            Tensor::cat(&[first, rest], 0).equal(&batched),
            "{kind:?}: 3 + 5 rows"
        );
        // Stored keys and values: the new slots changed, nothing else.
        let changed = batched_pool
            .ne_tensor(&case.pool)
            .any_dim(2, false)
            .any_dim(1, false);
        let slots =
            Vec::<i64>::try_from(changed.nonzero().view([-1]).to_device(Device::Cpu)).unwrap();
        let mut written = Vec::<i64>::try_from(case.write_slots.to_device(Device::Cpu)).unwrap();
        written.sort_unstable();
        assert_eq!(
            slots, written,
            "{kind:?}: only the new positions' slots are written"
        );
    }
}

#[test]
fn shapes_the_fused_decode_attention_cannot_serve_are_turned_down() {
    let cpu = AttentionShape {
        rows: 1,
        hidden: 1024,
        heads: 16,
        groups: 16,
        head_dim: 64,
    };
    assert!(!decode_attention::usable(Device::Cpu, Kind::BFloat16, &cpu));
    if !on_hopper() {
        return;
    }
    let cuda = Device::Cuda(0);
    assert!(decode_attention::usable(cuda, Kind::BFloat16, &cpu));
    for shape in [
        // Head dim 96: no kernel.
        AttentionShape {
            head_dim: 96,
            ..cpu
        },
        // More rows than the decode kernels take.
        AttentionShape { rows: 9, ..cpu },
        // A weight slice too large for a third of a multiprocessor's shared memory.
        AttentionShape {
            hidden: 8192,
            heads: 64,
            groups: 64,
            head_dim: 128,
            ..cpu
        },
    ] {
        assert!(
            !decode_attention::usable(cuda, Kind::BFloat16, &shape),
            "{shape:?}"
        );
    }
}
