//! `pretrain_gpt`: Megatron's `pretrain()` for GPT on one device — set-up from the flags,
//! resume, the iteration loop with micro-batch accumulation, evaluation, logging, checkpoints
//! and the exit conditions (spec §4).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use megatron_data::tokenizer::build_tokenizer;
use tch::{Device, Kind, Tensor};

use super::checkpointing::{self, LoadRequest, Progress, Resumed, SaveRequest, TrainingState};
use super::datasets::{build_datasets, DatasetRequest, SplitDatasets};
use super::device::{peak_tflops_of, resolve_device};
use super::flops::{num_floating_point_operations, FlopsModel};
use super::log_line::{format_eval_block, format_iteration_line, local_timestamp, IterationLog};
use super::loss_scale::{LossScaleFlags, LossScaler};
use super::lr_schedule::{LrDecayStyle, OptimizerParamScheduler, ScheduleFlags, SchedulerConfig, SchedulerLoadPolicy, WdIncrStyle, WsdDecayStyle};
use super::microbatches::{train_iters_from_samples, BatchRampup, MicrobatchCalculator};
use super::signals::{exit_requested, install_exit_handler};
use crate::args::GptPretrainArgs;
use crate::loader::{BatchLoader, SamplerPosition};
use crate::metrics::TrainingMetrics;
use crate::model::{cross_entropy, Activation, GptConfig, GptModel, ModelOptions};
use crate::optim::{MixedPrecisionOptimizer, OptimizerKind, OptimizerSettings};
use crate::parallel::ParallelState;

/// How a run ended, for the binary's one-line summary.
#[derive(Debug, Clone)]
pub struct TrainingSummary {
    pub iterations: u64,
    pub consumed_samples: u64,
    pub last_lm_loss: Option<f64>,
    pub validation_loss: Option<f64>,
    pub last_checkpoint: Option<PathBuf>,
    pub exit_reason: &'static str,
    pub seconds: f64,
}

/// Interval statistics behind the log line (Megatron's `total_loss_dict`).
#[derive(Default)]
struct IntervalStats {
    loss_sum: f64,
    advanced: u64,
    skipped: u64,
    nan: u64,
    iterations: u64,
    started: Option<Instant>,
}

struct Run<'a> {
    args: &'a GptPretrainArgs,
    model: GptModel,
    optimizer: MixedPrecisionOptimizer,
    scheduler: OptimizerParamScheduler,
    scaler: LossScaler,
    batches: MicrobatchCalculator,
    parallel: ParallelState,
    progress: Progress,
    train_iters: u64,
    device: Device,
    flops: FlopsModel,
    peak_tflops: Option<f64>,
    metrics: TrainingMetrics,
    args_json: serde_json::Value,
    last_checkpoint: Option<PathBuf>,
}

