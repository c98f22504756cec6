//! Megatron's top-k router: a gating linear scores each token against every expert, the k best
//! experts are chosen, and their probabilities weigh the experts' outputs. In training the
//! auxiliary losses ride on the probabilities and logits ([`aux_loss::attach`]).

use std::sync::Arc;

use anyhow::Result;
use tch::{Device, Kind, Tensor};

use super::aux_loss;
use super::config::{LoadBalancing, MoeConfig, RouterDtype, ScoreFunction};
use super::expert_bias::ExpertBias;
use crate::layers::{NamedTensors, ParamAttributes, TensorParallel};
use crate::param::{Initializer, Param};
use megatron_parallel::{Communicator, ReduceOp};

/// Which experts each token goes to, and with what weight.
pub struct Routing {
    /// `[tokens, experts]`: each token's probability for its chosen experts, 0 elsewhere.
    pub probs: Tensor,
    /// `[tokens, experts]`, bool: the chosen experts.
    pub map: Tensor,
    pub assignments: Assignments,
}

/// How the assignments of `map` lie, which tells the permutation what it may assume.
pub enum Assignments {
    /// Dropless: every token has exactly `topk`, these experts `[tokens, topk]` (int64).
    TopK(Tensor),
    /// Some dropped by the expert capacity: any number per token.
    Dropped,
    /// Padded to the expert capacity: every expert exactly this many tokens.
    Padded(i64),
}

#[derive(Clone)]
pub struct TopKRouter {
    /// `[experts, hidden]`, in the parameters' dtype.
    pub weight: Param,
    config: MoeConfig,
    /// With sequence parallelism, the tensor-parallel group whose ranks route the parts of
    /// one sequence (Megatron's `tp_cp` group): the load-balancing loss counts its tokens.
    sequence_group: Option<Arc<dyn Communicator>>,
    /// `--moe-router-enable-expert-bias`.
    pub expert_bias: Option<ExpertBias>,
}

impl TopKRouter {
    pub fn new(
        init: &Initializer,
        config: &MoeConfig,
        hidden: i64,
        std: f64,
        parallel: &TensorParallel,
    ) -> Self {
        TopKRouter {
            weight: init.normal("weight", &[config.num_experts, hidden], std),
            config: config.clone(),
            sequence_group: (parallel.sequence_parallel && parallel.group.size() > 1)
                .then(|| parallel.group.clone()),
            expert_bias: config
                .expert_bias_update_rate
                .map(|rate| ExpertBias::new(config.num_experts, rate, init.device)),
        }
    }

    /// The ranks sharing one sequence's tokens (1 without sequence parallelism).
    fn sequence_ranks(&self) -> i64 {
        self.sequence_group.as_ref().map_or(1, |g| g.size() as i64)
    }

    /// Tokens per expert counted over the ranks sharing the sequence.
    fn counted_over_sequence(&self, per_expert: Tensor) -> Result<Tensor> {
        if let Some(group) = &self.sequence_group {
            group.all_reduce(&per_expert, ReduceOp::Sum)?;
        }
        Ok(per_expert)
    }

    /// Routes `hidden` `[s, b, h]` (`train`: with the auxiliary losses, which also need
    /// gradients recorded).
    pub fn forward(&self, hidden: &Tensor, train: bool) -> Result<Routing> {
        let (seq_length, _, h) = hidden.size3()?;
        let logits = self.gating(&hidden.reshape([-1, h]));
        let training = train && grad_enabled();
        let logits = match self.config.z_loss_coeff {
            Some(coeff) if training => {
                // Each rank's mean over its part of the sequence, whose gradients the ranks
                // sum: Megatron divides the coefficient among them.
                let coeff = coeff / self.sequence_ranks() as f64;
                let z = aux_loss::z_loss(&logits, coeff);
                aux_loss::track("z_loss", &(&z / coeff));
                aux_loss::attach(&logits, &z)?
            }
            _ => logits,
        };
        let (probs, map, indices) = self.top_k(&logits);
        let (probs, map, assignments) = match &self.config.capacity {
            Some(capacity) => {
                let (probs, map) = capacity.apply(&probs, &map, self.config.topk);
                let assignments = if capacity.pad_to_capacity {
                    let (tokens, experts) = map.size2()?;
                    Assignments::Padded(capacity.per_expert(tokens, self.config.topk, experts))
                } else {
                    Assignments::Dropped
                };
                (probs, map, assignments)
            }
            None => (probs, map, Assignments::TopK(indices)),
        };
        // Megatron counts what is routed with gradients recorded (not in evaluation, nor in
        // the first pass of a recomputed forward).
        if let Some(bias) = self.expert_bias.as_ref().filter(|_| training) {
            bias.count(&map);
        }
        let probs = match self.config.load_balancing {
            LoadBalancing::None => probs,
            _ if !training || self.config.aux_loss_coeff == 0.0 => probs,
            balancing => self.with_load_balancing(probs, &logits, balancing, seq_length)?,
        };
        Ok(Routing {
            probs,
            map,
            assignments,
        })
    }

