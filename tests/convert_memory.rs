//! `checkpoint_convert` holds a bounded amount of tensor data at a time: its peak resident
//! memory (the child's `ru_maxrss`) converting a checkpoint of over a gigabyte (weights and
//! Adam state) is within a small margin of converting a tiny one, both for a deep model (many
//! tensors) and for a shallow one with a huge vocabulary (a word embedding and Adam moments of
//! 256 MiB each, streamed in row chunks), for a TP1 → TP2 reshape with the optimizer,
//! Megatron's torch format out and back in (optimizer included), a HuggingFace export and its
//! import back from safetensors and from `pytorch_model.bin`; and reading Megatron's
//! `torch_dist` format, whose `.distcp` chunks are read lazily too.

use std::path::Path;
use std::process::Command;

use megatron_e2e::{bin, run_ok, shared_dir, test_python};

/// A one-iteration float32 run of `layers × hidden` with a vocabulary of `vocab` saved under
/// `save`, with its optimizer.
fn make_checkpoint(save: &Path, layers: usize, hidden: usize, vocab: usize) {
    run_ok(
        bin("pretrain_gpt")
            .args(["--num-layers", &layers.to_string()])
            .args(["--hidden-size", &hidden.to_string()])
            .args(["--num-attention-heads", "8"])
            .args(["--seq-length", "16", "--max-position-embeddings", "16"])
            .args(["--micro-batch-size", "1", "--global-batch-size", "1"])
            .args(["--lr", "1e-4", "--train-iters", "1", "--mock-data"])
            .args(["--tokenizer-type", "NullTokenizer"])
            .args(["--vocab-size", &vocab.to_string()])
            .args([
                "--eval-iters",
                "0",
                "--log-interval",
                "1",
                "--device",
                "cpu",
            ])
            .arg("--save")
            .arg(save)
            .args(["--save-interval", "1"]),
    );
}

/// Runs `command` to success; its peak resident set in bytes.
fn peak_rss(command: &mut Command) -> u64 {
    let mut child = command
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // Drained as it runs (a full pipe would block the child), for the failure message.
    let mut pipe = child.stderr.take().unwrap();
    let stderr = std::thread::spawn(move || {
        let mut text = String::new();
        std::io::Read::read_to_string(&mut pipe, &mut text).unwrap();
        text
    });
    let mut status = 0;
    // SAFETY: plain libc call on our own child's pid, with valid out-pointers.
    let usage = unsafe {
        let mut usage: libc::rusage = std::mem::zeroed();
        let pid = libc::wait4(child.id() as i32, &mut status, 0, &mut usage);
        assert_eq!(pid, child.id() as i32, "wait4");
        usage
    };
    let stderr = stderr.join().unwrap();
    assert!(
        libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
        "{command:?} failed: {stderr}"
    );
    // Linux reports ru_maxrss in KiB.
    usage.ru_maxrss as u64 * 1024
}

fn directory_bytes(dir: &Path) -> u64 {
    std::fs::read_dir(dir)
        .unwrap()
        .flatten()
        .map(|e| {
            let path = e.path();
            if path.is_dir() {
                directory_bytes(&path)
            } else {
                e.metadata().unwrap().len()
            }
        })
        .sum()
}

const CONVERSIONS: [&str; 6] = [
    "TP1 → TP2 reshape",
    "Megatron torch export",
    "Megatron torch import at TP2",
    "HuggingFace export",
    "HuggingFace import at TP2",
    "HuggingFace pytorch_model.bin import at TP2",
];

