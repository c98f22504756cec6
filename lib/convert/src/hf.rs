//! HuggingFace checkpoints in and out: `GPT2LMHeadModel` and the Llama family
//! (`LlamaForCausalLM`, `MistralForCausalLM`, `Qwen2ForCausalLM`, `Qwen3ForCausalLM`: GQA,
//! untied output, `rope_theta`, qkv bias, per-head q/k norms; the experts of
//! `MixtralForCausalLM`, `Qwen2MoeForCausalLM` and `Qwen3MoeForCausalLM`), from
//! `*.safetensors` or `pytorch_model*.bin`, and back as safetensors with a `config.json` that
//! `transformers` loads without edits.

use std::collections::HashMap;
use std::path::Path;

use anyhow::{bail, ensure, Context, Result};
use megatron_checkpoint::TorchFile;
use serde_json::{json, Value as Json};
use tch::{Kind, Tensor};

use super::hf_tokenizer::{write_tokenizer, TokenizerExport};
use super::lazy::{return_freed_memory, safetensors_tensors, tensor_of, InputFile, LazyTensor};
use super::progress::report_written;
use super::sizes::{check_layers, layers_found};
use super::state::{ModelState, RunState, Tensors};
use megatron_models::gpt::hf::{gpt2_recipes, llama_recipes};
use megatron_models::gpt::hf_config::{
    config_from_hf, moe_to_hf, rope_to_hf, LlamaFamily, SHARED_EXPERT, SHARED_EXPERT_GATE,
};
use megatron_models::hf::Recipe;
use megatron_models::{Activation, Normalization, PositionEmbeddingType};
use megatron_store::{write_tensors_streamed, TensorEntry};

/// Every tensor of a HuggingFace model directory (sharded or not), read lazily: from
/// `*.safetensors` or `pytorch_model*.bin` (zip archives of pickles).
fn read_hf_tensors(directory: &Path) -> Result<HashMap<String, LazyTensor>> {
    let mut files: Vec<_> = std::fs::read_dir(directory)
        .with_context(|| format!("listing {}", directory.display()))?
        .flatten()
        .map(|e| e.path())
        .collect();
    files.sort();
    let safetensors: Vec<_> = files
        .iter()
        .filter(|p| p.extension().is_some_and(|e| e == "safetensors"))
        .collect();
    let mut out = HashMap::new();
    if !safetensors.is_empty() {
        for path in safetensors {
            out.extend(safetensors_tensors(path)?);
        }
        return Ok(out);
    }
    let bins: Vec<_> = files
        .iter()
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("pytorch_model") && n.ends_with(".bin"))
        })
        .collect();
    ensure!(
        !bins.is_empty(),
        "{}: no *.safetensors or pytorch_model*.bin weights",
        directory.display()
    );
    for path in bins {
        let file = TorchFile::open(path)?;
        let input = InputFile::open(path)?;
        for (name, tensor) in file.tensors() {
            let lazy = tensor_of(&file, &input, tensor)
                .with_context(|| format!("{}: tensor {name}", path.display()))?;
            out.insert(name, lazy);
        }
    }
    Ok(out)
}

/// The Megatron tensors `recipes` make from the HuggingFace `tensors`, each read when a saver
/// asks for it; every input's shape is checked against the config first.
fn imported(recipes: Vec<Recipe>, tensors: &HashMap<String, LazyTensor>) -> Result<Tensors> {
    recipes
        .into_iter()
        .map(|recipe| {
            let inputs = recipe
                .inputs
                .iter()
                .map(|(name, shape)| {
                    let tensor = tensors
                        .get(name)
                        .with_context(|| format!("no tensor {name}"))?;
                    ensure!(
                        tensor.shape() == shape.as_slice(),
                        "tensor {name} has shape {:?}, config.json implies {shape:?}",
                        tensor.shape()
                    );
                    Ok(tensor.clone())
                })
                .collect::<Result<Vec<_>>>()?;
            let tensor = match recipe.rows {
                Some(rows) => LazyTensor::row_ranges(
                    rows.into_iter()
                        .map(|(input, start, count)| (inputs[input].clone(), start, count))
                        .collect(),
                )?
                .with_rows(recipe.shape[0]),
                None => LazyTensor::derived(inputs, recipe.shape, recipe.make)?,
            };
            Ok((recipe.name, tensor))
        })
        .collect()
}

