//! HuggingFace checkpoints in Megatron-core names and layouts (spec §5.6): what every family's
//! mapping is made of. A [`Recipe`] says how one Megatron-core tensor is made from HuggingFace
//! tensors; each family's folder holds its recipes (`gpt::hf`, `bert::hf`).

use std::collections::HashMap;
use std::sync::Arc;

use anyhow::{ensure, Context, Result};
use tch::Tensor;

use crate::config::TransformerConfig;

/// Tensors by name: a HuggingFace checkpoint's, or the Megatron-core tensors made of them.
pub type StateDict = HashMap<String, Tensor>;

pub(crate) fn take<'a>(state: &'a StateDict, name: &str) -> Result<&'a Tensor> {
    state
        .get(name)
        .with_context(|| format!("HuggingFace checkpoint has no tensor {name}"))
}

/// Pads the vocabulary rows to Megatron's padded size by repeating the last row, as Megatron's
/// converters do.
pub(crate) fn pad_vocab(table: &Tensor, padded: i64) -> Tensor {
    let rows = table.size()[0];
    if rows >= padded {
        return table.narrow(0, 0, padded);
    }
    let last = table
        .narrow(0, rows - 1, 1)
        .expand([padded - rows, table.size()[1]], false);
    Tensor::cat(&[table, &last], 0)
}

/// How one Megatron-core tensor is made from HuggingFace tensors: the importers' one
/// definition of each mapping, applied at once (`gpt::hf::gpt2_to_megatron`) or tensor by tensor
/// as a converter writes (`convert::hf`).
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
    pub(crate) fn new(
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
    pub(crate) fn stacking(self, rows: Vec<(usize, i64, i64)>) -> Self {
        Recipe {
            rows: Some(rows),
            ..self
        }
    }

    pub(crate) fn copy(name: impl Into<String>, hf: impl Into<String>, shape: Vec<i64>) -> Self {
        let rows = shape.first().copied().unwrap_or(1);
        Recipe::new(name, shape.clone(), vec![(hf.into(), shape)], |t| {
            t[0].shallow_clone()
        })
        .stacking(vec![(0, 0, rows)])
    }

    /// A vocabulary table padded to Megatron's size.
    pub(crate) fn vocabulary(name: &str, hf: &str, config: &TransformerConfig) -> Self {
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
pub(crate) fn apply(recipes: Vec<Recipe>, hf: &StateDict) -> Result<StateDict> {
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

/// Separate q/k/v projections (Llama's, BERT's) → Megatron's per-group `[q heads of the group;
/// k; v]` rows. HF stores q and k already in the rotate-half layout Megatron's RoPE uses.
pub(crate) fn grouped_qkv_weight(
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
