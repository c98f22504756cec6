//! The paged decode attention kernel: on a GPU it equals the gathered path (each
//! row's window of slots gathered, libtorch's attention under a mask) on random pools with rows
//! of 1 to 2,000 positions, several batch sizes, grouped-query heads, head dims 64 and 128, in
//! fp32, bf16 and fp16, the new position's keys and values stored by both (by the kernel itself,
//! from a strided view, as it attends).

use megatron_kernels::ops::paged_attention::{self};
use megatron_models::layers::{PagedStep, BLOCK_SIZE};
use tch::{Device, Kind, Tensor};

/// A small deterministic generator for the test's layout (lengths and block order).
struct Lcg(u64);

impl Lcg {
    fn below(&mut self, n: u64) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (self.0 >> 33) % n
    }
}

/// One random case: `rows` rows of 1..=2000 positions (the last one new) over shuffled blocks
/// of a pool, attended by both paths; the largest difference of their outputs beyond
/// `relative` times the expected value.
fn largest_difference(
    rows: usize,
    heads: i64,
    groups: i64,
    d: i64,
    kind: Kind,
    relative: f64,
    random: &mut Lcg,
) -> f64 {
    let device = Device::Cuda(0);
    let lengths: Vec<i64> = (0..rows)
        .map(|r| {
            if r == 0 {
                2000
            } else if r == 1 {
                1
            } else {
                1 + random.below(2000) as i64
            }
        })
        .take(rows)
        .collect();
    let needs: Vec<i64> = lengths
        .iter()
        .map(|l| (l + BLOCK_SIZE - 1) / BLOCK_SIZE)
        .collect();
    let total: i64 = needs.iter().sum::<i64>() + 1;
    // Blocks 1.. in a shuffled order (block 0 pads the tables).
    let mut order: Vec<i64> = (1..total).collect();
    for i in (1..order.len()).rev() {
        order.swap(i, random.below(i as u64 + 1) as usize);
    }
    let per_row = *needs.iter().max().unwrap();
    let window = per_row * BLOCK_SIZE;
    let mut tables = vec![0i64; rows * per_row as usize];
    let mut next = order.into_iter();
    for (r, &need) in needs.iter().enumerate() {
        for b in 0..need as usize {
            tables[r * per_row as usize + b] = next.next().unwrap();
        }
    }
    let slot = |r: usize, p: i64| {
        tables[r * per_row as usize + (p / BLOCK_SIZE) as usize] * BLOCK_SIZE + p % BLOCK_SIZE
    };
    let write: Vec<i64> = (0..rows).map(|r| slot(r, lengths[r] - 1)).collect();
    let read: Vec<i64> = (0..rows)
        .flat_map(|r| (0..window).map(move |p| (r, p)))
        .map(|(r, p)| slot(r, p))
        .collect();
    let positions: Vec<i64> = lengths.iter().map(|l| l - 1).collect();
    let on = |v: &[i64]| Tensor::from_slice(v).to_device(device);
    let b = rows as i64;
    let pool =
        Tensor::randn([total * BLOCK_SIZE, groups, 2 * d], (Kind::Float, device)).to_kind(kind);
    // A strided view, as the query is a slice of the QKV projection `[s, b, ..., d]`.
    let query = Tensor::randn([1, b, 2 * heads, d], (Kind::Float, device))
        .to_kind(kind)
        .narrow(2, heads, heads)
        .permute([1, 2, 0, 3]);
    // Also a strided view: the kernel reads the new keys and values in place and stores them.
    let kv = Tensor::randn([b, groups, 1, 3 * d], (Kind::Float, device))
        .to_kind(kind)
        .narrow(3, d, 2 * d);
    let expand = |t: Tensor| t.repeat_interleave_self_int(heads / groups, 1, None);

    let gathered = PagedStep::new(
        on(&write),
        on(&read).view([b, window]),
        &on(&positions).view([b, 1]),
        kind,
    );
    let mut gathered_pool = pool.copy();
    let want = gathered
        .attend(&mut gathered_pool, &query, &kv, expand)
        .unwrap();
    let in_place =
        PagedStep::decode_in_place(on(&write), on(&tables).view([b, per_row]), on(&positions));
    let mut kernel_pool = pool.copy();
    let got = in_place
        .attend(&mut kernel_pool, &query, &kv, |t| t)
        .unwrap();
    assert_eq!(got.size(), want.size());
    assert!(
        kernel_pool.equal(&gathered_pool),
        "both paths store the new keys and values alike"
    );
    // Beyond `relative` of the expected magnitude: the two round their float results to the
    // same 16-bit format, a unit in the last place apart at most.
    let (got, want) = (got.to_kind(Kind::Float), want.to_kind(Kind::Float));
    ((got - &want).abs() - want.abs() * relative)
        .max()
        .double_value(&[])
}

#[test]
fn the_paged_decode_kernel_equals_gathered_attention_on_a_gpu() {
    if !tch::Cuda::is_available() {
        eprintln!("skipped: no CUDA device");
        return;
    }
    let mut random = Lcg(7);
    // (absolute, relative): bf16 keeps 8 significant bits, fp16 11.
    for (kind, tolerance, relative) in [
        (Kind::Float, 1e-4, 1e-4),
        (Kind::BFloat16, 1e-2, 2.0 / 128.0),
        (Kind::Half, 2e-3, 2.0 / 1024.0),
    ] {
        for d in [64, 128] {
            for (heads, groups) in [(4, 4), (8, 2)] {
                for rows in [1, 3, 17, 64] {
                    let difference =
                        largest_difference(rows, heads, groups, d, kind, relative, &mut random);
                    assert!(
                        difference <= tolerance,
                        "{kind:?}, head dim {d}, {heads} heads in {groups} groups, {rows} rows: \
                         outputs differ by {difference} beyond {relative} of their size"
                    );
                }
            }
        }
    }
    // The self-check the decoder runs before it relies on the kernel passes.
    for kind in [Kind::Float, Kind::BFloat16, Kind::Half] {
        for d in [64, 128] {
            paged_attention::self_check(0, kind, d).unwrap();
        }
    }
    // Shapes it has no kernel for are turned away with a message.
    assert!(!paged_attention::supports(96, Kind::BFloat16));
    let query = Tensor::zeros([1, 4, 96], (Kind::BFloat16, Device::Cuda(0)));
    let mut pool = Tensor::zeros([32, 4, 192], (Kind::BFloat16, Device::Cuda(0)));
    let tables = Tensor::ones([1, 1], (Kind::Int64, Device::Cuda(0)));
    let positions = Tensor::zeros([1], (Kind::Int64, Device::Cuda(0)));
    let error =
        paged_attention::paged_decode_attention(&query, &mut pool, &tables, &positions, None)
            .unwrap_err()
            .to_string();
    assert!(error.contains("head dim 96"), "{error}");
}
