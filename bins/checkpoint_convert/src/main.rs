//! `checkpoint_convert`: Megatron's `tools/checkpoint/convert.py` — same flags — plus
//! `inspect`. Loaders: megatron-rs, core/mcore and legacy/megatron (Megatron `torch` or
//! `torch_dist`, detected from the files), hf. Savers: megatron-rs, core (Megatron `torch`), hf.
//! T5: megatron-rs TP reshapes.

mod progress;

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::{Parser, Subcommand, ValueEnum};
use megatron_cli::bail_usage;
use megatron_convert::{
    load_checkpoint, load_hf, load_megatron_rs, load_megatron_torch, load_torch_dist,
    reporting_progress, reshape_t5, save_hf, save_megatron_rs, save_megatron_torch_dist,
    save_megatron_torch_experts, t5_max_logit_difference, tokenizer_export, use_one_torch_thread,
    verify, vocab_file_size, ConversionProgress, LoadOptions, TargetLayout, TokenizerFiles,
};
use megatron_store::find_checkpoint;
use progress::TensorBytesBar;

/// Convert a checkpoint between formats and model-parallel layouts, or describe one.
///
/// Flags keep the names of Megatron's tools/checkpoint/convert.py. Reading Megatron's and
/// HuggingFace's files needs no torch and no Python. The output is written under a temporary
/// name and renamed into place when complete.
#[derive(Parser)]
#[command(
    version,
    about,
    long_about = None,
    args_conflicts_with_subcommands = true,
    subcommand_negates_reqs = true,
    max_term_width = 100
)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
    #[command(flatten)]
    convert: ConvertArgs,
}

#[derive(Subcommand)]
enum Command {
    /// Describe any supported checkpoint: format, layout, args, every tensor's dtype and shape.
    Inspect {
        /// A checkpoint root (with latest_checkpointed_iteration.txt), an iteration directory,
        /// or a HuggingFace model directory.
        dir: PathBuf,
    },
}

/// `--model-type`.
#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum ModelType {
    #[value(name = "GPT")]
    Gpt,
    #[value(name = "T5")]
    T5,
}

/// `--loader`: the names convert.py knows, each format under one name and its aliases.
#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Loader {
    #[value(name = "megatron-rs")]
    MegatronRs,
    #[value(alias = "mcore", alias = "legacy", alias = "megatron")]
    Core,
    #[value(alias = "llama_mistral")]
    Hf,
}

impl Loader {
    /// The name `load_checkpoint` takes.
    fn name(self) -> &'static str {
        match self {
            Loader::MegatronRs => "megatron-rs",
            Loader::Core => "core",
            Loader::Hf => "hf",
        }
    }
}

/// `--saver`.
#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Saver {
    #[value(name = "megatron-rs")]
    MegatronRs,
    #[value(alias = "mcore", alias = "legacy", alias = "megatron")]
    Core,
    Hf,
}

