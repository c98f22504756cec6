//! The Mixture-of-Experts columns of the iteration log and TensorBoard (Megatron's
//! `track_moe_metrics`): each auxiliary loss, unscaled by its coefficient, averaged over the
//! step's micro-batches and the model's MoE layers.

use anyhow::Result;
use tch::{Device, Kind, Tensor};

use megatron_models::layers::moe::aux_loss::take_tracked_losses;
use megatron_models::layers::moe::config::LoadBalancing;
use megatron_models::TransformerConfig;
use megatron_parallel::{ParallelState, ReduceOp};

pub struct MoeLossColumns {
    /// The columns, in Megatron's order; each is printed even when no layer reported it
    /// (a zero coefficient), as Megatron does.
    names: Vec<&'static str>,
    num_moe_layers: usize,
}

impl MoeLossColumns {
    /// The columns of `config`'s model; `None` for a dense model.
    pub fn of(config: &TransformerConfig) -> Option<MoeLossColumns> {
        let moe = config.moe.as_ref()?;
        let mut names = Vec::new();
        // Megatron picks the columns by substring of the balancing type, so per-sequence
        // balancing also shows an (all-zero) load_balancing_loss.
        if matches!(
            moe.load_balancing,
            LoadBalancing::AuxLoss | LoadBalancing::SeqAuxLoss
        ) {
            names.push("load_balancing_loss");
        }
        if moe.load_balancing == LoadBalancing::SeqAuxLoss {
            names.push("seq_load_balancing_loss");
        }
        if moe.z_loss_coeff.is_some() {
            names.push("z_loss");
        }
        Some(MoeLossColumns {
            names,
            num_moe_layers: moe.num_moe_layers().max(1),
        })
    }

    /// This step's values, read from what this rank's layers tracked and summed over the
    /// pipeline stages (every stage calls this, with the same columns).
    pub fn take(
        &self,
        parallel: &ParallelState,
        microbatches: usize,
        device: Device,
    ) -> Result<Vec<(&'static str, f64)>> {
        let tracked = take_tracked_losses();
        let values: Vec<f64> = self
            .names
            .iter()
            .map(|name| tracked.get(name).copied().unwrap_or(0.0))
            .collect();
        if values.is_empty() {
            return Ok(Vec::new());
        }
        let totals = Tensor::from_slice(&values)
            .to_kind(Kind::Float)
            .to_device(device);
        parallel.pipeline.all_reduce(&totals, ReduceOp::Sum)?;
        let totals = if parallel.sequence_parallel {
            // Each rank of the sequence's group holds the load-balancing losses' share of its
            // tokens, summed over the group (Megatron's `reduce_group`); the z-loss is each
            // rank's own mean.
            let shared: Vec<bool> = self.names.iter().map(|name| *name != "z_loss").collect();
            let shared = Tensor::from_slice(&shared).to_device(device);
            let summed = totals.copy();
            parallel.tensor.all_reduce(&summed, ReduceOp::Sum)?;
            summed.where_self(&shared, &totals)
        } else {
            totals
        };
        let totals = Vec::<f64>::try_from(&totals.to_kind(Kind::Double))?;
        let per = (microbatches * self.num_moe_layers) as f64;
        Ok(self
            .names
            .iter()
            .zip(totals)
            .map(|(name, total)| (*name, total / per))
            .collect())
    }
}
