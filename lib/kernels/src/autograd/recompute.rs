//! Activation recompute (Megatron's `--recompute-granularity`): run a block without keeping its
//! intermediate activations, and run it again during backward to get its gradients.

use super::function::{apply, CustomFunction, SavedTensors};
use crate::rng::RngSnapshot;
use crate::TorchError;
use tch::Tensor;

/// Applies `block` to `inputs` keeping only the inputs for backward. In backward the block is
/// recomputed with gradients enabled and with the random generators rewound to their state at
/// the original forward, so dropout masks are identical; parameters the block closes over
/// accumulate their gradients as in an ordinary backward pass.
pub fn recompute<F>(block: F, inputs: &[&Tensor]) -> Result<Vec<Tensor>, TorchError>
where
    F: FnMut(&[Tensor]) -> anyhow::Result<Vec<Tensor>> + Send + 'static,
{
    apply(
        Recompute {
            block,
            rng: None,
            input_requires_grad: Vec::new(),
        },
        inputs,
    )
}

struct Recompute<F> {
    block: F,
    rng: Option<RngSnapshot>,
    input_requires_grad: Vec<bool>,
}

impl<F> CustomFunction for Recompute<F>
where
    F: FnMut(&[Tensor]) -> anyhow::Result<Vec<Tensor>> + Send + 'static,
{
    fn forward(
        &mut self,
        inputs: &[Tensor],
        saved: &mut SavedTensors,
    ) -> anyhow::Result<Vec<Tensor>> {
        self.rng = Some(RngSnapshot::capture(inputs.iter().map(Tensor::device))?);
        self.input_requires_grad = inputs.iter().map(Tensor::requires_grad).collect();
        for input in inputs {
            saved.save(input);
        }
        (self.block)(inputs)
    }

    fn backward(
        &mut self,
        grad_outputs: &[Tensor],
        saved: &[Tensor],
    ) -> anyhow::Result<Vec<Option<Tensor>>> {
        let inputs: Vec<Tensor> = saved
            .iter()
            .zip(&self.input_requires_grad)
            .map(|(t, &requires_grad)| t.detach().set_requires_grad(requires_grad))
            .collect();
        let original = self.rng.as_ref().expect("forward captured the generators");
        let current = RngSnapshot::capture(inputs.iter().map(Tensor::device))?;
        original.restore()?;
        let outputs = tch::with_grad(|| (self.block)(&inputs));
        current.restore()?;
        let outputs = outputs?;

        let (outs, grads): (Vec<&Tensor>, Vec<&Tensor>) = outputs
            .iter()
            .zip(grad_outputs)
            .filter(|(out, _)| out.requires_grad())
            .unzip();
        if !outs.is_empty() {
            super::engine::backward(&outs, &grads, false)?;
        }
        Ok(inputs
            .iter()
            .zip(&self.input_requires_grad)
            .map(|(input, &requires_grad)| {
                let grad = input.grad();
                (requires_grad && grad.defined()).then_some(grad)
            })
            .collect())
    }
}
