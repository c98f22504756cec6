//! Writing Megatron's `--ckpt-format torch` checkpoints (`--saver core`/`legacy`): per rank
//! `mp_rank_XX[_YYY]/model_optim_rng.pt` with Megatron-core names in Megatron's module order
//! (local-spec `_extra_state` entries included, as Megatron's strict `load_state_dict` expects),
//! `args` as an `argparse.Namespace`, `checkpoint_version` 3.0, `iteration` and the scheduler.
//! With the optimizer state when the input has one (Adam's moments and the float32 main
//! parameters, as Megatron's non-distributed optimizer saves them, or the distributed
//! optimizer's parameter groups with its state in `distrib_optim.pt`: `distrib_optim_save`);
//! without RNG states, so Megatron resumes it with `--no-load-rng`.

use std::path::Path;

use anyhow::{ensure, Context, Result};
use megatron_checkpoint::torch_writer::{write_torch_file, Saved, TensorSlot};
use megatron_checkpoint::{DType, Value};
use serde_json::Value as Json;

use super::distrib_optim::{expert_params, Bucketing};
use super::distrib_optim_save::{write_distrib_optim, OptimizerBuffers};
use super::lazy::with_bytes;
use super::megatron_rng::{rng_state_entry, RankSeeds};
use super::megatron_torch::param_groups;
use super::ours::TargetLayout;
use super::state::{shard_of, shard_shape, ModelState, OptimizerState};
use super::tensors::kind_named;
use megatron_models::gpt::megatron_names::expert_of;
use megatron_models::layers::moe::config::{LoadBalancing, ScoreFunction};
use megatron_models::{
    Activation, ChunkSpec, Normalization, PipelineSplit, PositionEmbeddingType, RopeScaling,
    YarnScaling,
};
use megatron_optim::excluded_from_weight_decay;
use megatron_store::{iteration_directory, rank_directory_name, write_tracker};

pub(super) fn json_to_value(json: &Json) -> Option<Value> {
    Some(match json {
        Json::Null => Value::None,
        Json::Bool(b) => Value::Bool(*b),
        Json::Number(n) => match n.as_i64() {
            Some(i) => Value::Int(i),
            None => Value::Float(n.as_f64()?),
        },
        // Megatron's enums were read as opaque values; Megatron fills them from its own flags.
        Json::String(s) if s.starts_with("megatron.") && s.contains('(') => return None,
        Json::String(s) => Value::Str(s.clone()),
        Json::Array(items) => Value::List(items.iter().filter_map(json_to_value).collect()),
        Json::Object(map) => Value::Dict(
            map.iter()
                .filter_map(|(k, v)| Some((Value::Str(k.clone()), json_to_value(v)?)))
                .collect(),
        ),
    })
}

