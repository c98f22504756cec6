//! The flags every binary that loads a trained checkpoint shares (`eval_tasks`,
//! `text_generation_server`, `generate_samples_gpt`), with Megatron's `--use-checkpoint-args`
//! semantics: Megatron's scripts pass the architecture again, so those flags are accepted and
//! checked against the checkpoint's metadata (a mismatch is an error naming both values);
//! run-time flags (precision, batch size, seed, parallel sizes) take effect; flags that have no
//! meaning here are accepted and ignored with a one-line note.

use std::mem::discriminant;
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use anyhow::{bail, ensure, Context, Result};
use clap::Args;
use megatron_cli::{bail_usage, usage_error};
use tch::{Device, Kind};

use megatron_checkpoint::layout::Format;
use megatron_models::{
    Activation, GptModel, Normalization, PositionEmbeddingType, RopeScaling, RopeScalingArgs,
    T5Config, T5Model, TransformerConfig,
};
use megatron_parallel::{
    join_launched_job, Backend, Job, JoinOptions, LaunchEnv, ParallelState, Placement,
};
use megatron_store::{checkpoint_config, load_for_inference};

#[derive(Debug, Clone, Args)]
pub struct CheckpointModelArgs {
    /// Checkpoint directory (the iteration its tracker names is used; any TP/PP layout).
    #[arg(long, required_unless_present_any = ["pretrained_checkpoint", "load_hf"])]
    pub load: Option<PathBuf>,
    /// Weights to evaluate when --load is not given (Megatron's tasks accept either).
    #[arg(long)]
    pub pretrained_checkpoint: Option<PathBuf>,
    /// A HuggingFace checkpoint directory (GPT2LMHeadModel, LlamaForCausalLM,
    /// MistralForCausalLM, Qwen2ForCausalLM) to use instead of --load, imported on the fly with
    /// checkpoint_convert's loader.
    #[arg(long, conflicts_with_all = ["load", "pretrained_checkpoint"])]
    pub load_hf: Option<PathBuf>,
    /// The import of a --load-hf checkpoint, or of a Megatron one given to --load, made once
    /// and removed when the flags are dropped.
    #[arg(skip)]
    imported: Arc<OnceLock<tempfile::TempDir>>,
    /// auto, cpu, cuda or cuda:N.
    #[arg(long, default_value = "auto")]
    pub device: String,
    /// Do not verify the checkpoint's per-file checksums (recorded in its metadata.json).
    #[arg(long)]
    pub no_checkpoint_checksums: bool,