#[derive(clap::Args)]
struct ConvertArgs {
    /// GPT, or T5 (our T5 checkpoints reshaped to another tensor-parallel size, with
    /// --loader megatron-rs --saver megatron-rs; T5 has no pipeline stages and no HuggingFace
    /// form).
    #[arg(long, required = true)]
    model_type: Option<ModelType>,
    /// megatron-rs; core (alias mcore) or legacy (alias megatron): Megatron's torch or
    /// torch_dist checkpoints, detected from the files; hf (alias llama_mistral): a
    /// HuggingFace GPT2LMHeadModel, LlamaForCausalLM, MistralForCausalLM or Qwen2ForCausalLM
    /// directory (safetensors or pytorch_model.bin).
    #[arg(long, default_value = "megatron")]
    loader: Loader,
    /// megatron-rs; core (alias mcore, legacy, megatron): Megatron's checkpoint in
    /// --ckpt-format (core names and the optimizer state, no RNG state: resume it with
    /// --no-load-rng); hf: a HuggingFace model directory with config.json.
    #[arg(long, default_value = "megatron-rs")]
    saver: Saver,
    /// The format --saver core writes: torch (mp_rank_XX/model_optim_rng.pt, the plain
    /// optimizer's state) or torch_dist (Megatron's distributed checkpoint: .metadata,
    /// __N_0.distcp files, common.pt; the optimizer's state as --use-distributed-optimizer's
    /// fully_sharded_model_space, so resume it with --use-distributed-optimizer).
    #[arg(long, default_value = "torch", value_parser = ["torch", "torch_dist"])]
    ckpt_format: String,
    /// Data-parallel size whose ranks' parts of the distributed optimizer's state become the
    /// torch_dist chunks (any size resumes it) [default: the input run's, else 1].
    #[arg(long, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..))]
    target_data_parallel_size: Option<usize>,
    /// Directory to load the checkpoint from.
    #[arg(long, required = true)]
    load_dir: Option<PathBuf>,
    /// Directory to write the converted checkpoint to (must not exist, or be empty).
    #[arg(long, required = true)]
    save_dir: Option<PathBuf>,
    /// Tensor-parallel size of the output [default: the input's].
    #[arg(long, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..))]
    target_tensor_parallel_size: Option<usize>,
    /// Pipeline-parallel size of the output [default: the input's].
    #[arg(long, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..))]
    target_pipeline_parallel_size: Option<usize>,
    /// Expert-parallel size of a Megatron output (`--saver core`): the routed experts of a
    /// Mixture-of-Experts model split over `mp_rank_*_EEE` folders (torch), or their optimizer
    /// state that of an expert-parallel run's chained optimizer (torch_dist) [default: 1, as
    /// Megatron's saver_core].
    #[arg(long, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..))]
    target_expert_parallel_size: Option<usize>,
    /// Model chunks per pipeline stage of the output (interleaved schedule) [default: 1].
    #[arg(long, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..))]
    target_virtual_pipeline_parallel_size: Option<usize>,
    /// The tokenizer's real vocabulary size (embedding rows beyond it are padding).
    #[arg(long)]
    true_vocab_size: Option<i64>,
    /// GPT-2 vocabulary JSON: its size is the true vocabulary size (must agree with
    /// --true-vocab-size when both are given).
    #[arg(long)]
    vocab_file: Option<PathBuf>,
    /// GPT-2 merges file (copied into HuggingFace exports) [default: the one the checkpoint
    /// recorded].
    #[arg(long)]
    merge_file: Option<PathBuf>,
    /// The tokenizer HuggingFace exports carry [default: the one the checkpoint recorded]: a
    /// HuggingFace tokenizer.json or a directory holding one (with tokenizer_config.json and
    /// special_tokens_map.json, copied where present), or a SentencePiece tokenizer.model. Its
    /// bos/eos ids go into config.json and generation_config.json.
    #[arg(long)]
    tokenizer_model: Option<PathBuf>,
    /// Accepted for compatibility with convert.py; nothing of Megatron is needed.
    #[arg(long)]
    megatron_path: Option<PathBuf>,
    /// Accepted for compatibility with convert.py (the conversion streams without a queue).
    #[arg(long)]
    max_queue_size: Option<usize>,
    /// Accepted for compatibility with convert.py.
    #[arg(long)]
    no_checking: bool,
    /// Accepted for compatibility with convert.py (names of both implementations are read).
    #[arg(long)]
    loader_transformer_impl: Option<String>,
    /// Accepted for compatibility with convert.py.
    #[arg(long)]
    saver_transformer_impl: Option<String>,
    /// Pad the vocabulary of imports to a multiple of this times the target TP size [default:
    /// a Megatron checkpoint's own, 128 for HuggingFace]. Needed to pad a Megatron checkpoint
    /// beyond the embedding rows it holds.
    #[arg(long)]
    make_vocab_size_divisible_by: Option<i64>,
    /// Convert the weights only, leaving the optimizer state behind (HuggingFace exports
    /// always do).
    #[arg(long)]
    no_optimizer: bool,
    /// Do not verify the per-file checksums of a megatron-rs checkpoint read (recorded in its
    /// metadata.json), nor record them in one written.
    #[arg(long)]
    no_checkpoint_checksums: bool,
    /// Run both models forward on a few sequences and print the largest logit difference.
    #[arg(long)]
    verify: bool,
    /// Write the parameters in bfloat16 [default: the input's dtype].
    #[arg(long, conflicts_with = "fp16")]
    bf16: bool,
    /// Write the parameters in float16 [default: the input's dtype].
    #[arg(long)]
    fp16: bool,
    /// The llama_mistral loader's input format: hf, a HuggingFace model directory (Meta's
    /// original consolidated.*.pth files, `meta`, are not read here).
    #[arg(long, value_parser = ["hf", "meta"])]
    checkpoint_type: Option<String>,
    /// The llama_mistral loader's model family and size; the architecture itself is read from
    /// the HuggingFace config.json, so this names what is expected.
    #[arg(long, value_parser = [
        "llama2-7B", "llama2-13B", "llama2-70B", "llama2-7Bf", "llama2-13Bf", "llama2-70Bf",
        "llama3", "mistral", "yi-34B", "qwen2.5",
    ])]
    model_size: Option<String>,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    megatron_cli::run(|| match cli.command {
        Some(Command::Inspect { dir }) => {
            print!("{}", megatron_checkpoint::inspect::inspect(&dir)?);
            Ok(())
        }
        None => convert(&cli.convert),
    })
}

