//! The training engine: Megatron's `pretrain()` for any [`ModelFamily`] on one rank of a
//! (possibly single-rank) tensor × pipeline × data-parallel job — set-up from the flags, resume,
//! the iteration loop over the pipeline schedule, evaluation, logging, checkpoints and the exit
//! conditions (spec §4).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, ensure, Context, Result};
use tch::{Device, Kind, Tensor};

use super::async_save::{AsyncSaves, Finalized, Flags};
use super::checkpointing::{self, LoadRequest, Progress, Resumed, SaveRequest, TrainingState};
use super::cuda_graphs::{self, GraphChoice, MicrobatchGraph};
use super::device::peak_tflops_of;
use super::expert_bias::update_expert_biases;
use super::export::{self, CheckpointExport};
use super::flops::{num_floating_point_operations, FlopsModel};
use super::log_line::{format_eval_block, format_iteration_line, local_timestamp, IterationLog};
use super::loss_scale::{LossScaleFlags, LossScaler};
use super::loss_spikes::LossSpikeTracker;
use super::lr_schedule::{
    LrDecayStyle, OptimizerParamScheduler, ScheduleFlags, SchedulerConfig, SchedulerLoadPolicy,
    WdIncrStyle, WsdDecayStyle,
};
use super::memory_report::{ActivationShape, MemoryReport};
use super::microbatches::{
    train_iters_from_samples, BatchRampup, BatchSizeSchedule, MicrobatchCalculator, StepSchedule,
};
use super::moe_losses::MoeLossColumns;
use super::profiling::StepProfiler;
use super::schedules::{forward_backward, ActivationSpec, ScheduleShape};
use super::stage::{FamilyStage, LossScaling};
use crate::args::PretrainArgs;
use crate::families::{LossTotals, ModelFamily};
use crate::metrics::{EvalSplit, TrainingMetrics};
use megatron_cli::signals::{exit_requested, install_exit_handler};
use megatron_cli::{bail_usage, usage_error};
use megatron_kernels::rng;
use megatron_kernels::runtime::cuda_memory_stats;
use megatron_models::layers::moe::aux_loss::set_aux_loss_backward_scale;
use megatron_models::loader::{BatchLoader, DeviceBatch, SampleSource, SamplerPosition, Splits};
use megatron_models::{ModelChunk, ModelOptions, NamedParameter, PipelineSplit};
use megatron_optim::{
    LearningRates, MixedPrecisionOptimizer, OptimizerKind, OptimizerSettings, ParamShape,
    StateBytes, StepOutcome,
};
use megatron_parallel::Placement;
use megatron_parallel::{ParallelState, ReduceOp};

/// How a run ended, for the binary's one-line summary.
#[derive(Debug, Clone)]
pub struct TrainingSummary {
    pub iterations: u64,
    pub consumed_samples: u64,
    /// The first reported loss (`lm loss`) of the last iteration that stepped.
    pub last_lm_loss: Option<f64>,
    /// Every reported loss of that iteration.
    pub last_losses: Vec<(&'static str, f64)>,
    /// The first reported loss of the last evaluation on the validation set.
    pub validation_loss: Option<f64>,
    pub last_checkpoint: Option<PathBuf>,
    pub exit_reason: &'static str,
    pub seconds: f64,
}

impl TrainingSummary {
    /// The binary's closing line: `<binary>: N iterations, M samples, <losses>, <validation
    /// label> X, checkpoint C, T s (exit reason)`. The losses are `lm loss X` of the last step,
    /// or with `all_losses` every loss it reported.
    pub fn line(&self, binary: &str, all_losses: bool, validation_label: &str) -> String {
        let value = |v: Option<f64>| v.map_or("-".to_string(), |v| format!("{v:.4}"));
        let losses = if all_losses && !self.last_losses.is_empty() {
            let losses: Vec<String> = self
                .last_losses
                .iter()
                .map(|(name, v)| format!("{name} {v:.4}"))
                .collect();
            losses.join(", ")
        } else {
            format!("lm loss {}", value(self.last_lm_loss))
        };
        let checkpoint = self
            .last_checkpoint
            .as_ref()
            .map_or("none".to_string(), |p| p.display().to_string());
        format!(
            "{binary}: {} iterations, {} samples, {losses}, {validation_label} {}, checkpoint {checkpoint}, {:.1} s ({})",
            self.iterations,
            self.consumed_samples,
            value(self.validation_loss),
            self.seconds,
            self.exit_reason
        )
    }
}

/// Interval statistics behind the log line (Megatron's `total_loss_dict`).
#[derive(Default)]
struct IntervalStats {
    /// The reported losses' names and, per loss, its sum over the iterations that stepped.
    loss_names: Vec<&'static str>,
    loss_sums: Vec<f64>,
    advanced: u64,
    skipped: u64,
    nan: u64,
    iterations: u64,
    started: Option<Instant>,
}

struct Run<'a, F: ModelFamily> {
    args: &'a PretrainArgs,
    family: &'a F,
    chunks: Vec<F::Chunk>,
    split: PipelineSplit,
    optimizer: MixedPrecisionOptimizer,
    scheduler: OptimizerParamScheduler,
    scaler: LossScaler,
    batches: MicrobatchCalculator,
    parallel: ParallelState,
    progress: Progress,
    train_iters: u64,
    device: Device,
    activation: ActivationSpec,
    flops: FlopsModel,
    peak_tflops: Option<f64>,
    /// The Mixture-of-Experts losses reported after the family's.
    moe_losses: Option<MoeLossColumns>,
    metrics: Option<TrainingMetrics>,
    args_json: serde_json::Value,
    last_checkpoint: Option<PathBuf>,
    /// `--async-save`: the save in flight.
    async_saves: AsyncSaves,
    /// `--ckpt-format` one of Megatron's: what rewrites each save.
    export: Option<Arc<dyn CheckpointExport>>,
    spikes: LossSpikeTracker,
    /// The micro-batches' CUDA graph, asked for or by default, when this run can use it.
    graph: Option<MicrobatchGraph<F::Batch>>,
    /// `--decoupled-lr` and `--decoupled-min-lr`: the peak and floor of the embeddings' and
    /// output layer's learning rate.
    decoupled_lr: Option<(f64, f64)>,
}

/// What a caller adds to the engine's loop: `eval_tasks`' finetuning saves and scores the model
/// at the end of every epoch (spec §7.6).
pub trait TrainingHooks<F: ModelFamily> {
    /// Whether to save a checkpoint (with `--save`) after `iteration`, besides
    /// `--save-interval`, the exits and the last iteration.
    fn save_after(&self, _iteration: u64) -> bool {
        false
    }

    /// Runs after `iteration` and its save, before the exit checks.
    fn after_iteration(&mut self, _iteration: u64, _model: &Scorer<'_, F>) -> Result<()> {
        Ok(())
    }

    /// Runs once, in place of the loop, when the run has no iterations to train.
    fn without_training(&mut self, _model: &Scorer<'_, F>) -> Result<()> {
        Ok(())
    }

    /// What writes the saves in the format `--ckpt-format` names, where that is not ours.
    fn checkpoint_export(&self) -> Option<Arc<dyn CheckpointExport>> {
        None
    }
}

/// Pretraining whose saves are written by `export` (`--ckpt-format` one of Megatron's).
pub struct ExportingHooks(pub Option<Arc<dyn CheckpointExport>>);

impl<F: ModelFamily> TrainingHooks<F> for ExportingHooks {
    fn checkpoint_export(&self) -> Option<Arc<dyn CheckpointExport>> {
        self.0.clone()
    }
}

/// Pretraining adds nothing to the loop.
pub struct NoHooks;

impl<F: ModelFamily> TrainingHooks<F> for NoHooks {}

/// The model as it stands, for scoring whole datasets with the family's
/// [`score_step`](ModelFamily::score_step).
pub struct Scorer<'a, F: ModelFamily> {
    family: &'a F,
    chunks: &'a [F::Chunk],
    parallel: &'a ParallelState,
    activation: &'a ActivationSpec,
    device: Device,
    micro_batch_size: u64,
}