    // The architecture: taken from the checkpoint; when given, checked against it.
    /// Checked against the checkpoint.
    #[arg(long, help_heading = "Architecture (checked against the checkpoint)")]
    pub num_layers: Option<usize>,
    /// Checked against the checkpoint.
    #[arg(long, help_heading = "Architecture (checked against the checkpoint)")]
    pub hidden_size: Option<i64>,
    /// Checked against the checkpoint.
    #[arg(long, help_heading = "Architecture (checked against the checkpoint)")]
    pub ffn_hidden_size: Option<i64>,
    /// Checked against the checkpoint.
    #[arg(long, help_heading = "Architecture (checked against the checkpoint)")]
    pub num_attention_heads: Option<i64>,
    /// Checked against the checkpoint.
    #[arg(long, help_heading = "Architecture (checked against the checkpoint)")]
    pub kv_channels: Option<i64>,
    /// Checked against the checkpoint.
    #[arg(long, help_heading = "Architecture (checked against the checkpoint)")]
    pub group_query_attention: bool,
    /// Checked against the checkpoint (with --group-query-attention).
    #[arg(long, help_heading = "Architecture (checked against the checkpoint)")]
    pub num_query_groups: Option<i64>,
    /// Checked against the checkpoint.
    #[arg(long, help_heading = "Architecture (checked against the checkpoint)")]
    pub max_position_embeddings: Option<i64>,
    /// Checked against the checkpoint: learned_absolute, rope, yarn or none.
    #[arg(long, help_heading = "Architecture (checked against the checkpoint)")]
    pub position_embedding_type: Option<String>,
    /// Megatron's older spelling of --position-embedding-type rope (checked the same way).
    #[arg(long, help_heading = "Architecture (checked against the checkpoint)")]
    pub use_rotary_position_embeddings: bool,
    /// Checked against the checkpoint.
    #[arg(long, help_heading = "Architecture (checked against the checkpoint)")]
    pub rotary_percent: Option<f64>,
    /// Checked against the checkpoint.
    #[arg(long, help_heading = "Architecture (checked against the checkpoint)")]
    pub rotary_base: Option<f64>,
    /// RoPE scaling, checked against the checkpoint's (its kind and factor).
    #[command(
        flatten,
        next_help_heading = "Architecture (checked against the checkpoint)"
    )]
    pub rope: RopeScalingArgs,
    /// Checked against the checkpoint.
    #[arg(long, help_heading = "Architecture (checked against the checkpoint)")]
    pub make_vocab_size_divisible_by: Option<i64>,
    /// Checked against the checkpoint: LayerNorm or RMSNorm.
    #[arg(long, help_heading = "Architecture (checked against the checkpoint)")]
    pub normalization: Option<String>,
    /// Checked against the checkpoint (alias: --layernorm-epsilon).
    #[arg(
        long,
        alias = "layernorm-epsilon",
        help_heading = "Architecture (checked against the checkpoint)"
    )]
    pub norm_epsilon: Option<f64>,
    /// Checked against the checkpoint.
    #[arg(long, help_heading = "Architecture (checked against the checkpoint)")]
    pub apply_layernorm_1p: bool,
    /// Checked against the checkpoint.
    #[arg(long, help_heading = "Architecture (checked against the checkpoint)")]
    pub swiglu: bool,
    /// Checked against the checkpoint.
    #[arg(long, help_heading = "Architecture (checked against the checkpoint)")]
    pub squared_relu: bool,
    /// Checked against the checkpoint.
    #[arg(long, help_heading = "Architecture (checked against the checkpoint)")]
    pub openai_gelu: bool,
    /// Checked against the checkpoint (exact erf GeLU).
    #[arg(long, help_heading = "Architecture (checked against the checkpoint)")]
    pub no_bias_gelu_fusion: bool,
    /// Checked against the checkpoint.
    #[arg(long, help_heading = "Architecture (checked against the checkpoint)")]
    pub disable_bias_linear: bool,
    /// Checked against the checkpoint.
    #[arg(long, help_heading = "Architecture (checked against the checkpoint)")]
    pub add_qkv_bias: bool,
    /// Checked against the checkpoint.
    #[arg(long, help_heading = "Architecture (checked against the checkpoint)")]
    pub untie_embeddings_and_output_weights: bool,
    /// Checked against the checkpoint.
    #[arg(long, help_heading = "Architecture (checked against the checkpoint)")]
    pub apply_residual_connection_post_layernorm: bool,

    // Run-time flags: they take effect.
    /// Longest sequence the tool feeds the model (at most the checkpoint's
    /// --max-position-embeddings; text_generation_server's KV cache must hold one sequence
    /// of it) [default: the checkpoint's --max-position-embeddings].
    #[arg(long, help_heading = "Run time", value_parser = at_least_one)]
    pub seq_length: Option<usize>,
    /// Run the model in float16 (GPUs; on a CPU float32 is used).
    #[arg(long, help_heading = "Run time", conflicts_with = "bf16")]
    pub fp16: bool,
    /// Run the model in bfloat16.
    #[arg(long, help_heading = "Run time")]
    pub bf16: bool,
    /// Sequences per forward pass.
    #[arg(long, help_heading = "Run time")]
    pub micro_batch_size: Option<usize>,
    /// Seed of the random generators (sampling).
    #[arg(long, default_value_t = 1234, help_heading = "Run time")]
    pub seed: u64,
    /// Split the model over this many GPUs (processes launched by torchrun or srun), whatever
    /// layout it was saved in.
    #[arg(long, default_value_t = 1, help_heading = "Run time")]
    pub tensor_model_parallel_size: usize,
    /// Must be 1: inference tools merge a checkpoint's pipeline stages into one model.
    #[arg(long, default_value_t = 1, help_heading = "Run time")]
    pub pipeline_model_parallel_size: usize,
    /// Minutes ranks wait for each other at start-up.
    #[arg(long, default_value_t = 10.0, help_heading = "Run time")]
    pub distributed_timeout_minutes: f64,

    // Accepted for Megatron's scripts; nothing to do here.
    /// Accepted (the architecture always comes from the checkpoint).
    #[arg(long, help_heading = "Accepted and ignored")]
    pub use_checkpoint_args: bool,
    /// Accepted (inference loads no optimizer state).
    #[arg(long, help_heading = "Accepted and ignored")]
    pub no_load_optim: bool,
    /// Accepted (inference loads no generator state).
    #[arg(long, help_heading = "Accepted and ignored")]
    pub no_load_rng: bool,
    /// Accepted (attention always runs through libtorch's SDPA, flash attention on GPUs).
    #[arg(long, help_heading = "Accepted and ignored")]
    pub use_flash_attn: bool,
    /// Accepted (weights come from the checkpoint).
    #[arg(long, help_heading = "Accepted and ignored")]
    pub use_cpu_initialization: bool,
    /// Accepted (a mathematical no-op).
    #[arg(long, help_heading = "Accepted and ignored")]
    pub apply_query_key_layer_scaling: bool,
    /// Accepted (the SDPA softmax accumulates in float32).
    #[arg(long, help_heading = "Accepted and ignored")]
    pub attention_softmax_in_fp32: bool,
    /// Accepted (the model is Megatron-core's GPT).
    #[arg(long, help_heading = "Accepted and ignored")]
    pub use_mcore_models: bool,
    /// Accepted (the model is Megatron-core's GPT).
    #[arg(long, help_heading = "Accepted and ignored")]
    pub use_legacy_models: bool,
    /// Accepted: local or transformer_engine.
    #[arg(long, help_heading = "Accepted and ignored")]
    pub transformer_impl: Option<String>,
    /// Accepted (GPUs use NCCL, CPU processes TCP).
    #[arg(long, help_heading = "Accepted and ignored")]
    pub distributed_backend: Option<String>,
    /// Accepted (checkpoints are safetensors).
    #[arg(long, help_heading = "Accepted and ignored")]
    pub ckpt_format: Option<String>,
    /// Accepted (inference runs without dropout).
    #[arg(long, help_heading = "Accepted and ignored")]
    pub hidden_dropout: Option<f64>,
    /// Accepted (inference runs without dropout).
    #[arg(long, help_heading = "Accepted and ignored")]
    pub attention_dropout: Option<f64>,
    /// Accepted (weights come from the checkpoint).
    #[arg(long, help_heading = "Accepted and ignored")]
    pub init_method_std: Option<f64>,
    /// Accepted (no data loader workers: data is prepared in the process).
    #[arg(long, help_heading = "Accepted and ignored")]
    pub num_workers: Option<usize>,
    /// Accepted (inference runs one micro-batch at a time).
    #[arg(long, help_heading = "Accepted and ignored")]
    pub global_batch_size: Option<usize>,
    /// Accepted (no fusion flags: libtorch picks its kernels).
    #[arg(long, help_heading = "Accepted and ignored")]
    pub no_masked_softmax_fusion: bool,
    /// Accepted (no fusion flags: libtorch picks its kernels).
    #[arg(long, help_heading = "Accepted and ignored")]
    pub no_bias_dropout_fusion: bool,
    /// Accepted (no fusion flags: libtorch picks its kernels).
    #[arg(long, help_heading = "Accepted and ignored")]
    pub no_gradient_accumulation_fusion: bool,
    /// Accepted (sequence parallelism only applies to training).
    #[arg(long, help_heading = "Accepted and ignored")]
    pub sequence_parallel: bool,
    /// Accepted (the launch environment names this process's GPU).
    #[arg(long, help_heading = "Accepted and ignored")]
    pub local_rank: Option<usize>,
}

