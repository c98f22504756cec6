//! Context-parallel attention alone: CP ranks as threads, each holding its two chunks of the
//! queries, keys and values, give the causal attention of the whole sequence and its input
//! gradients (within 1e-5 in float32), for every exchange and group size, and with packed
//! sequences the attention of each document alone.

use std::time::Duration;

use megatron_models::layers::{ContextExchange, ContextParallel, PackedSequences};
use megatron_parallel::ThreadWorld;
use tch::{Device, Kind, Tensor};

/// `[b, n, s, d]` with 4 heads, so a2a can split them over 2 and 4 ranks.
const SHAPE: [i64; 4] = [2, 4, 32, 8];

/// Documents of the two sequences when packed: across chunk boundaries of every group size,
/// one of a single token, none aligned with the chunks of 4 ranks.
fn documents() -> Vec<Vec<i64>> {
    vec![vec![5, 11, 1, 15], vec![19, 13]]
}

struct Inputs {
    query: Tensor,
    key: Tensor,
    value: Tensor,
    /// Weights of the output in the scalar that is backpropagated.
    weights: Tensor,
}

/// The same inputs on every thread (tensors cannot be shared between them): values in
/// (−2, 2) from a fixed sequence of each tensor's own.
fn inputs(device: Device) -> Inputs {
    let numel: i64 = SHAPE.iter().product();
    let tensor = |seed: f32| {
        let values: Vec<f32> = (0..numel)
            .map(|i| 2.0 * ((i as f32 * 0.618_034 + seed).sin() * 43_758.547).fract())
            .collect();
        Tensor::from_slice(&values).view(SHAPE).to_device(device)
    };
    Inputs {
        query: tensor(0.1),
        key: tensor(0.2),
        value: tensor(0.3),
        weights: tensor(0.4),
    }
}

/// Output and the query, key and value gradients of `(attention · weights).sum()`.
fn attend_and_grads(
    inputs: &Inputs,
    take: impl Fn(&Tensor) -> Tensor,
    attend: impl FnOnce(&Tensor, &Tensor, &Tensor) -> anyhow::Result<Tensor>,
) -> anyhow::Result<[Tensor; 4]> {
    let leaf = |t: &Tensor| take(t).detach().set_requires_grad(true);
    let (query, key, value) = (leaf(&inputs.query), leaf(&inputs.key), leaf(&inputs.value));
    let output = attend(&query, &key, &value)?;
    (&output * take(&inputs.weights))
        .sum(Kind::Float)
        .backward();
    Ok([output.detach(), query.grad(), key.grad(), value.grad()])
}

/// Unpacked and packed, on the CPU.
fn check(exchange: ContextExchange, size: usize) {
    check_on(exchange, size, false, |_| Device::Cpu);
    check_on(exchange, size, true, |_| Device::Cpu);
}

/// Rank `r` computes on `device(r)`; the unsplit reference (causal, or with `packed` each
/// document alone) on rank 0's device.
fn check_on(
    exchange: ContextExchange,
    size: usize,
    packed: bool,
    device_of: impl Fn(usize) -> Device + Sync,
) {
    let device = device_of(0);
    let packing = |device: Device| {
        PackedSequences::from_lengths(&documents(), SHAPE[2])
            .unwrap()
            .map_tensors(&mut |t| t.to_device(device))
    };
    let reference = attend_and_grads(&inputs(device), Tensor::shallow_clone, |q, k, v| {
        if packed {
            return packing(device).attend(q, k, v, 0.0);
        }
        Ok(Tensor::scaled_dot_product_attention::<&Tensor>(
            q, k, v, None, 0.0, true, None, false,
        ))
    })
    .unwrap();
    let world = ThreadWorld::new(size, Duration::from_secs(60));
    let members: Vec<usize> = (0..size).collect();
    let ranks = world
        .run(|rank| {
            let device = device_of(rank);
            let context = ContextParallel::new(world.group("context", &members, rank)?, exchange);
            let chunks = if packed {
                context.with_documents(&packing(device))?
            } else {
                context.chunks()
            };
            let local = attend_and_grads(
                &inputs(device),
                |t| context.keep_local_chunks(t, 2).unwrap(),
                |q, k, v| chunks.attend(q, k, v, 0.0),
            )?;
            let positions = context.positions(SHAPE[2] / size as i64, device);
            Ok((local, positions))
        })
        .unwrap();
    for (rank, (local, positions)) in ranks.iter().enumerate() {
        let expected = reference
            .each_ref()
            .map(|t| t.index_select(2, &positions.to_device(device)));
        for (what, (got, want)) in ["output", "query grad", "key grad", "value grad"]
            .iter()
            .zip(local.iter().zip(expected))
        {
            let diff = (got.to_device(device) - want).abs().max().double_value(&[]);
            assert!(
                diff <= 1e-5,
                "{exchange:?} CP={size} packed={packed} rank {rank}: {what} differs by {diff:e}"
            );
        }
    }
}

#[test]
fn ring_attention_equals_the_unsplit_attention() {
    check(ContextExchange::Ring, 2);
    check(ContextExchange::Ring, 4);
}

#[test]
fn gathered_attention_equals_the_unsplit_attention() {
    check(ContextExchange::AllGather, 2);
    check(ContextExchange::AllGather, 4);
}

#[test]
fn all_to_all_attention_equals_the_unsplit_attention() {
    check(ContextExchange::AllToAll, 2);
    check(ContextExchange::AllToAll, 4);
}

/// `a2a+p2p` over 4 ranks: all-to-all within pairs and a ring of 2 across them, or the whole
/// group as one all-to-all level (a ring of one).
#[test]
fn hierarchical_attention_equals_the_unsplit_attention() {
    check(ContextExchange::AllToAllThenRing { a2a_size: 2 }, 4);
    check(ContextExchange::AllToAllThenRing { a2a_size: 4 }, 4);
}

/// On GPUs, one per rank (libtorch runs a device's backward nodes on one worker thread for the
/// whole process, so two ranks sharing a GPU would wait for each other there): the fused
/// attention of `allgather` and `a2a` under a mask, and the float32 blocks of `p2p` (and of
/// `a2a+p2p`'s ring), against the fused causal kernel, and packed against each document's.
/// Runs where there are at least two GPUs (CP=4 with four).
#[test]
fn every_exchange_on_gpus_equals_the_unsplit_attention() {
    let gpus = tch::Cuda::device_count() as usize;
    if gpus < 2 {
        eprintln!("skipped: needs 2 GPUs");
        return;
    }
    for exchange in [
        ContextExchange::Ring,
        ContextExchange::AllGather,
        ContextExchange::AllToAll,
        ContextExchange::AllToAllThenRing { a2a_size: 2 },
    ] {
        for size in [2, 4].into_iter().filter(|&size| size <= gpus) {
            for packed in [false, true] {
                check_on(exchange, size, packed, Device::Cuda);
            }
        }
    }
}

#[test]
fn heads_not_divisible_by_the_group_are_refused() {
    let world = ThreadWorld::new(4, Duration::from_secs(60));
    let error = world
        .run(|rank| {
            let context = ContextParallel::new(
                world.group("context", &[0, 1, 2, 3], rank)?,
                ContextExchange::AllToAll,
            );
            let x = Tensor::zeros([1, 2, 8, 4], (Kind::Float, Device::Cpu));
            context.chunks().attend(&x, &x, &x, 0.0)
        })
        .err()
        .expect("refused");
    assert!(
        format!("{error:#}")
            .contains("the 2 attention heads of a tensor-parallel rank are not divisible by 4"),
        "{error:#}"
    );
}