impl<F: ModelFamily> Scorer<'_, F> {
    /// The training micro-batch size (`--micro-batch-size`).
    pub fn micro_batch_size(&self) -> u64 {
        self.micro_batch_size
    }

    /// Global batches (a micro-batch of `micro` samples per data-parallel rank) that
    /// [`score`](Self::score) runs over `samples` samples.
    pub fn batches(&self, samples: u64, micro: u64) -> u64 {
        samples.div_ceil(micro.max(1) * self.parallel.data_parallel_size() as u64)
    }

    /// Scores every sample of `source` once, in order, `micro` samples per forward: each
    /// data-parallel rank takes its micro-batch of every global batch (the last ones may be
    /// short or empty). Returns each of `names` as `(sum, count)` over the whole job;
    /// `on_batch` follows the global batches.
    pub fn score(
        &self,
        source: &dyn SampleSource<Batch = F::Batch>,
        names: &'static [&'static str],
        micro: u64,
        on_batch: &mut dyn FnMut(),
    ) -> Result<Vec<(f64, f64)>> {
        ensure!(
            self.parallel.pipeline_parallel_size() == 1,
            "scoring runs without pipeline parallelism"
        );
        let (micro, data_rank) = (micro.max(1), self.parallel.data.rank() as u64);
        let global = micro * self.parallel.data_parallel_size() as u64;
        let mut totals = LossTotals::new(names, self.device);
        for batch in 0..self.batches(source.len(), micro) {
            let first = (batch * global + data_rank * micro).min(source.len());
            let end = (first + micro).min(source.len());
            if first < end {
                let batches = [source.collate(first..end)?.to_device(self.device)];
                let mut stage = FamilyStage {
                    family: self.family,
                    chunks: self.chunks,
                    batches: &batches,
                    parallel: self.parallel,
                    optimizer: None,
                    loss_scaling: LossScaling::Host(1.0),
                    totals: LossTotals::new(names, self.device),
                    scoring: true,
                };
                let shape = ScheduleShape {
                    microbatches: 1,
                    chunks: self.chunks.len(),
                    group_size: 1,
                    forward_only: true,
                };
                tch::no_grad(|| {
                    forward_backward(&mut stage, &self.parallel.pipeline, self.activation, shape)
                })?;
                totals.absorb(&stage.totals);
            }
            on_batch();
        }
        Ok(totals
            .reduce_totals(self.parallel)?
            .into_iter()
            .map(|(_, sum, count)| (sum, count))
            .collect())
    }
}

/// Trains `family` as the common flags `args` say; `args_json` is every flag of the run (the
/// family's own included), recorded in checkpoints.
pub fn pretrain<F: ModelFamily>(
    args: &PretrainArgs,
    args_json: serde_json::Value,
    family: &F,
    placement: &Placement,
) -> Result<TrainingSummary> {
    train_with_hooks(args, args_json, family, placement, &mut NoHooks)
}

