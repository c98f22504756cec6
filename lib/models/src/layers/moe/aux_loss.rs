//! The router's auxiliary losses (Switch Transformer's load balancing, ST-MoE's z-loss), how
//! their gradients enter the backward pass, and the per-layer values the iteration log reports.

use std::cell::{Cell, RefCell};
use std::collections::BTreeMap;

use anyhow::Result;
use tch::{Kind, Tensor};

use megatron_kernels::autograd::{self, CustomFunction, SavedTensors};

/// Switch Transformer's load-balancing loss `E · Σᵢ fᵢ · Pᵢ · coeff`: `fᵢ` the fraction of the
/// `tokens · topk` assignments given to expert i, `Pᵢ` its mean score over the tokens.
/// `scores` `[tokens, columns]`, `tokens_per_expert` `[columns]` (counted over
/// `total_tokens`); the columns are the experts, or each sequence's experts side by side for
/// the per-sequence loss.
pub fn switch_load_balancing_loss(
    scores: &Tensor,
    tokens_per_expert: &Tensor,
    total_tokens: i64,
    experts: i64,
    topk: i64,
    coeff: f64,
) -> Tensor {
    let per_expert = scores.sum_dim_intlist(0, false, None);
    let scale = experts as f64 * coeff / (topk as f64 * total_tokens as f64 * total_tokens as f64);
    (per_expert * tokens_per_expert).sum(None) * scale
}

/// ST-MoE's z-loss: the mean square of each token's log-sum-exp of the logits, times `coeff`.
pub fn z_loss(logits: &Tensor, coeff: f64) -> Tensor {
    logits.logsumexp([-1], false).square().mean(None) * coeff
}

thread_local! {
    /// The gradient every auxiliary loss gets in backward: the main loss's scale there (the loss
    /// scale over the micro-batches, set by the training step), so that an auxiliary loss weighs
    /// on the parameters exactly as if it were added to each micro-batch's loss. Megatron keeps
    /// it in a class attribute; here it is per thread, because ranks may be threads of one
    /// process training different layouts, and read when the loss is attached (a rank's
    /// forward runs on its own thread; its backward may not).
    static BACKWARD_SCALE: Cell<f64> = const { Cell::new(1.0) };
}

/// Sets the gradient the auxiliary losses attached on this thread from now on get in backward.
pub fn set_aux_loss_backward_scale(scale: f64) {
    BACKWARD_SCALE.with(|cell| cell.set(scale));
}

/// Returns `activation` unchanged, tying `aux_loss` to it: in backward the activation's
/// gradient passes through and `aux_loss` gets the backward scale (as set when attached) as
/// its gradient, whatever the activation's gradient is (an auxiliary loss enters the backward
/// without entering the reported loss).
pub fn attach(activation: &Tensor, aux_loss: &Tensor) -> Result<Tensor> {
    let scaler = AuxLossScaler {
        scale: BACKWARD_SCALE.with(Cell::get),
    };
    Ok(autograd::apply(scaler, &[activation, aux_loss])?.remove(0))
}

struct AuxLossScaler {
    scale: f64,
}

impl CustomFunction for AuxLossScaler {
    fn forward(&mut self, inputs: &[Tensor], saved: &mut SavedTensors) -> Result<Vec<Tensor>> {
        saved.save(&inputs[1]);
        Ok(vec![inputs[0].copy()])
    }

    fn backward(&mut self, grads: &[Tensor], saved: &[Tensor]) -> Result<Vec<Option<Tensor>>> {
        let aux_grad = saved[0].ones_like() * self.scale;
        Ok(vec![Some(grads[0].shallow_clone()), Some(aux_grad)])
    }
}

thread_local! {
    /// Each auxiliary loss's values (unscaled by its coefficient), one per MoE layer and
    /// micro-batch since the last [`take_tracked_losses`], kept on the device until read; per
    /// thread because ranks may be threads of one process, and a rank's forward runs on its
    /// own thread.
    static TRACKED: RefCell<BTreeMap<&'static str, Vec<Tensor>>> =
        const { RefCell::new(BTreeMap::new()) };
}

/// Records `value` (a scalar tensor) of the loss `name`.
pub fn track(name: &'static str, value: &Tensor) {
    let value = value.detach().to_kind(Kind::Float);
    TRACKED.with(|tracked| tracked.borrow_mut().entry(name).or_default().push(value));
}

/// The tracked losses, each summed over layers and micro-batches (reading them waits for
/// the device), and forgets them.
pub fn take_tracked_losses() -> BTreeMap<&'static str, f64> {
    TRACKED.with(|tracked| {
        std::mem::take(&mut *tracked.borrow_mut())
            .into_iter()
            .map(|(name, values)| {
                (
                    name,
                    Tensor::stack(&values, 0)
                        .sum(Kind::Double)
                        .double_value(&[]),
                )
            })
            .collect()
    })
}