/// The args namespace: the source run's flags with the architecture and layout of the output.
pub(super) fn args_namespace(
    state: &ModelState,
    target: TargetLayout,
) -> Result<Vec<(String, Saved)>> {
    let config = &state.config;
    if let Some(RopeScaling::Llama3(scaling)) = config.rope_scaling {
        ensure!(
            scaling.is_megatron_expressible(),
            "{}: Megatron's --use-rope-scaling fixes low_freq_factor 1, high_freq_factor 4 and original_max_position_embeddings 8192; this model has {scaling:?}",
            state.source
        );
    }
    // Our checkpoints keep the flags in groups (`{"model": {...}, "tokenizer": {...}}`);
    // Megatron's namespace is flat.
    let mut flat: Vec<(&String, &Json)> = Vec::new();
    for (key, value) in state.run.args.as_object().into_iter().flatten() {
        match value.as_object() {
            Some(group) => flat.extend(group.iter()),
            None => flat.push((key, value)),
        }
    }
    let mut args: Vec<(String, Value)> = Vec::new();
    for (key, value) in flat {
        if let (false, Some(value)) = (args.iter().any(|(k, _)| k == key), json_to_value(value)) {
            args.push((key.clone(), value));
        }
    }
    let dtype = state.params_dtype.as_str();
    let vp = (target.virtual_stages > 1).then_some(target.virtual_stages as i64);
    let mut overrides: Vec<(&str, Value)> = vec![
        ("num_layers", Value::Int(config.num_layers as i64)),
        ("hidden_size", Value::Int(config.hidden_size)),
        ("ffn_hidden_size", Value::Int(config.ffn_hidden_size)),
        (
            "num_attention_heads",
            Value::Int(config.num_attention_heads),
        ),
        (
            "group_query_attention",
            Value::Bool(config.num_query_groups != config.num_attention_heads),
        ),
        ("num_query_groups", Value::Int(config.num_query_groups)),
        ("kv_channels", Value::Int(config.kv_channels)),
        (
            "max_position_embeddings",
            Value::Int(config.max_position_embeddings),
        ),
        (
            "padded_vocab_size",
            Value::Int(config.padded_vocab_size(target.tensor as i64)),
        ),
        (
            "make_vocab_size_divisible_by",
            Value::Int(config.make_vocab_size_divisible_by),
        ),
        (
            "position_embedding_type",
            Value::Str(
                match (config.position_embedding_type, config.rope_scaling) {
                    (PositionEmbeddingType::LearnedAbsolute, _) => "learned_absolute",
                    (PositionEmbeddingType::Rope, Some(RopeScaling::Yarn(_))) => "yarn",
                    (PositionEmbeddingType::Rope, _) => "rope",
                    (PositionEmbeddingType::None, _) => "none",
                }
                .into(),
            ),
        ),
        ("rotary_base", Value::Int(config.rotary_base as i64)),
        ("rotary_percent", Value::Float(config.rotary_percent)),
        (
            "normalization",
            Value::Str(
                match config.normalization {
                    Normalization::LayerNorm => "LayerNorm",
                    Normalization::RMSNorm => "RMSNorm",
                }
                .into(),
            ),
        ),
        ("norm_epsilon", Value::Float(config.norm_epsilon)),
        ("hidden_dropout", Value::Float(config.hidden_dropout)),
        ("attention_dropout", Value::Float(config.attention_dropout)),
        ("apply_layernorm_1p", Value::Bool(config.apply_layernorm_1p)),
        ("qk_layernorm", Value::Bool(config.qk_layernorm)),
        (
            "swiglu",
            Value::Bool(config.activation == Activation::Swiglu),
        ),
        (
            "squared_relu",
            Value::Bool(config.activation == Activation::SquaredRelu),
        ),
        ("add_bias_linear", Value::Bool(config.add_bias_linear)),
        ("add_qkv_bias", Value::Bool(config.add_qkv_bias)),
        (
            "untie_embeddings_and_output_weights",
            Value::Bool(config.untie_embeddings_and_output_weights),
        ),
        (
            "tensor_model_parallel_size",
            Value::Int(target.tensor as i64),
        ),
        (
            "pipeline_model_parallel_size",
            Value::Int(target.pipeline as i64),
        ),
        (
            "virtual_pipeline_model_parallel_size",
            vp.map_or(Value::None, Value::Int),
        ),
        (
            "params_dtype",
            Value::Global {
                module: "torch".into(),
                name: dtype.into(),
            },
        ),
        ("bf16", Value::Bool(dtype == "bfloat16")),
        ("fp16", Value::Bool(dtype == "float16")),
        ("iteration", Value::Int(state.run.iteration as i64)),
        (
            "consumed_train_samples",
            Value::Int(state.run.consumed_train_samples as i64),
        ),
        (
            "consumed_valid_samples",
            Value::Int(state.run.consumed_valid_samples as i64),
        ),
    ];
    overrides.extend(rope_scaling_args(config.rope_scaling));
    for (key, value) in overrides {
        match args.iter_mut().find(|(k, _)| k == key) {
            Some(entry) => entry.1 = value,
            None => args.push((key.to_string(), value)),
        }
    }
    Ok(args
        .into_iter()
        .map(|(k, v)| (k, Saved::Value(v)))
        .collect())
}

/// Megatron's Mixture-of-Experts flags of `state`'s model, its experts over `expert_parallel`
/// ranks (none for a dense model).
pub(super) fn moe_args(state: &ModelState, expert_parallel: usize) -> Vec<(String, Saved)> {
    let Some(moe) = &state.config.moe else {
        return Vec::new();
    };
    let optional = |value: Option<i64>| value.map_or(Value::None, Value::Int);
    let entries = [
        ("num_experts", Value::Int(moe.num_experts)),
        ("moe_ffn_hidden_size", Value::Int(moe.ffn_hidden_size)),
        ("moe_router_topk", Value::Int(moe.topk)),
        (
            "moe_shared_expert_intermediate_size",
            optional(moe.shared_expert_intermediate_size),
        ),
        (
            "moe_shared_expert_gate",
            Value::Bool(moe.shared_expert_gate),
        ),
        ("moe_router_pre_softmax", Value::Bool(moe.pre_softmax)),
        (
            "moe_router_score_function",
            Value::Str(
                match moe.score_function {
                    ScoreFunction::Softmax => "softmax",
                    ScoreFunction::Sigmoid => "sigmoid",
                }
                .into(),
            ),
        ),
        (
            "moe_router_topk_scaling_factor",
            moe.topk_scaling_factor.map_or(Value::None, Value::Float),
        ),
        (
            "moe_router_load_balancing_type",
            Value::Str(
                match moe.load_balancing {
                    LoadBalancing::AuxLoss => "aux_loss",
                    LoadBalancing::SeqAuxLoss => "seq_aux_loss",
                    LoadBalancing::None => "none",
                }
                .into(),
            ),
        ),
        ("moe_aux_loss_coeff", Value::Float(moe.aux_loss_coeff)),
        (
            "moe_z_loss_coeff",
            moe.z_loss_coeff.map_or(Value::None, Value::Float),
        ),
        (
            "moe_router_enable_expert_bias",
            Value::Bool(moe.expert_bias_update_rate.is_some()),
        ),
        (
            "moe_router_bias_update_rate",
            Value::Float(moe.expert_bias_update_rate.unwrap_or(1e-3)),
        ),
        (
            "expert_model_parallel_size",
            Value::Int(expert_parallel as i64),
        ),
    ];
    entries
        .into_iter()
        .map(|(key, value)| (key.to_string(), Saved::Value(value)))
        .collect()
}