/// [`pretrain`] with `hooks` added to the loop.
pub fn train_with_hooks<F: ModelFamily>(
    args: &PretrainArgs,
    args_json: serde_json::Value,
    family: &F,
    placement: &Placement,
    hooks: &mut dyn TrainingHooks<F>,
) -> Result<TrainingSummary> {
    let started = Instant::now();
    install_exit_handler();
    megatron_store::set_checksums_enabled(!args.checkpoint.no_checkpoint_checksums);
    let parallel = placement.parallel.clone();
    let device = placement.device;
    let layout = parallel.layout;
    ensure!(
        (layout.tensor, layout.pipeline) == (args.parallel.tensor_model_parallel_size, args.parallel.pipeline_model_parallel_size),
        "the job's layout {} does not match the flags' --tensor-model-parallel-size {} --pipeline-model-parallel-size {}",
        layout.describe(),
        args.parallel.tensor_model_parallel_size,
        args.parallel.pipeline_model_parallel_size
    );
    ensure!(
        layout.context == args.parallel.context_parallel_size,
        "the job's layout {} does not match the flags' --context-parallel-size {}",
        layout.describe(),
        args.parallel.context_parallel_size
    );
    if layout.context > 1 && !family.context_parallel() {
        megatron_cli::bail_usage!(
            "--context-parallel-size {}: {} pretraining does not support context parallelism \
             (only GPT's does)",
            layout.context,
            family.model_type()
        );
    }
    if parallel.is_logging_rank() {
        for note in args.compatibility.notes() {
            eprintln!("{note}");
        }
    }
    if args.logging.log_memory_to_tensorboard && !device.is_cuda() && parallel.is_logging_rank() {
        eprintln!(
            "note: --log-memory-to-tensorboard writes nothing on the CPU: the statistics are the \
             CUDA caching allocator's"
        );
    }
    if args.parallel.sequence_parallel && layout.tensor == 1 {
        eprintln!("warning: --sequence-parallel has no effect without tensor parallelism");
    }
    // Megatron's seeds (spec §3.2): offset by the pipeline stage, and a per-tensor-rank stream
    // for dropout on split tensors.
    let coordinates = parallel.coordinates();
    let seed = args.training.seed + 100 * coordinates.pipeline as u64;
    tch::manual_seed(seed as i64);
    rng::manual_seed(device, seed)?;
    rng::seed_model_parallel_rng(device, seed + 2718 + coordinates.tensor as u64)?;
    if args.training.deterministic_mode {
        megatron_kernels::ops::set_deterministic(true)?;
    }
    let config = family.transformer().clone();
    let recompute = args.recompute.recompute()?;
    args.model.moe.refuse_full_recompute(recompute)?;
    args.model.moe.check_parallel(&args.parallel)?;
    ensure!(
        layout.expert_size() == args.model.moe.expert_model_parallel_size,
        "the job's groups were built for {} but --expert-model-parallel-size is {}",
        layout.describe(),
        args.model.moe.expert_model_parallel_size
    );
    let options = ModelOptions {
        params_dtype: args.precision.params_dtype(),
        device,
        recompute,
        seed: args.training.seed,
        bias_dropout_fusion: !args.training.no_bias_dropout_fusion,
        rope_fusion: !args.model.no_rope_fusion,
    };
    let fp8 = args
        .fp8
        .plan(&args.precision, config.num_layers, layout.pipeline)?;
    let virtual_stages = args.parallel.virtual_stages(config.num_layers)?;
    let split = PipelineSplit {
        num_layers: config.num_layers,
        stages: layout.pipeline,
        chunks: virtual_stages,
        first_stage_layers: args.parallel.decoder_first_pipeline_num_layers,
        last_stage_layers: args.parallel.decoder_last_pipeline_num_layers,
    };
    let mut chunks = split
        .chunks_of(coordinates.pipeline)?
        .into_iter()
        .map(|spec| family.build_chunk(options, &parallel, spec))
        .collect::<Result<Vec<_>>>()?;
    if let Some(plan) = &fp8 {
        for chunk in &mut chunks {
            chunk.enable_fp8(plan)?;
        }
    }

    let micro_batch_size = args.training.micro_batch_size;
    let data_parallel_size = layout.data as u64;
    let schedule = match (
        &args.training.rampup_batch_size,
        &args.training.step_batch_size_schedule,
    ) {
        (Some(values), _) => Some(BatchSizeSchedule::Rampup(BatchRampup::from_flag_values(
            values,
        )?)),
        (None, Some(text)) => Some(BatchSizeSchedule::Steps(StepSchedule::parse(
            text,
            u64::try_from(args.model.seq_length).unwrap_or(0),
        )?)),
        (None, None) => None,
    };
    // With a step schedule, its largest batch stands for the global batch where one number is
    // needed (the evaluation samples to build).
    let global_batch_size = match &schedule {
        Some(BatchSizeSchedule::Steps(steps)) => steps.largest_global_batch_size(),
        _ => args
            .training
            .global_batch_size
            .unwrap_or(micro_batch_size * data_parallel_size),
    };
    let batches = MicrobatchCalculator::new(
        global_batch_size,
        micro_batch_size,
        data_parallel_size,
        schedule.clone(),
        args.training.decrease_batch_size_if_needed,
    )?;
    let train_iters = match (args.training.train_iters, args.training.train_samples) {
        (Some(iters), None) => iters,
        (None, Some(samples)) => {
            train_iters_from_samples(samples, global_batch_size, schedule.as_ref())?
        }
        (Some(_), Some(_)) => bail_usage!("give only one of --train-iters and --train-samples"),
        (None, None) if args.training.skip_train => 0,
        (None, None) => bail_usage!("give --train-iters or --train-samples"),
    };
    if schedule.is_some() && args.training.train_samples.is_none() {
        bail_usage!(
            "{} needs sample-based training (--train-samples)",
            if args.training.rampup_batch_size.is_some() {
                "--rampup-batch-size"
            } else {
                "--step-batch-size-schedule"
            }
        );
    }
    let scheduler = OptimizerParamScheduler::new(SchedulerConfig::from_flags(&schedule_flags(
        args,
        global_batch_size,
    )?)?)?;
    let scaler = LossScaler::from_flags(&LossScaleFlags {
        fp16: args.precision.fp16,
        loss_scale: args.precision.loss_scale,
        initial_loss_scale: args.precision.initial_loss_scale,
        min_loss_scale: args.precision.min_loss_scale,
        loss_scale_window: args.precision.loss_scale_window,
        hysteresis: args.precision.hysteresis as u32,
    })?;

    // One writer per save directory, locked before anything is written (and before a long
    // model build) so that a second run into it stops at once.
    if let (Some(save), 0) = (&args.checkpoint.save, parallel.rank) {
        megatron_store::lock_save_directory(save)?;
    }
    let load_request = load_request(args)?;
    let mut loaded = None;
    if let Some(request) = &load_request {
        loaded = checkpointing::load_weights(request, family.model_type(), &chunks, &parallel)?;
    }
    let pretrained = match (&loaded, &args.checkpoint.pretrained_checkpoint) {
        (None, Some(path)) => Some(family.load_pretrained(path, &chunks, &parallel)?),
        _ => None,
    };
    if loaded.is_none() && pretrained.is_none() && args.checkpoint.exit_on_missing_checkpoint {
        bail!(
            "--exit-on-missing-checkpoint: no checkpoint under {}",
            args.checkpoint
                .load
                .as_ref()
                .map_or("--load (not given)".to_string(), |p| p
                    .display()
                    .to_string())
        );
    }

    let parameters = chunks
        .iter()
        .enumerate()
        .flat_map(|(c, chunk)| {
            chunk.named_parameters().into_iter().map(move |mut p| {
                if virtual_stages > 1 {
                    p.name = format!("model{c}.{}", p.name);
                }
                p
            })
        })
        .collect::<Vec<NamedParameter>>();
    let graph = microbatch_graph(args, family, device, &parallel)?;
    let gradient_ranks = layout.data * layout.context;
    let settings = optimizer_settings(args, gradient_ranks, graph.is_some())?;
    if graph.is_some()
        && gradient_ranks > 1
        && args.parallel.overlap_grad_reduce
        && parallel.rank == 0
    {
        eprintln!(
            "note: --enable-cuda-graph with {gradient_ranks} data-parallel ranks: gradients are \
             reduced after each step's micro-batches, not overlapped with their backward \
             (--overlap-grad-reduce and --overlap-param-gather are set aside)"
        );
    }
    let predicted_state = predicted_state_bytes(&parameters, &settings, &parallel);
    let mut optimizer = MixedPrecisionOptimizer::new(parameters, settings, &parallel)?;
    if args.logging.log_num_zeros_in_grad {
        optimizer = optimizer.counting_zeros();
    }
    let prefixes: Vec<String> = (0..chunks.len())
        .map(|c| {
            if virtual_stages > 1 {
                format!("model{c}.")
            } else {
                String::new()
            }
        })
        .collect();
    for (chunk, gate) in chunks.iter_mut().zip(optimizer.param_gates(&prefixes)) {
        chunk.set_param_gate(gate);
    }
    let logging_rank = parallel.is_logging_rank();
    let metrics_path = args.logging.metrics_file.clone().or_else(|| {
        args.logging
            .tensorboard_dir
            .as_ref()
            .map(|d| d.join("metrics.jsonl"))
    });
    let metrics = logging_rank
        .then(|| {
            TrainingMetrics::new(
                args.logging.tensorboard_dir.as_deref(),
                metrics_path.as_deref(),
            )
        })
        .transpose()?;
    // Each context-parallel rank holds 2 of the sequence's 2 × CP chunks.
    let sequence = args.model.seq_length
        / layout.context as i64
        / if parallel.sequence_parallel {
            layout.tensor as i64
        } else {
            1
        };
    let mut run = Run {
        args,
        family,
        chunks,
        split,
        optimizer,
        scheduler,
        scaler,
        batches,
        parallel: parallel.clone(),
        progress: Progress::default(),
        train_iters,
        device,
        activation: ActivationSpec {
            shape: vec![sequence, micro_batch_size as i64, config.hidden_size],
            kind: options.params_dtype,
            device,
        },
        flops: family.flops(args.model.seq_length),
        peak_tflops: peak_tflops_of(device),
        moe_losses: MoeLossColumns::of(family.transformer()),
        metrics,
        args_json,
        last_checkpoint: None,
        async_saves: AsyncSaves::default(),
        export: checkpoint_export(args, &*hooks)?,
        spikes: LossSpikeTracker::default(),
        graph,
        decoupled_lr: decoupled_lr(args)?,
    };
    let mut resumed_from_save = false;
    if let (Some(found), Some(request)) = (loaded, &load_request) {
        let state = TrainingState {
            optimizer: &mut run.optimizer,
            distributed_optimizer: args.parallel.use_distributed_optimizer,
            scheduler: &mut run.scheduler,
            scaler: &mut run.scaler,
        };
        match checkpointing::restore_training_state(found, request, state, &parallel, device)? {
            Resumed::Full {
                directory,
                progress,
            } => {
                run.print_rank0(&loaded_checkpoint_line(
                    request.root,
                    &parallel,
                    progress.iteration,
                ));
                run.spikes.record_loaded(&directory);
                run.progress = progress;
                resumed_from_save = args
                    .checkpoint
                    .save
                    .as_deref()
                    .is_some_and(|save| checkpointing::same_directory(request.root, save));
            }
            // Megatron counts a finetune or release load from iteration 0 and says so.
            Resumed::Weights => {
                run.print_rank0(&loaded_checkpoint_line(request.root, &parallel, 0))
            }
        }
    }
    if let Some(directory) = pretrained {
        run.print_rank0(&format!(
            "loaded pretrained weights from {}",
            directory.display()
        ));
    }
    if let Some(save) = &args.checkpoint.save {
        checkpointing::refuse_replacing_another_run(
            save,
            resumed_from_save,
            run.progress.iteration,
        )?;
    }
    run.batches
        .update(run.progress.consumed_train_samples, false)?;
    run.print_model_summary()?;
    run.print_memory_report(predicted_state)?;
    run.reserve_snapshot_memory()?;

    let datasets =
        family.build_datasets(args, dataset_sizes(args, train_iters, global_batch_size))?;
    run.train_and_evaluate(&datasets, started, hooks)
}

