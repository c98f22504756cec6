//! BERT's HuggingFace weights in Megatron-core names and layouts (spec §5.6):
//! `MegatronBertForPreTraining`.

use anyhow::Result;
use tch::Tensor;

use super::config::BertConfig;
use crate::hf::{grouped_qkv_weight, pad_vocab, take, StateDict};

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
            grouped_qkv_weight(
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
            grouped_qkv_weight(&bias("query")?, &bias("key")?, &bias("value")?, n, n, d)
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
