//! Training-loop flags: batch geometry, duration, optimizer and schedule, precision, recompute.

use anyhow::{bail, ensure, Result};
use clap::Args;
use megatron_cli::bail_usage;
use megatron_cli::ranges;
use tch::Kind;

use megatron_models::{Recompute, RecomputeMethod};

#[derive(Debug, Clone, Args, serde::Serialize)]
pub struct TrainingArgs {
    /// Samples per micro-batch on each data-parallel rank.
    #[arg(long, value_parser = ranges::at_least_one, allow_hyphen_values = true)]
    pub micro_batch_size: u64,
    /// Samples per optimizer step over all ranks [default: micro batch × data-parallel size].
    #[arg(long, value_parser = ranges::at_least_one, allow_hyphen_values = true)]
    pub global_batch_size: Option<u64>,
    /// Ramp the global batch: START INCREMENT RAMP_SAMPLES (sample-based training).
    #[arg(long, num_args = 3, value_names = ["START", "INCREMENT", "RAMP_SAMPLES"])]
    pub rampup_batch_size: Option<Vec<u64>>,
    /// Megatron's step-wise global batch sizes, "THRESHOLD:BATCH THRESHOLD:BATCH ...": from
    /// THRESHOLD tokens on (K, M, B, T suffixes; the first 0), the global batch is BATCH
    /// (sample-based training; instead of --global-batch-size).
    #[arg(long, conflicts_with_all = ["global_batch_size", "rampup_batch_size"])]
    pub step_batch_size_schedule: Option<String>,
    /// With --rampup-batch-size, shrink the batch instead of failing when it is not divisible.
    #[arg(long)]
    pub decrease_batch_size_if_needed: bool,
    /// Iterations to train for (or use --train-samples).
    #[arg(long)]
    pub train_iters: Option<u64>,
    /// Samples to train for (or use --train-iters).
    #[arg(long)]
    pub train_samples: Option<u64>,
    /// Save (if --save) and exit when the iteration is a multiple of this.
    #[arg(long)]
    pub exit_interval: Option<u64>,
    /// Save (if --save) and exit after this many minutes of training.
    #[arg(long, value_parser = ranges::positive, allow_hyphen_values = true)]
    pub exit_duration_in_mins: Option<f64>,
    /// Accepted for compatibility: SIGTERM always makes the run save (if --save) and exit
    /// after the current iteration.
    #[arg(long)]
    pub exit_signal_handler: bool,
    /// Random seed for initialisation, dropout and data shuffling.
    #[arg(long, default_value_t = 1234)]
    pub seed: u64,
    /// Bitwise-reproducible kernels (slower); runs are repeatable and resumable bit for bit.
    #[arg(long)]
    pub deterministic_mode: bool,
    /// Run validation every N iterations.
    #[arg(long, default_value_t = 1000)]
    pub eval_interval: u64,
    /// Global batches per validation/test evaluation.
    #[arg(long, default_value_t = 100)]
    pub eval_iters: u64,
    /// Only evaluate (validation and test) the loaded model.
    #[arg(long)]
    pub skip_train: bool,
    /// Where to train: auto (this rank's CUDA device if there is one, else the CPU), cpu, cuda
    /// or cuda:N.
    #[arg(long, default_value = "auto")]
    pub device: String,
    /// Replay each micro-batch's forward and backward from a CUDA graph captured after the
    /// warm-up steps: one launch instead of a thousand kernel launches, and no gaps while the
    /// host queues work. On a GPU without pipeline parallelism or activation recomputation;
    /// otherwise the run says why and trains without graphs. With several data-parallel ranks
    /// it sets --overlap-grad-reduce and --overlap-param-gather aside. GPT and BERT runs that
    /// can use graphs use them without this flag (a replay computes the eager step's bits),
    /// unless they ask for --overlap-grad-reduce over several data-parallel ranks or memory is
    /// short; --no-cuda-graph turns that off.
    #[arg(long, conflicts_with = "no_cuda_graph")]
    pub enable_cuda_graph: bool,
    /// Never replay micro-batches from CUDA graphs (megatron-rs's own flag: GPT and BERT runs
    /// that can use them do by default).
    #[arg(long)]
    pub no_cuda_graph: bool,
    /// Eager iterations before the graph is captured (at least one).
    #[arg(long, default_value_t = 3)]
    pub cuda_graph_warmup_steps: u64,
    /// Accepted for Megatron's scripts: full, attn or full_iteration. Every scope captures the
    /// whole forward and backward of a micro-batch (the optimizer step stays outside the graph).
    #[arg(long, default_value = "full", value_parser = ["full", "attn", "full_iteration"])]
    pub cuda_graph_scope: String,
    /// Megatron's training-script capture through Transformer Engine: here the same as
    /// --enable-cuda-graph.
    #[arg(long, conflicts_with = "no_cuda_graph")]
    pub external_cuda_graph: bool,
    /// Run libtorch's dropout on each attention and MLP output before its residual add, instead
    /// of dropping it out inside the fused residual add + norm kernel on GPUs (Megatron's default
    /// `--bias-dropout-fusion`); this flag turns the fusion off.
    #[arg(long)]
    pub no_bias_dropout_fusion: bool,
    /// Divide the summed token losses by the non-masked tokens of the whole global batch (over
    /// its micro-batches and data-parallel ranks) instead of averaging each micro-batch's loss
    /// over its own tokens and then over the micro-batches. Changes the gradients when the loss
    /// mask leaves micro-batches different numbers of tokens; the logged loss is the global
    /// per-token mean either way.
    #[arg(long)]
    pub calculate_per_token_loss: bool,
}