impl<F: ModelFamily> Run<'_, F> {
    fn print_rank0(&self, message: &str) {
        if self.parallel.rank == 0 {
            println!("{message}");
        }
    }

    /// Megatron's parameter-count line, over all stages (the last stage's copy of the tied
    /// embeddings counted once).
    fn print_model_summary(&self) -> Result<()> {
        let config = self.family.transformer();
        let local: i64 = self
            .chunks
            .iter()
            .flat_map(|c| c.named_parameters())
            .filter(|p| !p.attributes.shared_embedding)
            .map(|p| p.tensor.numel() as i64)
            .sum();
        let counts = Tensor::from_slice(&[local as f64]).to_device(self.device);
        // Each tensor-parallel rank holds different parameters: sum over the model group.
        self.parallel.model.all_reduce(&counts, ReduceOp::Sum)?;
        let total = counts.double_value(&[0]) as i64;
        let replicated: i64 = self
            .chunks
            .iter()
            .flat_map(|c| c.named_parameters())
            .filter(|p| !p.attributes.tensor_parallel && !p.attributes.shared_embedding)
            .map(|p| p.tensor.numel() as i64)
            .sum();
        let replicated_total = Tensor::from_slice(&[replicated as f64]).to_device(self.device);
        self.parallel
            .pipeline
            .all_reduce(&replicated_total, ReduceOp::Sum)?;
        let duplicates = (self.parallel.tensor_parallel_size() as i64 - 1)
            * replicated_total.double_value(&[0]) as i64;
        self.print_rank0(&format!(
            "> {} model: {} parameters, padded vocab {} (from {}), {} on {:?}, {}",
            self.family.model_type(),
            total - duplicates,
            config.padded_vocab_size(self.parallel.tensor_parallel_size() as i64),
            config.vocab_size,
            checkpointing::dtype_name(self.chunks[0].options().params_dtype),
            self.device,
            self.parallel.layout.describe()
        ));
        self.print_rank0(&format!(
            "> parameters, gradients and optimizer state: {:.1} bytes per parameter on this rank",
            self.optimizer.bytes_per_parameter()
        ));
        Ok(())
    }

    /// Megatron's theoretical memory line and our breakdown, before the first step (Megatron
    /// prints it with the first log line; before training it is there even when the first step
    /// runs out of memory).
    fn print_memory_report(&self, state: StateBytes) -> Result<()> {
        let stage = self.parallel.coordinates().pipeline;
        let chunks = self.split.chunks_of(stage)?;
        let shape = ActivationShape::of(
            self.family.transformer(),
            &self.parallel,
            self.args.model.seq_length as u64,
            self.args.training.micro_batch_size,
            self.chunks[0].options().params_dtype.elt_size_in_bytes() as u64,
            self.chunks[0].options().recompute,
            chunks.iter().map(|c| c.layers.len() as u64).collect(),
            (
                chunks.iter().any(|c| c.pre_process),
                chunks.iter().any(|c| c.post_process),
            ),
            self.batches.num_microbatches(),
        );
        let report = MemoryReport {
            state,
            activations: shape.estimate(),
        }
        .largest_over_ranks(&self.parallel, self.device)?;
        for line in report.lines() {
            self.print_rank0(&line);
        }
        Ok(())
    }

    /// Megatron's `report_memory` after the first log line: the CUDA caching allocator's
    /// figures of every rank of the first data-parallel replica (the peak is what the
    /// theoretical memory report predicts).
    fn report_memory(&self, iteration: u64) -> Result<()> {
        let Device::Cuda(index) = self.device else {
            return Ok(());
        };
        if self.parallel.data.rank() != 0 {
            return Ok(());
        }
        let memory = cuda_memory_stats(index)?;
        let mb = |bytes: i64| bytes as f64 / (1024.0 * 1024.0);
        println!(
            "[Rank {}] (after {iteration} iterations) memory (MB) | allocated: {} | max allocated: {} | reserved: {}",
            self.parallel.rank,
            mb(memory.allocated_bytes),
            mb(memory.max_allocated_bytes),
            mb(memory.reserved_bytes)
        );
        Ok(())
    }

    fn scorer(&self) -> Scorer<'_, F> {
        Scorer {
            family: self.family,
            chunks: &self.chunks,
            parallel: &self.parallel,
            activation: &self.activation,
            device: self.device,
            micro_batch_size: self.args.training.micro_batch_size,
        }
    }

    fn train_and_evaluate(
        &mut self,
        datasets: &Splits<F::Batch>,
        started: Instant,
        hooks: &mut dyn TrainingHooks<F>,
    ) -> Result<TrainingSummary> {
        if let Some(metrics) = self.metrics.as_mut() {
            metrics.record_args(self.progress.iteration, &self.args_json)?;
        }
        let mut summary = TrainingSummary {
            iterations: self.progress.iteration,
            consumed_samples: self.progress.consumed_train_samples,
            last_lm_loss: None,
            last_losses: Vec::new(),
            validation_loss: None,
            last_checkpoint: None,
            exit_reason: "finished",
            seconds: 0.0,
        };
        let mut valid_loader = datasets
            .valid
            .as_ref()
            .map(|d| self.loader(d.clone(), "valid", self.progress.consumed_valid_samples));
        if !self.args.training.skip_train && self.progress.iteration < self.train_iters {
            let train = datasets
                .train
                .clone()
                .context("the training split is empty")?;
            let mut train_loader =
                self.loader(train, "train", self.progress.consumed_train_samples);
            summary.exit_reason = self.train(
                &mut train_loader,
                valid_loader.as_mut(),
                &mut summary,
                started,
                hooks,
            )?;
        } else if self.train_iters == 0 {
            hooks.without_training(&self.scorer())?;
        }
        summary.iterations = self.progress.iteration;
        summary.consumed_samples = self.progress.consumed_train_samples;
        // As Megatron's do_valid/do_test: nothing is evaluated with --eval-iters 0.
        if summary.exit_reason == "finished" && self.args.training.eval_iters > 0 {
            let label = format!("iteration {} on validation set", self.progress.iteration);
            if let Some(loader) = valid_loader.as_mut() {
                let losses = self.evaluate(loader, &label, !self.args.training.skip_train)?;
                summary.validation_loss = losses.first().map(|(_, loss)| *loss);
            }
            if let Some(test) = &datasets.test {
                let mut loader = self.loader(test.clone(), "test", 0);
                let label = format!("iteration {} on test set", self.progress.iteration);
                let losses = self.evaluate_without_counting(&mut loader, &label)?;
                // As Megatron: recorded like the validation set, unless only evaluating.
                if !self.args.training.skip_train {
                    self.record_eval(EvalSplit::Test, &losses)?;
                }
            }
        }
        summary.last_checkpoint = self.last_checkpoint.clone();
        summary.seconds = started.elapsed().as_secs_f64();
        Ok(summary)
    }

    fn loader(
        &self,
        dataset: Arc<dyn SampleSource<Batch = F::Batch>>,
        name: &'static str,
        start: u64,
    ) -> BatchLoader<F::Batch> {
        let position = SamplerPosition {
            start,
            micro_batch_size: self.args.training.micro_batch_size,
            data_parallel_rank: self.parallel.data.rank() as u64,
            data_parallel_size: self.parallel.data_parallel_size() as u64,
        };
        BatchLoader::spawn(dataset, name, position, self.args.data.num_workers.max(1))
    }

    fn train(
        &mut self,
        train: &mut BatchLoader<F::Batch>,
        mut valid: Option<&mut BatchLoader<F::Batch>>,
        summary: &mut TrainingSummary,
        started: Instant,
        hooks: &mut dyn TrainingHooks<F>,
    ) -> Result<&'static str> {
        let mut interval = IntervalStats {
            started: Some(Instant::now()),
            ..Default::default()
        };
        let logging = &self.args.logging;
        let checkpoint = &self.args.checkpoint;
        let mut profiler =
            StepProfiler::from_args(logging, self.parallel.rank, self.device.is_cuda())?;
        let mut memory_reported = false;
        while self.progress.iteration < self.train_iters {
            let global_batch = self.batches.current_global_batch_size();
            if let Some(profiler) = profiler.as_mut() {
                profiler.before_step(self.progress.iteration)?;
            }
            let iteration_started = Instant::now();
            let (losses, outcome) = self.train_step(train)?;
            self.progress.iteration += 1;
            if let Some(done) = profiler
                .as_mut()
                .map(|p| p.after_step(self.progress.iteration))
            {
                self.print_profiler_note(done?);
            }
            self.progress.consumed_train_samples += global_batch;
            self.progress.floating_point_operations +=
                num_floating_point_operations(&self.flops, global_batch);
            self.batches
                .update(self.progress.consumed_train_samples, true)?;
            let iteration = self.progress.iteration;

            interval.iterations += 1;
            if outcome.skipped {
                interval.skipped += 1;
                if losses.iter().any(|(_, loss)| !loss.is_finite()) {
                    interval.nan += 1;
                }
            } else {
                interval.loss_names = losses.iter().map(|(name, _)| *name).collect();
                interval.loss_sums.resize(losses.len(), 0.0);
                for (sum, (_, loss)) in interval.loss_sums.iter_mut().zip(&losses) {
                    *sum += loss;
                }
                interval.advanced += 1;
                summary.last_lm_loss = losses.first().map(|(_, loss)| *loss);
                summary.last_losses = losses.clone();
            }
            if iteration % logging.tensorboard_log_interval.max(1) == 0 {
                let mut scalars = vec![
                    ("learning-rate", self.scheduler.lr()),
                    ("batch-size", global_batch as f64),
                    ("loss-scale", self.scaler.scale() as f64),
                    ("world-size", self.parallel.world_size() as f64),
                    ("iteration-time", iteration_started.elapsed().as_secs_f64()),
                ];
                if let Some(rate) = self.decoupled_learning_rate() {
                    scalars.push(("decoupled-learning-rate", rate));
                }
                if !outcome.skipped {
                    scalars.extend(losses.iter().copied());
                }
                if let Some(norm) = outcome.grad_norm {
                    scalars.push(("grad-norm", norm));
                }
                if let Some(zeros) = outcome.num_zeros {
                    scalars.push(("num-zeros", zeros as f64));
                }
                if let (true, true, Device::Cuda(index)) = (
                    logging.log_memory_to_tensorboard,
                    self.metrics.is_some(),
                    self.device,
                ) {
                    let memory = cuda_memory_stats(index)?;
                    scalars.extend([
                        ("mem-reserved-bytes", memory.reserved_bytes as f64),
                        ("mem-allocated-bytes", memory.allocated_bytes as f64),
                        ("mem-max-allocated-bytes", memory.max_allocated_bytes as f64),
                        ("mem-allocated-count", memory.allocation_count as f64),
                    ]);
                }
                if self.metrics.is_some() && logging.log_params_norm {
                    scalars.push(("params-norm", self.optimizer.params_norm()?));
                }
                if let Some(metrics) = self.metrics.as_mut() {
                    metrics.record_iteration(
                        iteration,
                        self.progress.consumed_train_samples,
                        &scalars,
                    )?;
                }
            }
            if iteration % logging.log_interval.max(1) == 0 {
                self.print_log_line(&mut interval, global_batch, &outcome)?;
                if !memory_reported {
                    self.report_memory(iteration)?;
                    memory_reported = true;
                }
            }
            if let Some(loader) = valid.as_deref_mut() {
                if self.args.training.eval_interval > 0
                    && iteration % self.args.training.eval_interval == 0
                {
                    let losses = self.evaluate(loader, &format!("iteration {iteration}"), true)?;
                    summary.validation_loss = losses.first().map(|(_, loss)| *loss);
                }
            }

            self.poll_async_save(false)?;
            let mut saved_now = false;
            if let (Some(_), Some(interval)) = (&checkpoint.save, checkpoint.save_interval) {
                if interval > 0 && iteration % interval == 0 {
                    self.save()?;
                    saved_now = true;
                }
            }
            if checkpoint.save.is_some() && !saved_now && hooks.save_after(iteration) {
                self.save()?;
                saved_now = true;
            }
            hooks.after_iteration(iteration, &self.scorer())?;
            let reason = self.exit_reason(iteration, started)?;
            if let Some(reason) = reason {
                if checkpoint.save.is_some() && !saved_now {
                    self.save()?;
                }
                self.poll_async_save(true)?;
                if let Some(done) = profiler.as_mut().map(StepProfiler::finish) {
                    self.print_profiler_note(done?);
                }
                self.print_rank0(&format!("exiting at iteration {iteration} ({reason})"));
                return Ok(reason);
            }
            if self.progress.iteration == self.train_iters
                && checkpoint.save.is_some()
                && !saved_now
            {
                self.save()?;
            }
        }
        self.poll_async_save(true)?;
        if let Some(done) = profiler.as_mut().map(StepProfiler::finish) {
            self.print_profiler_note(done?);
        }
        Ok("finished")
    }

    /// The profiler reports from the rank it runs on, which need not be rank 0.
    fn print_profiler_note(&self, note: Option<String>) {
        if let Some(note) = note {
            println!("[rank {}] {note}", self.parallel.rank);
        }
    }

    /// Megatron's exit checks, agreed by all ranks: a signal on any rank, the longest elapsed
    /// time, or the exit interval.
    fn exit_reason(&self, iteration: u64, started: Instant) -> Result<Option<&'static str>> {
        let flags = Tensor::from_slice(&[
            f64::from(u8::from(exit_requested())),
            started.elapsed().as_secs_f64() / 60.0,
        ]);
        if self.parallel.world_size() > 1 {
            let flags_on_device = flags.to_device(self.device);
            self.parallel
                .world
                .all_reduce(&flags_on_device, ReduceOp::Max)?;
            flags.shallow_clone().copy_(&flags_on_device);
        }
        let (signal, minutes) = (flags.double_value(&[0]) > 0.0, flags.double_value(&[1]));
        Ok(if signal {
            Some("signal")
        } else if self
            .args
            .training
            .exit_duration_in_mins
            .is_some_and(|m| minutes > m)
        {
            Some("exit-duration-in-mins")
        } else if self
            .args
            .training
            .exit_interval
            .is_some_and(|n| n > 0 && iteration % n == 0)
        {
            Some("exit-interval")
        } else {
            None
        })
    }

    fn next_microbatches(
        &self,
        loader: &mut BatchLoader<F::Batch>,
        count: u64,
    ) -> Result<Vec<F::Batch>> {
        (0..count)
            .map(|_| Ok(loader.next_batch()?.to_device(self.device)))
            .collect()
    }

    fn schedule_shape(&self, microbatches: u64, forward_only: bool) -> ScheduleShape {
        ScheduleShape {
            microbatches: microbatches as usize,
            chunks: self.chunks.len(),
            group_size: self
                .args
                .parallel
                .microbatch_group_size_per_virtual_pipeline_stage
                .unwrap_or(self.parallel.pipeline_parallel_size()),
            forward_only,
        }
    }

    /// One iteration: forward/backward over the micro-batches through the pipeline schedule,
    /// then the optimizer step. Returns the iteration's reported losses (for GPT `lm loss`,
    /// Σ loss / Σ tokens over its micro-batches and data-parallel ranks).
    fn train_step(
        &mut self,
        loader: &mut BatchLoader<F::Batch>,
    ) -> Result<(Vec<(&'static str, f64)>, StepOutcome)> {
        let microbatches = self.batches.num_microbatches();
        let batches = self.next_microbatches(loader, microbatches)?;
        let shape = self.schedule_shape(microbatches, false);
        self.optimizer.begin_step(microbatches as usize);
        let loss_scaling = if self.args.training.calculate_per_token_loss {
            LossScaling::PerToken {
                per_global_token: self.per_global_token(&batches)?,
                loss_scale: self.scaler.scale() as f64,
            }
        } else {
            LossScaling::Host(self.scaler.scale() as f64)
        };
        // The auxiliary losses' gradient: the main loss's scale in backward.
        set_aux_loss_backward_scale(match &loss_scaling {
            LossScaling::PerToken { loss_scale, .. } => *loss_scale,
            _ => self.scaler.scale() as f64 / microbatches as f64,
        });
        let mut stage = FamilyStage {
            family: self.family,
            chunks: &self.chunks,
            batches: &batches,
            parallel: &self.parallel,
            optimizer: Some(&mut self.optimizer),
            loss_scaling,
            totals: LossTotals::new(self.family.loss_names(), self.device),
            scoring: false,
        };
        let replay = self.graph.as_mut().is_some_and(|g| g.replays_this_step());
        let replayed = match self.graph.as_mut().filter(|_| replay) {
            Some(graph) => graph.run(
                &mut stage,
                self.scaler.scale() as f64,
                self.parallel.rank == 0,
            )?,
            None => false,
        };
        if !replayed {
            forward_backward(&mut stage, &self.parallel.pipeline, &self.activation, shape)?;
        }
        update_expert_biases(&self.chunks, &self.parallel)?;
        // Reading the losses waits for the device; queueing the optimizer first keeps the GPU
        // busy through that wait (the gradient norm's read is the step's one sync).
        let pending_losses = stage.totals.start_reduce(&self.parallel)?;
        let lr = self.scheduler.lr();
        let lrs = LearningRates {
            lr,
            embedding_or_output: self.decoupled_learning_rate().unwrap_or(lr),
        };
        let weight_decay = self.scheduler.weight_decay();
        let fp16 = self.args.precision.fp16;
        let outcome = self
            .optimizer
            .step(lrs, weight_decay, fp16.then(|| self.scaler.scale()))?;
        let mut losses = pending_losses.values()?;
        if let Some(columns) = &self.moe_losses {
            losses.extend(columns.take(&self.parallel, microbatches as usize, self.device)?);
        }
        // Every family reports its language-model loss first: the spike rule follows it.
        let lm_loss = losses[0].1;
        if !fp16 || lm_loss.is_finite() {
            self.spikes
                .record_loss(self.progress.iteration + 1, lm_loss);
        }
        if let Some((name, loss)) = losses.iter().find(|(_, loss)| !loss.is_finite()) {
            if !fp16 {
                bail!(self.nan_message(name, *loss));
            }
        }
        if fp16 {
            self.scaler.update(outcome.skipped);
        }
        if let Some(norm) = outcome.grad_norm {
            if !norm.is_finite() {
                bail!(self.nan_message("gradient norm", norm));
            }
        }
        if !outcome.skipped {
            self.scheduler
                .step(self.batches.current_global_batch_size());
        }
        Ok((losses, outcome))
    }

    /// The learning rate of the embeddings and output layer now, with `--decoupled-lr`: the
    /// same schedule between their own peak and floor.
    fn decoupled_learning_rate(&self) -> Option<f64> {
        self.decoupled_lr
            .map(|(max_lr, min_lr)| self.scheduler.lr_between(max_lr, min_lr))
    }

    /// `--calculate-per-token-loss`'s factor of the summed token losses: the data-parallel size
    /// over the non-masked tokens of the global batch (each rank counts its micro-batches, the
    /// data-parallel group adds the counts up). Only the last stage uses it; every stage counts,
    /// so that a family without per-token losses is refused on all ranks alike.
    fn per_global_token(&self, batches: &[F::Batch]) -> Result<Tensor> {
        let total = Tensor::zeros([], (Kind::Float, self.device));
        for batch in batches {
            let tokens = self.family.loss_tokens(batch).ok_or_else(|| {
                usage_error(format!(
                    "--calculate-per-token-loss: {} pretraining averages its loss per \
                     micro-batch, not over tokens (only GPT's loss is per token)",
                    self.family.model_type()
                ))
            })?;
            let _ = total.shallow_clone().g_add_(&tokens);
        }
        // The gradients are averaged over data × context, each context-parallel rank's tokens
        // a part of its sequences'.
        let group = &self.parallel.data_with_context;
        group.all_reduce(&total, ReduceOp::Sum)?;
        Ok(total.clamp_min(1.0).reciprocal() * group.size() as f64)
    }

    fn nan_message(&self, what: &str, value: f64) -> String {
        let kept = self.spikes.advice();
        format!(
            "{what} is {value} at iteration {}; stopping ({kept})",
            self.progress.iteration + 1
        )
    }

    fn print_log_line(
        &mut self,
        interval: &mut IntervalStats,
        global_batch: u64,
        outcome: &StepOutcome,
    ) -> Result<()> {
        let params_norm = if self.args.logging.log_params_norm {
            Some(self.optimizer.params_norm()?)
        } else {
            None
        };
        let elapsed = interval.started.map_or(0.0, |s| s.elapsed().as_secs_f64());
        let per_iteration = elapsed / interval.iterations.max(1) as f64;
        let world = self.parallel.world_size() as f64;
        let tflops = num_floating_point_operations(&self.flops, global_batch)
            / (per_iteration * 1e12 * world);
        let tokens_per_second =
            (global_batch * self.args.model.seq_length as u64) as f64 / per_iteration;
        let losses = if interval.advanced > 0 {
            interval
                .loss_names
                .iter()
                .zip(&interval.loss_sums)
                .map(|(name, sum)| (name.to_string(), sum / interval.advanced as f64))
                .collect()
        } else {
            Vec::new()
        };
        let log = IterationLog {
            timestamp: local_timestamp(),
            iteration: self.progress.iteration,
            train_iters: self.train_iters,
            consumed_samples: self.progress.consumed_train_samples,
            skipped_samples: None,
            elapsed_ms_per_iter: per_iteration * 1000.0,
            throughput_tflops: self.args.logging.log_throughput.then_some(tflops),
            learning_rate: self.scheduler.lr(),
            decoupled_learning_rate: self.decoupled_learning_rate(),
            global_batch_size: global_batch,
            losses,
            loss_scale: self.scaler.scale() as f64,
            grad_norm: outcome.grad_norm,
            num_zeros: outcome.num_zeros,
            params_norm,
            skipped_iterations: interval.skipped,
            nan_iterations: interval.nan,
            tokens_per_second: Some(tokens_per_second),
            mfu_percent: self.peak_tflops.map(|peak| 100.0 * tflops / peak),
        };
        if self.parallel.is_logging_rank() {
            println!("{}", format_iteration_line(&log));
        }
        *interval = IntervalStats {
            started: Some(Instant::now()),
            ..Default::default()
        };
        Ok(())
    }

    /// `--eval-iters` global batches of the validation split, forward only; advances the
    /// validation sample counter like Megatron.
    fn evaluate(
        &mut self,
        loader: &mut BatchLoader<F::Batch>,
        label: &str,
        record: bool,
    ) -> Result<Vec<(&'static str, f64)>> {
        let losses = self.evaluate_without_counting(loader, label)?;
        self.progress.consumed_valid_samples +=
            self.args.training.eval_iters * self.batches.current_global_batch_size();
        if record {
            self.record_eval(EvalSplit::Validation, &losses)?;
        }
        Ok(losses)
    }

    fn record_eval(&mut self, split: EvalSplit, losses: &[(&'static str, f64)]) -> Result<()> {
        if let Some(metrics) = self.metrics.as_mut() {
            metrics.record_eval(
                self.progress.iteration,
                self.progress.consumed_train_samples,
                split,
                losses,
            )?;
        }
        Ok(())
    }

    fn evaluate_without_counting(
        &mut self,
        loader: &mut BatchLoader<F::Batch>,
        label: &str,
    ) -> Result<Vec<(&'static str, f64)>> {
        let microbatches = self.batches.num_microbatches();
        let names = self.family.loss_names();
        let mut totals = LossTotals::new(names, self.device);
        for _ in 0..self.args.training.eval_iters {
            let batches = self.next_microbatches(loader, microbatches)?;
            let shape = self.schedule_shape(microbatches, true);
            let mut stage = FamilyStage {
                family: self.family,
                chunks: &self.chunks,
                batches: &batches,
                parallel: &self.parallel,
                optimizer: None,
                loss_scaling: LossScaling::Host(1.0),
                totals: LossTotals::new(names, self.device),
                scoring: false,
            };
            tch::no_grad(|| {
                forward_backward(&mut stage, &self.parallel.pipeline, &self.activation, shape)
            })?;
            totals.absorb(&stage.totals);
        }
        let losses = totals.reduce(&self.parallel)?;
        if self.parallel.is_logging_rank() {
            let named: Vec<(String, f64)> = losses
                .iter()
                .map(|(name, loss)| (name.to_string(), *loss))
                .collect();
            println!("{}", format_eval_block(label, &named));
        }
        Ok(losses)
    }

    /// What a save of the current state writes to `root`.
    fn save_request<'s>(&'s self, root: &'s Path) -> Result<SaveRequest<'s, F::Chunk>> {
        let optimizer_name = if self.args.optimizer.optimizer == "sgd" {
            "sgd"
        } else {
            "adam"
        };
        Ok(SaveRequest {
            root,
            model_type: self.family.model_type(),
            progress: self.progress,
            chunks: &self.chunks,
            split: self.split,
            optimizer: (!self.args.checkpoint.no_save_optim)
                .then_some((&self.optimizer, optimizer_name)),
            distributed_optimizer: self.args.parallel.use_distributed_optimizer,
            scheduler: &self.scheduler,
            scaler: &self.scaler,
            save_rng: !self.args.checkpoint.no_save_rng,
            args: self.args_json.clone(),
            data: self.args.data.trained_on()?,
            parallel: &self.parallel,
        })
    }

    fn save(&mut self) -> Result<()> {
        self.optimizer.wait_for_params()?;
        let root = self
            .args
            .checkpoint
            .save
            .clone()
            .expect("save is only called with --save");
        let iteration = self.progress.iteration;
        let source = match &self.export {
            Some(_) => export::source_root(&root),
            None => root.clone(),
        };
        if !self.args.checkpoint.async_save {
            let started = Instant::now();
            checkpointing::save(self.save_request(&source)?)?;
            self.export_saved(&root, iteration)?;
            return self.report_saved(Finalized {
                iteration,
                seconds: started.elapsed().as_secs_f64(),
            });
        }
        // Out of `self` while the snapshot borrows the rest of it.
        let mut saves = std::mem::take(&mut self.async_saves);
        let finished = saves.schedule(
            iteration,
            &mut |flags| agree(&self.parallel, self.device, flags),
            || {
                self.print_rank0(
                    "WARNING: Starting a checkpoint save before previous has finished. \
                     Consider increasing the checkpoint interval.",
                )
            },
            || {
                let write = checkpointing::snapshot(self.save_request(&source)?)?;
                Ok(match &self.export {
                    Some(export) => export::exporting_write(write, export.clone(), root.clone()),
                    None => write,
                })
            },
        );
        self.async_saves = saves;
        if let Some(finished) = finished? {
            self.report_saved(finished)?;
        }
        self.print_rank0(&format!(
            "  scheduled an async checkpoint save at iteration {iteration:7} to {}",
            root.display()
        ));
        Ok(())
    }

    /// With `--ckpt-format` one of Megatron's: rank 0 rewrites the save of `iteration` just
    /// made in our format, and every rank learns whether that worked.
    fn export_saved(&self, root: &Path, iteration: u64) -> Result<()> {
        let Some(export) = &self.export else {
            return Ok(());
        };
        let exported = if self.parallel.rank == 0 {
            export::export_and_clean(export.as_ref(), root)
        } else {
            Ok(())
        };
        let failed = agree(
            &self.parallel,
            self.device,
            [f64::from(u8::from(exported.is_err())), 0.0],
        )?[0]
            > 0.0;
        exported?;
        ensure!(
            !failed,
            "saving iteration {iteration} in --ckpt-format {} failed on rank 0",
            export.format()
        );
        Ok(())
    }

    /// `--async-save` on a GPU: pins host memory for a snapshot before training, so that the
    /// first save does not pay for pinning its bytes in the step it follows (libtorch's caching
    /// host allocator keeps the blocks for every snapshot after).
    fn reserve_snapshot_memory(&self) -> Result<()> {
        match &self.args.checkpoint.save {
            Some(root) if self.args.checkpoint.async_save && self.device.is_cuda() => {
                checkpointing::reserve_host_memory(self.save_request(root)?)
            }
            _ => Ok(()),
        }
    }

    /// `--async-save`: agrees with the other ranks on the save in flight and finalizes it once
    /// every rank is done (each iteration), or waits until it is (`blocking`, at the exits).
    fn poll_async_save(&mut self, blocking: bool) -> Result<()> {
        // Every rank has the same save in flight, so all or none take part in the agreement.
        if self.async_saves.in_flight().is_none() {
            return Ok(());
        }
        if blocking {
            self.print_rank0(
                "Unfinalized async checkpoint saves. Finalizing them synchronously now.",
            );
        }
        let (parallel, device) = (&self.parallel, self.device);
        let finalized = self
            .async_saves
            .poll(blocking, &mut |flags| agree(parallel, device, flags))?;
        match finalized {
            Some(finalized) => self.report_saved(finalized),
            None => Ok(()),
        }
    }

    /// A save committed: the tracker names it.
    fn report_saved(&mut self, saved: Finalized) -> Result<()> {
        let root = self
            .args
            .checkpoint
            .save
            .as_ref()
            .expect("saves are only made with --save");
        self.print_rank0(&format!(
            "  successfully saved checkpoint from iteration {:7} to {} [ {:.1} ms ]",
            saved.iteration,
            root.display(),
            saved.seconds * 1000.0
        ));
        let directory = megatron_store::iteration_directory(root, saved.iteration);
        self.spikes.record_save(saved.iteration, &directory);
        self.last_checkpoint = Some(directory);
        Ok(())
    }
}

/// The `--async-save` agreement: each flag's maximum over the ranks.
fn agree(parallel: &ParallelState, device: Device, flags: Flags) -> Result<Flags> {
    megatron_parallel::max_over_ranks(parallel.world.as_ref(), device, flags)
}

/// What writes this run's saves when `--ckpt-format` names one of Megatron's formats: the
/// caller's export, or a usage error naming the flag where the caller has none for it.
fn checkpoint_export<F: ModelFamily>(
    args: &PretrainArgs,
    hooks: &dyn TrainingHooks<F>,
) -> Result<Option<Arc<dyn CheckpointExport>>> {
    let format = args
        .checkpoint
        .ckpt_format
        .as_deref()
        .unwrap_or(export::OURS);
    if format == export::OURS || args.checkpoint.save.is_none() {
        return Ok(None);
    }
    match hooks.checkpoint_export() {
        Some(export) if export.format() == format => Ok(Some(export)),
        _ => bail_usage!(
            "--ckpt-format {format} is not written by this program; it saves --ckpt-format {} \
             (pretrain_gpt saves torch_dist and torch too, and checkpoint_convert turns a saved \
             checkpoint into Megatron's formats)",
            export::OURS
        ),
    }
}

/// The CUDA graph of `--enable-cuda-graph` (or `--external-cuda-graph`), or of the default, or
/// `None` when this run does not replay graphs. A run that asked for graphs and cannot use them
/// hears why from rank 0; a default run stays eager without a word when it cannot use them, or
/// when it asked for overlapped reductions over several data-parallel ranks (which a graphed
/// run sets aside), and says once that it replays graphs when it does.
fn microbatch_graph<F: ModelFamily>(
    args: &PretrainArgs,
    family: &F,
    device: Device,
    parallel: &ParallelState,
) -> Result<Option<MicrobatchGraph<F::Batch>>> {
    let model_type = family.model_type();
    let training = &args.training;
    let choice = if training.enable_cuda_graph || training.external_cuda_graph {
        GraphChoice::Asked
    } else if training.no_cuda_graph
        || !matches!(model_type, "GPT" | "BERT")
        || (args.parallel.overlap_grad_reduce && parallel.layout.data * parallel.layout.context > 1)
    {
        return Ok(None);
    } else {
        GraphChoice::Default
    };
    if let Some(reason) =
        cuda_graphs::unsupported_reason(args, family.transformer(), device, parallel)?
    {
        if parallel.rank == 0 && choice == GraphChoice::Asked {
            eprintln!("warning: --enable-cuda-graph: {reason}; training without CUDA graphs");
        }
        return Ok(None);
    }
    let Device::Cuda(index) = device else {
        unreachable!("unsupported_reason rules out the CPU")
    };
    if parallel.rank == 0 && choice == GraphChoice::Default {
        eprintln!(
            "note: after {} warm-up steps each micro-batch replays from a CUDA graph, which \
             computes the eager step's bits with one launch (--no-cuda-graph turns this off)",
            training.cuda_graph_warmup_steps.max(1)
        );
    }
    Ok(Some(MicrobatchGraph::new(
        index,
        choice,
        training.cuda_graph_warmup_steps,
    )))
}

/// Megatron's line after a checkpoint is loaded, which scripts and people grep for: the `--load`
/// directory, this rank's tensor and pipeline position (1-based) and the iteration resumed.
fn loaded_checkpoint_line(load_dir: &Path, parallel: &ParallelState, iteration: u64) -> String {
    format!(
        "  successfully loaded checkpoint from {} [ t {}/{}, p {}/{} ] at iteration {iteration}",
        load_dir.display(),
        parallel.tensor.rank() + 1,
        parallel.tensor.size(),
        parallel.pipeline.rank() + 1,
        parallel.pipeline.size(),
    )
}

fn load_request(args: &PretrainArgs) -> Result<Option<LoadRequest<'_>>> {
    let optimizer = &args.optimizer;
    let policy = match (optimizer.override_opt_param_scheduler, optimizer.use_checkpoint_opt_param_scheduler) {
        (true, true) => bail_usage!("--override-opt_param-scheduler and --use-checkpoint-opt_param-scheduler exclude each other"),
        (true, false) => SchedulerLoadPolicy::OverrideFromCli,
        (false, true) => SchedulerLoadPolicy::UseCheckpoint,
        (false, false) => SchedulerLoadPolicy::RequireMatch,
    };
    Ok(args.checkpoint.load.as_deref().map(|root| LoadRequest {
        root,
        finetune: args.checkpoint.finetune,
        load_optimizer: !args.checkpoint.no_load_optim,
        load_rng: !args.checkpoint.no_load_rng,
        scheduler_policy: policy,
    }))
}

fn schedule_flags(args: &PretrainArgs, global_batch_size: u64) -> Result<ScheduleFlags> {
    let o = &args.optimizer;
    let lr = match (o.lr, args.training.skip_train) {
        (Some(lr), _) => Some(lr),
        (None, true) => Some(0.0),
        (None, false) => bail_usage!("--lr is required for training"),
    };
    Ok(ScheduleFlags {
        lr,
        min_lr: o.min_lr,
        lr_warmup_init: o.lr_warmup_init,
        lr_decay_style: o.lr_decay_style.parse::<LrDecayStyle>()?,
        lr_decay_iters: o.lr_decay_iters,
        lr_decay_samples: o.lr_decay_samples,
        lr_warmup_fraction: o.lr_warmup_fraction,
        lr_warmup_iters: o.lr_warmup_iters,
        lr_warmup_samples: o.lr_warmup_samples,
        lr_wsd_decay_style: o.lr_wsd_decay_style.parse::<WsdDecayStyle>()?,
        lr_wsd_decay_iters: o.lr_wsd_decay_iters,
        lr_wsd_decay_samples: o.lr_wsd_decay_samples,
        weight_decay: o.weight_decay,
        start_weight_decay: o.start_weight_decay,
        end_weight_decay: o.end_weight_decay,
        weight_decay_incr_style: o.weight_decay_incr_style.parse::<WdIncrStyle>()?,
        train_iters: args
            .training
            .train_iters
            .or(args.training.skip_train.then_some(1)),
        train_samples: args.training.train_samples,
        global_batch_size,
    })
}

/// What the optimizer will allocate for `parameters` on this rank (see [`StateBytes::predicted`]).
fn predicted_state_bytes(
    parameters: &[NamedParameter],
    settings: &OptimizerSettings,
    parallel: &ParallelState,
) -> StateBytes {
    let shapes = ParamShape::of_all(parameters);
    let dtype = parameters.first().map_or(Kind::Float, |p| p.tensor.kind());
    let data = &parallel.data_with_context;
    settings.predicted_state_bytes(&shapes, dtype, data.rank(), data.size())
}

/// The optimizer's settings from the flags. With micro-batches replayed from CUDA graphs
/// (`graphed`), `--overlap-grad-reduce` and `--overlap-param-gather` are set aside: their
/// reductions and gathers are started by hooks on the host during the backward and the forward,
/// which a replayed graph does not run. The gradients are then reduced after the step's last
/// micro-batch, and the parameters gathered after the optimizer step; on runs bound by the host,
/// which graphs are for, that costs far less than the launches the graph saves.
fn optimizer_settings(
    args: &PretrainArgs,
    data_parallel_size: usize,
    graphed: bool,
) -> Result<OptimizerSettings> {
    let o = &args.optimizer;
    let kind = match o.optimizer.as_str() {
        "adam" => OptimizerKind::Adam {
            beta1: o.adam_beta1,
            beta2: o.adam_beta2,
            eps: o.adam_eps,
        },
        "sgd" => OptimizerKind::Sgd {
            momentum: o.sgd_momentum,
        },
        other => bail!("--optimizer {other:?}: expected adam or sgd"),
    };
    let bucket_size = args.parallel.bucket_size(data_parallel_size);
    let parallel = &args.parallel;
    if parallel.overlap_param_gather {
        ensure!(
            parallel.use_distributed_optimizer,
            "--overlap-param-gather only supported with distributed optimizer"
        );
        ensure!(
            parallel.overlap_grad_reduce,
            "--overlap-grad-reduce should be turned on when using --overlap-param-gather"
        );
    }
    let overlap = !(graphed && data_parallel_size > 1);
    Ok(OptimizerSettings {
        kind,
        clip_grad: o.clip_grad,
        distributed: parallel.use_distributed_optimizer,
        bucket_size,
        overlap_grad_reduce: overlap && parallel.overlap_grad_reduce,
        overlap_param_gather: overlap && parallel.overlap_param_gather,
        gradient_accumulation_fusion: !o.no_gradient_accumulation_fusion,
        decoupled_lr: o.decoupled_lr.is_some(),
    })
}

/// `--decoupled-lr` with `--decoupled-min-lr` (by default `--min-lr`, as Megatron), checked as
/// the scheduler checks `--lr` and `--min-lr`.
fn decoupled_lr(args: &PretrainArgs) -> Result<Option<(f64, f64)>> {
    let o = &args.optimizer;
    let Some(max_lr) = o.decoupled_lr else {
        if o.decoupled_min_lr.is_some() {
            eprintln!("warning: --decoupled-min-lr has no effect without --decoupled-lr");
        }
        return Ok(None);
    };
    let min_lr = o.decoupled_min_lr.unwrap_or(o.min_lr);
    if !(min_lr >= 0.0 && max_lr >= min_lr) {
        bail_usage!(
            "--decoupled-lr ({max_lr}) must be at least --decoupled-min-lr ({min_lr}), which must \
             be non-negative"
        );
    }
    if max_lr < o.lr_warmup_init {
        bail_usage!(
            "--lr-warmup-init ({}) must not exceed --decoupled-lr ({max_lr})",
            o.lr_warmup_init
        );
    }
    Ok(Some((max_lr, min_lr)))
}

/// Megatron's requested sample counts: train, `(iters // eval_interval + 1) · eval_iters · gbs`
/// validation, `eval_iters · gbs` test.
fn dataset_sizes(args: &PretrainArgs, train_iters: u64, global_batch_size: u64) -> [u64; 3] {
    let t = &args.training;
    let train = t.train_samples.unwrap_or(train_iters * global_batch_size);
    let evaluations = train_iters / t.eval_interval.max(1) + 1;
    [
        train,
        evaluations * t.eval_iters * global_batch_size,
        t.eval_iters * global_batch_size,
    ]
}