/// Megatron's flags for a RoPE scaling (the others at their defaults, so that a source run's
/// stale ones cannot linger).
fn rope_scaling_args(scaling: Option<RopeScaling>) -> Vec<(&'static str, Value)> {
    let (llama3, linear, yarn) = match scaling {
        Some(RopeScaling::Llama3(s)) => (Some(s), None, None),
        Some(RopeScaling::Linear { factor }) => (None, Some(factor), None),
        Some(RopeScaling::Yarn(s)) => (None, None, Some(s)),
        None => (None, None, None),
    };
    let defaults = YarnScaling::megatron(1.0);
    let yarn_or = |field: fn(&YarnScaling) -> f64| Value::Float(field(&yarn.unwrap_or(defaults)));
    let yarn_only = |value: fn(&YarnScaling) -> Value| yarn.as_ref().map_or(Value::None, value);
    vec![
        ("use_rope_scaling", Value::Bool(llama3.is_some())),
        (
            "rope_scaling_factor",
            Value::Float(llama3.map_or(8.0, |s| s.factor)),
        ),
        (
            "rotary_seq_len_interpolation_factor",
            // Megatron's flag is an integer; a fractional factor is kept as it is.
            match linear {
                Some(f) if f.fract() == 0.0 => Value::Int(f as i64),
                Some(f) => Value::Float(f),
                None => Value::None,
            },
        ),
        ("rotary_scaling_factor", yarn_or(|s| s.factor)),
        ("mscale", yarn_or(|s| s.mscale)),
        ("mscale_all_dim", yarn_or(|s| s.mscale_all_dim)),
        (
            "yarn_original_max_position_embeddings",
            yarn_only(|s| Value::Int(s.original_max_position_embeddings)),
        ),
        ("yarn_beta_fast", yarn_only(|s| Value::Float(s.beta_fast))),
        ("yarn_beta_slow", yarn_only(|s| Value::Float(s.beta_slow))),
        (
            "yarn_correction_range_round_to_int",
            yarn_only(|s| Value::Bool(s.correction_range_round_to_int)),
        ),
    ]
}

/// Megatron-core's state-dict order of one chunk: `(chunk-local name, global name)`, `None`
/// as the global name for an `_extra_state` entry.
pub(super) fn chunk_entries(state: &ModelState, spec: &ChunkSpec) -> Vec<(String, Option<String>)> {
    let experts = state
        .config
        .moe
        .as_ref()
        .map_or(0, |m| m.num_experts as usize);
    rank_chunk_entries(state, spec, 0..experts)
}

/// The parameters of pipeline stage `stage`'s model chunks on a rank of `tp` tensor-parallel
/// ranks holding the routed experts `experts`, as Megatron registers them: per chunk each
/// parameter's global name and shard shape, in the rank file's order.
pub(super) fn rank_chunk_params(
    state: &ModelState,
    split: &PipelineSplit,
    stage: usize,
    tp: usize,
    experts: std::ops::Range<usize>,
) -> Result<Vec<Vec<(String, Vec<usize>)>>> {
    split
        .chunks_of(stage)?
        .iter()
        .map(|spec| {
            rank_chunk_entries(state, spec, experts.clone())
                .into_iter()
                .filter_map(|(_, global)| global)
                .map(|global| {
                    let shape =
                        shard_shape(&global, state.tensor(&global)?.shape(), &state.config, tp);
                    Ok((global, shape.iter().map(|&d| d as usize).collect()))
                })
                .collect()
        })
        .collect()
}