pub fn pretrain_gpt(args: &GptPretrainArgs) -> Result<TrainingSummary> {
    let started = Instant::now();
    install_exit_handler();
    args.training.check_parallel_sizes()?;
    let device = resolve_device(&args.training.device)?;
    let tokenizer = build_tokenizer(&args.tokenizer.config()?)?;
    let vocab_size = tokenizer.vocab_size();
    let eod = tokenizer.eod().context("the tokenizer has no end-of-document token, which GPT training needs")?;

    tch::manual_seed(args.training.seed as i64);
    if args.training.deterministic_mode {
        crate::ops::set_deterministic(true)?;
    }
    let config = args.model.gpt_config(vocab_size as i64)?;
    let options = ModelOptions { params_dtype: args.precision.params_dtype(), device, recompute: args.recompute.recompute()? };
    let parallel = ParallelState::single();
    let model = GptModel::new(config.clone(), options, &parallel)?;

    let micro_batch_size = args.training.micro_batch_size;
    let data_parallel_size = parallel.data_parallel_size() as u64;
    let global_batch_size = args.training.global_batch_size.unwrap_or(micro_batch_size * data_parallel_size);
    let rampup = args.training.rampup_batch_size.as_deref().map(BatchRampup::from_flag_values).transpose()?;
    let batches = MicrobatchCalculator::new(
        global_batch_size,
        micro_batch_size,
        data_parallel_size,
        rampup.clone(),
        args.training.decrease_batch_size_if_needed,
    )?;
    let train_iters = match (args.training.train_iters, args.training.train_samples) {
        (Some(iters), None) => iters,
        (None, Some(samples)) => train_iters_from_samples(samples, global_batch_size, rampup.as_ref())?,
        (Some(_), Some(_)) => bail!("give only one of --train-iters and --train-samples"),
        (None, None) if args.training.skip_train => 0,
        (None, None) => bail!("give --train-iters or --train-samples"),
    };
    if rampup.is_some() && args.training.train_samples.is_none() {
        bail!("--rampup-batch-size needs sample-based training (--train-samples)");
    }
    let scheduler = OptimizerParamScheduler::new(SchedulerConfig::from_flags(&schedule_flags(args, global_batch_size)?)?)?;
    let scaler = LossScaler::from_flags(&LossScaleFlags {
        fp16: args.precision.fp16,
        loss_scale: args.precision.loss_scale,
        initial_loss_scale: args.precision.initial_loss_scale,
        min_loss_scale: args.precision.min_loss_scale,
        loss_scale_window: args.precision.loss_scale_window,
        hysteresis: args.precision.hysteresis as u32,
    })?;

    let load_request = load_request(args)?;
    let mut loaded = None;
    if let Some(request) = &load_request {
        loaded = checkpointing::load_weights(request, &model)?;
    }
    let pretrained = match (&loaded, &args.checkpoint.pretrained_checkpoint) {
        (None, Some(path)) => {
            let request = LoadRequest { root: path, finetune: true, load_optimizer: false, load_rng: false, scheduler_policy: SchedulerLoadPolicy::RequireMatch };
            let found = checkpointing::load_weights(&request, &model)?;
            Some(found.with_context(|| format!("--pretrained-checkpoint {} holds no checkpoint", path.display()))?.directory)
        }
        _ => None,
    };
    if loaded.is_none() && pretrained.is_none() && args.checkpoint.exit_on_missing_checkpoint {
        bail!("--exit-on-missing-checkpoint: no checkpoint under {:?}", args.checkpoint.load);
    }

    let optimizer = MixedPrecisionOptimizer::new(model.named_parameters(), optimizer_settings(args)?);
    let metrics_path = args.logging.metrics_file.clone().or_else(|| args.logging.tensorboard_dir.as_ref().map(|d| d.join("metrics.jsonl")));
    let mut run = Run {
        args,
        model,
        optimizer,
        scheduler,
        scaler,
        batches,
        parallel,
        progress: Progress::default(),
        train_iters,
        device,
        flops: flops_model(&config, args.model.seq_length),
        peak_tflops: peak_tflops_of(device),
        metrics: TrainingMetrics::new(args.logging.tensorboard_dir.as_deref(), metrics_path.as_deref())?,
        args_json: serde_json::to_value(args)?,
        last_checkpoint: None,
    };
    if let (Some(checkpoint), Some(request)) = (loaded, &load_request) {
        let state = TrainingState { optimizer: &mut run.optimizer, scheduler: &mut run.scheduler, scaler: &mut run.scaler };
        match checkpointing::restore_training_state(checkpoint, request, state, device)? {
            Resumed::Full { directory, progress } => {
                println!("loaded checkpoint {} at iteration {}", directory.display(), progress.iteration);
                run.progress = progress;
            }
            Resumed::Weights { directory } => println!("loaded weights from {} (starting at iteration 0)", directory.display()),
        }
    }
    if let Some(directory) = pretrained {
        println!("loaded pretrained weights from {}", directory.display());
    }
    run.batches.update(run.progress.consumed_train_samples, false)?;
    println!(
        "> GPT model: {} parameters, padded vocab {} (from {vocab_size}), {} on {device:?}",
        run.model.parameter_count(),
        config.padded_vocab_size(1),
        checkpointing::dtype_name(options.params_dtype)
    );

    let datasets = build_datasets(&DatasetRequest {
        data: &args.data,
        tokenizer: &args.tokenizer,
        seq_length: args.model.seq_length as usize,
        seed: args.training.seed,
        sizes: dataset_sizes(args, train_iters, global_batch_size),
        eod: eod as i64,
        vocab_size,
    })?;
    run.train_and_evaluate(&datasets, started)
}