/// Peak RSS of a TP1 → TP2 reshape (optimizer included), of Megatron's torch format written
/// and read back at TP2, of a HuggingFace export of the checkpoint under `input` and of that
/// export's import at TP2, from safetensors and from `pytorch_model.bin`; each output is
/// removed once used, to keep the scratch space small.
fn conversions(input: &Path, scratch: &Path) -> [u64; 6] {
    let convert = |loader: &str, load: &Path, saver: &str, save: &str, extra: &[&str]| {
        let mut command = bin("checkpoint_convert");
        command
            .args(["--model-type", "GPT", "--loader", loader, "--saver", saver])
            .arg("--load-dir")
            .arg(load)
            .arg("--save-dir")
            .arg(scratch.join(save))
            .args(extra);
        let peak = peak_rss(&mut command);
        assert!(scratch.join(save).is_dir());
        peak
    };
    let remove = |name: &str| std::fs::remove_dir_all(scratch.join(name)).unwrap();
    let tp2 = ["--target-tensor-parallel-size", "2"];
    let reshape = convert("megatron-rs", input, "megatron-rs", "tp2", &tp2);
    remove("tp2");
    let to_megatron = convert("megatron-rs", input, "core", "megatron", &[]);
    let from_megatron = convert(
        "core",
        &scratch.join("megatron"),
        "megatron-rs",
        "back",
        &tp2,
    );
    remove("megatron");
    remove("back");
    let to_hf = convert("megatron-rs", input, "hf", "hf", &["--no-optimizer"]);
    let from_hf = convert("hf", &scratch.join("hf"), "megatron-rs", "imported", &tp2);
    remove("imported");
    // The same export as torch.save writes it (what from_pretrained's older format holds).
    let bin_dir = scratch.join("hf_bin");
    std::fs::create_dir(&bin_dir).unwrap();
    std::fs::copy(scratch.join("hf/config.json"), bin_dir.join("config.json")).unwrap();
    run_ok(
        Command::new(test_python(&["torch", "safetensors"]))
            .args([
                "-c",
                "import sys, torch\n\
                 from safetensors.torch import load_file\n\
                 torch.save(load_file(sys.argv[1]), sys.argv[2])",
            ])
            .arg(scratch.join("hf/model.safetensors"))
            .arg(bin_dir.join("pytorch_model.bin")),
    );
    remove("hf");
    let from_bin = convert("hf", &bin_dir, "megatron-rs", "imported", &tp2);
    remove("imported");
    remove("hf_bin");
    [
        reshape,
        to_megatron,
        from_megatron,
        to_hf,
        from_hf,
        from_bin,
    ]
}

/// A conversion that held the model, or its largest tensor, would grow by at least that
/// tensor's size (256 MiB for the huge vocabulary); one chunk at a time grows by a few chunks
/// and the writer's buffer.
const MARGIN: u64 = 128 << 20;

fn mib(bytes: u64) -> u64 {
    bytes / (1 << 20)
}

/// Builds the tiny reference and `shape`'s checkpoint, converts both every way and checks
/// that the peak RSS of the large one's conversions stays within [`MARGIN`] of the tiny ones'.
fn peak_memory_is_flat(what: &str, layers: usize, hidden: usize, vocab: usize) {
    let dir = tempfile::tempdir().unwrap();
    let (tiny, large) = (dir.path().join("tiny"), dir.path().join("large"));
    make_checkpoint(&tiny.join("ckpt"), 1, 64, 1000);
    make_checkpoint(&large.join("ckpt"), layers, hidden, vocab);
    let input = directory_bytes(&large.join("ckpt"));
    assert!(
        input > 1_000_000_000,
        "the {what} checkpoint holds {input} bytes"
    );
    let small = conversions(&tiny.join("ckpt"), &tiny);
    let big = conversions(&large.join("ckpt"), &large);
    for (conversion, (tiny, large)) in CONVERSIONS.into_iter().zip(small.into_iter().zip(big)) {
        let line = format!(
            "{what}, {conversion}: peak RSS {} MiB from a checkpoint of {} MiB, {} MiB for a tiny model",
            mib(large),
            mib(input),
            mib(tiny)
        );
        eprintln!("{line}");
        assert!(large < tiny + MARGIN && large < 1 << 30, "{line}");
    }
}

#[test]
fn peak_memory_does_not_grow_with_depth() {
    // 24 layers of hidden 512: 76M parameters, 1.2 GB with the float32 Adam state.
    peak_memory_is_flat("deep model", 24, 512, 1000);
}

#[test]
fn peak_memory_does_not_grow_with_the_largest_tensor() {
    // One layer of hidden 256 and a vocabulary of 262144: the word embedding and each of its
    // Adam tensors are 256 MiB, 1.1 GB in all.
    peak_memory_is_flat("huge vocabulary", 1, 256, 262_144);
}