/// [`chunk_entries`] of an expert-parallel rank holding the routed experts `experts` (the
/// model's numbers), which its file numbers from 0.
fn rank_chunk_entries(
    state: &ModelState,
    spec: &ChunkSpec,
    experts: std::ops::Range<usize>,
) -> Vec<(String, Option<String>)> {
    let config = &state.config;
    let has = |name: &str| state.weights.contains_key(name);
    let mut out = Vec::new();
    let mut push = |local: String, global: Option<String>| out.push((local, global));
    if spec.pre_process {
        for name in [
            "embedding.word_embeddings.weight",
            "embedding.position_embeddings.weight",
        ] {
            if has(name) {
                push(name.into(), Some(name.into()));
            }
        }
    }
    for (local, global) in spec.layers.clone().enumerate() {
        let module_order: [(&str, bool); 8] = [
            ("input_layernorm", false),
            ("self_attention.linear_proj", true),
            ("self_attention.linear_qkv", true),
            ("self_attention.q_layernorm", false),
            ("self_attention.k_layernorm", false),
            ("pre_mlp_layernorm", false),
            ("mlp.linear_fc1", true),
            ("mlp.linear_fc2", true),
        ];
        let moe_layer = config.moe.as_ref().is_some_and(|m| m.is_moe_layer(global));
        for (module, linear) in module_order {
            if moe_layer && module.starts_with("mlp.") {
                if module == "mlp.linear_fc1" {
                    moe_entries(&has, local, global, experts.clone(), &mut push);
                }
                continue;
            }
            for parameter in ["weight", "bias"] {
                let name = format!("decoder.layers.{global}.{module}.{parameter}");
                if has(&name) {
                    push(
                        format!("decoder.layers.{local}.{module}.{parameter}"),
                        Some(name),
                    );
                }
            }
            if linear {
                push(
                    format!("decoder.layers.{local}.{module}._extra_state"),
                    None,
                );
            }
        }
    }
    if spec.post_process {
        for parameter in ["weight", "bias"] {
            let name = format!("decoder.final_layernorm.{parameter}");
            if has(&name) {
                push(name.clone(), Some(name));
            }
        }
        if config.untie_embeddings_and_output_weights {
            push(
                "output_layer.weight".into(),
                Some("output_layer.weight".into()),
            );
        } else if !spec.pre_process {
            push(
                "output_layer.weight".into(),
                Some("embedding.word_embeddings.weight".into()),
            );
        }
        push("output_layer._extra_state".into(), None);
    }
    out
}

/// An MoE layer's entries in `SequentialMLP`'s order: the router, each routed expert of
/// `experts` (numbered from 0 in the file), then the shared expert.
fn moe_entries(
    has: &dyn Fn(&str) -> bool,
    local: usize,
    global: usize,
    experts: std::ops::Range<usize>,
    push: &mut dyn FnMut(String, Option<String>),
) {
    let router = "mlp.router.weight";
    push(
        format!("decoder.layers.{local}.{router}"),
        Some(format!("decoder.layers.{global}.{router}")),
    );
    let modules = experts
        .clone()
        .enumerate()
        .map(|(file, model)| {
            (
                format!("mlp.experts.local_experts.{file}"),
                format!("mlp.experts.local_experts.{model}"),
            )
        })
        .chain([(
            "mlp.shared_experts".to_string(),
            "mlp.shared_experts".to_string(),
        )]);
    for (file, model) in modules {
        // The gate is the shared expert's own parameter, before its submodules' in Megatron's
        // state dict.
        let gate = format!("decoder.layers.{global}.{model}.gate_weight");
        if has(&gate) {
            push(
                format!("decoder.layers.{local}.{file}.gate_weight"),
                Some(gate),
            );
        }
        let mut present = false;
        for linear in ["linear_fc1", "linear_fc2"] {
            for parameter in ["weight", "bias"] {
                let name = format!("decoder.layers.{global}.{model}.{linear}.{parameter}");
                if has(&name) {
                    present = true;
                    push(
                        format!("decoder.layers.{local}.{file}.{linear}.{parameter}"),
                        Some(name),
                    );
                }
            }
            if present {
                push(
                    format!("decoder.layers.{local}.{file}.{linear}._extra_state"),
                    None,
                );
            }
        }
    }
}

/// What the `i`th tensor of a rank file holds.
enum Source {
    Weight(String),
    /// A router's expert bias, a float32 buffer every tensor rank holds whole.
    ExpertBias(String),
    /// Optimizer buffer (main, exp_avg, exp_avg_sq) of a parameter.
    Optimizer(usize, String),
    Step(f64),
    /// A generator state's bytes.
    Bytes(Vec<u8>),
}