/// A count flag's value: a whole number of at least 1 (clap's value parser, so that 0 is a
/// usage error saying so).
pub fn at_least_one(value: &str) -> Result<usize, String> {
    match value.parse::<usize>() {
        Ok(0) => Err("must be at least 1".into()),
        Ok(count) => Ok(count),
        Err(e) => Err(e.to_string()),
    }
}

fn text(value: Option<impl ToString>) -> Option<String> {
    value.map(|v| v.to_string())
}

/// A flag given on the command line whose value disagrees with the checkpoint.
/// The flag that gives a scaling's factor.
fn factor_flag(scaling: &RopeScaling) -> &'static str {
    match scaling {
        RopeScaling::Llama3(_) => "--rope-scaling-factor",
        RopeScaling::Linear { .. } => "--rotary-seq-len-interpolation-factor",
        RopeScaling::Yarn(_) => "--rotary-scaling-factor",
    }
}

fn mismatch(
    flag: &str,
    given: impl std::fmt::Display,
    saved: impl std::fmt::Display,
    dir: &Path,
) -> anyhow::Error {
    anyhow::anyhow!(
        "{flag} {given} does not match the checkpoint {} ({saved}); drop the flag or load the right checkpoint",
        dir.display()
    )
}

impl CheckpointModelArgs {
    /// `--load`, else `--pretrained-checkpoint`; a HuggingFace (`--load-hf`) or Megatron
    /// (`torch`, `torch_dist`) checkpoint is imported into one of ours first.
    pub fn checkpoint(&self) -> Result<&Path> {
        let given = self.given_checkpoint()?;
        let loader = if self.load_hf.is_some() {
            "hf"
        } else {
            match megatron_checkpoint::layout::detect(given) {
                Ok((Format::MegatronTorch | Format::TorchDist, _)) => "core",
                _ => return Ok(given),
            }
        };
        if self.imported.get().is_none() {
            // A concurrent import loses the race and is dropped; both are the same model.
            let _ = self
                .imported
                .set(import(given, loader, self.make_vocab_size_divisible_by)?);
        }
        let imported = self.imported.get().expect("the import was just made");
        Ok(imported.path())
    }

