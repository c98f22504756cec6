//! The Mixture-of-Experts architecture as Megatron's `--num-experts` and `--moe-*` flags
//! describe it; part of [`TransformerConfig`](crate::TransformerConfig), so checkpoint metadata
//! rebuilds the same model.

use anyhow::{bail, ensure, Result};
use serde::{Deserialize, Serialize};

pub use super::capacity::{Capacity, DropPolicy};

/// `--moe-router-score-function`: how the router's logits become scores.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ScoreFunction {
    Softmax,
    Sigmoid,
}

/// `--moe-router-load-balancing-type`: which auxiliary loss balances the experts' load.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LoadBalancing {
    /// Switch Transformer's loss over the micro-batch.
    AuxLoss,
    /// The same loss per sequence, averaged over the sequences.
    SeqAuxLoss,
    None,
}

/// `--moe-router-dtype`: the precision of the router's logits and scores (`None`: the
/// activations' dtype).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RouterDtype {
    Fp32,
    Fp64,
}

/// `--moe-token-dispatcher-type`: how tokens reach the experts of other expert-parallel ranks
/// (the same on one rank).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TokenDispatcher {
    /// Every rank gathers the group's tokens, runs its experts over those routed to them, and
    /// the outputs are reduce-scattered back.
    #[default]
    Allgather,
    /// The token counts, then the tokens themselves, go by all-to-all to the ranks of their
    /// experts and come back the same way.
    Alltoall,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MoeConfig {
    pub num_experts: i64,
    /// The hidden size of each routed expert's MLP.
    pub ffn_hidden_size: i64,
    /// Which layers are MoE layers, one entry per layer (`--moe-layer-freq` expanded).
    pub layer_pattern: Vec<bool>,
    pub topk: i64,
    pub score_function: ScoreFunction,
    /// Softmax over all experts before the top-k instead of over the chosen k after it.
    pub pre_softmax: bool,
    pub topk_scaling_factor: Option<f64>,
    pub router_dtype: Option<RouterDtype>,
    pub load_balancing: LoadBalancing,
    pub aux_loss_coeff: f64,
    pub z_loss_coeff: Option<f64>,
    /// The hidden size of the shared expert every token also passes through.
    pub shared_expert_intermediate_size: Option<i64>,
    /// `--moe-expert-capacity-factor` and its policies; `None`: dropless.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub capacity: Option<Capacity>,
    /// `--moe-router-bias-update-rate` with `--moe-router-enable-expert-bias`: the router keeps
    /// a per-expert bias for its choice ([`ExpertBias`](super::expert_bias::ExpertBias)).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expert_bias_update_rate: Option<f64>,
    /// `--moe-shared-expert-gate`: the shared expert's output scaled per token by a sigmoid
    /// gate (Qwen2-MoE); absent in metadata written before it existed.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub shared_expert_gate: bool,
    /// How tokens travel, not what the model is: left out of the architecture a checkpoint
    /// records.
    #[serde(skip)]
    pub token_dispatcher: TokenDispatcher,
    /// `--moe-grouped-gemm`: the experts run as grouped GEMMs where the kernel takes them; how
    /// they run, not what they are, so left out of the architecture too.
    #[serde(skip)]
    pub grouped_gemm: bool,
}

impl MoeConfig {
    /// Whether layer `index` (global, from 0) is an MoE layer.
    pub fn is_moe_layer(&self, index: usize) -> bool {
        self.layer_pattern.get(index).copied().unwrap_or(false)
    }

    /// The number of MoE layers in the model.
    pub fn num_moe_layers(&self) -> usize {
        self.layer_pattern.iter().filter(|&&moe| moe).count()
    }

    /// The checks Megatron's `validate_args` makes on the MoE flags.
    pub fn validate(&self, num_layers: usize) -> Result<()> {
        ensure!(
            self.num_experts > 0,
            "--num-experts must be positive (got {})",
            self.num_experts
        );
        ensure!(
            self.topk >= 1 && self.topk <= self.num_experts,
            "--moe-router-topk {} must be between 1 and --num-experts {}",
            self.topk,
            self.num_experts
        );
        ensure!(
            self.ffn_hidden_size > 0,
            "--moe-ffn-hidden-size must be positive (got {})",
            self.ffn_hidden_size
        );
        ensure!(
            self.layer_pattern.len() == num_layers,
            "--moe-layer-freq gives {} layers, the model has --num-layers {num_layers}",
            self.layer_pattern.len()
        );
        if let Some(size) = self.shared_expert_intermediate_size {
            ensure!(
                size > 0,
                "--moe-shared-expert-intermediate-size must be positive (got {size})"
            );
        }
        ensure!(
            self.expert_bias_update_rate.is_none() || self.score_function == ScoreFunction::Sigmoid,
            "--moe-router-enable-expert-bias needs --moe-router-score-function sigmoid (as \
             Megatron requires)"
        );
        ensure!(
            !self.shared_expert_gate || self.shared_expert_intermediate_size.is_some(),
            "--moe-shared-expert-gate needs --moe-shared-expert-intermediate-size"
        );
        ensure!(
            self.aux_loss_coeff >= 0.0,
            "--moe-aux-loss-coeff must not be negative (got {})",
            self.aux_loss_coeff
        );
        Ok(())
    }
}