#[derive(Debug, Clone, Args, serde::Serialize)]
pub struct OptimizerArgs {
    /// adam (AdamW, decoupled weight decay) or sgd.
    #[arg(long, default_value = "adam", value_parser = ["adam", "sgd"], hide_possible_values = true)]
    pub optimizer: String,
    #[arg(long, default_value_t = 0.9, value_parser = ranges::below_one, allow_hyphen_values = true)]
    pub adam_beta1: f64,
    #[arg(long, default_value_t = 0.999, value_parser = ranges::below_one, allow_hyphen_values = true)]
    pub adam_beta2: f64,
    #[arg(long, default_value_t = 1e-8, value_parser = ranges::positive, allow_hyphen_values = true)]
    pub adam_eps: f64,
    #[arg(long, default_value_t = 0.9, value_parser = ranges::below_one, allow_hyphen_values = true)]
    pub sgd_momentum: f64,
    /// Clip the global gradient norm to this (0 disables).
    #[arg(long, default_value_t = 1.0, value_parser = ranges::non_negative, allow_hyphen_values = true)]
    pub clip_grad: f64,
    /// Compute the weight gradients of linear layers straight into the float32 gradient
    /// buffer instead of a bf16/fp16 gradient that is then added to it (Megatron's default
    /// `--gradient-accumulation-fusion`); this flag turns it off.
    #[arg(long)]
    pub no_gradient_accumulation_fusion: bool,
    /// Peak learning rate.
    #[arg(long, value_parser = ranges::non_negative, allow_hyphen_values = true)]
    pub lr: Option<f64>,
    /// Learning rate at the end of the decay.
    #[arg(long, default_value_t = 0.0, value_parser = ranges::non_negative, allow_hyphen_values = true)]
    pub min_lr: f64,
    /// constant, linear, cosine, inverse-square-root or WSD.
    #[arg(
        long,
        default_value = "linear",
        value_parser = ["constant", "linear", "cosine", "inverse-square-root", "WSD"],
        hide_possible_values = true
    )]
    pub lr_decay_style: String,
    /// Iterations to decay over [default: --train-iters].
    #[arg(long)]
    pub lr_decay_iters: Option<u64>,
    /// Samples to decay over [default: --train-samples].
    #[arg(long)]
    pub lr_decay_samples: Option<u64>,
    /// Warm-up as a fraction of the decay steps.
    #[arg(long, value_parser = ranges::probability, allow_hyphen_values = true)]
    pub lr_warmup_fraction: Option<f64>,
    /// Warm-up iterations.
    #[arg(long, default_value_t = 0)]
    pub lr_warmup_iters: u64,
    /// Warm-up samples.
    #[arg(long, default_value_t = 0)]
    pub lr_warmup_samples: u64,
    /// Learning rate at the start of warm-up.
    #[arg(long, default_value_t = 0.0, value_parser = ranges::non_negative, allow_hyphen_values = true)]
    pub lr_warmup_init: f64,
    /// Annealing shape of WSD: linear, cosine, exponential or minus_sqrt.
    #[arg(
        long,
        default_value = "exponential",
        value_parser = ["linear", "cosine", "exponential", "minus_sqrt"],
        hide_possible_values = true
    )]
    pub lr_wsd_decay_style: String,
    /// WSD annealing iterations.
    #[arg(long)]
    pub lr_wsd_decay_iters: Option<u64>,
    /// WSD annealing samples.
    #[arg(long)]
    pub lr_wsd_decay_samples: Option<u64>,
    /// Decoupled weight decay of matrices (biases and norm weights are never decayed).
    #[arg(long, default_value_t = 0.01, value_parser = ranges::non_negative, allow_hyphen_values = true)]
    pub weight_decay: f64,
    /// Weight decay at the start of training (with --weight-decay-incr-style).
    #[arg(long, value_parser = ranges::non_negative, allow_hyphen_values = true)]
    pub start_weight_decay: Option<f64>,
    /// Weight decay at the end of training (with --weight-decay-incr-style).
    #[arg(long, value_parser = ranges::non_negative, allow_hyphen_values = true)]
    pub end_weight_decay: Option<f64>,
    /// constant, linear or cosine.
    #[arg(long, default_value = "constant", value_parser = ["constant", "linear", "cosine"], hide_possible_values = true)]
    pub weight_decay_incr_style: String,
    /// Peak learning rate of the input word embeddings and the output layer, on the same
    /// schedule as --lr (warm-up, decay) [default: --lr].
    #[arg(long)]
    pub decoupled_lr: Option<f64>,
    /// Learning rate at the end of the decay for the input word embeddings and the output
    /// layer, with --decoupled-lr [default: --min-lr].
    #[arg(long)]
    pub decoupled_min_lr: Option<f64>,
    /// On load, take the scheduler settings from the command line.
    #[arg(long = "override-opt_param-scheduler")]
    pub override_opt_param_scheduler: bool,
    /// On load, take the scheduler settings from the checkpoint.
    #[arg(long = "use-checkpoint-opt_param-scheduler")]
    pub use_checkpoint_opt_param_scheduler: bool,
}