    /// The checkpoint directory as the flags name it (`--load-hf`, `--load` or
    /// `--pretrained-checkpoint`), before any import.
    pub fn given_checkpoint(&self) -> Result<&Path> {
        self.load_hf
            .as_deref()
            .or(self.load.as_deref())
            .or(self.pretrained_checkpoint.as_deref())
            .ok_or_else(|| {
                usage_error("give the checkpoint with --load (or --pretrained-checkpoint)")
            })
    }

    /// One line per given flag that has no effect in `tool`, for the user to see.
    pub fn ignored_flag_notes(&self, tool: &str) -> Vec<String> {
        let given = [
            ("--use-checkpoint-args", self.use_checkpoint_args),
            ("--no-load-optim", self.no_load_optim),
            ("--no-load-rng", self.no_load_rng),
            ("--use-flash-attn", self.use_flash_attn),
            ("--use-cpu-initialization", self.use_cpu_initialization),
            (
                "--apply-query-key-layer-scaling",
                self.apply_query_key_layer_scaling,
            ),
            (
                "--attention-softmax-in-fp32",
                self.attention_softmax_in_fp32,
            ),
            ("--use-mcore-models", self.use_mcore_models),
            ("--use-legacy-models", self.use_legacy_models),
            ("--transformer-impl", self.transformer_impl.is_some()),
            ("--distributed-backend", self.distributed_backend.is_some()),
            ("--ckpt-format", self.ckpt_format.is_some()),
            ("--hidden-dropout", self.hidden_dropout.is_some()),
            ("--attention-dropout", self.attention_dropout.is_some()),
            ("--init-method-std", self.init_method_std.is_some()),
            ("--num-workers", self.num_workers.is_some()),
            ("--global-batch-size", self.global_batch_size.is_some()),
            ("--no-masked-softmax-fusion", self.no_masked_softmax_fusion),
            ("--no-bias-dropout-fusion", self.no_bias_dropout_fusion),
            (
                "--no-gradient-accumulation-fusion",
                self.no_gradient_accumulation_fusion,
            ),
            ("--sequence-parallel", self.sequence_parallel),
            ("--local-rank", self.local_rank.is_some()),
        ];
        given
            .iter()
            .filter(|(_, on)| *on)
            .map(|(flag, _)| format!("note: {flag} does not apply to {tool}; ignored"))
            .collect()
    }