impl Run<'_> {
    fn train_and_evaluate(&mut self, datasets: &SplitDatasets, started: Instant) -> Result<TrainingSummary> {
        let mut summary = TrainingSummary {
            iterations: self.progress.iteration,
            consumed_samples: self.progress.consumed_train_samples,
            last_lm_loss: None,
            validation_loss: None,
            last_checkpoint: None,
            exit_reason: "finished",
            seconds: 0.0,
        };
        let mut valid_loader = datasets.valid.as_ref().map(|d| {
            self.loader(d.clone(), "valid", self.progress.consumed_valid_samples)
        });
        if !self.args.training.skip_train && self.progress.iteration < self.train_iters {
            let train = datasets.train.clone().context("the training split is empty")?;
            let mut train_loader = self.loader(train, "train", self.progress.consumed_train_samples);
            summary.exit_reason = self.train(&mut train_loader, valid_loader.as_mut(), &mut summary, started)?;
        }
        summary.iterations = self.progress.iteration;
        summary.consumed_samples = self.progress.consumed_train_samples;
        if summary.exit_reason == "finished" {
            let label = format!("iteration {} on validation set", self.progress.iteration);
            if let Some(loader) = valid_loader.as_mut() {
                summary.validation_loss = Some(self.evaluate(loader, &label, !self.args.training.skip_train)?);
            }
            if let Some(test) = &datasets.test {
                let mut loader = self.loader(test.clone(), "test", 0);
                let label = format!("iteration {} on test set", self.progress.iteration);
                self.evaluate_without_counting(&mut loader, &label)?;
            }
        }
        summary.last_checkpoint = self.last_checkpoint.clone();
        summary.seconds = started.elapsed().as_secs_f64();
        Ok(summary)
    }

    fn loader(&self, dataset: Arc<megatron_data::blend::SplitDataset>, name: &'static str, start: u64) -> BatchLoader {
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
        train: &mut BatchLoader,
        mut valid: Option<&mut BatchLoader>,
        summary: &mut TrainingSummary,
        started: Instant,
    ) -> Result<&'static str> {
        let mut interval = IntervalStats { started: Some(Instant::now()), ..Default::default() };
        let logging = &self.args.logging;
        let checkpoint = &self.args.checkpoint;
        while self.progress.iteration < self.train_iters {
            let global_batch = self.batches.current_global_batch_size();
            let iteration_started = Instant::now();
            let (lm_loss, outcome) = self.train_step(train)?;
            self.progress.iteration += 1;
            self.progress.consumed_train_samples += global_batch;
            self.progress.floating_point_operations += num_floating_point_operations(&self.flops, global_batch);
            self.batches.update(self.progress.consumed_train_samples, true)?;
            let iteration = self.progress.iteration;

            interval.iterations += 1;
            if outcome.skipped {
                interval.skipped += 1;
                if !lm_loss.is_finite() {
                    interval.nan += 1;
                }
            } else {
                interval.loss_sum += lm_loss;
                interval.advanced += 1;
                summary.last_lm_loss = Some(lm_loss);
            }
            if iteration % logging.tensorboard_log_interval.max(1) == 0 {
                let mut scalars = vec![
                    ("learning-rate", self.scheduler.lr()),
                    ("batch-size", global_batch as f64),
                    ("loss-scale", self.scaler.scale() as f64),
                    ("iteration-time", iteration_started.elapsed().as_secs_f64()),
                ];
                if !outcome.skipped {
                    scalars.push(("lm loss", lm_loss));
                }
                if let Some(norm) = outcome.grad_norm {
                    scalars.push(("grad-norm", norm));
                }
                self.metrics.record_iteration(iteration, self.progress.consumed_train_samples, &scalars)?;
            }
            if iteration % logging.log_interval.max(1) == 0 {
                self.print_log_line(&mut interval, global_batch, outcome.grad_norm);
            }
            if let Some(loader) = valid.as_deref_mut() {
                if self.args.training.eval_interval > 0 && iteration % self.args.training.eval_interval == 0 {
                    summary.validation_loss = Some(self.evaluate(loader, &format!("iteration {iteration}"), true)?);
                }
            }

            let mut saved_now = false;
            if let (Some(_), Some(interval)) = (&checkpoint.save, checkpoint.save_interval) {
                if interval > 0 && iteration % interval == 0 {
                    self.save()?;
                    saved_now = true;
                }
            }
            let reason = if exit_requested() {
                Some("signal")
            } else if self.args.training.exit_duration_in_mins.is_some_and(|m| started.elapsed().as_secs_f64() / 60.0 > m) {
                Some("exit-duration-in-mins")
            } else if self.args.training.exit_interval.is_some_and(|n| n > 0 && iteration % n == 0) {
                Some("exit-interval")
            } else {
                None
            };
            if let Some(reason) = reason {
                if checkpoint.save.is_some() && !saved_now {
                    self.save()?;
                }
                println!("exiting at iteration {iteration} ({reason})");
                return Ok(reason);
            }
            if self.progress.iteration == self.train_iters && checkpoint.save.is_some() && !saved_now {
                self.save()?;
            }
        }
        Ok("finished")
    }

    /// One iteration: forward/backward over the micro-batches, then the optimizer step.
    /// Returns the iteration's `lm loss` (Σ loss / Σ tokens over its micro-batches).
    fn train_step(&mut self, loader: &mut BatchLoader) -> Result<(f64, crate::optim::StepOutcome)> {
        let microbatches = self.batches.num_microbatches();
        let scale = self.scaler.scale() as f64;
        let mut loss_sum = Tensor::zeros([], (Kind::Float, self.device));
        let mut token_sum = Tensor::zeros([], (Kind::Float, self.device));
        for _ in 0..microbatches {
            let batch = loader.next_batch()?.to_device(self.device);
            let logits = self.model.forward(&batch.tokens, &batch.position_ids, &batch.mask(), true)?;
            let losses = cross_entropy(&logits, &batch.labels, &self.parallel.tensor)?;
            let masked_sum = (losses * &batch.loss_mask).sum(Kind::Float);
            let tokens = batch.num_tokens();
            // Megatron divides each micro-batch's loss by its token count and by the number of
            // micro-batches before backward.
            let loss = &masked_sum / tokens.clamp_min(1.0) / microbatches as f64;
            (loss * scale).backward();
            self.optimizer.accumulate_grads()?;
            loss_sum += masked_sum.detach();
            token_sum += tokens;
        }
        let lm_loss = (loss_sum / token_sum.clamp_min(1.0)).double_value(&[]);
        let fp16 = self.args.precision.fp16;
        if !fp16 && !lm_loss.is_finite() {
            bail!(self.nan_message("loss", lm_loss));
        }
        let lr = self.scheduler.lr();
        let weight_decay = self.scheduler.weight_decay();
        let outcome = self.optimizer.step(lr, weight_decay, fp16.then(|| self.scaler.scale()))?;
        if fp16 {
            self.scaler.update(outcome.skipped);
        }
        if let Some(norm) = outcome.grad_norm {
            if !norm.is_finite() {
                bail!(self.nan_message("gradient norm", norm));
            }
        }
        if !outcome.skipped {
            self.scheduler.step(self.batches.current_global_batch_size());
        }
        Ok((lm_loss, outcome))
    }

    fn nan_message(&self, what: &str, value: f64) -> String {
        let kept = match &self.last_checkpoint {
            Some(dir) => format!("the last good checkpoint is {}", dir.display()),
            None => match &self.args.checkpoint.load {
                Some(load) => format!("checkpoints under {} are untouched", load.display()),
                None => "no checkpoint was written".to_string(),
            },
        };
        format!("{what} is {value} at iteration {}; stopping ({kept})", self.progress.iteration + 1)
    }

    fn print_log_line(&mut self, interval: &mut IntervalStats, global_batch: u64, grad_norm: Option<f64>) {
        let elapsed = interval.started.map_or(0.0, |s| s.elapsed().as_secs_f64());
        let per_iteration = elapsed / interval.iterations.max(1) as f64;
        let world = self.parallel.world_size() as f64;
        let tflops = num_floating_point_operations(&self.flops, global_batch) / (per_iteration * 1e12 * world);
        let tokens_per_second = (global_batch * self.args.model.seq_length as u64) as f64 / per_iteration;
        let losses = if interval.advanced > 0 {
            vec![("lm loss".to_string(), interval.loss_sum / interval.advanced as f64)]
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
            decoupled_learning_rate: None,
            global_batch_size: global_batch,
            losses,
            loss_scale: self.scaler.scale() as f64,
            grad_norm,
            num_zeros: None,
            params_norm: self.args.logging.log_params_norm.then(|| self.params_norm()),
            skipped_iterations: interval.skipped,
            nan_iterations: interval.nan,
            tokens_per_second: Some(tokens_per_second),
            mfu_percent: self.peak_tflops.map(|peak| 100.0 * tflops / peak),
        };
        println!("{}", format_iteration_line(&log));
        *interval = IntervalStats { started: Some(Instant::now()), ..Default::default() };
    }

    fn params_norm(&self) -> f64 {
        let parameters = self.model.named_parameters();
        let tensors: Vec<&Tensor> = parameters.iter().map(|(_, t)| t).collect();
        crate::ops::total_norm(&tensors).map_or(f64::NAN, |n| n.double_value(&[]))
    }

    /// `--eval-iters` global batches of the validation split, forward only; advances the
    /// validation sample counter like Megatron.
    fn evaluate(&mut self, loader: &mut BatchLoader, label: &str, record: bool) -> Result<f64> {
        let loss = self.evaluate_without_counting(loader, label)?;
        self.progress.consumed_valid_samples += self.args.training.eval_iters * self.batches.current_global_batch_size();
        if record {
            self.metrics.record_eval(self.progress.iteration, self.progress.consumed_train_samples, &[("lm loss", loss)])?;
        }
        Ok(loss)
    }

    fn evaluate_without_counting(&mut self, loader: &mut BatchLoader, label: &str) -> Result<f64> {
        let microbatches = self.batches.num_microbatches();
        let (mut loss_sum, mut tokens) = (0.0, 0.0);
        tch::no_grad(|| -> Result<()> {
            for _ in 0..self.args.training.eval_iters * microbatches {
                let batch = loader.next_batch()?.to_device(self.device);
                let logits = self.model.forward(&batch.tokens, &batch.position_ids, &batch.mask(), false)?;
                let losses = cross_entropy(&logits, &batch.labels, &self.parallel.tensor)?;
                loss_sum += (losses * &batch.loss_mask).sum(Kind::Float).double_value(&[]);
                tokens += batch.num_tokens().double_value(&[]);
            }
            Ok(())
        })?;
        let loss = loss_sum / tokens.max(1.0);
        println!("{}", format_eval_block(label, &[("lm loss".to_string(), loss)]));
        Ok(loss)
    }

    fn save(&mut self) -> Result<()> {
        let root = self.args.checkpoint.save.as_ref().expect("save is only called with --save");
        let optimizer_name = if self.args.optimizer.optimizer == "sgd" { "sgd" } else { "adam" };
        let started = Instant::now();
        let directory = checkpointing::save(SaveRequest {
            root,
            progress: self.progress,
            model: &self.model,
            optimizer: (!self.args.checkpoint.no_save_optim).then_some((&self.optimizer, optimizer_name)),
            scheduler: &self.scheduler,
            scaler: &self.scaler,
            save_rng: !self.args.checkpoint.no_save_rng,
            args: self.args_json.clone(),
        })?;
        println!(
            "  successfully saved checkpoint from iteration {:7} to {} [ {:.1} ms ]",
            self.progress.iteration,
            root.display(),
            started.elapsed().as_secs_f64() * 1000.0
        );
        self.last_checkpoint = Some(directory);
        Ok(())
    }
}