/// A run flag by Megatron's name: at the top of `args` (Megatron's namespace) or in one of
/// its groups (our runs record their flags by group).
/// The scheduler's state (where the run saved one) and the FLOPs counter, as Megatron keeps
/// them beside the model in both of its formats.
pub(super) fn schedule_entries(state: &ModelState) -> Vec<(String, Saved)> {
    let scheduler = state
        .run
        .opt_param_scheduler
        .as_ref()
        .and_then(json_to_value)
        .map(|scheduler| ("opt_param_scheduler".to_string(), Saved::Value(scheduler)));
    let flops = (
        "num_floating_point_operations_so_far".to_string(),
        Saved::Value(Value::Float(state.run.num_floating_point_operations_so_far)),
    );
    scheduler.into_iter().chain([flops]).collect()
}

pub(super) fn run_flag(args: &Json, key: &str) -> Option<Json> {
    args.get(key).cloned().or_else(|| {
        args.as_object()?
            .values()
            .find_map(|group| group.get(key).cloned())
    })
}

/// The hyperparameters of one of Megatron's parameter groups (torch Adam's and Megatron's
/// `wd_mult`/`lr_mult` tags), weight-decayed or not, from the run's flags.
pub(super) fn group_hyperparameters(
    state: &ModelState,
    decayed: bool,
) -> Vec<(&'static str, Value)> {
    let args = &state.run.args;
    let number = |key: &str, default: f64| {
        run_flag(args, key)
            .and_then(|v| v.as_f64())
            .unwrap_or(default)
    };
    let lr = number("lr", 0.0);
    let wd_mult = if decayed { 1.0 } else { 0.0 };
    vec![
        ("wd_mult", Value::Float(wd_mult)),
        ("lr_mult", Value::Float(1.0)),
        ("is_expert_parallel", Value::Bool(false)),
        ("is_decoupled_lr", Value::Bool(false)),
        ("max_lr", Value::Float(lr)),
        ("min_lr", Value::Float(number("min_lr", 0.0))),
        ("lr", Value::Float(lr)),
        (
            "betas",
            Value::Tuple(vec![
                Value::Float(number("adam_beta1", 0.9)),
                Value::Float(number("adam_beta2", 0.999)),
            ]),
        ),
        ("eps", Value::Float(number("adam_eps", 1e-8))),
        (
            "weight_decay",
            Value::Float(number("weight_decay", 0.01) * wd_mult),
        ),
        ("amsgrad", Value::Bool(false)),
        ("maximize", Value::Bool(false)),
        ("foreach", Value::None),
        ("capturable", Value::Bool(false)),
        ("differentiable", Value::Bool(false)),
        ("fused", Value::None),
        ("decoupled_weight_decay", Value::Bool(true)),
    ]
}

/// Megatron's `optimizer` entry of a rank file: torch Adam's `state_dict()` (per-parameter
/// `exp_avg`, `exp_avg_sq` and `step`; the weight-decayed and not-decayed `param_groups`),
/// wrapped with the float32 main parameters `fp32_from_fp16_params` (and the `grad_scaler`)
/// when the model is in half precision, as `Float16OptimizerWithFloat16Params` saves it.
fn optimizer_entry(
    state: &ModelState,
    optimizer: &OptimizerState,
    params: &[(String, Vec<usize>)],
    expert_parallel: bool,
    slots: &mut Vec<TensorSlot>,
    sources: &mut Vec<Source>,
) -> Result<Saved> {
    let mut tensor = |source: Source, shape: &[usize]| {
        slots.push(TensorSlot {
            dtype: DType::F32,
            shape: shape.to_vec(),
        });
        sources.push(source);
        Saved::Tensor(slots.len() - 1)
    };
    let mut per_parameter = Vec::new();
    let mut groups = Vec::new();
    let mut main = Vec::new();
    let mut index = 0;
    for members in param_groups(params) {
        let decayed = !excluded_from_weight_decay(
            &params[members[0]].0,
            &params[members[0]]
                .1
                .iter()
                .map(|&d| d as i64)
                .collect::<Vec<_>>(),
        );
        let mut indices = Vec::new();
        let mut group_main = Vec::new();
        for &member in &members {
            let (global, shape) = &params[member];
            ensure!(
                optimizer.main.contains_key(global),
                "{}: no optimizer state for {global}",
                state.source
            );
            per_parameter.push((
                index,
                Saved::Dict(vec![
                    ("step".into(), tensor(Source::Step(optimizer.step), &[])),
                    (
                        "exp_avg".into(),
                        tensor(Source::Optimizer(1, global.clone()), shape),
                    ),
                    (
                        "exp_avg_sq".into(),
                        tensor(Source::Optimizer(2, global.clone()), shape),
                    ),
                ]),
            ));
            group_main.push(tensor(Source::Optimizer(0, global.clone()), shape));
            indices.push(Value::Int(index));
            index += 1;
        }
        main.push(Saved::List(group_main));
        let mut group = group_hyperparameters(state, decayed);
        for (key, value) in &mut group {
            if *key == "is_expert_parallel" {
                *value = Value::Bool(expert_parallel);
            }
        }
        group.push(("params", Value::List(indices)));
        groups.push(Saved::Dict(
            group
                .into_iter()
                .map(|(k, v)| (k.to_string(), Saved::Value(v)))
                .collect(),
        ));
    }
    let adam = Saved::Dict(vec![
        ("state".into(), Saved::IndexedDict(per_parameter)),
        ("param_groups".into(), Saved::List(groups)),
    ]);
    if state.params_dtype == "float32" {
        return Ok(adam);
    }
    let mut wrapped = vec![("optimizer".to_string(), adam)];
    if let Some(scaler) = state.run.grad_scaler.as_ref().and_then(json_to_value) {
        wrapped.push(("grad_scaler".into(), Saved::Value(scaler)));
    }
    wrapped.push(("fp32_from_fp16_params".into(), Saved::List(main)));
    Ok(Saved::Dict(wrapped))
}