    /// Prints [`ignored_flag_notes`](Self::ignored_flag_notes) to stderr.
    pub fn print_ignored_flag_notes(&self, tool: &str) {
        for note in self.ignored_flag_notes(tool) {
            eprintln!("{note}");
        }
    }

    /// The parameter dtype `--fp16` / `--bf16` ask for on `device` (float16 runs as float32
    /// on a CPU, where libtorch's half-precision kernels are incomplete).
    pub fn dtype(&self, device: Device) -> Kind {
        if self.bf16 {
            Kind::BFloat16
        } else if self.fp16 && device.is_cuda() {
            Kind::Half
        } else {
            Kind::Float
        }
    }

    /// The checks that do not need the checkpoint.
    pub fn validate_run_time(&self, world_size: usize) -> Result<()> {
        if self.pipeline_model_parallel_size != 1 {
            bail_usage!(
                "--pipeline-model-parallel-size {}: inference tools merge a checkpoint's pipeline stages into one model \
                 (any saved layout loads); give 1 and split with --tensor-model-parallel-size",
                self.pipeline_model_parallel_size
            );
        }
        if world_size != self.tensor_model_parallel_size {
            bail_usage!(
                "{world_size} processes were launched for --tensor-model-parallel-size {}; \
                 inference runs one process per tensor-parallel rank",
                self.tensor_model_parallel_size
            );
        }
        if self.micro_batch_size == Some(0) {
            bail_usage!("--micro-batch-size must be at least 1");
        }
        Ok(())
    }