/// `--bf16` / `--fp16`: the dtype the savers write.
fn output_dtype(args: &ConvertArgs) -> Option<&'static str> {
    if args.bf16 {
        Some("bfloat16")
    } else if args.fp16 {
        Some("float16")
    } else {
        None
    }
}

fn true_vocab_size(args: &ConvertArgs) -> Result<Option<i64>> {
    let from_file = match &args.vocab_file {
        Some(path) => Some(vocab_file_size(path)?),
        None => None,
    };
    match (args.true_vocab_size, from_file) {
        (Some(given), Some(counted)) if given != counted => bail_usage!(
            "--true-vocab-size {given} disagrees with --vocab-file {} ({counted} entries)",
            args.vocab_file.as_ref().unwrap().display()
        ),
        (given, counted) => Ok(given.or(counted)),
    }
}

/// `--load-dir`, which clap requires unless a subcommand runs.
fn load_dir(args: &ConvertArgs) -> &Path {
    args.load_dir.as_deref().expect("clap requires --load-dir")
}

fn convert(args: &ConvertArgs) -> Result<()> {
    use_one_torch_thread();
    megatron_store::set_checksums_enabled(!args.no_checkpoint_checksums);
    if args.model_type == Some(ModelType::T5) {
        return convert_t5(args);
    }
    if args.ckpt_format == "torch_dist" && args.saver != Saver::Core {
        bail_usage!("--ckpt-format torch_dist is a format of --saver core");
    }
    let save_dir = empty_save_dir(args)?;
    let options = LoadOptions {
        true_vocab_size: true_vocab_size(args)?,
        optimizer: !args.no_optimizer && args.saver != Saver::Hf,
        make_vocab_size_divisible_by: args.make_vocab_size_divisible_by,
    };
    let started = Instant::now();
    if args.checkpoint_type.as_deref() == Some("meta") {
        bail_usage!(
            "--checkpoint-type meta: Meta's original consolidated.*.pth checkpoints are not read \
             here; convert them to a HuggingFace directory first (transformers' \
             convert_llama_weights_to_hf.py), then use --checkpoint-type hf"
        );
    }
    let mut state = load_checkpoint(load_dir(args), Some(args.loader.name()), &options)?;
    if let Some(dtype) = output_dtype(args) {
        state.params_dtype = dtype.to_string();
    }
    let target = TargetLayout {
        tensor: args
            .target_tensor_parallel_size
            .unwrap_or(state.source_parallel.0),
        pipeline: args
            .target_pipeline_parallel_size
            .unwrap_or(state.source_parallel.1),
        virtual_stages: args.target_virtual_pipeline_parallel_size.unwrap_or(1),
    };
    let run_args = &state.run.args;
    let data_parallel = args.target_data_parallel_size.unwrap_or_else(|| {
        run_args
            .get("data_parallel_size")
            .or_else(|| {
                run_args
                    .as_object()?
                    .values()
                    .find_map(|group| group.get("data_parallel_size"))
            })
            .and_then(|v| v.as_u64())
            .map_or(1, |d| d.max(1) as usize)
    });
    if let Some(experts) = args.target_expert_parallel_size.filter(|&e| e != 1) {
        if !matches!(args.saver, Saver::Core) {
            bail_usage!(
                "--target-expert-parallel-size {experts}: only Megatron's formats (--saver core) are written for expert-parallel runs; the other outputs hold every expert"
            );
        }
    }
    let staging = staging_for(&save_dir)?;
    let bar = TensorBytesBar::new(format!("writing {}", save_dir.display()));
    bar.total(state.bytes() as u64);
    let saved = reporting_progress(bar.clone(), || match args.saver {
        Saver::MegatronRs => save_megatron_rs(&state, &staging, target),
        Saver::Core if args.ckpt_format == "torch_dist" => save_megatron_torch_dist(
            &state,
            &staging,
            target,
            data_parallel,
            true,
            args.target_expert_parallel_size.unwrap_or(1),
        ),
        Saver::Core => save_megatron_torch_experts(
            &state,
            &staging,
            target,
            args.target_expert_parallel_size.unwrap_or(1),
            false,
        ),
        Saver::Hf => {
            let given = TokenizerFiles {
                vocab_file: args.vocab_file.clone(),
                merge_file: args.merge_file.clone(),
                tokenizer_model: args.tokenizer_model.clone(),
            };
            let tokenizer = tokenizer_export(&state.run.args, &given)?;
            for warning in &tokenizer.warnings {
                eprintln!("warning: {warning}");
            }
            save_hf(&state, &staging, &tokenizer)
        }
    });
    commit(&staging, &save_dir, || saved)?;
    bar.finish();
    let bytes = state.bytes();
    let seconds = started.elapsed().as_secs_f64();
    let gigabytes = bytes as f64 / 1e9;
    println!(
        "checkpoint_convert: {} tensors{} ({gigabytes:.3} GB) from {} to {} (TP={} PP={}), {seconds:.1} s ({:.2} GB/s)",
        state.weights.len(),
        if state.optimizer.is_some() { " with optimizer state" } else { "" },
        state.source,
        save_dir.display(),
        target.tensor,
        target.pipeline,
        gigabytes / seconds.max(1e-9)
    );
    if args.verify {
        let written = if args.saver == Saver::Hf {
            load_hf(&save_dir, state.config.make_vocab_size_divisible_by, None)?
        } else if args.saver == Saver::Core {
            let options = LoadOptions {
                true_vocab_size: Some(state.config.vocab_size),
                optimizer: false,
                make_vocab_size_divisible_by: None,
            };
            let directory = megatron_checkpoint::layout::iteration_directory(&save_dir)?;
            if args.ckpt_format == "torch_dist" {
                load_torch_dist(&directory, &options)?
            } else {
                load_megatron_torch(&directory, &options)?
            }
        } else {
            let checkpoint = find_checkpoint(&save_dir)?.context("the output has no checkpoint")?;
            load_megatron_rs(&checkpoint, false)?
        };
        let difference = verify::max_logit_difference(&state, &written)?;
        println!("verify: max |Δ logits| = {difference:e} over 4 sequences");
    }
    Ok(())
}