/// Loads a HuggingFace model directory.
pub fn load_hf(
    directory: &Path,
    make_vocab_size_divisible_by: i64,
    true_vocab_size: Option<i64>,
) -> Result<ModelState> {
    let path = directory.join("config.json");
    let text =
        std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
    let hf: Json =
        serde_json::from_str(&text).with_context(|| format!("{}: invalid JSON", path.display()))?;
    let (architecture, config) = config_from_hf(&hf, make_vocab_size_divisible_by)
        .with_context(|| path.display().to_string())?;
    if let Some(size) = true_vocab_size {
        ensure!(
            size == config.vocab_size,
            "--true-vocab-size {size} disagrees with {} (vocab_size {})",
            path.display(),
            config.vocab_size
        );
    }
    let tensors = read_hf_tensors(directory)?;
    let (field, prefixes): (&str, &[&str]) = if architecture == "GPT2LMHeadModel" {
        ("n_layer", &["transformer.h.", "h."])
    } else {
        ("num_hidden_layers", &["model.layers."])
    };
    let found = layers_found(tensors.keys().map(String::as_str), prefixes);
    check_layers(&path.display().to_string(), field, config.num_layers, found)?;
    let dtype = tensors
        .values()
        .map(LazyTensor::kind)
        .find(|k| matches!(k, Kind::Float | Kind::Double | Kind::Half | Kind::BFloat16))
        .unwrap_or(Kind::Float);
    let weights = if architecture == "GPT2LMHeadModel" {
        // Older exports prefix names with `transformer.` only sometimes.
        let tensors: HashMap<String, LazyTensor> = tensors
            .into_iter()
            .map(|(k, v)| {
                (
                    if k.starts_with("transformer.") || k.starts_with("lm_head") {
                        k
                    } else {
                        format!("transformer.{k}")
                    },
                    v,
                )
            })
            .collect();
        imported(gpt2_recipes(&config), &tensors)
    } else {
        if config.untie_embeddings_and_output_weights && !tensors.contains_key("lm_head.weight") {
            bail!(
                "{}: untied model without lm_head.weight",
                directory.display()
            );
        }
        imported(llama_recipes(&config)?, &tensors)
    }
    .with_context(|| directory.display().to_string())?;
    let params_dtype = match dtype {
        Kind::BFloat16 => "bfloat16",
        Kind::Half => "float16",
        _ => "float32",
    };
    Ok(ModelState {
        weights,
        expert_biases: Default::default(),
        config,
        params_dtype: params_dtype.to_string(),
        optimizer: None,
        run: RunState {
            args: json!({"hf_architecture": architecture}),
            ..Default::default()
        },
        source_parallel: (1, 1),
        source: format!("HuggingFace {architecture} {}", directory.display()),
    })
}

type Make<'a> = Box<dyn Fn(&Exports<'a>) -> Result<Tensor> + 'a>;

/// How one exported tensor is made.
enum Export<'a> {
    /// Rows of our tensors, streamed in chunks.
    Rows(LazyTensor),
    /// A function of whole tensors (GPT-2's transposed Conv1D weights, one layer's).
    Make(Make<'a>),
}

/// The tensors of an export: each one's name, shape and how it is made from the state, so
/// that they are read and written one at a time, in chunks of rows where they are rows of
/// ours.
struct Exports<'a> {
    state: &'a ModelState,
    kind: Kind,
    entries: Vec<(String, Vec<i64>, Export<'a>)>,
}

