//! GPT's HuggingFace weights in Megatron-core names and layouts (spec §5.6): `GPT2LMHeadModel`
//! and the Llama-style families (RoPE, RMSNorm, SwiGLU, GQA, untied output; Qwen's QKV biases
//! and per-head norms; the experts of Mixtral, Qwen2-MoE and Qwen3-MoE).

use anyhow::Result;
use tch::Tensor;

use super::hf_config::{LlamaFamily, SHARED_EXPERT, SHARED_EXPERT_GATE};
use crate::config::TransformerConfig;
use crate::hf::{apply, grouped_qkv_weight, Recipe, StateDict};

/// GPT-2's fused `c_attn` (Conv1D `[h, 3h]`, q|k|v blocks) → Megatron's `[n, 3, d]` rows.
fn gpt2_qkv_weight(c_attn: &Tensor, heads: i64, head_dim: i64) -> Tensor {
    let hidden = c_attn.size()[0];
    c_attn
        .tr()
        .contiguous()
        .view([3, heads, head_dim, hidden])
        .permute([1, 0, 2, 3])
        .reshape([3 * heads * head_dim, hidden])
}

fn gpt2_qkv_bias(bias: &Tensor, heads: i64, head_dim: i64) -> Tensor {
    bias.view([3, heads, head_dim])
        .permute([1, 0, 2])
        .reshape([3 * heads * head_dim])
}

pub fn gpt2_recipes(config: &TransformerConfig) -> Vec<Recipe> {
    let (n, d, h) = (
        config.num_attention_heads,
        config.kv_channels,
        config.hidden_size,
    );
    let (ffn, width) = (config.ffn_hidden_size, n * d);
    let mut out = vec![
        Recipe::vocabulary(
            "embedding.word_embeddings.weight",
            "transformer.wte.weight",
            config,
        ),
        Recipe::copy(
            "embedding.position_embeddings.weight",
            "transformer.wpe.weight",
            vec![config.max_position_embeddings, h],
        ),
    ];
    for i in 0..config.num_layers {
        let theirs = |name: &str| format!("transformer.h.{i}.{name}");
        let ours = |name: &str| format!("decoder.layers.{i}.{name}");
        for (hf_norm, norm) in [("ln_1", "input_layernorm"), ("ln_2", "pre_mlp_layernorm")] {
            for leaf in ["weight", "bias"] {
                out.push(Recipe::copy(
                    ours(&format!("{norm}.{leaf}")),
                    theirs(&format!("{hf_norm}.{leaf}")),
                    vec![h],
                ));
            }
        }
        out.push(Recipe::new(
            ours("self_attention.linear_qkv.weight"),
            vec![3 * width, h],
            vec![(theirs("attn.c_attn.weight"), vec![h, 3 * width])],
            move |t| gpt2_qkv_weight(&t[0], n, d),
        ));
        out.push(Recipe::new(
            ours("self_attention.linear_qkv.bias"),
            vec![3 * width],
            vec![(theirs("attn.c_attn.bias"), vec![3 * width])],
            move |t| gpt2_qkv_bias(&t[0], n, d),
        ));
        // Conv1D stores [in, out]; Megatron's linears are [out, in].
        for (hf_linear, linear, rows, columns) in [
            ("attn.c_proj", "self_attention.linear_proj", h, width),
            ("mlp.c_fc", "mlp.linear_fc1", ffn, h),
            ("mlp.c_proj", "mlp.linear_fc2", h, ffn),
        ] {
            out.push(Recipe::new(
                ours(&format!("{linear}.weight")),
                vec![rows, columns],
                vec![(theirs(&format!("{hf_linear}.weight")), vec![columns, rows])],
                |t| t[0].tr(),
            ));
            out.push(Recipe::copy(
                ours(&format!("{linear}.bias")),
                theirs(&format!("{hf_linear}.bias")),
                vec![rows],
            ));
        }
    }
    for leaf in ["weight", "bias"] {
        out.push(Recipe::copy(
            format!("decoder.final_layernorm.{leaf}"),
            format!("transformer.ln_f.{leaf}"),
            vec![h],
        ));
    }
    out
}

pub fn gpt2_to_megatron(hf: &StateDict, config: &TransformerConfig) -> Result<StateDict> {
    apply(gpt2_recipes(config), hf)
}

/// Megatron's fused q/k/v rows as row ranges of HF's q (input 0), k (1) and v (2): per query
/// group its heads' q rows, then its k and v rows.
fn qkv_rows_of_groups(heads: i64, groups: i64, head_dim: i64) -> Vec<(usize, i64, i64)> {
    let per_group = heads / groups;
    (0..groups)
        .flat_map(|group| {
            [
                (0, group * per_group * head_dim, per_group * head_dim),
                (1, group * head_dim, head_dim),
                (2, group * head_dim, head_dim),
            ]
        })
        .collect()
}

/// A SwiGLU `linear_fc1` of `ffn` rows per half: HF's gate projection, then its up projection.
fn swiglu_fc1(ours: String, gate: String, up: String, ffn: i64, h: i64) -> Recipe {
    Recipe::new(
        ours,
        vec![2 * ffn, h],
        vec![(gate, vec![ffn, h]), (up, vec![ffn, h])],
        |t| Tensor::cat(t, 0),
    )
    .stacking(vec![(0, 0, ffn), (1, 0, ffn)])
}

