//! `pretrain_gpt --ckpt-format torch_dist` and `torch`: a run's saves in Megatron's formats,
//! read back by torch (`torch.distributed.checkpoint`) and resumed here as if never stopped;
//! and a checkpoint rewritten at `--load` once per node.

use std::path::{Path, PathBuf};
use std::process::Command;

use megatron_e2e::{bin, free_port, metrics_losses, run_job, run_ok, test_python, TINY_MOCK_GPT};

/// A two-process CPU run of the tiny GPT, eight iterations, with `extra`.
fn run(extra: &[&str]) -> Command {
    let mut command = bin("pretrain_gpt");
    command
        .args(TINY_MOCK_GPT)
        .args(["--train-iters", "8", "--device", "cpu"])
        .args(["--distributed-backend", "gloo"])
        .args(extra);
    command
}

/// Runs `make()` as both ranks of a two-process job; returns rank 0's stdout.
fn two_ranks(make: impl Fn() -> Command) -> String {
    let outputs = run_job(2, "", |_| make());
    String::from_utf8_lossy(&outputs[0].stdout).into_owned()
}

fn path(p: &Path) -> String {
    p.to_str().unwrap().to_string()
}

/// The entries of `dir`, sorted.
fn entries(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

/// Reads Megatron's torch_dist checkpoint `dist` with `torch.distributed.checkpoint` and
/// compares every model tensor with our safetensors save of the same run (`ours`, one
/// tensor-parallel rank): a layer's parameter stacked over the layers under Megatron's key,
/// the norms under the fused layers' keys. Prints how many tensors matched.
const COMPARE_WITH_OURS: &str = r#"
import sys, torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from safetensors.torch import load_file
dist, ours = sys.argv[1], load_file(sys.argv[2])
reader = dcp.FileSystemReader(dist)
metadata = reader.read_metadata()
state = {k: torch.empty(m.size, dtype=m.properties.dtype)
         for k, m in metadata.state_dict_metadata.items() if isinstance(m, TensorStorageMetadata)}
dcp.load(state, storage_reader=reader, no_dist=True)
norms = {"self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
         "self_attention.linear_qkv.layer_norm_bias": "input_layernorm.bias",
         "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
         "mlp.linear_fc1.layer_norm_bias": "pre_mlp_layernorm.bias"}
compared = set()
for key, value in state.items():
    if key.startswith("optimizer."):
        continue
    experts = "decoder.layers.mlp.experts.experts."
    if key.startswith(experts):
        for layer in range(value.shape[0]):
            for expert in range(value.shape[1]):
                name = (f"decoder.layers.{layer}.mlp.experts.local_experts.{expert}."
                        + key[len(experts):])
                assert torch.equal(value[layer, expert], ours[name]), name
                compared.add(name)
    elif key.startswith("decoder.layers."):
        leaf = key[len("decoder.layers."):]
        leaf = norms.get(leaf, leaf)
        for layer in range(value.shape[0]):
            name = f"decoder.layers.{layer}.{leaf}"
            assert torch.equal(value[layer], ours[name]), name
            compared.add(name)
    else:
        assert torch.equal(value, ours[key]), key
        compared.add(key)
assert compared == set(ours), sorted(set(ours) ^ compared)
print(len(compared))
"#;

/// A DP=2 run saving torch_dist at iteration 5 writes Megatron's files (and nothing of ours is
/// left beside them); torch reads every model tensor equal to the same run's save in our
/// format; resumed here, iterations 6-8 log the uninterrupted run's losses exactly. Returns
/// torch's view of the saved iteration and the directory holding the run's two saves.
/// `data_files` are the `.distcp` files expected: one per rank that saves a chunk.
fn torch_dist_save_resumes_exactly(
    run_flags: &[&str],
    data_files: &[&str],
    model_tensors: usize,
) -> (serde_json::Value, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let (dist, ours) = (dir.path().join("dist"), dir.path().join("ours"));
    let full = dir.path().join("full.jsonl");
    two_ranks(|| {
        let mut c = run(run_flags);
        c.args(["--metrics-file", &path(&full)]);
        c
    });
    for (save, format) in [(&dist, "torch_dist"), (&ours, "safetensors")] {
        let stdout = two_ranks(|| {
            let mut c = run(run_flags);
            c.args(["--save-interval", "5", "--exit-interval", "5"])
                .args(["--ckpt-format", format, "--save", &path(save)]);
            c
        });
        assert!(
            stdout.contains("successfully saved checkpoint from iteration       5"),
            "{stdout}"
        );
    }
    assert_eq!(
        std::fs::read_to_string(dist.join("latest_checkpointed_iteration.txt")).unwrap(),
        "5"
    );
    let iteration = dist.join("iter_0000005");
    let mut expected = vec![".metadata"];
    expected.extend(data_files);
    expected.extend(["common.pt", "metadata.json"]);
    assert_eq!(entries(&iteration), expected);
    assert_eq!(
        entries(&dist),
        [
            ".megatron-rs-save.lock",
            "iter_0000005",
            "latest_checkpointed_iteration.txt"
        ]
    );
    let python = test_python(&["torch", "safetensors"]);
    let compared = run_ok(
        Command::new(&python)
            .arg("-c")
            .arg(COMPARE_WITH_OURS)
            .arg(&iteration)
            .arg(ours.join("iter_0000005/mp_rank_00/model.safetensors")),
    );
    assert_eq!(
        String::from_utf8_lossy(&compared.stdout).trim(),
        model_tensors.to_string()
    );
    let resumed = dir.path().join("resumed.jsonl");
    two_ranks(|| {
        let mut c = run(run_flags);
        c.args(["--load", &path(&dist), "--metrics-file", &path(&resumed)]);
        c
    });
    let expected: Vec<_> = metrics_losses(&full)
        .into_iter()
        .filter(|(i, _)| *i > 5)
        .collect();
    assert_eq!(expected.len(), 3);
    assert_eq!(metrics_losses(&resumed), expected);
    (torch_reference(&iteration), dir)
}

/// With `--use-distributed-optimizer` the optimizer state is saved in
/// `fully_sharded_model_space`, every tensor as `checkpoint_convert` exports the same run's
/// save in our format (and so as Megatron's own save lays it out).
#[test]
fn torch_dist_saves_of_a_distributed_optimizer_run_resume_exactly() {
    let (saved, dir) = torch_dist_save_resumes_exactly(
        &["--use-distributed-optimizer", "--ddp-bucket-size", "5000"],
        &["__0_0.distcp", "__1_0.distcp"],
        28,
    );
    let exported = dir.path().join("exported");
    run_ok(
        bin("checkpoint_convert")
            .args(["--model-type", "GPT", "--loader", "megatron-rs"])
            .args(["--saver", "core", "--ckpt-format", "torch_dist"])
            .args(["--target-data-parallel-size", "2"])
            .args(["--load-dir", &path(&dir.path().join("ours"))])
            .args(["--save-dir", &path(&exported)]),
    );
    let converted = torch_reference(&exported.join("iter_0000005"));
    assert_eq!(saved["dist_metadata"], converted["dist_metadata"]);
    assert_eq!(saved["tensors"], converted["tensors"]);
    assert_eq!(
        saved["dist_metadata"]["optimizer.state.exp_avg.embedding.word_embeddings.weight"][1],
        serde_json::json!([1, 1, 65536])
    );
    assert_eq!(saved["args"]["use_distributed_optimizer"], true);
}

/// Reads a torch_dist checkpoint with `torch.distributed.checkpoint` and checks that every
/// `optimizer.state.fp32_param.K` is model tensor `K` (float32 runs: the main parameters are
/// the parameters), laid out as Megatron's N-D flattened tensors are: of `K`'s shape, or of
/// shape `grid + [n]`, cell `i` of the grid the block of `K` at `i * K.shape / grid`,
/// flattened. Prints the keys of the flattened ones with their grids.
const FP32_PARAMS_ARE_THE_MODEL: &str = r#"
import sys, itertools, torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
reader = dcp.FileSystemReader(sys.argv[1])
metadata = reader.read_metadata()
state = {k: torch.empty(m.size, dtype=m.properties.dtype)
         for k, m in metadata.state_dict_metadata.items() if isinstance(m, TensorStorageMetadata)}
dcp.load(state, storage_reader=reader, no_dist=True)
prefix = "optimizer.state.fp32_param."
checked = 0
for key, main in sorted(state.items()):
    if not key.startswith(prefix):
        continue
    model = state[key[len(prefix):]]
    checked += 1
    if main.shape == model.shape:
        assert torch.equal(main, model), key
        continue
    grid = main.shape[:-1]
    cell = [whole // parts for whole, parts in zip(model.shape, grid)]
    for index in itertools.product(*(range(g) for g in grid)):
        block = model
        for axis, (i, size) in enumerate(zip(index, cell)):
            block = block.narrow(axis, i * size, size)
        assert torch.equal(main[index], block.reshape(-1)), (key, index)
    if any(g > 1 for g in grid[1:]):
        print(key[len(prefix):], list(grid))
assert checked > 0
"#;

/// A Llama-style model (SwiGLU, RMSNorm, RoPE, grouped-query attention, untied output layer, no
/// biases) with the distributed optimizer: its `fc1` is saved as Megatron's swiglu sharded
/// factory saves it, the gate and the up rows two chunks of the row axis, and so is its
/// optimizer state (grid `[layers, 2, 1]`, each half flattened, the data-parallel ranges cut
/// where the halves meet); torch reads the main parameters back as the model, this project
/// resumes it exactly, and `checkpoint_convert` writes the same files from the same run.
#[test]
fn torch_dist_saves_of_a_swiglu_distributed_optimizer_run_resume_exactly() {
    let llama = [
        "--swiglu",
        "--normalization",
        "RMSNorm",
        "--position-embedding-type",
        "rope",
        "--group-query-attention",
        "--num-query-groups",
        "2",
        "--untie-embeddings-and-output-weights",
        "--disable-bias-linear",
        "--use-distributed-optimizer",
    ];
    let (saved, dir) =
        torch_dist_save_resumes_exactly(&llama, &["__0_0.distcp", "__1_0.distcp"], 15);
    let iteration = dir.path().join("dist/iter_0000005");
    let python = test_python(&["torch"]);
    let out = run_ok(
        Command::new(&python)
            .arg("-c")
            .arg(FP32_PARAMS_ARE_THE_MODEL)
            .arg(&iteration),
    );
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        "decoder.layers.mlp.linear_fc1.weight [2, 2, 1]"
    );
    let exported = dir.path().join("exported");
    run_ok(
        bin("checkpoint_convert")
            .args(["--model-type", "GPT", "--loader", "megatron-rs"])
            .args(["--saver", "core", "--ckpt-format", "torch_dist"])
            .args(["--target-data-parallel-size", "2"])
            .args(["--load-dir", &path(&dir.path().join("ours"))])
            .args(["--save-dir", &path(&exported)]),
    );
    let converted = torch_reference(&exported.join("iter_0000005"));
    assert_eq!(saved["dist_metadata"], converted["dist_metadata"]);
    assert_eq!(saved["tensors"], converted["tensors"]);
}

/// Compares the layout of our torch_dist checkpoint (argv[1]) with Megatron's golden save of a
/// Mixture-of-Experts run of the same architecture (argv[2]): the same tensor and object keys
/// (the golden's RNG state aside: ours has none), the same shapes of the routed experts' and
/// the router's tensors and of their optimizer state, the chained optimizer's two parts in
/// `common.pt` (dense, then the experts', `is_expert_parallel`). Prints the expert keys' shapes.
const MOE_LAYOUT_AS_MEGATRONS: &str = r#"
import pickle, sys, types, torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
def metadata(path):
    return dcp.FileSystemReader(path).read_metadata().state_dict_metadata
ours, golden = metadata(sys.argv[1]), metadata(sys.argv[2])
golden = {k: v for k, v in golden.items() if not k.startswith("rng_state")}
assert set(ours) == set(golden), sorted(set(ours) ^ set(golden))
shown = []
for key, theirs in sorted(golden.items()):
    if ("experts" in key or "router" in key) and isinstance(theirs, TensorStorageMetadata):
        assert ours[key].size == theirs.size, (key, ours[key].size, theirs.size)
        assert ours[key].properties.dtype == theirs.properties.dtype or not key.startswith("optimizer"), key
        if key.startswith("decoder") or key.startswith("optimizer.state.fp32_param"):
            shown.append(f"{key} {list(theirs.size)}")
class Stubs(pickle.Unpickler):
    def find_class(self, module, name):
        if module.startswith("megatron"):
            return type(name, (), {"__init__": lambda self, *a, **k: None,
                                   "__setstate__": lambda self, state: None})
        return super().find_class(module, name)
stubs = types.ModuleType("stubs"); stubs.Unpickler = Stubs; stubs.load = pickle.load
def optimizer(path):
    common = torch.load(f"{path}/common.pt", map_location="cpu", weights_only=False,
                        pickle_module=stubs)
    return {index: ([g["is_expert_parallel"] for g in part["optimizer"]["param_groups"]],
                    part["param_state_sharding_type"])
            for index, part in common["optimizer"].items()}
assert optimizer(sys.argv[1]) == optimizer(sys.argv[2]), (optimizer(sys.argv[1]), optimizer(sys.argv[2]))
print("\n".join(shown))
"#;

/// A Mixture-of-Experts model (four routed experts of ffn 128, top-2, as Megatron's
/// `moe_torch_dist` golden) with the distributed optimizer: the experts saved as core_v0.14.0's
/// `SequentialMLP` saves them (`decoder.layers.mlp.experts.experts.*`, stacked over the layers
/// and the experts; the optimizer state in grid `[layers, experts, 1, 1]`); torch reads every
/// tensor and the main parameters as the model, and this project resumes it exactly.
/// `checkpoint_convert` writes the same run for expert parallelism 2 as the golden's run
/// (EP=2 × DP=2 here): the same keys and expert shapes as the golden, the chained optimizer's
/// two parts in `common.pt`; resumed here, it too continues the run exactly.
#[test]
fn torch_dist_saves_of_a_moe_distributed_optimizer_run_resume_exactly() {
    let moe = [
        "--disable-bias-linear",
        "--num-experts",
        "4",
        "--moe-router-topk",
        "2",
        "--moe-ffn-hidden-size",
        "128",
        "--moe-aux-loss-coeff",
        "1e-2",
        "--use-distributed-optimizer",
    ];
    let (saved, dir) = torch_dist_save_resumes_exactly(&moe, &["__0_0.distcp", "__1_0.distcp"], 34);
    assert_eq!(saved["args"]["num_experts"], 4);
    let iteration = dir.path().join("dist/iter_0000005");
    let python = test_python(&["torch"]);
    let checked = run_ok(
        Command::new(&python)
            .arg("-c")
            .arg(FP32_PARAMS_ARE_THE_MODEL)
            .arg(&iteration),
    );
    assert_eq!(
        String::from_utf8_lossy(&checked.stdout).trim(),
        "decoder.layers.mlp.experts.experts.linear_fc1.weight [2, 4, 1, 1]\n\
         decoder.layers.mlp.experts.experts.linear_fc2.weight [2, 4, 1, 1]"
    );
    let exported = dir.path().join("exported");
    run_ok(
        bin("checkpoint_convert")
            .args(["--model-type", "GPT", "--loader", "megatron-rs"])
            .args(["--saver", "core", "--ckpt-format", "torch_dist"])
            .args(["--target-data-parallel-size", "2"])
            .args(["--target-expert-parallel-size", "2"])
            .args(["--load-dir", &path(&dir.path().join("ours"))])
            .args(["--save-dir", &path(&exported)]),
    );
    let golden =
        megatron_e2e::shared_dir().join("golden/megatron_checkpoints/moe_torch_dist/iter_0000005");
    let layout = run_ok(
        Command::new(&python)
            .arg("-c")
            .arg(MOE_LAYOUT_AS_MEGATRONS)
            .arg(exported.join("iter_0000005"))
            .arg(&golden),
    );
    assert_eq!(
        String::from_utf8_lossy(&layout.stdout).trim(),
        "decoder.layers.mlp.experts.experts.linear_fc1.weight [2, 4, 128, 64]\n\
         decoder.layers.mlp.experts.experts.linear_fc2.weight [2, 4, 64, 128]\n\
         decoder.layers.mlp.router.weight [2, 4, 64]\n\
         optimizer.state.fp32_param.decoder.layers.mlp.experts.experts.linear_fc1.weight [2, 4, 1, 1, 8192]\n\
         optimizer.state.fp32_param.decoder.layers.mlp.experts.experts.linear_fc2.weight [2, 4, 1, 1, 8192]\n\
         optimizer.state.fp32_param.decoder.layers.mlp.router.weight [2, 1, 1, 256]"
    );
    let resumed = dir.path().join("resumed_from_ep2.jsonl");
    two_ranks(|| {
        let mut c = run(&moe);
        c.args([
            "--load",
            &path(&exported),
            "--metrics-file",
            &path(&resumed),
        ]);
        c
    });
    let expected: Vec<_> = metrics_losses(&dir.path().join("full.jsonl"))
        .into_iter()
        .filter(|(i, _)| *i > 5)
        .collect();
    assert_eq!(metrics_losses(&resumed), expected);
}

/// Without the distributed optimizer each optimizer tensor has its parameter's shape and
/// chunks, as Megatron's non-distributed optimizer saves it; data-parallel rank 0 saves them
/// all, as it does the model.
#[test]
fn torch_dist_saves_of_a_plain_optimizer_run_resume_exactly() {
    let (saved, _dir) = torch_dist_save_resumes_exactly(&[], &["__0_0.distcp"], 28);
    let metadata = &saved["dist_metadata"];
    for key in [
        "embedding.word_embeddings.weight",
        "decoder.layers.mlp.linear_fc1.weight",
    ] {
        for kind in ["fp32_param", "exp_avg", "exp_avg_sq"] {
            let optimizer = &metadata[format!("optimizer.state.{kind}.{key}")];
            assert_eq!(optimizer[0], "float32", "{kind} {key}");
            assert_eq!(optimizer[1], metadata[key][1], "{kind} {key}");
            assert_eq!(optimizer[2], metadata[key][2], "{kind} {key}");
        }
    }
    assert_eq!(saved["args"]["use_distributed_optimizer"], false);
}

/// With `--async-save` the rewrite runs in rank 0's commit thread, and the tracker moves once
/// Megatron's checkpoint is in place: the same files, resumed the same.
#[test]
fn torch_dist_async_saves_resume_exactly() {
    let (saved, _dir) = torch_dist_save_resumes_exactly(
        &["--use-distributed-optimizer", "--async-save"],
        &["__0_0.distcp", "__1_0.distcp"],
        28,
    );
    assert_eq!(saved["args"]["use_distributed_optimizer"], true);
}

/// `--ckpt-format torch` saves Megatron's `mp_rank_00/model_optim_rng.pt` (the model and the
/// non-distributed optimizer's state), which torch loads and this project resumes exactly.
#[test]
fn torch_saves_resume_exactly() {
    let dir = tempfile::tempdir().unwrap();
    let (saved, full, resumed) = (
        dir.path().join("saved"),
        dir.path().join("full.jsonl"),
        dir.path().join("resumed.jsonl"),
    );
    two_ranks(|| {
        let mut c = run(&[]);
        c.args(["--metrics-file", &path(&full)]);
        c
    });
    two_ranks(|| {
        let mut c = run(&["--save-interval", "5", "--exit-interval", "5"]);
        c.args(["--ckpt-format", "torch", "--save", &path(&saved)]);
        c
    });
    assert_eq!(entries(&saved.join("iter_0000005")), ["mp_rank_00"]);
    let file = saved.join("iter_0000005/mp_rank_00/model_optim_rng.pt");
    let reference = torch_reference(&file);
    assert_eq!(reference["args"]["ckpt_format"], "torch");
    assert!(
        reference["tensors"]
            .as_object()
            .unwrap()
            .contains_key("model/embedding.word_embeddings.weight"),
        "{}",
        reference["tensors"]
    );
    two_ranks(|| {
        let mut c = run(&[]);
        c.args(["--load", &path(&saved), "--metrics-file", &path(&resumed)]);
        c
    });
    let expected: Vec<_> = metrics_losses(&full)
        .into_iter()
        .filter(|(i, _)| *i > 5)
        .collect();
    assert_eq!(metrics_losses(&resumed), expected);
}

/// Checks the distributed optimizer's `distrib_optim.pt` of a float32 `--ckpt-format torch`
/// rank folder (argv[1]) against the rank file beside it and against Megatron's golden
/// `moe_torch` folder (argv[2], whose dense buffers are its first list entry): laid out as
/// `_ParamAndGradBuffer` lays out one bucket (the parameters in reverse order of the rank
/// file's model, each at a multiple of 64), every parameter's `param` slice is the model's
/// weight (float32 runs: the main parameters are the parameters), the dictionary has the
/// golden's entries, and the rank file's `optimizer` the golden's parameter-group fields.
/// Prints the buffer's length.
const DISTRIB_OPTIM_AS_MEGATRONS: &str = r#"
import pickle, sys, types, torch
class Stubs(pickle.Unpickler):
    def find_class(self, module, name):
        if module.startswith("megatron"):
            return type(name, (), {"__init__": lambda self, *a, **k: None,
                                   "__setstate__": lambda self, state: None})
        return super().find_class(module, name)
stubs = types.ModuleType("stubs"); stubs.Unpickler = Stubs; stubs.load = pickle.load
def load(path):
    return torch.load(path, map_location="cpu", weights_only=False, pickle_module=stubs)
ours, golden = sys.argv[1], sys.argv[2]
buffers, reference = load(f"{ours}/distrib_optim.pt"), load(f"{golden}/distrib_optim.pt")[0]
rank_file = load(f"{ours}/model_optim_rng.pt")
model = {k: v for k, v in rank_file["model"].items() if not k.endswith("_extra_state")}
assert [type(k) for k in buffers] == [type(k) for k in reference], (list(buffers), list(reference))
assert buffers["buckets_coalesced"] is True
(dtypes, flat), = buffers[0].items()
(their_dtypes, their_flat), = reference[0].items()
assert dtypes == (torch.float32, torch.float32) and len(their_dtypes) == 2, dtypes
assert sorted(flat) == sorted(their_flat), (sorted(flat), sorted(their_flat))
at = 0
for name in reversed(list(model)):
    at = (at + 63) // 64 * 64
    n = model[name].numel()
    assert torch.equal(flat["param"][at:at + n], model[name].reshape(-1)), name
    at += n
assert at == flat["numel_unpadded"], (at, flat["numel_unpadded"])
for kind in ("param", "exp_avg", "exp_avg_sq"):
    assert flat[kind].dtype == torch.float32 and flat[kind].shape == (at,), kind
theirs = load(f"{golden}/model_optim_rng.pt")["optimizer"][0]["optimizer"]["param_groups"]
groups = rank_file["optimizer"]["optimizer"]["param_groups"]
assert [sorted(g) for g in groups] == [sorted(g) for g in theirs], (groups, theirs)
assert [g["is_expert_parallel"] for g in groups] == [False, False]
print(at)
"#;

/// The routed-experts flags of the MoE runs below: four experts of ffn 128, top-2, with the
/// distributed optimizer.
const MOE: [&str; 10] = [
    "--disable-bias-linear",
    "--num-experts",
    "4",
    "--moe-router-topk",
    "2",
    "--moe-ffn-hidden-size",
    "128",
    "--moe-aux-loss-coeff",
    "1e-2",
    "--use-distributed-optimizer",
];

/// A two-rank MoE run with `flags` saved as `--ckpt-format torch` at iteration 5 and resumed
/// here: iterations 6-8 log the uninterrupted run's losses exactly. Returns the saved iteration
/// directory (in the returned temporary directory).
fn moe_torch_save_resumes_exactly(flags: &[&str]) -> (PathBuf, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let (saved, full, resumed) = (
        dir.path().join("saved"),
        dir.path().join("full.jsonl"),
        dir.path().join("resumed.jsonl"),
    );
    two_ranks(|| {
        let mut c = run(flags);
        c.args(["--metrics-file", &path(&full)]);
        c
    });
    two_ranks(|| {
        let mut c = run(flags);
        c.args(["--save-interval", "5", "--exit-interval", "5"])
            .args(["--ckpt-format", "torch", "--save", &path(&saved)]);
        c
    });
    two_ranks(|| {
        let mut c = run(flags);
        c.args(["--load", &path(&saved), "--metrics-file", &path(&resumed)]);
        c
    });
    let expected: Vec<_> = metrics_losses(&full)
        .into_iter()
        .filter(|(i, _)| *i > 5)
        .collect();
    assert_eq!(expected.len(), 3);
    assert_eq!(metrics_losses(&resumed), expected);
    (saved.join("iter_0000005"), dir)
}

/// `--ckpt-format torch` of a Mixture-of-Experts run with the distributed optimizer (DP=2,
/// experts not expert-parallel, so in the dense buffers as Megatron keeps them): `mp_rank_00`
/// holds `model_optim_rng.pt` and the distributed optimizer's `distrib_optim.pt`, laid out as
/// Megatron's `get_parameter_state_dp_zero` saves it (checked against the rank file's weights
/// and the `moe_torch` golden's entries and parameter groups); this project resumes it exactly.
#[test]
fn torch_saves_of_a_moe_distributed_optimizer_run_resume_exactly() {
    let (iteration, _dir) = moe_torch_save_resumes_exactly(&MOE);
    let rank = iteration.join("mp_rank_00");
    assert_eq!(entries(&rank), ["distrib_optim.pt", "model_optim_rng.pt"]);
    let golden = megatron_e2e::shared_dir()
        .join("golden/megatron_checkpoints/moe_torch/iter_0000005/mp_rank_00_000");
    let checked = run_ok(
        Command::new(test_python(&["torch"]))
            .arg("-c")
            .arg(DISTRIB_OPTIM_AS_MEGATRONS)
            .arg(&rank)
            .arg(&golden),
    );
    assert_eq!(String::from_utf8_lossy(&checked.stdout).trim(), "232576");
}

/// The `*.safetensors` files of the checkpoint under `root`, by path under it, with their bytes.
fn safetensors_files(root: &Path) -> Vec<(String, Vec<u8>)> {
    let iteration = std::fs::read_dir(root)
        .unwrap()
        .flatten()
        .find(|e| e.file_name().to_string_lossy().starts_with("iter_"))
        .unwrap()
        .path();
    let mut files = Vec::new();
    for rank in entries(&iteration) {
        let directory = iteration.join(&rank);
        if !directory.is_dir() {
            continue;
        }
        for file in entries(&directory) {
            if file.ends_with(".safetensors") {
                let bytes = std::fs::read(directory.join(&file)).unwrap();
                files.push((format!("{rank}/{file}"), bytes));
            }
        }
    }
    files
}

/// Checks each `mp_rank_00_EEE` folder of a float32 expert-parallel `--ckpt-format torch` save
/// (argv[1], the iteration directory): its `distrib_optim.pt` lists the dense parameters' buffer
/// and the routed experts', each laid out as `_ParamAndGradBuffer` lays out one bucket of
/// its parameters (in reverse order of the rank file's model, each at a multiple of 64), and
/// every parameter's `param` slice is the rank file's weight (float32: the main parameters
/// are the parameters), so no expert's state sits in another's place. Prints the count.
const EXPERT_RANKS_DISTRIB_OPTIM: &str = r#"
import os, pickle, sys, types, torch
class Stubs(pickle.Unpickler):
    def find_class(self, module, name):
        if module.startswith("megatron"):
            return type(name, (), {"__init__": lambda self, *a, **k: None,
                                   "__setstate__": lambda self, state: None})
        return super().find_class(module, name)
stubs = types.ModuleType("stubs"); stubs.Unpickler = Stubs; stubs.load = pickle.load
def load(path):
    return torch.load(path, map_location="cpu", weights_only=False, pickle_module=stubs)
iteration, checked = sys.argv[1], 0
for folder in sorted(os.listdir(iteration)):
    buffers = load(f"{iteration}/{folder}/distrib_optim.pt")
    model = {k: v for k, v in load(f"{iteration}/{folder}/model_optim_rng.pt")["model"].items()
             if isinstance(v, torch.Tensor) and not k.endswith(".expert_bias")}
    parts = [[k for k in model if ".local_experts." not in k],
             [k for k in model if ".local_experts." in k]]
    assert len(buffers) == 2, folder
    for buffer, names in zip(buffers, parts):
        (flat,) = buffer[0].values()
        at = 0
        for name in reversed(names):
            at = (at + 63) // 64 * 64
            n = model[name].numel()
            assert torch.equal(flat["param"][at:at + n], model[name].reshape(-1)), (folder, name)
            at += n
            checked += 1
        assert at == flat["numel_unpadded"], (folder, at, flat["numel_unpadded"])
print(checked)
"#;

/// An expert-parallel MoE run (EP=2 × DP=2: each rank's routed experts its own, their
/// optimizer state unsharded, the dense parameters' sharded over both ranks) with the routers'
/// expert biases (`--moe-router-enable-expert-bias`), saved at iteration 5 as `--ckpt-format
/// torch` and, by a second run, in our format: the torch save has one `mp_rank_00_EEE` folder
/// per expert-parallel rank whose rank files hold the routers' `expert_bias` buffers and whose
/// `distrib_optim.pt` holds every parameter's state in its place (checked in Python against
/// the weights), and `checkpoint_convert` reads it into the same weights, optimizer state and
/// biases, bit for bit, as it reads the run's own save.
#[test]
fn torch_saves_of_an_expert_parallel_moe_run_with_expert_biases_import_as_its_own_save() {
    let flags = [
        &MOE[..],
        &[
            "--expert-model-parallel-size",
            "2",
            "--moe-router-score-function",
            "sigmoid",
            "--moe-router-enable-expert-bias",
        ],
    ]
    .concat();
    let dir = tempfile::tempdir().unwrap();
    let mut imported = Vec::new();
    for (format, loader) in [("torch", "core"), ("safetensors", "megatron-rs")] {
        let saved = dir.path().join(format);
        two_ranks(|| {
            let mut c = run(&flags);
            c.args(["--save-interval", "5", "--exit-interval", "5"])
                .args(["--ckpt-format", format, "--save", &path(&saved)]);
            c
        });
        let converted = dir.path().join(format!("{format}-imported"));
        run_ok(
            bin("checkpoint_convert")
                .args(["--model-type", "GPT", "--loader", loader])
                .args(["--saver", "megatron-rs"])
                .args(["--load-dir", &path(&saved)])
                .args(["--save-dir", &path(&converted)]),
        );
        imported.push(safetensors_files(&converted));
    }
    let iteration = dir.path().join("torch/iter_0000005");
    assert_eq!(entries(&iteration), ["mp_rank_00_000", "mp_rank_00_001"]);
    let reference = torch_reference(&iteration.join("mp_rank_00_001/model_optim_rng.pt"));
    for layer in 0..2 {
        let bias =
            &reference["tensors"][format!("model/decoder.layers.{layer}.mlp.router.expert_bias")];
        assert_eq!(bias[0], "float32", "{}", reference["tensors"]);
        assert_eq!(bias[1], serde_json::json!([4]), "{bias}");
    }
    let checked = run_ok(
        Command::new(test_python(&["torch"]))
            .arg("-c")
            .arg(EXPERT_RANKS_DISTRIB_OPTIM)
            .arg(&iteration),
    );
    assert_eq!(String::from_utf8_lossy(&checked.stdout).trim(), "52");
    let names = |files: &[(String, Vec<u8>)]| files.iter().map(|f| f.0.clone()).collect::<Vec<_>>();
    assert_eq!(
        names(&imported[0]),
        [
            "mp_rank_00/expert_bias.safetensors",
            "mp_rank_00/model.safetensors",
            "mp_rank_00/optimizer.safetensors"
        ]
    );
    assert_eq!(names(&imported[0]), names(&imported[1]));
    for ((name, a), (_, b)) in imported[0].iter().zip(&imported[1]) {
        assert!(
            a == b,
            "{name} differs between the torch save and the run's own"
        );
    }
}

/// `scripts/torch_checkpoint_reference.py`'s view of a checkpoint: every tensor's digest.
fn torch_reference(checkpoint: &Path) -> serde_json::Value {
    let python: PathBuf = test_python(&["torch"]);
    let out = run_ok(
        Command::new(python)
            .arg(megatron_e2e::workspace_root().join("scripts/torch_checkpoint_reference.py"))
            .arg(checkpoint),
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

/// `--load` of a checkpoint saved under another layout, by a job of four processes on two nodes
/// (Slurm's variables, one host) sharing `$TMPDIR`: each node's first process writes the
/// reshaped copy once, for its node, and says so; the others read it; every copy is gone when
/// the run ends.
#[test]
fn a_reshape_at_load_is_written_once_per_node() {
    let dir = tempfile::tempdir().unwrap();
    let (saved, tmp) = (dir.path().join("saved"), dir.path().join("tmp"));
    std::fs::create_dir(&tmp).unwrap();
    two_ranks(|| {
        let mut c = run(&["--save-interval", "4", "--exit-interval", "4"]);
        c.args(["--save", &path(&saved)]);
        c
    });
    let port = free_port();
    let tasks: Vec<_> = (0..4)
        .map(|rank| {
            run(&["--tensor-model-parallel-size", "2", "--load", &path(&saved)])
                .env("TMPDIR", &tmp)
                .env("SLURM_PROCID", rank.to_string())
                .env("SLURM_NTASKS", "4")
                .env("SLURM_LOCALID", (rank % 2).to_string())
                .env("SLURM_NODEID", (rank / 2).to_string())
                .env("SLURM_NNODES", "2")
                .env("SLURM_TASKS_PER_NODE", "2(x2)")
                .env("SLURM_JOB_NODELIST", "127.0.0.[1-2]")
                .env("MASTER_PORT", &port)
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    let mut written = Vec::new();
    for (rank, task) in tasks.into_iter().enumerate() {
        let out = task.wait_with_output().unwrap();
        assert!(
            out.status.success(),
            "rank {rank}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        written.extend(
            stdout
                .lines()
                .filter(|l| l.starts_with("reshaped the checkpoint"))
                .map(|l| (rank, l.to_string())),
        );
    }
    assert_eq!(written.len(), 2, "{written:?}");
    for ((rank, line), node) in written.iter().zip([0, 2]) {
        assert_eq!(*rank, node, "{written:?}");
        let copy = tmp.join(format!(
            "megatron-rs-resume-127.0.0.1-{port}-node{}",
            node / 2
        ));
        assert!(
            line.contains(" to TP=2 PP=1 (written once")
                && line.ends_with(&format!(
                    "(written once for this node's processes, to {})",
                    copy.display()
                )),
            "{line}"
        );
    }
    assert_eq!(entries(&tmp), Vec::<String>::new());
}

/// Formats a program does not write are usage errors (exit 2) naming the flag and the value,
/// before anything is saved: Megatron's zarr everywhere, Megatron's torch_dist in pretrain_bert.
#[test]
fn formats_not_written_are_refused_naming_the_flag() {
    let dir = tempfile::tempdir().unwrap();
    let save = dir.path().join("save");
    let gpt = bin("pretrain_gpt")
        .args(TINY_MOCK_GPT)
        .args([
            "--train-iters",
            "2",
            "--device",
            "cpu",
            "--ckpt-format",
            "zarr",
        ])
        .arg("--save")
        .arg(&save)
        .output()
        .unwrap();
    let bert = bin("pretrain_bert")
        .args(["--num-layers", "2", "--hidden-size", "32"])
        .args(["--num-attention-heads", "4", "--seq-length", "32"])
        .args(["--max-position-embeddings", "32", "--micro-batch-size", "4"])
        .args([
            "--global-batch-size",
            "8",
            "--lr",
            "3e-3",
            "--train-iters",
            "2",
        ])
        .args(["--eval-iters", "0", "--device", "cpu", "--mock-data"])
        .args(["--tokenizer-type", "NullTokenizer", "--vocab-size", "255"])
        .args(["--ckpt-format", "torch_dist", "--save"])
        .arg(&save)
        .output()
        .unwrap();
    for (out, value) in [(gpt, "zarr"), (bert, "torch_dist")] {
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{stderr}");
        assert!(
            stderr.contains(&format!(
                "--ckpt-format {value} is not written by this program"
            )),
            "{stderr}"
        );
        assert!(
            !save.join("latest_checkpointed_iteration.txt").exists(),
            "{stderr}"
        );
    }
}