    /// Every architecture flag given must agree with `config`, saved in `dir`.
    pub fn check_architecture(&self, config: &TransformerConfig, dir: &Path) -> Result<()> {
        let check = |flag: &str, given: Option<String>, saved: String| -> Result<()> {
            match given {
                Some(given) if given != saved => Err(mismatch(flag, given, saved, dir)),
                _ => Ok(()),
            }
        };
        check(
            "--num-layers",
            text(self.num_layers),
            config.num_layers.to_string(),
        )?;
        check(
            "--hidden-size",
            text(self.hidden_size),
            config.hidden_size.to_string(),
        )?;
        check(
            "--ffn-hidden-size",
            text(self.ffn_hidden_size),
            config.ffn_hidden_size.to_string(),
        )?;
        check(
            "--num-attention-heads",
            text(self.num_attention_heads),
            config.num_attention_heads.to_string(),
        )?;
        check(
            "--kv-channels",
            text(self.kv_channels),
            config.kv_channels.to_string(),
        )?;
        if self.group_query_attention {
            check(
                "--num-query-groups",
                text(Some(self.num_query_groups.unwrap_or(1))),
                config.num_query_groups.to_string(),
            )?;
        }
        check(
            "--max-position-embeddings",
            text(self.max_position_embeddings),
            config.max_position_embeddings.to_string(),
        )?;
        let rope = self
            .use_rotary_position_embeddings
            .then(|| "rope".to_string());
        if let Some(kind) = rope.as_ref().or(self.position_embedding_type.as_ref()) {
            let given = PositionEmbeddingType::parse(kind)?;
            if given != config.position_embedding_type {
                return Err(mismatch(
                    "--position-embedding-type",
                    kind,
                    format!("{:?}", config.position_embedding_type),
                    dir,
                ));
            }
        }
        let close = |flag: &str, given: Option<f64>, saved: f64| -> Result<()> {
            match given {
                Some(given) if (given - saved).abs() > 1e-12 * saved.abs().max(1.0) => {
                    Err(mismatch(flag, given, saved, dir))
                }
                _ => Ok(()),
            }
        };
        if config.position_embedding_type == PositionEmbeddingType::Rope {
            close(
                "--rotary-percent",
                self.rotary_percent,
                config.rotary_percent,
            )?;
            close("--rotary-base", self.rotary_base, config.rotary_base)?;
            let kind = self.position_embedding_type.as_deref().unwrap_or("rope");
            if let Some(given) = self.rope.scaling(kind).map_err(usage_error)? {
                let saved = config.rope_scaling;
                match saved.filter(|saved| discriminant(saved) == discriminant(&given)) {
                    Some(saved) => {
                        close(factor_flag(&given), Some(given.factor()), saved.factor())?
                    }
                    None => {
                        let saved = saved.map_or("no rope scaling".into(), |s| format!("{s:?}"));
                        return Err(mismatch(given.flag(), "is given", saved, dir));
                    }
                }
            }
        }
        close("--norm-epsilon", self.norm_epsilon, config.norm_epsilon)?;
        check(
            "--make-vocab-size-divisible-by",
            text(self.make_vocab_size_divisible_by),
            config.make_vocab_size_divisible_by.to_string(),
        )?;
        if let Some(norm) = &self.normalization {
            if Normalization::parse(norm)? != config.normalization {
                return Err(mismatch(
                    "--normalization",
                    norm,
                    format!("{:?}", config.normalization),
                    dir,
                ));
            }
        }
        let switch = |flag: &str, given: bool, saved: bool, what: &str| -> Result<()> {
            if given && !saved {
                return Err(mismatch(
                    flag,
                    "is given",
                    format!("it was saved without {what}"),
                    dir,
                ));
            }
            Ok(())
        };
        switch(
            "--apply-layernorm-1p",
            self.apply_layernorm_1p,
            config.apply_layernorm_1p,
            "it",
        )?;
        switch(
            "--swiglu",
            self.swiglu,
            config.activation == Activation::Swiglu,
            "SwiGLU",
        )?;
        switch(
            "--squared-relu",
            self.squared_relu,
            config.activation == Activation::SquaredRelu,
            "squared ReLU",
        )?;
        switch(
            "--openai-gelu",
            self.openai_gelu,
            config.activation == Activation::GeluTanh,
            "tanh GeLU",
        )?;
        if !self.swiglu && !self.squared_relu && !self.openai_gelu {
            switch(
                "--no-bias-gelu-fusion",
                self.no_bias_gelu_fusion,
                config.activation == Activation::GeluErf,
                "erf GeLU",
            )?;
        }
        switch(
            "--disable-bias-linear",
            self.disable_bias_linear,
            !config.add_bias_linear,
            "it (it has biases)",
        )?;
        switch(
            "--add-qkv-bias",
            self.add_qkv_bias,
            config.add_qkv_bias,
            "QKV biases",
        )?;
        switch(
            "--untie-embeddings-and-output-weights",
            self.untie_embeddings_and_output_weights,
            config.untie_embeddings_and_output_weights,
            "it (its output layer is tied)",
        )?;
        switch(
            "--apply-residual-connection-post-layernorm",
            self.apply_residual_connection_post_layernorm,
            config.apply_residual_connection_post_layernorm,
            "it",
        )?;
        if let Some(seq) = self.seq_length {
            if config.position_embedding_type == PositionEmbeddingType::LearnedAbsolute
                && seq as i64 > config.max_position_embeddings
            {
                bail!(
                    "--seq-length {seq} exceeds the checkpoint's --max-position-embeddings {} ({})",
                    config.max_position_embeddings,
                    dir.display()
                );
            }
        }
        Ok(())
    }