/// `--save-dir`, which must not exist or be empty.
fn empty_save_dir(args: &ConvertArgs) -> Result<PathBuf> {
    let save_dir = args.save_dir.clone().expect("clap requires --save-dir");
    if save_dir.exists() && std::fs::read_dir(&save_dir)?.next().is_some() {
        bail!("--save-dir {} exists and is not empty", save_dir.display());
    }
    Ok(save_dir)
}

/// Writes `staging` with `write`, then renames it to `save_dir`; on failure removes it.
fn commit(staging: &Path, save_dir: &Path, write: impl FnOnce() -> Result<()>) -> Result<()> {
    if let Err(error) = write() {
        let _ = std::fs::remove_dir_all(staging);
        return Err(error);
    }
    if save_dir.exists() {
        std::fs::remove_dir(save_dir)
            .with_context(|| format!("replacing empty {}", save_dir.display()))?;
    }
    std::fs::rename(staging, save_dir)
        .with_context(|| format!("renaming {} to {}", staging.display(), save_dir.display()))
}

/// `--model-type T5`: our T5 checkpoints reshaped to another tensor-parallel size.
fn convert_t5(args: &ConvertArgs) -> Result<()> {
    match args.saver {
        Saver::MegatronRs => {}
        Saver::Hf => bail_usage!(
            "--saver hf: Megatron's T5 has no HuggingFace form (HuggingFace's T5 is another \
             architecture: relative position buckets instead of learned positions, no biases, \
             RMS layer norms); T5 checkpoints are reshaped between megatron-rs layouts"
        ),
        Saver::Core => bail_usage!(
            "--saver core: T5 checkpoints are written as megatron-rs only (--saver megatron-rs)"
        ),
    }
    if args.loader != Loader::MegatronRs {
        bail_usage!(
            "--model-type T5 reads megatron-rs checkpoints only: give --loader megatron-rs"
        );
    }
    if let Some(pipeline) = args.target_pipeline_parallel_size.filter(|&p| p != 1) {
        bail_usage!(
            "--target-pipeline-parallel-size {pipeline}: T5 runs without pipeline parallelism; give 1"
        );
    }
    if let Some(chunks) = args
        .target_virtual_pipeline_parallel_size
        .filter(|&v| v != 1)
    {
        bail_usage!(
            "--target-virtual-pipeline-parallel-size {chunks}: T5 runs without pipeline parallelism"
        );
    }
    let save_dir = empty_save_dir(args)?;
    let load_dir = load_dir(args);
    let checkpoint = find_checkpoint(load_dir)?.with_context(|| {
        format!(
            "{} holds no megatron-rs checkpoint (no latest_checkpointed_iteration.txt)",
            load_dir.display()
        )
    })?;
    let tensor = args
        .target_tensor_parallel_size
        .unwrap_or(checkpoint.metadata.tensor_model_parallel_size);
    let started = Instant::now();
    let bar = TensorBytesBar::new(format!("reshaping {}", load_dir.display()));
    let staging = staging_for(&save_dir)?;
    let mut moved = None;
    commit(&staging, &save_dir, || {
        moved = Some(reporting_progress(bar.clone(), || {
            reshape_t5(&checkpoint, &staging, tensor, !args.no_optimizer)
        })?);
        Ok(())
    })?;
    bar.finish();
    let moved = moved.expect("written above");
    let seconds = started.elapsed().as_secs_f64();
    let gigabytes = moved.bytes as f64 / 1e9;
    println!(
        "checkpoint_convert: {} T5 tensors{} ({gigabytes:.3} GB) from {} to {} (TP={tensor} PP=1), {seconds:.1} s ({:.2} GB/s)",
        moved.tensors,
        if moved.with_optimizer { " with optimizer state" } else { "" },
        checkpoint.directory.display(),
        save_dir.display(),
        gigabytes / seconds.max(1e-9)
    );
    if args.verify {
        let difference = t5_max_logit_difference(load_dir, &save_dir)?;
        println!("verify: max |Δ logits| = {difference:e} over 4 sequences");
    }
    Ok(())
}

/// A fresh sibling of `save_dir` to write into before the rename.
fn staging_for(save_dir: &std::path::Path) -> Result<PathBuf> {
    let name = save_dir
        .file_name()
        .with_context(|| format!("--save-dir {} has no name", save_dir.display()))?
        .to_string_lossy()
        .into_owned();
    let parent = save_dir
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(std::path::Path::new("."));
    std::fs::create_dir_all(parent).with_context(|| format!("creating {}", parent.display()))?;
    let staging = parent.join(format!(".{name}.tmp-{}", std::process::id()));
    if staging.exists() {
        std::fs::remove_dir_all(&staging)?;
    }
    Ok(staging)
}