/// Rewrites Megatron's `torch_dist` golden (argv[1]) under argv[2] with a word embedding of
/// argv[3] rows (random, and the args' vocabulary to match) through
/// `torch.distributed.checkpoint`, as Megatron saves it; `common.pt`'s Megatron classes
/// (enums in `args`) are stood in for by stubs that pickle back under their own names.
const BIG_TORCH_DIST: &str = r#"
import sys, pickle, types, torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

golden, out, rows = sys.argv[1], sys.argv[2], int(sys.argv[3])

def stub(module, name):
    parts = module.split(".")
    for i in range(1, len(parts) + 1):
        sys.modules.setdefault(".".join(parts[:i]), types.ModuleType(".".join(parts[:i])))
    mod = sys.modules[module]
    if not hasattr(mod, name):
        setattr(mod, name, type(name, (), {
            "__module__": module, "__qualname__": name,
            "__init__": lambda self, *a: setattr(self, "args", a),
            "__reduce__": lambda self: (type(self), self.args)}))
    return getattr(mod, name)

class Unpickler(pickle.Unpickler):
    def find_class(self, module, name):
        if module.startswith("megatron"):
            return stub(module, name)
        return super().find_class(module, name)

stubbed = types.ModuleType("pickle")
stubbed.Unpickler, stubbed.load = Unpickler, pickle.load
common = torch.load(f"{golden}/common.pt", map_location="cpu", weights_only=False,
                    pickle_module=stubbed)
common["args"].vocab_size = rows - 1  # NullTokenizer adds one id
common["args"].padded_vocab_size = rows
state = {k: v for k, v in _load_state_dict_from_keys(checkpoint_id=golden).items()
         if isinstance(v, torch.Tensor)}
hidden = state["embedding.word_embeddings.weight"].shape[1]
state["embedding.word_embeddings.weight"] = torch.randn(rows, hidden).to(torch.bfloat16)
dcp.save(state, checkpoint_id=out)
torch.save(common, f"{out}/common.pt")
"#;

/// Peak RSS of `torch_dist` checkpoint `load` converted to ours at TP2 and to HuggingFace.
fn torch_dist_conversions(load: &Path, scratch: &Path) -> [u64; 2] {
    let mut out = [0; 2];
    for (peak, (saver, extra)) in out.iter_mut().zip([
        ("megatron-rs", &["--target-tensor-parallel-size", "2"][..]),
        ("hf", &[][..]),
    ]) {
        let save = scratch.join(format!("out_{saver}"));
        *peak = peak_rss(
            bin("checkpoint_convert")
                .args(["--model-type", "GPT", "--loader", "core", "--saver", saver])
                .arg("--load-dir")
                .arg(load)
                .arg("--save-dir")
                .arg(&save)
                .args(extra),
        );
        std::fs::remove_dir_all(&save).unwrap();
    }
    out
}

#[test]
fn torch_dist_chunks_are_read_lazily() {
    let golden = shared_dir().join("golden/megatron_checkpoints/gpt_torch_dist");
    let dir = tempfile::tempdir().unwrap();
    let big = dir.path().join("big");
    // 2M rows of hidden 64 in bfloat16: a 256 MiB embedding (the rest is the golden's).
    run_ok(
        Command::new(test_python(&["torch"]))
            .args(["-c", BIG_TORCH_DIST])
            .arg(golden.join("iter_0000003"))
            .arg(big.join("iter_0000003"))
            .arg((2 << 20).to_string()),
    );
    std::fs::write(big.join("latest_checkpointed_iteration.txt"), "3").unwrap();
    let input = directory_bytes(&big);
    assert!(
        input > 256 << 20,
        "the torch_dist checkpoint holds {input} bytes"
    );
    let small = torch_dist_conversions(&golden, dir.path());
    let large = torch_dist_conversions(&big, dir.path());
    for (what, (tiny, large)) in ["to ours at TP2", "to HuggingFace"]
        .into_iter()
        .zip(small.into_iter().zip(large))
    {
        let line = format!(
            "torch_dist {what}: peak RSS {} MiB from a checkpoint of {} MiB, {} MiB from the golden",
            mib(large),
            mib(input),
            mib(tiny)
        );
        eprintln!("{line}");
        assert!(large < tiny + MARGIN, "{line}");
    }
}