    /// The sequence length the tool feeds the model.
    pub fn seq_length_for(&self, config: &TransformerConfig) -> usize {
        self.seq_length
            .unwrap_or(config.max_position_embeddings as usize)
    }

    /// Joins the launched job (one process per tensor-parallel rank, or a single process),
    /// checks the run-time flags and builds this rank's groups on its device.
    pub fn join_job(&self) -> Result<(Job, ParallelState, Device)> {
        self.validate_run_time(LaunchEnv::from_env()?.world_size)?;
        let (job, Placement { parallel, device }) = join_launched_job(&JoinOptions {
            device: &self.device,
            local_rank: None,
            tensor_parallel: self.tensor_model_parallel_size,
            context_parallel: 1,
            pipeline_parallel: 1,
            expert_parallel: None,
            sequence_parallel: false,
            backend: Backend::Nccl,
            timeout: Duration::from_secs_f64(self.distributed_timeout_minutes * 60.0),
        })?;
        Ok((job, parallel, device))
    }

    /// The checkpoint's architecture, once the given flags are checked against it.
    pub fn checked_config(&self) -> Result<TransformerConfig> {
        megatron_store::set_checksums_enabled(!self.no_checkpoint_checksums);
        let (dir, config) = checkpoint_config::<GptModel>(self.checkpoint()?)?;
        self.check_architecture(&config, &dir)?;
        Ok(config)
    }

    /// Reads the checkpoint's architecture, checks the given flags against it and loads the
    /// model for `parallel`'s tensor-parallel rank (any saved layout is merged first).
    pub fn load_model(&self, device: Device, parallel: &ParallelState) -> Result<GptModel> {
        self.checked_config()?;
        load_for_inference(self.checkpoint()?, device, self.dtype(device), parallel)
    }

    /// [`Self::load_model`] for the ids `tokenizer` makes: its vocabulary must be the
    /// checkpoint's.
    pub fn load_model_for(
        &self,
        tokenizer: &dyn megatron_data::tokenizer::Tokenizer,
        device: Device,
        parallel: &ParallelState,
    ) -> Result<GptModel> {
        let model = self.load_model(device, parallel)?;
        ensure!(
            tokenizer.vocab_size() as i64 == model.config.vocab_size,
            "the tokenizer has {} tokens but the checkpoint was trained with {}",
            tokenizer.vocab_size(),
            model.config.vocab_size
        );
        Ok(model)
    }

    /// The checkpoint's T5 architecture, once the given flags are checked against it
    /// (`--num-layers` is the encoder's depth).
    pub fn checked_t5_config(&self) -> Result<T5Config> {
        megatron_store::set_checksums_enabled(!self.no_checkpoint_checksums);
        let (dir, config) = checkpoint_config::<T5Model>(self.checkpoint()?)?;
        self.check_architecture(&config.transformer, &dir)?;
        Ok(config)
    }

    /// [`load_model`](Self::load_model) for a T5 checkpoint.
    pub fn load_t5_model(&self, device: Device, parallel: &ParallelState) -> Result<T5Model> {
        self.checked_t5_config()?;
        load_for_inference(self.checkpoint()?, device, self.dtype(device), parallel)
    }
}

