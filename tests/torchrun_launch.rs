//! Jobs launched by torchrun (here `python -m torch.distributed.run`, the same program) meet
//! through torchrun's own store, so no port of ours can collide: a job whose `MASTER_PORT + 1`
//! is taken (the port an earlier version bound) runs, and `--standalone` jobs started three at
//! a time all finish.

use std::net::TcpListener;
use std::process::{Child, Command, Stdio};

use megatron_e2e::{bin_path, test_python};

/// A two-rank data-parallel `pretrain_gpt` of one tiny step on the CPU, under torchrun with
/// `launcher` flags.
fn torchrun(launcher: &[&str]) -> Command {
    let mut command = Command::new(test_python(&["torch"]));
    command
        .args(["-m", "torch.distributed.run", "--nproc-per-node", "2"])
        .args(launcher)
        .arg("--no-python")
        .arg(bin_path("pretrain_gpt"))
        .args(["--num-layers", "1", "--hidden-size", "16"])
        .args(["--num-attention-heads", "2", "--seq-length", "8"])
        .args(["--max-position-embeddings", "8", "--micro-batch-size", "1"])
        .args([
            "--global-batch-size",
            "2",
            "--train-iters",
            "1",
            "--mock-data",
        ])
        .args(["--tokenizer-type", "NullTokenizer", "--vocab-size", "64"])
        .args(["--lr", "1e-3", "--eval-iters", "0", "--device", "cpu"])
        .args(["--distributed-backend", "gloo"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    command
}

fn finishes(child: Child, what: &str) {
    let out = child.wait_with_output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && stdout.contains("pretrain_gpt: 1 iterations"),
        "{what}: {:?}\n{stdout}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn a_job_runs_when_the_port_after_master_port_is_taken() {
    // Two adjacent ports: the master's, released for torchrun's store, and the one after it,
    // held by this test for the whole run.
    let (master, next) = loop {
        let master = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = master.local_addr().unwrap().port();
        if let Ok(next) = TcpListener::bind(("0.0.0.0", port + 1)) {
            break (port, next);
        }
    };
    let job = torchrun(&[
        "--nnodes",
        "1",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        &master.to_string(),
    ])
    .spawn()
    .unwrap();
    finishes(job, &format!("MASTER_PORT {master}, {} taken", master + 1));
    drop(next);
}

#[test]
fn concurrent_standalone_jobs_never_collide() {
    // Three jobs at once, twice: no port is guessed, so none can be taken by a neighbour.
    for round in 0..2 {
        let jobs: Vec<Child> = (0..3)
            .map(|_| torchrun(&["--standalone"]).spawn().unwrap())
            .collect();
        for (index, job) in jobs.into_iter().enumerate() {
            finishes(job, &format!("round {round}, job {index}"));
        }
    }
}
