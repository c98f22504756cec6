//! The three checkpoints Megatron-LM core_v0.14.0 wrote (../shared/golden/megatron_checkpoints)
//! read without torch: every tensor equals, byte for byte, what PyTorch's own
//! `torch.load(weights_only=False)` / `torch.distributed.checkpoint` reads
//! (scripts/torch_checkpoint_reference.py), and the args and counters come out.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use md5::{Digest, Md5};
use megatron_checkpoint::{DistCheckpoint, TorchFile, Value};
use serde_json::Value as Json;

fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn goldens() -> PathBuf {
    let shared = std::env::var_os("MEGATRON_RS_SHARED")
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace_root().join("../shared"));
    let dir = shared.join("golden/megatron_checkpoints");
    assert!(
        dir.is_dir(),
        "{} not found (set MEGATRON_RS_SHARED)",
        dir.display()
    );
    dir
}

fn python() -> PathBuf {
    std::env::var_os("MEGATRON_RS_TEST_PYTHON")
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace_root().join(".venv/bin/python"))
}

/// What PyTorch reads from `path`.
fn torch_reference(path: &Path) -> Json {
    let out = Command::new(python())
        .arg(workspace_root().join("scripts/torch_checkpoint_reference.py"))
        .arg(path)
        .output()
        .expect("running the python reference (MEGATRON_RS_TEST_PYTHON with torch)");
    assert!(
        out.status.success(),
        "reference failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

fn md5_hex(bytes: &[u8]) -> String {
    Md5::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

type Listing = BTreeMap<String, (String, Vec<usize>, String)>;

fn reference_listing(reference: &Json) -> Listing {
    reference["tensors"]
        .as_object()
        .unwrap()
        .iter()
        .map(|(path, v)| {
            let shape = v[1]
                .as_array()
                .unwrap()
                .iter()
                .map(|d| d.as_u64().unwrap() as usize)
                .collect();
            (
                path.clone(),
                (
                    v[0].as_str().unwrap().to_string(),
                    shape,
                    v[2].as_str().unwrap().to_string(),
                ),
            )
        })
        .collect()
}

fn assert_same_listing(ours: &Listing, reference: &Listing) {
    for (name, expected) in reference {
        assert_eq!(ours.get(name), Some(expected), "tensor {name}");
    }
    for name in ours.keys() {
        assert!(
            reference.contains_key(name),
            "tensor {name} is not in torch's reading"
        );
    }
}

fn assert_args_match(ours: &Value, reference: &Json) {
    let ours = ours.to_json();
    let reference = reference["args"].as_object().unwrap();
    assert!(
        reference.len() > 100,
        "the reference read {} args",
        reference.len()
    );
    for (key, expected) in reference {
        if expected.is_null() {
            continue; // None, or an object the reference could not show as plain JSON
        }
        assert_eq!(&ours[key], expected, "args.{key}");
    }
}

fn check_torch_file(path: &Path) -> TorchFile {
    let reference = torch_reference(path);
    let file = TorchFile::open(path).unwrap();
    let ours: Listing = file
        .tensors()
        .into_iter()
        .map(|(name, tensor)| {
            let bytes = file.tensor_bytes(tensor).unwrap();
            (
                name,
                (
                    tensor.storage.dtype.torch_name().to_string(),
                    tensor.shape.clone(),
                    md5_hex(&bytes),
                ),
            )
        })
        .collect();
    assert_same_listing(&ours, &reference_listing(&reference));
    assert_eq!(
        file.root.get("checkpoint_version").and_then(Value::as_f64),
        Some(3.0)
    );
    assert_eq!(file.root.get("iteration").and_then(Value::as_i64), Some(3));
    assert_args_match(file.root.get("args").unwrap(), &reference);
    file
}

#[test]
fn gpt_torch_reads_like_torch_load() {
    let file =
        check_torch_file(&goldens().join("gpt_torch/iter_0000003/mp_rank_00/model_optim_rng.pt"));
    let args = file.root.get("args").unwrap();
    assert_eq!(args.get("num_layers").and_then(Value::as_i64), Some(2));
    assert_eq!(args.get("hidden_size").and_then(Value::as_i64), Some(64));
    assert_eq!(
        args.get("padded_vocab_size").and_then(Value::as_i64),
        Some(8320)
    );
    // Megatron's enums stay opaque, named values.
    assert!(
        matches!(args.get("model_type"), Some(Value::Object { name, .. }) if name == "ModelType")
    );
    // The optimizer state and the numpy RNG state are there too.
    let optimizer = file.root.get("optimizer").unwrap();
    assert!(optimizer.get("fp32_from_fp16_params").is_some());
    let rng = &file.root.get("rng_state").unwrap().items().unwrap()[0];
    let Some(Value::Tuple(np_state)) = rng.get("np_rng_state") else {
        panic!("np_rng_state")
    };
    assert_eq!(np_state[0], Value::Str("MT19937".into()));
    assert!(matches!(&np_state[1], Value::Numpy(a) if a.shape == vec![624] && a.dtype == "<u4"));
}

#[test]
fn llama_torch_reads_like_torch_load() {
    let file =
        check_torch_file(&goldens().join("llama_torch/iter_0000003/mp_rank_00/model_optim_rng.pt"));
    let args = file.root.get("args").unwrap();
    assert_eq!(args.get("swiglu").and_then(Value::as_bool), Some(true));
    assert_eq!(
        args.get("num_query_groups").and_then(Value::as_i64),
        Some(2)
    );
}

#[test]
fn gpt_torch_dist_reads_like_torch_distributed_checkpoint() {
    let directory = goldens().join("gpt_torch_dist/iter_0000003");
    let reference = torch_reference(&directory);
    let checkpoint = DistCheckpoint::open(&directory).unwrap();
    let mut ours = Listing::new();
    for (name, tensor) in &checkpoint.tensors {
        let (dtype, shape, bytes) = checkpoint.read(name).unwrap();
        assert_eq!(shape, tensor.shape);
        ours.insert(
            name.clone(),
            (dtype.torch_name().to_string(), shape, md5_hex(&bytes)),
        );
    }
    assert_same_listing(&ours, &reference_listing(&reference));
    // One layer of a stacked tensor is the matching slice of the whole.
    let name = "decoder.layers.mlp.linear_fc1.weight";
    let (_, whole_shape, whole) = checkpoint.read(name).unwrap();
    let (_, shape, layer1) = checkpoint.read_rows(name, 1..2).unwrap();
    assert_eq!(shape, vec![1, whole_shape[1], whole_shape[2]]);
    assert_eq!(layer1, whole[whole.len() / 2..]);
    let common = &checkpoint.common.root;
    assert_eq!(
        common.get("checkpoint_version").and_then(Value::as_f64),
        Some(3.0)
    );
    assert_eq!(common.get("iteration").and_then(Value::as_i64), Some(3));
    assert_args_match(common.get("args").unwrap(), &reference);
}

#[test]
fn truncated_and_foreign_files_name_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let source = goldens().join("gpt_torch/iter_0000003/mp_rank_00/model_optim_rng.pt");
    let bytes = std::fs::read(source).unwrap();
    let truncated = dir.path().join("truncated.pt");
    std::fs::write(&truncated, &bytes[..bytes.len() / 2]).unwrap();
    let error = format!("{:#}", TorchFile::open(&truncated).unwrap_err());
    assert!(error.contains("truncated.pt"), "{error}");
    let foreign = dir.path().join("notes.pt");
    std::fs::write(&foreign, b"hello").unwrap();
    let error = format!("{:#}", TorchFile::open(&foreign).unwrap_err());
    assert!(
        error.contains("notes.pt") && error.contains("not a PyTorch checkpoint"),
        "{error}"
    );
}
