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
    /// While a CUDA graph captures: the device scalar the graph's backward reads the scale from
    /// at each replay, in place of [`BACKWARD_SCALE`].
    static DEVICE_BACKWARD_SCALE: RefCell<Option<Tensor>> = const { RefCell::new(None) };
}

/// Sets the gradient the auxiliary losses attached on this thread from now on get in backward.
pub fn set_aux_loss_backward_scale(scale: f64) {
    BACKWARD_SCALE.with(|cell| cell.set(scale));
}

/// Runs `f` with the auxiliary losses attached on this thread taking their gradient from the
/// scalar `scale` (float32, on their device) as it holds when their backward runs: a CUDA
/// graph's capture, whose replays fill it with each step's scale.
pub fn with_aux_loss_backward_scale_on_device<T>(scale: &Tensor, f: impl FnOnce() -> T) -> T {
    let previous = DEVICE_BACKWARD_SCALE.with(|cell| cell.replace(Some(scale.shallow_clone())));
    let result = f();
    DEVICE_BACKWARD_SCALE.with(|cell| *cell.borrow_mut() = previous);
    result
}

/// Returns `activation` unchanged, tying `aux_loss` to it: in backward the activation's
/// gradient passes through and `aux_loss` gets the backward scale (as set when attached) as
/// its gradient, whatever the activation's gradient is (an auxiliary loss enters the backward
/// without entering the reported loss).
pub fn attach(activation: &Tensor, aux_loss: &Tensor) -> Result<Tensor> {
    let scale = match DEVICE_BACKWARD_SCALE
        .with(|cell| cell.borrow().as_ref().map(Tensor::shallow_clone))
    {
        Some(scale) => BackwardScale::Device(scale),
        None => BackwardScale::Host(BACKWARD_SCALE.with(Cell::get)),
    };
    Ok(autograd::apply(AuxLossScaler { scale }, &[activation, aux_loss])?.remove(0))
}

enum BackwardScale {
    Host(f64),
    Device(Tensor),
}

struct AuxLossScaler {
    scale: BackwardScale,
}

impl CustomFunction for AuxLossScaler {
    fn forward(&mut self, inputs: &[Tensor], saved: &mut SavedTensors) -> Result<Vec<Tensor>> {
        saved.save(&inputs[1]);
        Ok(vec![inputs[0].copy()])
    }

    fn backward(&mut self, grads: &[Tensor], saved: &[Tensor]) -> Result<Vec<Option<Tensor>>> {
        let ones = saved[0].ones_like();
        let aux_grad = match &self.scale {
            BackwardScale::Host(scale) => ones * *scale,
            BackwardScale::Device(scale) => ones * scale,
        };
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
    take_tracked_values()
        .0
        .into_iter()
        .map(|(name, values)| {
            let flat: Vec<Tensor> = values.iter().map(|v| v.reshape([-1])).collect();
            (
                name,
                Tensor::cat(&flat, 0).sum(Kind::Double).double_value(&[]),
            )
        })
        .collect()
}

/// The tensors tracked on this thread since the last take, by loss, in the order tracked.
pub struct TrackedValues(BTreeMap<&'static str, Vec<Tensor>>);

/// Takes what this thread tracked (a CUDA graph's capture takes the tensors its replays
/// rewrite).
pub fn take_tracked_values() -> TrackedValues {
    TrackedValues(TRACKED.with(|tracked| std::mem::take(&mut *tracked.borrow_mut())))
}

impl TrackedValues {
    /// Tracks on this thread, in their order, a copy of what these tensors hold once the
    /// device has run what is queued now (after a CUDA graph's replay: that micro-batch's
    /// values, one copy per loss).
    pub fn track_copies(&self) {
        for (name, values) in &self.0 {
            let flat: Vec<Tensor> = values.iter().map(|v| v.reshape([-1])).collect();
            track(name, &Tensor::cat(&flat, 0));
        }
    }

    /// Tracks these tensors again on this thread, before anything tracked since they were
    /// taken.
    pub fn restore(self) {
        TRACKED.with(|tracked| {
            let mut tracked = tracked.borrow_mut();
            let later = std::mem::replace(&mut *tracked, self.0);
            for (name, values) in later {
                tracked.entry(name).or_default().extend(values);
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::Device;

    /// Attached while a graph would capture, the loss's gradient is what the device scalar
    /// holds when backward runs, the same bits as the host scale.
    #[test]
    fn a_device_scale_is_read_when_backward_runs() {
        let gradient = |attach_with: &dyn Fn(&Tensor, &Tensor) -> Tensor| {
            let activation = Tensor::from_slice(&[1.0f32, 2.0]).set_requires_grad(true);
            let loss_input = Tensor::from_slice(&[3.0f32]).set_requires_grad(true);
            let loss = (&loss_input * 2.0).sum(Kind::Float);
            attach_with(&activation, &loss).sum(Kind::Float).backward();
            (activation.grad(), loss_input.grad())
        };
        set_aux_loss_backward_scale(0.375);
        let host = gradient(&|activation, loss| attach(activation, loss).unwrap());
        let scale = Tensor::full([], 0.125, (Kind::Float, Device::Cpu));
        let device = gradient(&|activation, loss| {
            let attached = with_aux_loss_backward_scale_on_device(&scale, || {
                attach(activation, loss).unwrap()
            });
            let _ = scale.shallow_clone().fill_(0.375);
            attached
        });
        set_aux_loss_backward_scale(1.0);
        assert!(host.0.equal(&device.0));
        assert_eq!(Vec::<f32>::try_from(&device.1).unwrap(), [0.75]);
        assert!(host.1.equal(&device.1));
        // Outside the closure the host scale applies again.
        let after = gradient(&|activation, loss| attach(activation, loss).unwrap());
        assert_eq!(Vec::<f32>::try_from(&after.1).unwrap(), [2.0]);
    }

    /// A graph's tracked tensors, taken at its capture and copied after each replay, add up
    /// to what tracking each replay's values would give, after what was tracked before.
    #[test]
    fn copies_of_tracked_tensors_sum_as_the_values() {
        take_tracked_losses();
        track("z_loss", &Tensor::from(0.5f32));
        let before = take_tracked_values();
        let statics = [Tensor::from(1.0f32), Tensor::from(2.0f32)];
        for value in &statics {
            track("load_balancing_loss", value);
        }
        let captured = take_tracked_values();
        before.restore();
        for step in [1.0, 10.0] {
            for value in &statics {
                let _ = value.shallow_clone().fill_(step);
            }
            captured.track_copies();
        }
        let losses = take_tracked_losses();
        assert_eq!(losses["load_balancing_loss"], 22.0);
        assert_eq!(losses["z_loss"], 0.5);
        assert!(take_tracked_losses().is_empty());
    }
}