fn load_request(args: &GptPretrainArgs) -> Result<Option<LoadRequest<'_>>> {
    let optimizer = &args.optimizer;
    let policy = match (optimizer.override_opt_param_scheduler, optimizer.use_checkpoint_opt_param_scheduler) {
        (true, true) => bail!("--override-opt_param-scheduler and --use-checkpoint-opt_param-scheduler exclude each other"),
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

fn schedule_flags(args: &GptPretrainArgs, global_batch_size: u64) -> Result<ScheduleFlags> {
    let o = &args.optimizer;
    let lr = match (o.lr, args.training.skip_train) {
        (Some(lr), _) => Some(lr),
        (None, true) => Some(0.0),
        (None, false) => bail!("--lr is required for training"),
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
        train_iters: args.training.train_iters.or(args.training.skip_train.then_some(1)),
        train_samples: args.training.train_samples,
        global_batch_size,
    })
}

fn optimizer_settings(args: &GptPretrainArgs) -> Result<OptimizerSettings> {
    let o = &args.optimizer;
    let kind = match o.optimizer.as_str() {
        "adam" => OptimizerKind::Adam { beta1: o.adam_beta1, beta2: o.adam_beta2, eps: o.adam_eps },
        "sgd" => OptimizerKind::Sgd { momentum: o.sgd_momentum },
        other => bail!("--optimizer {other:?}: expected adam or sgd"),
    };
    Ok(OptimizerSettings { kind, clip_grad: o.clip_grad })
}

/// Megatron's requested sample counts: train, `(iters // eval_interval + 1) · eval_iters · gbs`
/// validation, `eval_iters · gbs` test.
fn dataset_sizes(args: &GptPretrainArgs, train_iters: u64, global_batch_size: u64) -> [u64; 3] {
    let t = &args.training;
    let train = t.train_samples.unwrap_or(train_iters * global_batch_size);
    let evaluations = train_iters / t.eval_interval.max(1) + 1;
    [train, evaluations * t.eval_iters * global_batch_size, t.eval_iters * global_batch_size]
}

fn flops_model(config: &GptConfig, seq_length: i64) -> FlopsModel {
    FlopsModel {
        num_layers: config.num_layers as u64,
        hidden_size: config.hidden_size as u64,
        ffn_hidden_size: config.ffn_hidden_size as u64,
        num_attention_heads: config.num_attention_heads as u64,
        num_query_groups: config.num_query_groups as u64,
        kv_channels: config.kv_channels as u64,
        seq_length: seq_length as u64,
        padded_vocab_size: config.padded_vocab_size(1) as u64,
        swiglu: config.activation == Activation::Swiglu,
    }
}