    /// The logits `[tokens, experts]`, computed in `--moe-router-dtype` when given.
    fn gating(&self, tokens: &Tensor) -> Tensor {
        let kind = match self.config.router_dtype {
            Some(RouterDtype::Fp32) => Kind::Float,
            Some(RouterDtype::Fp64) => Kind::Double,
            None => tokens.kind(),
        };
        tokens
            .to_kind(kind)
            .linear::<&Tensor>(&self.weight.to_kind(kind), None)
    }

    /// The chosen experts' probabilities scattered over `[tokens, experts]`, the map of the
    /// chosen experts, and their indices `[tokens, topk]`.
    fn top_k(&self, logits: &Tensor) -> (Tensor, Tensor, Tensor) {
        let k = self.config.topk;
        let (probs, indices) = match self.config.score_function {
            ScoreFunction::Softmax if self.config.pre_softmax => {
                let scores = logits.softmax(-1, Kind::Float).to_kind(logits.kind());
                scores.topk(k, 1, true, true)
            }
            ScoreFunction::Softmax => {
                let (top, indices) = logits.topk(k, 1, true, true);
                (top.softmax(-1, Kind::Float).to_kind(logits.kind()), indices)
            }
            ScoreFunction::Sigmoid => {
                let scores = logits.to_kind(Kind::Float).sigmoid().to_kind(logits.kind());
                let (top, indices) = match &self.expert_bias {
                    Some(bias) => {
                        let indices = bias.choose(&scores, k);
                        (scores.gather(1, &indices, false), indices)
                    }
                    None => scores.topk(k, 1, true, true),
                };
                let probs = if k > 1 {
                    &top / (top.sum_dim_intlist(-1, true, None) + 1e-20)
                } else {
                    top
                };
                (probs, indices)
            }
        };
        let probs = match self.config.topk_scaling_factor {
            Some(factor) => probs * factor,
            None => probs,
        };
        let map = logits
            .zeros_like()
            .scatter_value(1, &indices, 1.0)
            .to_kind(Kind::Bool);
        let probs = logits.zeros_like().scatter(1, &indices, &probs);
        (probs, map, indices)
    }

    /// Attaches the load-balancing loss (over the micro-batch or per sequence) to `probs`.
    /// Its scores and the assignment it counts come from all the logits, whatever the
    /// routing's pre-softmax or scaling.
    fn with_load_balancing(
        &self,
        probs: Tensor,
        logits: &Tensor,
        balancing: LoadBalancing,
        seq_length: i64,
    ) -> Result<Tensor> {
        let config = &self.config;
        let scores = match config.score_function {
            ScoreFunction::Softmax => logits.softmax(-1, Kind::Float),
            ScoreFunction::Sigmoid => {
                let scores = logits.sigmoid();
                &scores / (scores.sum_dim_intlist(-1, true, None) + 1e-20)
            }
        };
        let (_, chosen) = scores.topk(config.topk, 1, true, true);
        let map = scores.zeros_like().scatter_value(1, &chosen, 1.0);
        let coeff = config.aux_loss_coeff;
        let (name, loss) = match balancing {
            LoadBalancing::AuxLoss => {
                let tokens = map.size()[0] * self.sequence_ranks();
                let per_expert = self.counted_over_sequence(map.sum_dim_intlist(0, false, None))?;
                let loss = aux_loss::switch_load_balancing_loss(
                    &scores,
                    &per_expert,
                    tokens,
                    config.num_experts,
                    config.topk,
                    coeff,
                );
                ("load_balancing_loss", loss)
            }
            // Each sequence's experts side by side: `[s, b·E]`, the sum of the sequences'
            // losses, averaged over the batch.
            _ => {
                let batch = map.size()[0] / seq_length;
                let per_expert = self.counted_over_sequence(
                    map.reshape([seq_length, -1])
                        .sum_dim_intlist(0, false, None),
                )?;
                let loss = aux_loss::switch_load_balancing_loss(
                    &scores.reshape([seq_length, -1]),
                    &per_expert,
                    seq_length * self.sequence_ranks(),
                    config.num_experts,
                    config.topk,
                    coeff,
                ) / batch as f64;
                ("seq_load_balancing_loss", loss)
            }
        };
        aux_loss::track(name, &(&loss / coeff));
        aux_loss::attach(&probs, &loss)
    }

    pub fn named_tensors(&self, out: &mut NamedTensors) {
        // Each rank of the sequence's group routes its own tokens: the gradients are summed
        // over the group.
        let attributes = ParamAttributes {
            sequence_parallel: self.sequence_group.is_some(),
            ..ParamAttributes::REPLICATED
        };
        out.push("weight", &self.weight, attributes);
    }
}

/// Whether autograd records operations here: not under `no_grad`, as in the first pass of a
/// recomputed forward, whose auxiliary losses the recomputation adds (tch exposes no query of
/// the grad mode; an operation on a leaf that requires grad tells it).
fn grad_enabled() -> bool {
    let leaf = Tensor::zeros([], (Kind::Float, Device::Cpu)).set_requires_grad(true);
    (&leaf * 1.0).requires_grad()
}