/// The recipes of a Llama-style model, its sparse layers named as its family
/// ([`LlamaFamily::of`]) names them.
pub fn llama_recipes(config: &TransformerConfig) -> Result<Vec<Recipe>> {
    let family = LlamaFamily::of(config)?;
    let (n, g, d, h) = (
        config.num_attention_heads,
        config.num_query_groups,
        config.kv_channels,
        config.hidden_size,
    );
    let ffn = config.ffn_hidden_size;
    let qkv_rows = (n + 2 * g) * d;
    let mut out = vec![Recipe::vocabulary(
        "embedding.word_embeddings.weight",
        "model.embed_tokens.weight",
        config,
    )];
    for i in 0..config.num_layers {
        let theirs = |name: &str| format!("model.layers.{i}.{name}");
        let ours = |name: &str| format!("decoder.layers.{i}.{name}");
        out.push(Recipe::copy(
            ours("input_layernorm.weight"),
            theirs("input_layernorm.weight"),
            vec![h],
        ));
        out.push(Recipe::copy(
            ours("pre_mlp_layernorm.weight"),
            theirs("post_attention_layernorm.weight"),
            vec![h],
        ));
        let projections = |leaf: &str, width: &[i64]| -> Vec<(String, Vec<i64>)> {
            [("q", n), ("k", g), ("v", g)]
                .into_iter()
                .map(|(p, heads)| {
                    let shape = [heads * d]
                        .into_iter()
                        .chain(width.iter().copied())
                        .collect();
                    (theirs(&format!("self_attn.{p}_proj.{leaf}")), shape)
                })
                .collect()
        };
        out.push(
            Recipe::new(
                ours("self_attention.linear_qkv.weight"),
                vec![qkv_rows, h],
                projections("weight", &[h]),
                move |t| grouped_qkv_weight(&t[0], &t[1], &t[2], n, g, d),
            )
            .stacking(qkv_rows_of_groups(n, g, d)),
        );
        if config.add_qkv_bias {
            // Qwen2's q/k/v biases, in the same per-group order as the weights.
            out.push(
                Recipe::new(
                    ours("self_attention.linear_qkv.bias"),
                    vec![qkv_rows],
                    projections("bias", &[]),
                    move |t| {
                        let parts: Vec<Tensor> = t.iter().map(|p| p.view([g, -1, 1])).collect();
                        Tensor::cat(&parts, 1).reshape([-1])
                    },
                )
                .stacking(qkv_rows_of_groups(n, g, d)),
            );
        }
        out.push(Recipe::copy(
            ours("self_attention.linear_proj.weight"),
            theirs("self_attn.o_proj.weight"),
            vec![h, n * d],
        ));
        if config.qk_layernorm {
            for (norm, hf_norm) in [("q_layernorm", "q_norm"), ("k_layernorm", "k_norm")] {
                out.push(Recipe::copy(
                    ours(&format!("self_attention.{norm}.weight")),
                    theirs(&format!("self_attn.{hf_norm}.weight")),
                    vec![d],
                ));
            }
        }
        match &config.moe {
            Some(moe) if moe.is_moe_layer(i) => {
                let ffn = moe.ffn_hidden_size;
                out.push(Recipe::copy(
                    ours("mlp.router.weight"),
                    theirs(family.router()),
                    vec![moe.num_experts, h],
                ));
                let mut mlps: Vec<(String, [String; 3], i64)> = (0..moe.num_experts)
                    .map(|e| {
                        let local = format!("mlp.experts.local_experts.{e}");
                        (local, family.expert(e), ffn)
                    })
                    .collect();
                if let Some(size) = moe.shared_expert_intermediate_size {
                    mlps.push((
                        "mlp.shared_experts".into(),
                        SHARED_EXPERT.map(str::to_string),
                        size,
                    ));
                }
                if moe.shared_expert_gate {
                    out.push(Recipe::copy(
                        ours("mlp.shared_experts.gate_weight"),
                        theirs(SHARED_EXPERT_GATE),
                        vec![1, h],
                    ));
                }
                for (local, [gate, up, down], ffn) in mlps {
                    out.push(swiglu_fc1(
                        ours(&format!("{local}.linear_fc1.weight")),
                        theirs(&gate),
                        theirs(&up),
                        ffn,
                        h,
                    ));
                    out.push(Recipe::copy(
                        ours(&format!("{local}.linear_fc2.weight")),
                        theirs(&down),
                        vec![h, ffn],
                    ));
                }
            }
            _ => {
                out.push(swiglu_fc1(
                    ours("mlp.linear_fc1.weight"),
                    theirs("mlp.gate_proj.weight"),
                    theirs("mlp.up_proj.weight"),
                    ffn,
                    h,
                ));
                out.push(Recipe::copy(
                    ours("mlp.linear_fc2.weight"),
                    theirs("mlp.down_proj.weight"),
                    vec![h, ffn],
                ));
            }
        }
    }
    out.push(Recipe::copy(
        "decoder.final_layernorm.weight",
        "model.norm.weight",
        vec![h],
    ));
    if config.untie_embeddings_and_output_weights {
        out.push(Recipe::vocabulary(
            "output_layer.weight",
            "lm_head.weight",
            config,
        ));
    }
    Ok(out)
}

pub fn llama_to_megatron(hf: &StateDict, config: &TransformerConfig) -> Result<StateDict> {
    apply(llama_recipes(config)?, hf)
}