impl<'a> Exports<'a> {
    fn new(state: &'a ModelState, kind: Kind) -> Self {
        Exports {
            state,
            kind,
            entries: Vec::new(),
        }
    }

    /// Our tensor `name` in the export's dtype.
    fn get(&self, name: &str) -> Result<Tensor> {
        Ok(self.state.read(name)?.to_kind(self.kind))
    }

    fn shape(&self, name: &str) -> Result<Vec<i64>> {
        Ok(self.state.tensor(name)?.shape().to_vec())
    }

    fn add(
        &mut self,
        name: String,
        shape: Vec<i64>,
        make: impl Fn(&Exports<'a>) -> Result<Tensor> + 'a,
    ) {
        self.entries
            .push((name, shape, Export::Make(Box::new(make))));
    }

    /// Row ranges `(start, count)` of our tensor `ours`, stacked.
    fn rows(&mut self, hf: String, ours: &str, ranges: &[(i64, i64)]) -> Result<()> {
        let tensor = self.state.tensor(ours)?;
        let rows = LazyTensor::row_ranges(
            ranges
                .iter()
                .map(|&(start, count)| (tensor.clone(), start, count))
                .collect(),
        )
        .with_context(|| format!("{}: {ours}", self.state.source))?;
        self.entries
            .push((hf, rows.shape().to_vec(), Export::Rows(rows)));
        Ok(())
    }

    fn copy(&mut self, hf: &str, ours: &str) -> Result<()> {
        let rows = self.shape(ours)?[0];
        self.rows(hf.to_string(), ours, &[(0, rows)])
    }

    fn transposed(&mut self, hf: &str, ours: &str) -> Result<()> {
        let mut shape = self.shape(ours)?;
        shape.reverse();
        let ours = ours.to_string();
        self.add(hf.to_string(), shape, move |x| Ok(x.get(&ours)?.tr()));
        Ok(())
    }

    /// A vocabulary-parallel tensor without its padding rows.
    fn vocabulary(&mut self, hf: &str, ours: &str, vocab: i64) -> Result<()> {
        self.rows(hf.to_string(), ours, &[(0, vocab)])
    }

    fn write(&self, path: &Path, metadata: HashMap<String, String>) -> Result<()> {
        let entries: Vec<TensorEntry> = self
            .entries
            .iter()
            .map(|(name, shape, _)| TensorEntry {
                name: name.clone(),
                kind: self.kind,
                shape: shape.clone(),
            })
            .collect();
        write_tensors_streamed(path, &entries, metadata, |i, emit| {
            let (name, shape, export) = &self.entries[i];
            match export {
                Export::Rows(rows) => rows.for_each_chunk(|chunk| emit(&chunk.to_kind(self.kind))),
                Export::Make(make) => {
                    let tensor = make(self)?;
                    ensure!(
                        &tensor.size() == shape,
                        "{name} came out of shape {:?}, {shape:?} expected",
                        tensor.size()
                    );
                    emit(&tensor)?;
                    report_written((tensor.numel() * tensor.kind().elt_size_in_bytes()) as u64);
                    drop(tensor);
                    return_freed_memory();
                    Ok(())
                }
            }
        })
    }
}

fn hf_dtype_name(params_dtype: &str) -> &'static str {
    match params_dtype {
        "bfloat16" => "bfloat16",
        "float16" => "float16",
        _ => "float32",
    }
}