/// Writes `state` in Megatron's torch format under `root` in `target`'s layout.
pub fn save_megatron_torch(state: &ModelState, root: &Path, target: TargetLayout) -> Result<()> {
    save_megatron_torch_experts(state, root, target, 1, false)
}

/// [`save_megatron_torch`] with the routed experts over `expert_parallel` ranks
/// (`--target-expert-parallel-size`): one `mp_rank_TT[_PPP]_EEE` folder per expert rank holding
/// its `num_experts / expert_parallel` experts numbered from 0 and a copy of the rest; the
/// optimizer state there as Megatron's chained optimizer saves it, a list of the dense
/// parameters' state and the routed experts'. With `distributed_optimizer` the optimizer state
/// is the distributed optimizer's: its parameter groups in the rank file and the state in
/// `distrib_optim.pt` beside it.
pub fn save_megatron_torch_experts(
    state: &ModelState,
    root: &Path,
    target: TargetLayout,
    expert_parallel: usize,
    distributed_optimizer: bool,
) -> Result<()> {
    let config = &state.config;
    config.validate(target.tensor as i64)?;
    let local_experts = match &config.moe {
        Some(moe) => {
            ensure!(
                moe.num_experts as usize % expert_parallel == 0,
                "--target-expert-parallel-size {expert_parallel} does not divide the model's {} experts",
                moe.num_experts
            );
            ensure!(
                expert_parallel == 1 || target.tensor == 1,
                "--target-expert-parallel-size {expert_parallel} with --target-tensor-parallel-size {} is not written yet",
                target.tensor
            );
            moe.num_experts as usize / expert_parallel
        }
        None => {
            ensure!(
                expert_parallel == 1,
                "--target-expert-parallel-size {expert_parallel}: {} has no Mixture-of-Experts layers",
                state.source
            );
            0
        }
    };
    let split = PipelineSplit {
        num_layers: config.num_layers,
        stages: target.pipeline,
        chunks: target.virtual_stages,
        first_stage_layers: None,
        last_stage_layers: None,
    };
    let kind = kind_named(&state.params_dtype)?;
    let dtype = DType::from_torch_name(&state.params_dtype).context("params dtype")?;
    let iteration = state.run.iteration;
    let directory = iteration_directory(root, iteration);
    let mut args = args_namespace(state, target)?;
    for (key, value) in moe_args(state, expert_parallel) {
        match args.iter_mut().find(|(k, _)| *k == key) {
            Some(entry) => entry.1 = value,
            None => args.push((key, value)),
        }
    }
    for t in 0..target.tensor {
        for stage in 0..target.pipeline {
            for e in 0..expert_parallel {
                let experts = e * local_experts..(e + 1) * local_experts;
                let chunks = split.chunks_of(stage)?;
                let mut slots = Vec::new();
                let mut sources = Vec::new();
                // The rank's parameters (global names) in Megatron's order, for the optimizer.
                let chunk_params =
                    rank_chunk_params(state, &split, stage, target.tensor, experts.clone())?;
                let params: Vec<(String, Vec<usize>)> = chunk_params.concat();
                let mut root_entries = vec![
                    ("args".to_string(), Saved::Namespace(args.clone())),
                    (
                        "checkpoint_version".to_string(),
                        Saved::Value(Value::Float(3.0)),
                    ),
                    (
                        "iteration".to_string(),
                        Saved::Value(Value::Int(iteration as i64)),
                    ),
                ];
                for (c, (spec, shapes)) in chunks.iter().zip(&chunk_params).enumerate() {
                    let mut shapes = shapes.iter();
                    let mut model = Vec::new();
                    for (local, global) in rank_chunk_entries(state, spec, experts.clone()) {
                        match global {
                            None => model.push((local, Saved::Value(Value::None))),
                            Some(global) => {
                                let (_, shape) = shapes.next().expect("one shape per parameter");
                                slots.push(TensorSlot {
                                    dtype,
                                    shape: shape.clone(),
                                });
                                let bias =
                                    global.replace(".mlp.router.weight", ".mlp.router.expert_bias");
                                sources.push(Source::Weight(global));
                                model.push((local.clone(), Saved::Tensor(slots.len() - 1)));
                                // The router's buffer follows its weight, as torch saves a
                                // module's parameters, then its buffers.
                                if let Some(value) = state.expert_biases.get(&bias) {
                                    slots.push(TensorSlot {
                                        dtype: DType::F32,
                                        shape: value.shape().iter().map(|&d| d as usize).collect(),
                                    });
                                    sources.push(Source::ExpertBias(bias));
                                    model.push((
                                        local.replace(
                                            ".mlp.router.weight",
                                            ".mlp.router.expert_bias",
                                        ),
                                        Saved::Tensor(slots.len() - 1),
                                    ));
                                }
                            }
                        }
                    }
                    let key = if chunks.len() == 1 {
                        "model".to_string()
                    } else {
                        format!("model{c}")
                    };
                    root_entries.push((key, Saved::OrderedDict(model)));
                }
                let mut rank_name = rank_directory_name(t, stage, target.pipeline);
                if expert_parallel > 1 {
                    rank_name.push_str(&format!("_{e:03}"));
                }
                let rank_dir = directory.join(rank_name);
                std::fs::create_dir_all(&rank_dir)
                    .with_context(|| format!("creating {}", rank_dir.display()))?;
                if let (Some(optimizer), true) = (&state.optimizer, distributed_optimizer) {
                    let optimizers =
                        distributed_buffers(state, &chunk_params, stage, expert_parallel);
                    let groups = optimizers
                        .iter()
                        .enumerate()
                        .map(|(part, buffers)| {
                            let params: Vec<_> = buffers.chunks.concat();
                            distributed_state_dict(state, optimizer.step, &params, part > 0)
                        })
                        .collect::<Vec<_>>();
                    root_entries.push((
                        "optimizer".into(),
                        match <[Saved; 1]>::try_from(groups) {
                            Ok([single]) => single,
                            Err(groups) => Saved::List(groups),
                        },
                    ));
                    // Gradients are reduced in float32 unless a float16 run keeps its own dtype.
                    let fp32_grads = state.params_dtype != "float16"
                        || run_flag(&state.run.args, "accumulate_allreduce_grads_in_fp32")
                            .and_then(|v| v.as_bool())
                            .unwrap_or(false);
                    write_distrib_optim(
                        &rank_dir.join("distrib_optim.pt"),
                        state,
                        &optimizers,
                        if fp32_grads { "float32" } else { "float16" },
                        t,
                        target.tensor,
                    )?;
                } else if let Some(optimizer) = &state.optimizer {
                    let saved = if expert_parallel > 1 {
                        let (experts, dense): (Vec<_>, Vec<_>) = params
                            .iter()
                            .cloned()
                            .partition(|(name, _)| expert_of(name).is_some());
                        let mut entry = |params: &[(String, Vec<usize>)], experts: bool| {
                            optimizer_entry(
                                state,
                                optimizer,
                                params,
                                experts,
                                &mut slots,
                                &mut sources,
                            )
                        };
                        Saved::List(vec![entry(&dense, false)?, entry(&experts, true)?])
                    } else {
                        optimizer_entry(state, optimizer, &params, false, &mut slots, &mut sources)?
                    };
                    root_entries.push(("optimizer".into(), saved));
                }
                root_entries.extend(schedule_entries(state));
                let seeds = RankSeeds {
                    seed: run_flag(&state.run.args, "seed")
                        .and_then(|v| v.as_i64())
                        .unwrap_or(1234),
                    tensor_rank: t,
                    pipeline_rank: stage,
                    expert_rank: e,
                };
                let mut generators = Vec::new();
                root_entries.push((
                    "rng_state".into(),
                    rng_state_entry(seeds, slots.len(), &mut generators),
                ));
                for generator in generators {
                    slots.push(generator.slot);
                    sources.push(Source::Bytes(generator.bytes));
                }
                write_torch_file(
                    &rank_dir.join("model_optim_rng.pt"),
                    &Saved::Dict(root_entries),
                    &slots,
                    |i, emit| {
                        let (tensor, kind) = match &sources[i] {
                            Source::Weight(global) => (
                                shard_of(global, state.tensor(global)?, config, t, target.tensor)?,
                                kind,
                            ),
                            Source::ExpertBias(name) => {
                                (state.expert_biases[name].clone(), tch::Kind::Float)
                            }
                            Source::Optimizer(buffer, global) => {
                                let optimizer = state.optimizer.as_ref().expect("listed above");
                                let map =
                                    [&optimizer.main, &optimizer.exp_avg, &optimizer.exp_avg_sq]
                                        [*buffer];
                                let value = map.get(global).with_context(|| {
                                    format!("{}: no optimizer state for {global}", state.source)
                                })?;
                                (
                                    shard_of(global, value, config, t, target.tensor)?,
                                    tch::Kind::Float,
                                )
                            }
                            Source::Step(step) => {
                                return with_bytes(&tch::Tensor::from(*step as f32), emit)
                            }
                            Source::Bytes(bytes) => return emit(bytes),
                        };
                        tensor.for_each_chunk(|chunk| with_bytes(&chunk.to_kind(kind), &mut *emit))
                    },
                )?;
            }
        }
    }
    write_tracker(root, iteration)
}

