//! HuggingFace checkpoints in Megatron-core names and layouts (spec §5.6): `GPT2LMHeadModel`,
//! Llama-style `LlamaForCausalLM` (RoPE, RMSNorm, SwiGLU, GQA, untied output) and
//! `MegatronBertForPreTraining`.

use std::collections::HashMap;

use anyhow::{Context, Result};
use tch::Tensor;

use super::bert::BertConfig;
use super::config::GptConfig;

type StateDict = HashMap<String, Tensor>;

fn take<'a>(state: &'a StateDict, name: &str) -> Result<&'a Tensor> {
    state
        .get(name)
        .with_context(|| format!("HuggingFace checkpoint has no tensor {name}"))
}

/// Pads the vocabulary rows to Megatron's padded size by repeating the last row, as Megatron's
/// converters do.
fn pad_vocab(table: &Tensor, padded: i64) -> Tensor {
    let rows = table.size()[0];
    if rows >= padded {
        return table.narrow(0, 0, padded);
    }
    let last = table
        .narrow(0, rows - 1, 1)
        .expand([padded - rows, table.size()[1]], false);
    Tensor::cat(&[table, &last], 0)
}

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

pub fn gpt2_to_megatron(hf: &StateDict, config: &GptConfig) -> Result<StateDict> {
    let (n, d) = (config.num_attention_heads, config.kv_channels);
    let padded = config.padded_vocab_size(1);
    let mut out = StateDict::new();
    let mut put = |name: String, tensor: Tensor| {
        out.insert(name, tensor.contiguous());
    };
    put(
        "embedding.word_embeddings.weight".into(),
        pad_vocab(take(hf, "transformer.wte.weight")?, padded),
    );
    put(
        "embedding.position_embeddings.weight".into(),
        take(hf, "transformer.wpe.weight")?.shallow_clone(),
    );
    for i in 0..config.num_layers {
        let hf_layer = |name: &str| take(hf, &format!("transformer.h.{i}.{name}"));
        let ours = |name: &str| format!("decoder.layers.{i}.{name}");
        for (hf_norm, norm) in [("ln_1", "input_layernorm"), ("ln_2", "pre_mlp_layernorm")] {
            put(
                ours(&format!("{norm}.weight")),
                hf_layer(&format!("{hf_norm}.weight"))?.shallow_clone(),
            );
            put(
                ours(&format!("{norm}.bias")),
                hf_layer(&format!("{hf_norm}.bias"))?.shallow_clone(),
            );
        }
        put(
            ours("self_attention.linear_qkv.weight"),
            gpt2_qkv_weight(hf_layer("attn.c_attn.weight")?, n, d),
        );
        put(
            ours("self_attention.linear_qkv.bias"),
            gpt2_qkv_bias(hf_layer("attn.c_attn.bias")?, n, d),
        );
        // Conv1D stores [in, out]; Megatron's linears are [out, in].
        for (hf_linear, linear) in [
            ("attn.c_proj", "self_attention.linear_proj"),
            ("mlp.c_fc", "mlp.linear_fc1"),
            ("mlp.c_proj", "mlp.linear_fc2"),
        ] {
            put(
                ours(&format!("{linear}.weight")),
                hf_layer(&format!("{hf_linear}.weight"))?.tr(),
            );
            put(
                ours(&format!("{linear}.bias")),
                hf_layer(&format!("{hf_linear}.bias"))?.shallow_clone(),
            );
        }
    }
    put(
        "decoder.final_layernorm.weight".into(),
        take(hf, "transformer.ln_f.weight")?.shallow_clone(),
    );
    put(
        "decoder.final_layernorm.bias".into(),
        take(hf, "transformer.ln_f.bias")?.shallow_clone(),
    );
    Ok(out)
}

/// Llama's separate q/k/v projections → Megatron's per-group `[q heads of the group; k; v]`
/// rows. HF stores q and k already in the rotate-half layout Megatron's RoPE uses.
fn llama_qkv_weight(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    heads: i64,
    groups: i64,
    head_dim: i64,
) -> Tensor {
    let hidden = q.size()[1];
    let per_group = heads / groups;
    let q = q.view([groups, per_group * head_dim, hidden]);
    let k = k.view([groups, head_dim, hidden]);
    let v = v.view([groups, head_dim, hidden]);
    Tensor::cat(&[q, k, v], 1).reshape([(heads + 2 * groups) * head_dim, hidden])
}

