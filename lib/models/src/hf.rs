//! HuggingFace checkpoints in Megatron-core names and layouts (spec §5.6): `GPT2LMHeadModel`,
//! Llama-style `LlamaForCausalLM` (RoPE, RMSNorm, SwiGLU, GQA, untied output) and
//! `MegatronBertForPreTraining`.

use std::collections::HashMap;
use std::sync::Arc;

use anyhow::{ensure, Context, Result};
use tch::Tensor;

use super::bert::BertConfig;
use super::config::TransformerConfig;

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

/// How one Megatron-core tensor is made from HuggingFace tensors: the importers' one
/// definition of each mapping, applied at once ([`gpt2_to_megatron`], [`llama_to_megatron`])
/// or tensor by tensor as a converter writes (`convert::hf`).
pub struct Recipe {
    pub name: String,
    pub shape: Vec<i64>,
    /// The HuggingFace tensors it is made of, with the shapes `config.json` implies.
    pub inputs: Vec<(String, Vec<i64>)>,
    pub make: Arc<dyn Fn(&[Tensor]) -> Tensor + Send + Sync>,
    /// Where `make` only stacks rows: the row ranges `(input, start, count)` it stacks, then
    /// zero rows up to `shape[0]` (so that a converter can stream it in row chunks).
    pub rows: Option<Vec<(usize, i64, i64)>>,
}

impl Recipe {
    fn new(
        name: impl Into<String>,
        shape: Vec<i64>,
        inputs: Vec<(String, Vec<i64>)>,
        make: impl Fn(&[Tensor]) -> Tensor + Send + Sync + 'static,
    ) -> Self {
        Recipe {
            name: name.into(),
            shape,
            inputs,
            make: Arc::new(make),
            rows: None,
        }
    }

    /// The same recipe, known to stack the row ranges `rows` of its inputs.
    fn stacking(self, rows: Vec<(usize, i64, i64)>) -> Self {
        Recipe {
            rows: Some(rows),
            ..self
        }
    }

    fn copy(name: impl Into<String>, hf: impl Into<String>, shape: Vec<i64>) -> Self {
        let rows = shape.first().copied().unwrap_or(1);
        Recipe::new(name, shape.clone(), vec![(hf.into(), shape)], |t| {
            t[0].shallow_clone()
        })
        .stacking(vec![(0, 0, rows)])
    }

    /// A vocabulary table padded to Megatron's size.
    fn vocabulary(name: &str, hf: &str, config: &TransformerConfig) -> Self {
        let padded = config.padded_vocab_size(1);
        let (vocab, h) = (config.vocab_size, config.hidden_size);
        Recipe::new(
            name,
            vec![padded, h],
            vec![(hf.into(), vec![vocab, h])],
            move |t| pad_vocab(&t[0], padded),
        )
        .stacking(vec![(0, 0, vocab)])
    }
}

/// Applies `recipes` to a whole state dict at once.
fn apply(recipes: Vec<Recipe>, hf: &StateDict) -> Result<StateDict> {
    let mut out = StateDict::new();
    for recipe in recipes {
        let inputs = recipe
            .inputs
            .iter()
            .map(|(name, shape)| {
                let tensor = take(hf, name)?;
                ensure!(
                    &tensor.size() == shape,
                    "HuggingFace tensor {name} has shape {:?}, config.json implies {shape:?}",
                    tensor.size()
                );
                Ok(tensor.shallow_clone())
            })
            .collect::<Result<Vec<_>>>()?;
        out.insert(recipe.name, (recipe.make)(&inputs).contiguous());
    }
    Ok(out)
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

pub fn llama_recipes(config: &TransformerConfig) -> Vec<Recipe> {
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
                move |t| llama_qkv_weight(&t[0], &t[1], &t[2], n, g, d),
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
        out.push(
            Recipe::new(
                ours("mlp.linear_fc1.weight"),
                vec![2 * ffn, h],
                vec![
                    (theirs("mlp.gate_proj.weight"), vec![ffn, h]),
                    (theirs("mlp.up_proj.weight"), vec![ffn, h]),
                ],
                |t| Tensor::cat(t, 0),
            )
            .stacking(vec![(0, 0, ffn), (1, 0, ffn)]),
        );
        out.push(Recipe::copy(
            ours("mlp.linear_fc2.weight"),
            theirs("mlp.down_proj.weight"),
            vec![h, ffn],
        ));
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
    out
}

pub fn llama_to_megatron(hf: &StateDict, config: &TransformerConfig) -> Result<StateDict> {
    apply(llama_recipes(config), hf)
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