/// The distributed optimizer's gradient buffers of a rank's `chunks`: one optimizer, or for an
/// expert-parallel Mixture-of-Experts model the chained optimizer's two, the dense parameters' and the routed
/// experts' (reduced over the expert-data-parallel ranks).
fn distributed_buffers(
    state: &ModelState,
    chunks: &[Vec<(String, Vec<usize>)>],
    stage: usize,
    expert_parallel: usize,
) -> Vec<OptimizerBuffers> {
    let args = &state.run.args;
    let flag = |key: &str| {
        run_flag(args, key)
            .and_then(|v| v.as_bool())
            .unwrap_or(false)
    };
    let int = |key: &str| run_flag(args, key).and_then(|v| v.as_i64());
    let data_parallel = int("data_parallel_size").unwrap_or(1).max(1) as usize;
    let pipeline = int("pipeline_model_parallel_size").unwrap_or(1);
    let bucket_size = int("ddp_bucket_size");
    let dense = Bucketing::new(flag, bucket_size, data_parallel, pipeline, stage);
    // Routed experts are the dense optimizer's too unless they are over expert-parallel ranks
    // (Megatron marks them `allreduce` then).
    if state.config.moe.is_none() || expert_parallel == 1 {
        return vec![OptimizerBuffers {
            chunks: chunks.to_vec(),
            bucketing: dense,
        }];
    }
    let experts = Bucketing::new(
        flag,
        bucket_size,
        (data_parallel / expert_parallel).max(1),
        pipeline,
        stage,
    );
    vec![
        OptimizerBuffers {
            chunks: expert_params(chunks, false),
            bucketing: dense,
        },
        OptimizerBuffers {
            chunks: expert_params(chunks, true),
            bucketing: experts,
        },
    ]
}