pub fn llama_to_megatron(hf: &StateDict, config: &GptConfig) -> Result<StateDict> {
    let (n, g, d) = (
        config.num_attention_heads,
        config.num_query_groups,
        config.kv_channels,
    );
    let padded = config.padded_vocab_size(1);
    let mut out = StateDict::new();
    let mut put = |name: String, tensor: Tensor| {
        out.insert(name, tensor.contiguous());
    };
    put(
        "embedding.word_embeddings.weight".into(),
        pad_vocab(take(hf, "model.embed_tokens.weight")?, padded),
    );
    for i in 0..config.num_layers {
        let hf_layer = |name: &str| take(hf, &format!("model.layers.{i}.{name}"));
        let ours = |name: &str| format!("decoder.layers.{i}.{name}");
        put(
            ours("input_layernorm.weight"),
            hf_layer("input_layernorm.weight")?.shallow_clone(),
        );
        put(
            ours("pre_mlp_layernorm.weight"),
            hf_layer("post_attention_layernorm.weight")?.shallow_clone(),
        );
        let qkv = llama_qkv_weight(
            hf_layer("self_attn.q_proj.weight")?,
            hf_layer("self_attn.k_proj.weight")?,
            hf_layer("self_attn.v_proj.weight")?,
            n,
            g,
            d,
        );
        put(ours("self_attention.linear_qkv.weight"), qkv);
        if config.add_qkv_bias {
            // Qwen2's q/k/v biases, in the same per-group order as the weights.
            let [q, k, v] = ["q", "k", "v"].map(|p| hf_layer(&format!("self_attn.{p}_proj.bias")));
            let (q, k, v) = (
                q?.view([g, -1, 1]),
                k?.view([g, -1, 1]),
                v?.view([g, -1, 1]),
            );
            put(
                ours("self_attention.linear_qkv.bias"),
                Tensor::cat(&[q, k, v], 1).reshape([-1]),
            );
        }
        put(
            ours("self_attention.linear_proj.weight"),
            hf_layer("self_attn.o_proj.weight")?.shallow_clone(),
        );
        let fc1 = Tensor::cat(
            &[
                hf_layer("mlp.gate_proj.weight")?,
                hf_layer("mlp.up_proj.weight")?,
            ],
            0,
        );
        put(ours("mlp.linear_fc1.weight"), fc1);
        put(
            ours("mlp.linear_fc2.weight"),
            hf_layer("mlp.down_proj.weight")?.shallow_clone(),
        );
    }
    put(
        "decoder.final_layernorm.weight".into(),
        take(hf, "model.norm.weight")?.shallow_clone(),
    );
    if config.untie_embeddings_and_output_weights {
        put(
            "output_layer.weight".into(),
            pad_vocab(take(hf, "lm_head.weight")?, padded),
        );
    }
    Ok(out)
}

/// `MegatronBertForPreTraining` (pre-LN BERT with separate q/k/v, the MLM transform and the
/// sentence-order head) → Megatron-core BERT names.
pub fn megatron_bert_to_megatron(hf: &StateDict, config: &BertConfig) -> Result<StateDict> {
    let trunk = &config.transformer;
    let (n, d) = (trunk.num_attention_heads, trunk.kv_channels);
    let padded = trunk.padded_vocab_size(1);
    let mut out = StateDict::new();
    let mut put = |name: &str, tensor: Tensor| {
        out.insert(name.to_string(), tensor.contiguous());
    };
    let copy = |name: &str| -> Result<Tensor> { Ok(take(hf, name)?.shallow_clone()) };
    put(
        "embedding.word_embeddings.weight",
        pad_vocab(take(hf, "bert.embeddings.word_embeddings.weight")?, padded),
    );
    put(
        "embedding.position_embeddings.weight",
        copy("bert.embeddings.position_embeddings.weight")?,
    );
    if config.binary_head {
        put(
            "embedding.tokentype_embeddings.weight",
            copy("bert.embeddings.token_type_embeddings.weight")?,
        );
    }
    for i in 0..trunk.num_layers {
        let hf_layer = |name: &str| copy(&format!("bert.encoder.layer.{i}.{name}"));
        let ours = |name: &str| format!("encoder.layers.{i}.{name}");
        let linears = [
            ("attention.ln", "input_layernorm"),
            ("attention.output.dense", "self_attention.linear_proj"),
            ("ln", "pre_mlp_layernorm"),
            ("intermediate.dense", "mlp.linear_fc1"),
            ("output.dense", "mlp.linear_fc2"),
        ];
        for (theirs, mine) in linears {
            for leaf in ["weight", "bias"] {
                put(
                    &ours(&format!("{mine}.{leaf}")),
                    hf_layer(&format!("{theirs}.{leaf}"))?,
                );
            }
        }
        let part = |p: &str, leaf: &str| hf_layer(&format!("attention.self.{p}.{leaf}"));
        put(
            &ours("self_attention.linear_qkv.weight"),
            llama_qkv_weight(
                &part("query", "weight")?,
                &part("key", "weight")?,
                &part("value", "weight")?,
                n,
                n,
                d,
            ),
        );
        let bias = |p: &str| -> Result<Tensor> { Ok(part(p, "bias")?.unsqueeze(1)) };
        put(
            &ours("self_attention.linear_qkv.bias"),
            llama_qkv_weight(&bias("query")?, &bias("key")?, &bias("value")?, n, n, d)
                .squeeze_dim(1),
        );
    }
    let pairs = [
        ("bert.encoder.ln", "encoder.final_layernorm"),
        ("cls.predictions.transform.dense", "lm_head.dense"),
        ("cls.predictions.transform.LayerNorm", "lm_head.layer_norm"),
    ];
    let heads = [
        ("bert.pooler.dense", "pooler.dense"),
        ("cls.seq_relationship", "binary_head"),
    ];
    let with_heads = if config.binary_head { &heads[..] } else { &[] };
    for (theirs, mine) in pairs.iter().chain(with_heads) {
        for leaf in ["weight", "bias"] {
            put(
                &format!("{mine}.{leaf}"),
                copy(&format!("{theirs}.{leaf}"))?,
            );
        }
    }
    let bias = take(hf, "cls.predictions.bias")?;
    let missing = padded - bias.size()[0];
    put(
        "output_layer.bias",
        Tensor::cat(
            &[
                bias,
                &bias.new_zeros([missing], (bias.kind(), bias.device())),
            ],
            0,
        ),
    );
    Ok(out)
}
