//! Two nodes on one host: two torchrun agents (`--nnodes 2 --node-rank 0|1`, c10d rendezvous),
//! and four processes with Slurm's variables for two nodes, train `pretrain_gpt` on CPUs with
//! gloo exactly as one node of four processes does, with data parallelism alone and with tensor
//! parallelism inside each node. On four GPUs the same job runs with NCCL kept off NVLink and
//! shared memory, so it goes through sockets as between hosts.

use std::path::Path;
use std::process::{Child, Command, Output, Stdio};

use megatron_e2e::{
    bin, bin_path, free_port, metrics_losses, test_python, visible_gpus, TINY_MOCK_GPT,
};

/// A 2-layer GPT on mock data for three steps, fp32, reproducible CPU GEMMs, its losses in
/// `metrics`.
fn training_flags(metrics: &Path, tensor: usize, device: &[&'static str]) -> Vec<String> {
    let mut flags: Vec<String> = TINY_MOCK_GPT
        .iter()
        .chain(&["--train-iters", "3", "--deterministic-mode"])
        .chain(device)
        .map(|s| s.to_string())
        .collect();
    flags.extend([
        "--tensor-model-parallel-size".into(),
        tensor.to_string(),
        "--metrics-file".into(),
        metrics.display().to_string(),
    ]);
    flags
}

const CPU: &[&str] = &["--device", "cpu", "--distributed-backend", "gloo"];
const GPU: &[&str] = &["--device", "cuda", "--distributed-backend", "nccl"];

/// One torchrun agent: node `node_rank` of `nodes`, `per_node` processes, meeting the other
/// agents at `endpoint`.
fn torchrun(
    nodes: usize,
    node_rank: usize,
    per_node: usize,
    endpoint: &str,
    flags: &[String],
) -> Command {
    let mut command = Command::new(test_python(&["torch"]));
    command
        .args(["-m", "torch.distributed.run"])
        .args(["--nnodes", &nodes.to_string()])
        .args(["--node-rank", &node_rank.to_string()])
        .args(["--nproc-per-node", &per_node.to_string()])
        .args(["--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint])
        .arg("--no-python")
        .arg(bin_path("pretrain_gpt"))
        .args(flags)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    command
}

fn succeeded(children: Vec<Child>, what: &str) -> Vec<Output> {
    let outputs: Vec<Output> = children
        .into_iter()
        .map(|child| child.wait_with_output().unwrap())
        .collect();
    for (index, out) in outputs.iter().enumerate() {
        assert!(
            out.status.success(),
            "{what}, process {index}: {}\n{}\n{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    outputs
}

fn stdout_of(outputs: &[Output]) -> String {
    outputs
        .iter()
        .map(|out| String::from_utf8_lossy(&out.stdout).into_owned())
        .collect()
}

/// Runs the job as `nodes` torchrun agents of `4 / nodes` processes each and returns its losses
/// (exact JSON text) and its agents' output.
fn run_torchrun(
    dir: &Path,
    nodes: usize,
    tensor: usize,
    device: &[&'static str],
) -> (Vec<(u64, String)>, String) {
    let what = format!("{nodes} node(s), TP={tensor}");
    let metrics = dir.join(format!("torchrun_{nodes}_{tensor}.jsonl"));
    let flags = training_flags(&metrics, tensor, device);
    let endpoint = format!("127.0.0.1:{}", free_port());
    let agents: Vec<Child> = (0..nodes)
        .map(|node| {
            let per_node = 4 / nodes;
            let mut agent = torchrun(nodes, node, per_node, &endpoint, &flags);
            if device == GPU {
                // Each "node" sees GPUs of its own, as separate hosts do: local rank 0 of
                // both would otherwise pick cuda:0, which NCCL refuses as a duplicate.
                let gpus: Vec<String> = (node * per_node..(node + 1) * per_node)
                    .map(|gpu| gpu.to_string())
                    .collect();
                agent
                    .env("CUDA_VISIBLE_DEVICES", gpus.join(","))
                    .env("NCCL_P2P_DISABLE", "1")
                    .env("NCCL_SHM_DISABLE", "1");
            }
            agent.spawn().unwrap()
        })
        .collect();
    let outputs = succeeded(agents, &what);
    (metrics_losses(&metrics), stdout_of(&outputs))
}

/// The launcher variables of the tests' own environment must not leak into the jobs here.
fn without_launcher_variables(command: &mut Command) -> &mut Command {
    for name in [
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "MASTER_ADDR",
        "TORCHELASTIC_USE_AGENT_STORE",
    ] {
        command.env_remove(name);
    }
    command
}

fn assert_equal_losses(expected: &[(u64, String)], got: &[(u64, String)], what: &str) {
    assert_eq!(expected.len(), 3, "the one-node run logged {expected:?}");
    assert_eq!(
        got, expected,
        "{what}: losses differ from the one-node run's"
    );
}

#[test]
fn two_torchrun_nodes_train_as_one_node() {
    let dir = tempfile::tempdir().unwrap();
    for tensor in [1, 2] {
        let (one_node, one_node_stdout) = run_torchrun(dir.path(), 1, tensor, CPU);
        let layout = format!("TP={tensor} PP=1 DP={}", 4 / tensor);
        assert!(
            one_node_stdout.contains(&format!(
                "> 4 process(es) on 1 node(s), 4 per node; {layout}"
            )),
            "{one_node_stdout}"
        );
        let (two_nodes, two_nodes_stdout) = run_torchrun(dir.path(), 2, tensor, CPU);
        assert!(
            two_nodes_stdout.contains(&format!(
                "> 4 process(es) on 2 node(s), 2 per node; {layout}"
            )),
            "{two_nodes_stdout}"
        );
        assert_equal_losses(&one_node, &two_nodes, &format!("two nodes, {layout}"));
    }
}

/// `srun -N 2 --ntasks-per-node 2` as Slurm would set it up, on localhost: the master is the
/// first host of the compressed node list (`127.0.0.[1-2]`), no `$MASTER_ADDR` given.
#[test]
fn slurm_variables_for_two_nodes_train_as_one_node() {
    let dir = tempfile::tempdir().unwrap();
    let (one_node, _) = run_torchrun(dir.path(), 1, 2, CPU);
    let metrics = dir.path().join("slurm.jsonl");
    let flags = training_flags(&metrics, 2, CPU);
    let port = free_port();
    let tasks: Vec<Child> = (0..4)
        .map(|rank| {
            let mut task = bin("pretrain_gpt");
            without_launcher_variables(&mut task)
                .args(&flags)
                .env("SLURM_PROCID", rank.to_string())
                .env("SLURM_NTASKS", "4")
                .env("SLURM_LOCALID", (rank % 2).to_string())
                .env("SLURM_NODEID", (rank / 2).to_string())
                .env("SLURM_NNODES", "2")
                .env("SLURM_TASKS_PER_NODE", "2(x2)")
                .env("SLURM_JOB_NODELIST", "127.0.0.[1-2]")
                .env("MASTER_PORT", &port)
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    let outputs = succeeded(tasks, "Slurm, two nodes");
    let stdout = stdout_of(&outputs);
    assert!(
        stdout.contains("> 4 process(es) on 2 node(s), 2 per node; TP=2 PP=1 DP=2"),
        "{stdout}"
    );
    assert_equal_losses(
        &one_node,
        &metrics_losses(&metrics),
        "Slurm, two nodes, TP=2",
    );
}

/// Tensor-parallel groups wider than a node are allowed but named: their collectives would
/// cross the network.
#[test]
fn tensor_parallel_groups_across_nodes_are_warned_about() {
    let dir = tempfile::tempdir().unwrap();
    let metrics = dir.path().join("tp4.jsonl");
    let flags = training_flags(&metrics, 4, CPU);
    let endpoint = format!("127.0.0.1:{}", free_port());
    let agents: Vec<Child> = (0..2)
        .map(|node| torchrun(2, node, 2, &endpoint, &flags).spawn().unwrap())
        .collect();
    let outputs = succeeded(agents, "two nodes, TP=4");
    let stderr: String = outputs
        .iter()
        .map(|out| String::from_utf8_lossy(&out.stderr).into_owned())
        .collect();
    assert!(
        stderr.contains("warning: tensor-parallel groups of 4 ranks span nodes of 2 process(es)"),
        "{stderr}"
    );
    assert_eq!(metrics_losses(&metrics).len(), 3);
}

/// On four GPUs: two nodes of two with NCCL through sockets (`NCCL_P2P_DISABLE=1
/// NCCL_SHM_DISABLE=1`) against one node of four with its NVLink. NCCL may pick other
/// algorithms over sockets, so the sums may round differently: within 1e-5.
#[test]
fn two_gpu_nodes_over_sockets_train_as_one_node() {
    if visible_gpus() < 4 {
        eprintln!("skipped: needs 4 GPUs");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    for tensor in [1, 2] {
        let (one_node, _) = run_torchrun(dir.path(), 1, tensor, GPU);
        let (two_nodes, _) = run_torchrun(dir.path(), 2, tensor, GPU);
        assert_eq!(one_node.len(), 3);
        assert_eq!(two_nodes.len(), 3);
        for ((_, a), (_, b)) in one_node.iter().zip(&two_nodes) {
            let (a, b): (f64, f64) = (a.parse().unwrap(), b.parse().unwrap());
            assert!(
                (a - b).abs() <= 1e-5 * a.abs(),
                "TP={tensor}: two nodes {two_nodes:?}, one node {one_node:?}"
            );
        }
        eprintln!("TP={tensor}: two nodes {two_nodes:?}, one node {one_node:?}");
    }
}
