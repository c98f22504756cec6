//! The NCCL backend on two GPUs gives what the ranks-as-threads backend gives on the CPU for
//! the same calls. Needs two CUDA devices and NCCL loadable (`source scripts/torch-env.sh`);
//! elsewhere it is skipped.

use std::sync::mpsc;
use std::time::Duration;

use anyhow::Result;
use megatron_parallel::{Communicator, NcclCommunicator, P2pOp, ReduceOp, ThreadWorld};
use tch::{Cuda, Device, Kind, Tensor};

const WORLD: usize = 2;

/// Small integers (exact in bf16, and in their sums), different on every rank and call.
fn input(rank: usize, shape: &[i64], kind: Kind, salt: i64) -> Tensor {
    let n: i64 = shape.iter().product();
    let values = Tensor::arange(n, (Kind::Int64, Device::Cpu)) * (3 + salt) + 7 * rank as i64;
    ((values + salt).remainder(23) - 11)
        .to_kind(kind)
        .reshape(shape)
}

/// Every collective, each result named; run by every rank of `comm`.
fn exercise(comm: &dyn Communicator, device: Device) -> Result<Vec<(String, Tensor)>> {
    let rank = comm.rank();
    let on = |t: Tensor| t.to_device(device);
    let mut results = Vec::new();
    for kind in [Kind::Float, Kind::BFloat16] {
        for op in [ReduceOp::Sum, ReduceOp::Max] {
            let x = on(input(rank, &[4, 6], kind, 0));
            comm.all_reduce(&x, op)?;
            results.push((format!("all_reduce {op:?} {kind:?}"), x));
            // A transposed view: reduced through a contiguous copy and written back.
            let t = on(input(rank, &[6, 4], kind, 1)).transpose(0, 1);
            comm.all_reduce(&t, op)?;
            results.push((format!("all_reduce {op:?} {kind:?} non-contiguous"), t));
        }
        for dim in [0, 1] {
            let x = on(input(rank, &[4, 6], kind, 2 + dim));
            let gathered = comm.all_gather(&x, dim)?;
            results.push((format!("all_gather dim {dim} {kind:?}"), gathered));
            let scattered = comm.reduce_scatter(&x, dim)?;
            results.push((format!("reduce_scatter dim {dim} {kind:?}"), scattered));
        }
        let b = on(input(rank, &[3, 5], kind, 4)).transpose(0, 1);
        comm.broadcast(&b, 1)?;
        results.push((format!("broadcast root 1 {kind:?}"), b));
    }
    let others = [
        Kind::Half,
        Kind::Double,
        Kind::Int64,
        Kind::Int,
        Kind::Int8,
        Kind::Uint8,
        Kind::Bool,
    ];
    for kind in others {
        for op in [ReduceOp::Sum, ReduceOp::Max] {
            let x = on(input(rank, &[5], kind, 5));
            comm.all_reduce(&x, op)?;
            results.push((format!("all_reduce {op:?} {kind:?}"), x));
        }
    }
    // Both ways at once in one batch, into a non-contiguous buffer.
    let peer = 1 - rank;
    let mine = on(input(rank, &[2, 3], Kind::Float, 6));
    let buffer = on(Tensor::zeros([3, 2], (Kind::Float, Device::Cpu))).transpose(0, 1);
    comm.exchange(&[
        P2pOp::Send {
            tensor: &mine,
            peer,
        },
        P2pOp::Recv {
            buffer: &buffer,
            peer,
        },
    ])?;
    results.push(("exchange both ways".into(), buffer));
    // One way, then the other.
    for sender in [0, 1] {
        let message = on(input(rank, &[4], Kind::BFloat16, 7 + sender as i64));
        let ops = if rank == sender {
            [P2pOp::Send {
                tensor: &message,
                peer,
            }]
        } else {
            [P2pOp::Recv {
                buffer: &message,
                peer,
            }]
        };
        comm.exchange(&ops)?;
        results.push((format!("exchange from rank {sender}"), message));
    }
    // All-to-all with uneven splits, one empty: rank r sends r + 1 rows to rank 0 and 1 - r
    // to rank 1.
    let send_of = |r: i64| [r + 1, 1 - r];
    let me = rank as i64;
    let rows = on(input(rank, &[send_of(me).iter().sum(), 3], Kind::Float, 8));
    let recv = [send_of(0)[rank], send_of(1)[rank]];
    let exchanged = comm.all_to_all(&rows, &send_of(me), &recv)?;
    results.push(("all_to_all uneven".into(), exchanged));
    comm.barrier()?;
    Ok(results
        .into_iter()
        .map(|(name, t)| (name, t.to_device(Device::Cpu)))
        .collect())
}

fn nccl_rank(id: [u8; 128], rank: usize) -> Result<Vec<(String, Tensor)>> {
    let device = Device::Cuda(rank);
    let comm = NcclCommunicator::new(id, WORLD, rank, device)?;
    let results = exercise(&comm, device)?;
    let cpu = Tensor::zeros([2], (Kind::Float, Device::Cpu));
    let error = comm.all_reduce(&cpu, ReduceOp::Sum).unwrap_err();
    assert!(
        format!("{error:#}").contains("NCCL needs CUDA tensors"),
        "{error:#}"
    );
    Ok(results)
}

#[test]
fn nccl_gives_what_the_thread_backend_gives() {
    if !Cuda::is_available() || Cuda::device_count() < WORLD as i64 {
        eprintln!("skipped: needs 2 GPUs");
        return;
    }
    // Rank 0 makes the id and hands it over, as the TCP rendezvous does between processes.
    // Ranks are detached threads so that a hung collective fails the test instead of hanging it.
    let (id_sender, id_receiver) = mpsc::channel();
    let (done, outcomes) = mpsc::channel();
    let rank0 = done.clone();
    std::thread::spawn(move || {
        let outcome = NcclCommunicator::unique_id().and_then(|id| {
            id_sender.send(id)?;
            nccl_rank(id, 0)
        });
        rank0.send((0, outcome)).unwrap();
    });
    std::thread::spawn(move || {
        let outcome = id_receiver
            .recv()
            .map_err(|_| anyhow::anyhow!("rank 0 made no NCCL id"))
            .and_then(|id| nccl_rank(id, 1));
        done.send((1, outcome)).unwrap();
    });
    let mut nccl: Vec<Option<Vec<(String, Tensor)>>> = vec![None, None];
    for _ in 0..WORLD {
        let (rank, outcome) = outcomes
            .recv_timeout(Duration::from_secs(300))
            .expect("NCCL ranks finished within 5 minutes");
        nccl[rank] = Some(outcome.unwrap_or_else(|e| panic!("rank {rank}: {e:#}")));
    }

    let world = ThreadWorld::new(WORLD, Duration::from_secs(60));
    let expected = world
        .run(|rank| exercise(world.group("test", &[0, 1], rank)?.as_ref(), Device::Cpu))
        .unwrap();

    for (rank, (got, want)) in nccl.into_iter().zip(expected).enumerate() {
        let got = got.expect("every rank reported");
        assert_eq!(got.len(), want.len());
        for ((name, g), (_, w)) in got.iter().zip(&want) {
            assert_eq!(g.kind(), w.kind(), "rank {rank}: {name}");
            assert_eq!(g.size(), w.size(), "rank {rank}: {name}");
            assert!(g.equal(w), "rank {rank}: {name}: {g} != {w}");
        }
    }
}