/// `--moe-layer-freq`: an integer `n` (every n-th layer from the first is MoE) or Megatron's
/// list expression, a Python list of 0s and 1s, one per layer, that may use `*` repetition
/// (`([1]*3+[0]*1)*3`, `[0]+[1]*23`).
pub fn parse_layer_freq(value: &str, num_layers: usize) -> Result<Vec<bool>> {
    let value = value.trim();
    if let Ok(every) = value.parse::<usize>() {
        ensure!(every > 0, "--moe-layer-freq must be positive (got {value})");
        return Ok((0..num_layers).map(|i| i % every == 0).collect());
    }
    let mut parser = ListExpression {
        text: value.as_bytes(),
        at: 0,
    };
    let pattern = parser
        .sum()
        .and_then(|list| {
            parser.skip_spaces();
            ensure!(
                parser.at == parser.text.len(),
                "unexpected text at {}",
                parser.at
            );
            Ok(list)
        })
        .map_err(|error| {
            anyhow::anyhow!(
                "--moe-layer-freq {value:?}: {error}; expected an integer or a list like \
                 \"([1]*3+[0]*1)*3\""
            )
        })?;
    ensure!(
        pattern.len() == num_layers,
        "--moe-layer-freq {value:?} describes {} layers, the model has --num-layers {num_layers}",
        pattern.len()
    );
    pattern
        .into_iter()
        .map(|entry| match entry {
            0 => Ok(false),
            1 => Ok(true),
            other => bail!("--moe-layer-freq {value:?}: entries must be 0 or 1, found {other}"),
        })
        .collect()
}

/// A recursive-descent reader of the list expressions `--moe-layer-freq` takes:
/// `sum := product ('+' product)*`, `product := atom ('*' integer)*`,
/// `atom := '[' integers ']' | '(' sum ')'`.
struct ListExpression<'a> {
    text: &'a [u8],
    at: usize,
}

impl ListExpression<'_> {
    fn skip_spaces(&mut self) {
        while self.text.get(self.at).is_some_and(u8::is_ascii_whitespace) {
            self.at += 1;
        }
    }

    fn eat(&mut self, byte: u8) -> bool {
        self.skip_spaces();
        let found = self.text.get(self.at) == Some(&byte);
        if found {
            self.at += 1;
        }
        found
    }

    fn sum(&mut self) -> Result<Vec<u64>> {
        let mut list = self.product()?;
        while self.eat(b'+') {
            list.extend(self.product()?);
        }
        Ok(list)
    }

    fn product(&mut self) -> Result<Vec<u64>> {
        let mut list = self.atom()?;
        while self.eat(b'*') {
            let times = self.integer()?;
            ensure!(list.len() as u64 * times <= 1 << 20, "the list is too long");
            list = list.repeat(times as usize);
        }
        Ok(list)
    }

    fn atom(&mut self) -> Result<Vec<u64>> {
        if self.eat(b'(') {
            let list = self.sum()?;
            ensure!(self.eat(b')'), "missing ')' at {}", self.at);
            return Ok(list);
        }
        ensure!(self.eat(b'['), "expected '[' or '(' at {}", self.at);
        let mut list = Vec::new();
        if self.eat(b']') {
            return Ok(list);
        }
        loop {
            list.push(self.integer()?);
            if self.eat(b']') {
                return Ok(list);
            }
            ensure!(self.eat(b','), "expected ',' or ']' at {}", self.at);
        }
    }

    fn integer(&mut self) -> Result<u64> {
        self.skip_spaces();
        let start = self.at;
        while self.text.get(self.at).is_some_and(u8::is_ascii_digit) {
            self.at += 1;
        }
        ensure!(self.at > start, "expected an integer at {start}");
        Ok(std::str::from_utf8(&self.text[start..self.at])?.parse()?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layer_freq_takes_an_integer_or_megatrons_list_expressions() {
        let pattern = |value: &str, layers| parse_layer_freq(value, layers).unwrap();
        assert_eq!(pattern("1", 3), vec![true, true, true]);
        assert_eq!(pattern("2", 5), vec![true, false, true, false, true]);
        assert_eq!(
            pattern("([1]*2+[0]*1)*2", 6),
            vec![true, true, false, true, true, false]
        );
        assert_eq!(pattern("[0]+[1]*3", 4), vec![false, true, true, true]);
        assert_eq!(pattern("[1, 0, 1]", 3), vec![true, false, true]);
        for (bad, needle) in [
            ("[1]*3", "describes 3 layers"),
            ("[1,2]", "entries must be 0 or 1"),
            ("[1", "expected ',' or ']'"),
            ("0", "must be positive"),
            ("[1]*", "expected an integer"),
        ] {
            let error = parse_layer_freq(bad, 2).unwrap_err().to_string();
            assert!(error.contains(needle), "{bad}: {error}");
            assert!(error.contains("--moe-layer-freq"), "{bad}: {error}");
        }
    }
}
