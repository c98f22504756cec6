//! Numerical gradient check: compares the autograd gradient of a function with central finite
//! differences, in float64. Used to validate every hand-written backward in the crate.

use super::engine::grad;
use anyhow::{bail, Result};
use tch::{Kind, Tensor};

/// Checks `f` at `inputs` (float64 tensors; the ones with `requires_grad` are checked).
///
/// The scalar probed is `sum_k <f(x)_k, w_k>` for fixed random weights `w_k`, so every output
/// element contributes. Fails with the worst element if analytic and numerical gradients differ
/// by more than `atol + rtol * |numerical|`.
pub fn gradcheck<F>(f: F, inputs: &[Tensor], eps: f64, atol: f64, rtol: f64) -> Result<()>
where
    F: Fn(&[Tensor]) -> Result<Vec<Tensor>>,
{
    for (i, x) in inputs.iter().enumerate() {
        if x.kind() != Kind::Double {
            bail!("gradcheck input {i} is {:?}; use float64", x.kind());
        }
    }
    let outputs = f(inputs)?;
    let weights: Vec<Tensor> = outputs
        .iter()
        .map(|o| Tensor::randn_like(&o.detach()))
        .collect();
    let probe = |xs: &[Tensor]| -> Result<f64> {
        let outs = tch::no_grad(|| f(xs))?;
        Ok(outs
            .iter()
            .zip(&weights)
            .map(|(o, w)| (o * w).sum(Kind::Double).double_value(&[]))
            .sum())
    };

    let out_refs: Vec<&Tensor> = outputs.iter().collect();
    let weight_refs: Vec<&Tensor> = weights.iter().collect();
    let checked: Vec<usize> = (0..inputs.len())
        .filter(|&i| inputs[i].requires_grad())
        .collect();
    let checked_refs: Vec<&Tensor> = checked.iter().map(|&i| &inputs[i]).collect();
    let analytic = grad(&out_refs, &weight_refs, &checked_refs, false, false)?;

    for (slot, &i) in checked.iter().enumerate() {
        let analytic = match &analytic[slot] {
            Some(g) => g.flatten(0, -1),
            None => inputs[i].zeros_like().flatten(0, -1),
        };
        let numel = inputs[i].numel();
        for element in 0..numel {
            let shifted = |delta: f64| -> Result<f64> {
                let xs: Vec<Tensor> = inputs.iter().map(|t| t.detach().copy()).collect();
                let mut entry = xs[i].view(-1).get(element as i64);
                let value = entry.double_value(&[]);
                let _ = entry.fill_(value + delta);
                probe(&xs)
            };
            let numerical = (shifted(eps)? - shifted(-eps)?) / (2.0 * eps);
            let got = analytic.double_value(&[element as i64]);
            if (got - numerical).abs() > atol + rtol * numerical.abs() {
                bail!("gradient mismatch for input {i} element {element}: autograd {got}, numerical {numerical}");
            }
        }
    }
    Ok(())
}
