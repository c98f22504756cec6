//! Jobs of several processes on this host, started as torchrun starts them (RANK, WORLD_SIZE,
//! LOCAL_RANK, MASTER_ADDR, MASTER_PORT), each rank's output captured.

use std::io::Read;
use std::process::{Child, Command, Output, Stdio};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::free_port;

/// How long a rank of a test job may run: a guard against hangs, far above any test's need.
pub const RANK_DEADLINE: Duration = Duration::from_secs(300);

/// Starts `command` as rank `rank` of `world` processes whose rendezvous is `port` on
/// loopback, its stdout and stderr piped.
pub fn spawn_rank(mut command: Command, rank: usize, world: usize, port: &str) -> Child {
    command
        .env("RANK", rank.to_string())
        .env("WORLD_SIZE", world.to_string())
        .env("LOCAL_RANK", rank.to_string())
        .env("MASTER_ADDR", "127.0.0.1")
        .env("MASTER_PORT", port)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("failed to start rank {rank} ({command:?}): {e}"))
}

/// The outputs of `ranks`, in their order. Their pipes are drained as they write (so that no
/// rank blocks on a full pipe while another is waited for); ranks still running after `limit`
/// are killed and the test fails naming them.
pub fn wait_for_ranks(ranks: Vec<Child>, limit: Duration) -> Vec<Output> {
    let mut running: Vec<_> = ranks
        .into_iter()
        .map(|mut child| {
            let stdout = drain(child.stdout.take());
            let stderr = drain(child.stderr.take());
            (child, stdout, stderr)
        })
        .collect();
    let deadline = Instant::now() + limit;
    let mut statuses = vec![None; running.len()];
    while statuses.iter().any(Option::is_none) {
        for (status, (child, _, _)) in statuses.iter_mut().zip(&mut running) {
            if status.is_none() {
                *status = child.try_wait().unwrap();
            }
        }
        if Instant::now() > deadline {
            let late: Vec<usize> = (0..statuses.len())
                .filter(|&rank| statuses[rank].is_none())
                .collect();
            for &rank in &late {
                let _ = running[rank].0.kill();
            }
            panic!("ranks {late:?} did not exit within {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    running
        .into_iter()
        .zip(statuses)
        .map(|((_, stdout, stderr), status)| Output {
            status: status.unwrap(),
            stdout: stdout.join().unwrap(),
            stderr: stderr.join().unwrap(),
        })
        .collect()
}

/// Runs `make(rank)` as every rank of a `world`-process job on a fresh port; every rank must
/// succeed (the test fails with the first failing rank's stderr, prefixed by `what`). Returns
/// the outputs in rank order.
pub fn run_job(world: usize, what: &str, make: impl Fn(usize) -> Command) -> Vec<Output> {
    let port = free_port();
    let ranks = (0..world)
        .map(|rank| spawn_rank(make(rank), rank, world, &port))
        .collect();
    let outputs = wait_for_ranks(ranks, RANK_DEADLINE);
    for (rank, out) in outputs.iter().enumerate() {
        assert!(
            out.status.success(),
            "{what} rank {rank}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    outputs
}

/// Reads `pipe` to its end on a thread of its own.
fn drain(pipe: Option<impl Read + Send + 'static>) -> JoinHandle<Vec<u8>> {
    std::thread::spawn(move || {
        let mut bytes = Vec::new();
        if let Some(mut pipe) = pipe {
            // A rank's output is what the test reads; a broken pipe leaves what was read.
            let _ = pipe.read_to_end(&mut bytes);
        }
        bytes
    })
}