/// Writes `state` as a HuggingFace model into `directory` (created), with `tokenizer`'s files
/// beside it and its bos/eos ids in `config.json` and `generation_config.json`.
pub fn save_hf(state: &ModelState, directory: &Path, tokenizer: &TokenizerExport) -> Result<()> {
    let config = &state.config;
    ensure!(
        state.expert_biases.is_empty(),
        "{}: its MoE routers have expert biases (--moe-router-enable-expert-bias), which the HuggingFace Mixtral and Qwen MoE models have no place for",
        state.source
    );
    let vocab = config.vocab_size;
    let kind = super::tensors::kind_named(&state.params_dtype)?;
    let (n, g, d, h) = (
        config.num_attention_heads,
        config.num_query_groups,
        config.kv_channels,
        config.hidden_size,
    );
    let mut out = Exports::new(state, kind);
    let hf_config = match (
        config.position_embedding_type,
        config.normalization,
        config.activation,
    ) {
        (
            PositionEmbeddingType::LearnedAbsolute,
            Normalization::LayerNorm,
            Activation::GeluTanh | Activation::GeluErf,
        ) => {
            ensure!(
                !config.untie_embeddings_and_output_weights && config.add_bias_linear && n == g && d * n == h,
                "{}: only GPT-2-shaped models (tied, with biases, no GQA) export as GPT2LMHeadModel",
                state.source
            );
            out.vocabulary(
                "transformer.wte.weight",
                "embedding.word_embeddings.weight",
                vocab,
            )?;
            out.copy(
                "transformer.wpe.weight",
                "embedding.position_embeddings.weight",
            )?;
            for i in 0..config.num_layers {
                let m = |s: &str| format!("decoder.layers.{i}.{s}");
                let t = |s: &str| format!("transformer.h.{i}.{s}");
                for (norm, hf_norm) in [("input_layernorm", "ln_1"), ("pre_mlp_layernorm", "ln_2")]
                {
                    for leaf in ["weight", "bias"] {
                        out.copy(
                            &t(&format!("{hf_norm}.{leaf}")),
                            &m(&format!("{norm}.{leaf}")),
                        )?;
                    }
                }
                // Megatron's [heads, (q k v), d] rows → GPT-2's [(q k v), heads, d] columns.
                let qkv = m("self_attention.linear_qkv.weight");
                out.add(t("attn.c_attn.weight"), vec![h, 3 * n * d], move |x| {
                    Ok(x.get(&qkv)?
                        .view([n, 3, d, h])
                        .permute([1, 0, 2, 3])
                        .reshape([3 * n * d, h])
                        .tr())
                });
                let bias = m("self_attention.linear_qkv.bias");
                out.add(t("attn.c_attn.bias"), vec![3 * n * d], move |x| {
                    Ok(x.get(&bias)?
                        .view([n, 3, d])
                        .permute([1, 0, 2])
                        .reshape([-1]))
                });
                for (linear, hf_linear) in [
                    ("self_attention.linear_proj", "attn.c_proj"),
                    ("mlp.linear_fc1", "mlp.c_fc"),
                    ("mlp.linear_fc2", "mlp.c_proj"),
                ] {
                    out.transposed(
                        &t(&format!("{hf_linear}.weight")),
                        &m(&format!("{linear}.weight")),
                    )?;
                    out.copy(
                        &t(&format!("{hf_linear}.bias")),
                        &m(&format!("{linear}.bias")),
                    )?;
                }
            }
            out.copy("transformer.ln_f.weight", "decoder.final_layernorm.weight")?;
            out.copy("transformer.ln_f.bias", "decoder.final_layernorm.bias")?;
            json!({
                "architectures": ["GPT2LMHeadModel"],
                "model_type": "gpt2",
                "vocab_size": vocab,
                "n_positions": config.max_position_embeddings,
                "n_embd": h,
                "n_layer": config.num_layers,
                "n_head": n,
                "n_inner": config.ffn_hidden_size,
                "activation_function": if config.activation == Activation::GeluTanh { "gelu_new" } else { "gelu" },
                "layer_norm_epsilon": config.norm_epsilon,
                "initializer_range": config.init_method_std,
                "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0,
                "tie_word_embeddings": true,
                "dtype": hf_dtype_name(&state.params_dtype),
            })
        }
        (PositionEmbeddingType::Rope, Normalization::RMSNorm, Activation::Swiglu) => {
            ensure!(
                !config.add_bias_linear && config.rotary_percent == 1.0,
                "{}: only Llama-shaped models (no linear biases, full rotary) export as Llama/Qwen2",
                state.source
            );
            let family = LlamaFamily::of(config).with_context(|| state.source.clone())?;
            // transformers' attention_bias also gives o_proj a bias, which ours have not.
            ensure!(
                !config.add_qkv_bias
                    || matches!(family, LlamaFamily::Qwen2 | LlamaFamily::Qwen2Moe),
                "{}: QKV biases export as Qwen2 or Qwen2-MoE only ({} has none)",
                state.source,
                family.architecture()
            );
            out.vocabulary(
                "model.embed_tokens.weight",
                "embedding.word_embeddings.weight",
                vocab,
            )?;
            let per_group = n / g;
            for i in 0..config.num_layers {
                let m = |s: &str| format!("decoder.layers.{i}.{s}");
                let t = |s: &str| format!("model.layers.{i}.{s}");
                out.copy(&t("input_layernorm.weight"), &m("input_layernorm.weight"))?;
                out.copy(
                    &t("post_attention_layernorm.weight"),
                    &m("pre_mlp_layernorm.weight"),
                )?;
                // Megatron's fused rows per query group: [q × heads-per-group, k, v].
                let mut leaves = vec!["weight"];
                if config.add_qkv_bias {
                    leaves.push("bias");
                }
                for leaf in leaves {
                    let fused = m(&format!("self_attention.linear_qkv.{leaf}"));
                    for (proj, first, heads) in [
                        ("q_proj", 0, per_group),
                        ("k_proj", per_group, 1),
                        ("v_proj", per_group + 1, 1),
                    ] {
                        let ranges: Vec<(i64, i64)> = (0..g)
                            .map(|group| ((group * (per_group + 2) + first) * d, heads * d))
                            .collect();
                        out.rows(t(&format!("self_attn.{proj}.{leaf}")), &fused, &ranges)?;
                    }
                }
                out.copy(
                    &t("self_attn.o_proj.weight"),
                    &m("self_attention.linear_proj.weight"),
                )?;
                if config.qk_layernorm {
                    for (norm, hf_norm) in [("q_layernorm", "q_norm"), ("k_layernorm", "k_norm")] {
                        out.copy(
                            &t(&format!("self_attn.{hf_norm}.weight")),
                            &m(&format!("self_attention.{norm}.weight")),
                        )?;
                    }
                }
                // (our module, HF's gate, up and down projections, width) of each MLP.
                let mut mlps = vec![(
                    "mlp".to_string(),
                    ["gate_proj", "up_proj", "down_proj"].map(|p| format!("mlp.{p}.weight")),
                    config.ffn_hidden_size,
                )];
                if let Some(moe) = config.moe.as_ref().filter(|moe| moe.is_moe_layer(i)) {
                    out.copy(&t(family.router()), &m("mlp.router.weight"))?;
                    mlps = (0..moe.num_experts)
                        .map(|e| {
                            let ours = format!("mlp.experts.local_experts.{e}");
                            (ours, family.expert(e), moe.ffn_hidden_size)
                        })
                        .collect();
                    if let Some(size) = moe.shared_expert_intermediate_size {
                        mlps.push((
                            "mlp.shared_experts".to_string(),
                            SHARED_EXPERT.map(str::to_string),
                            size,
                        ));
                    }
                    if moe.shared_expert_gate {
                        out.copy(&t(SHARED_EXPERT_GATE), &m("mlp.shared_experts.gate_weight"))?;
                    }
                }
                for (ours, [gate, up, down], ffn) in mlps {
                    for (half, proj) in [gate, up].into_iter().enumerate() {
                        out.rows(
                            t(&proj),
                            &m(&format!("{ours}.linear_fc1.weight")),
                            &[(half as i64 * ffn, ffn)],
                        )?;
                    }
                    out.copy(&t(&down), &m(&format!("{ours}.linear_fc2.weight")))?;
                }
            }
            out.copy("model.norm.weight", "decoder.final_layernorm.weight")?;
            let tied = !config.untie_embeddings_and_output_weights;
            if !tied {
                out.vocabulary("lm_head.weight", "output_layer.weight", vocab)?;
            }
            let mut hf = json!({
                "architectures": [family.architecture()],
                "model_type": family.model_type(),
                "vocab_size": vocab,
                "hidden_size": h,
                "intermediate_size": config.ffn_hidden_size,
                "num_hidden_layers": config.num_layers,
                "num_attention_heads": n,
                "num_key_value_heads": g,
                "head_dim": d,
                "max_position_embeddings": config.max_position_embeddings,
                "rms_norm_eps": config.norm_epsilon,
                "hidden_act": "silu",
                "initializer_range": config.init_method_std,
                "tie_word_embeddings": tied,
                "attention_dropout": 0.0,
                "dtype": hf_dtype_name(&state.params_dtype),
            });
            rope_to_hf(config, &mut hf);
            if let Some(moe) = &config.moe {
                moe_to_hf(family, moe, &mut hf);
            }
            match family {
                LlamaFamily::Llama => {
                    hf["attention_bias"] = json!(false);
                    hf["mlp_bias"] = json!(false);
                }
                LlamaFamily::Qwen3 | LlamaFamily::Qwen3Moe => hf["attention_bias"] = json!(false),
                LlamaFamily::Qwen2Moe => hf["qkv_bias"] = json!(config.add_qkv_bias),
                LlamaFamily::Qwen2 | LlamaFamily::Mixtral => {}
            }
            hf
        }
        _ => bail!(
            "{}: no HuggingFace architecture matches this model ({:?} positions, {:?}, {:?})",
            state.source,
            config.position_embedding_type,
            config.normalization,
            config.activation
        ),
    };
    let mut hf_config = hf_config;
    let special = special_token_ids(state, tokenizer)?;
    for (key, id) in &special {
        hf_config[key] = json!(id);
    }
    std::fs::create_dir_all(directory)
        .with_context(|| format!("creating {}", directory.display()))?;
    let metadata = HashMap::from([("format".to_string(), "pt".to_string())]);
    out.write(&directory.join("model.safetensors"), metadata)?;
    std::fs::write(
        directory.join("config.json"),
        serde_json::to_string_pretty(&hf_config)?,
    )?;
    if !special.is_empty() {
        let generation: serde_json::Map<String, Json> = special
            .into_iter()
            .map(|(key, id)| (key.to_string(), json!(id)))
            .collect();
        std::fs::write(
            directory.join("generation_config.json"),
            serde_json::to_string_pretty(&generation)?,
        )?;
    }
    write_tokenizer(tokenizer, directory, config.max_position_embeddings)?;
    Ok(())
}

/// `bos_token_id` and `eos_token_id` of the export: the tokenizer's, else for GPT-2 its last
/// token (`<|endoftext|>`); each must be a row of the exported vocabulary.
fn special_token_ids(
    state: &ModelState,
    tokenizer: &TokenizerExport,
) -> Result<Vec<(&'static str, i64)>> {
    let vocab = state.config.vocab_size;
    let gpt2_end = (state.config.position_embedding_type == PositionEmbeddingType::LearnedAbsolute)
        .then_some(vocab - 1);
    let mut ids = Vec::new();
    for (key, id) in [
        ("bos_token_id", tokenizer.bos_token_id),
        ("eos_token_id", tokenizer.eos_token_id),
    ] {
        let Some(id) = id.map(i64::from).or(gpt2_end) else {
            continue;
        };
        ensure!(
            (0..vocab).contains(&id),
            "{}: the tokenizer's {key} {id} is outside the model's vocabulary of {vocab}",
            state.source
        );
        ids.push((key, id));
    }
    Ok(ids)
}