#[derive(Debug, Clone, Args, serde::Serialize)]
pub struct MixedPrecisionArgs {
    /// bfloat16 parameters and activations, float32 main weights and gradients.
    #[arg(long, conflicts_with = "fp16")]
    pub bf16: bool,
    /// float16 parameters and activations with loss scaling, float32 main weights.
    #[arg(long)]
    pub fp16: bool,
    /// A static loss scale (fp16); without it the scale is dynamic.
    #[arg(long, value_parser = ranges::positive_f32, allow_hyphen_values = true)]
    pub loss_scale: Option<f32>,
    /// Initial dynamic loss scale.
    #[arg(long, default_value_t = 4294967296.0, value_parser = ranges::positive_f32, allow_hyphen_values = true)]
    pub initial_loss_scale: f32,
    /// Minimum dynamic loss scale.
    #[arg(long, default_value_t = 1.0, value_parser = ranges::positive_f32, allow_hyphen_values = true)]
    pub min_loss_scale: f32,
    /// Good iterations before the dynamic scale doubles.
    #[arg(long, default_value_t = 1000)]
    pub loss_scale_window: u64,
    /// Overflows tolerated before the dynamic scale halves.
    #[arg(long, default_value_t = 2)]
    pub hysteresis: u64,
    /// Accepted for compatibility: gradients always accumulate and are reduced in float32.
    #[arg(long)]
    pub accumulate_allreduce_grads_in_fp32: bool,
}

impl MixedPrecisionArgs {
    pub fn params_dtype(&self) -> Kind {
        if self.bf16 {
            Kind::BFloat16
        } else if self.fp16 {
            Kind::Half
        } else {
            Kind::Float
        }
    }
}

#[derive(Debug, Clone, Args, serde::Serialize)]
pub struct RecomputeArgs {
    /// Recompute the attention core in backward (= --recompute-granularity selective).
    #[arg(long)]
    pub recompute_activations: bool,
    /// full or selective.
    #[arg(long, value_parser = ["full", "selective"], hide_possible_values = true)]
    pub recompute_granularity: Option<String>,
    /// uniform or block (with --recompute-granularity full).
    #[arg(long, value_parser = ["uniform", "block"], hide_possible_values = true)]
    pub recompute_method: Option<String>,
    /// Layers per recomputed chunk (uniform) or recomputed layers (block).
    #[arg(long, default_value_t = 1)]
    pub recompute_num_layers: usize,
}

impl RecomputeArgs {
    pub fn recompute(&self) -> Result<Recompute> {
        let granularity = match (&self.recompute_granularity, self.recompute_activations) {
            (Some(g), _) => g.as_str(),
            (None, true) => "selective",
            (None, false) => return Ok(Recompute::None),
        };
        match granularity {
            "selective" => Ok(Recompute::Selective),
            "full" => {
                let method = match self.recompute_method.as_deref() {
                    Some("uniform") => RecomputeMethod::Uniform,
                    Some("block") => RecomputeMethod::Block,
                    Some(other) => bail!("--recompute-method {other:?}: expected uniform or block"),
                    None => bail_usage!(
                        "--recompute-granularity full needs --recompute-method uniform or block"
                    ),
                };
                ensure!(
                    self.recompute_num_layers > 0,
                    "--recompute-num-layers must be positive"
                );
                Ok(Recompute::Full {
                    method,
                    num_layers: self.recompute_num_layers,
                })
            }
            other => bail!("--recompute-granularity {other:?}: expected full or selective"),
        }
    }
}