/// `dir` (a HuggingFace checkpoint for `loader` hf, a Megatron one for core) converted into one
/// of ours in a temporary directory, with checkpoint_convert's loader.
fn import(
    dir: &Path,
    loader: &str,
    make_vocab_size_divisible_by: Option<i64>,
) -> Result<tempfile::TempDir> {
    let state = megatron_convert::load_checkpoint(
        dir,
        Some(loader),
        &megatron_convert::LoadOptions {
            true_vocab_size: None,
            optimizer: false,
            make_vocab_size_divisible_by,
        },
    )
    .with_context(|| format!("importing the checkpoint {}", dir.display()))?;
    let imported = tempfile::Builder::new()
        .prefix("megatron-rs-import")
        .tempdir()
        .context("creating a temporary directory for the checkpoint's import")?;
    let single = megatron_convert::TargetLayout {
        tensor: 1,
        pipeline: 1,
        virtual_stages: 1,
    };
    megatron_convert::save_megatron_rs(&state, imported.path(), single)?;
    Ok(imported)
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Flags {
        #[command(flatten)]
        model: CheckpointModelArgs,
    }

    /// The flags `args`, after `--load ckpt`.
    fn parse(args: &[&str]) -> CheckpointModelArgs {
        let argv = ["tool", "--load", "ckpt"].into_iter();
        Flags::try_parse_from(argv.chain(args.iter().copied()))
            .unwrap()
            .model
    }

    #[derive(Parser)]
    struct Training {
        #[command(flatten)]
        model: megatron_training::args::ModelArgs,
    }

    fn config() -> TransformerConfig {
        let argv = [
            "pretrain",
            "--num-layers",
            "2",
            "--hidden-size",
            "64",
            "--num-attention-heads",
            "4",
            "--seq-length",
            "128",
        ];
        Training::try_parse_from(argv)
            .unwrap()
            .model
            .gpt_config(1000)
            .unwrap()
    }

    #[test]
    fn architecture_flags_are_checked() {
        let dir = Path::new("ckpt");
        let ok = parse(&[
            "--num-layers",
            "2",
            "--hidden-size",
            "64",
            "--max-position-embeddings",
            "128",
            "--fp16",
        ]);
        ok.check_architecture(&config(), dir).unwrap();
        let bad = parse(&["--num-layers", "24"]);
        let error = bad
            .check_architecture(&config(), dir)
            .unwrap_err()
            .to_string();
        assert!(
            error.contains("--num-layers 24") && error.contains("(2)"),
            "{error}"
        );
        let bad = parse(&["--swiglu"]);
        assert!(bad.check_architecture(&config(), dir).is_err());
        let bad = parse(&["--seq-length", "256"]);
        assert!(bad
            .check_architecture(&config(), dir)
            .unwrap_err()
            .to_string()
            .contains("--seq-length 256"));
        // The older spelling of rope is checked as rope: this checkpoint has learned positions.
        let rope = parse(&["--use-rotary-position-embeddings"]);
        let error = rope
            .check_architecture(&config(), dir)
            .unwrap_err()
            .to_string();
        assert!(error.contains("--position-embedding-type rope"), "{error}");
    }

    #[test]
    fn run_time_and_ignored_flags() {
        let args = parse(&[
            "--bf16",
            "--use-flash-attn",
            "--transformer-impl",
            "local",
            "--pipeline-model-parallel-size",
            "2",
        ]);
        assert_eq!(args.dtype(Device::Cpu), Kind::BFloat16);
        assert_eq!(
            args.ignored_flag_notes("eval_tasks"),
            [
                "note: --use-flash-attn does not apply to eval_tasks; ignored",
                "note: --transformer-impl does not apply to eval_tasks; ignored"
            ]
        );
        assert!(megatron_cli::is_usage_error(
            &args.validate_run_time(1).unwrap_err()
        ));
        assert_eq!(parse(&["--fp16"]).dtype(Device::Cpu), Kind::Float);
        let missing = Flags::try_parse_from(["tool"]).err().unwrap();
        assert_eq!(
            missing.kind(),
            clap::error::ErrorKind::MissingRequiredArgument
        );
        assert!(Flags::try_parse_from(["tool", "--load-hf", "hf"]).is_ok());
    }
}