/// `DistributedOptimizer.state_dict()` as a rank file keeps it: the parameter groups of `params`
/// (with the step, without their members: the state is in `distrib_optim.pt`), the routed
/// experts' marked `is_expert_parallel` where `experts`, and a float16 run's grad scaler.
fn distributed_state_dict(
    state: &ModelState,
    step: f64,
    params: &[(String, Vec<usize>)],
    experts: bool,
) -> Saved {
    let groups = param_groups(params)
        .into_iter()
        .map(|members| {
            let (name, shape) = &params[members[0]];
            let shape: Vec<i64> = shape.iter().map(|&d| d as i64).collect();
            let mut group = group_hyperparameters(state, !excluded_from_weight_decay(name, &shape));
            for (key, value) in &mut group {
                if *key == "is_expert_parallel" {
                    *value = Value::Bool(experts);
                }
            }
            group.push(("step", Value::Float(step)));
            Saved::Dict(
                group
                    .into_iter()
                    .map(|(k, v)| (k.to_string(), Saved::Value(v)))
                    .collect(),
            )
        })
        .collect();
    let mut wrapped = vec![(
        "optimizer".to_string(),
        Saved::Dict(vec![("param_groups".to_string(), Saved::List(groups))]),
    )];
    if state.params_dtype == "float16" {
        if let Some(scaler) = state.run.grad_scaler.as_ref().and_then(json_to_value) {
            wrapped.push(("grad_scaler".into(), Saved::Value(scaler)));
        }
    }
    Saved::Dict(wrapped)
}
