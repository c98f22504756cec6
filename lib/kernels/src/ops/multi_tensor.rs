//! Multi-tensor kernels: one launch per list of tensors (ATen's `_foreach_*` and
//! `_fused_adamw_`), which is what keeps the optimizer step and clipping cheap for models with
//! hundreds of parameter tensors.

use crate::autograd::ffi::{self, TensorHandle};
use crate::error::check;
use crate::TorchError;
use tch::Tensor;

fn handles(tensors: &[&Tensor]) -> Vec<TensorHandle> {
    tensors.iter().map(|t| ffi::handle(t)).collect()
}

fn same_length(what: &str, lengths: &[usize]) -> Result<(), TorchError> {
    if lengths.windows(2).all(|w| w[0] == w[1]) {
        Ok(())
    } else {
        Err(TorchError(format!(
            "{what}: tensor lists of different lengths {lengths:?}"
        )))
    }
}

/// Hyper-parameters of one AdamW step (decoupled weight decay, bias correction on).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamwHyper {
    pub lr: f64,
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub weight_decay: f64,
}

/// One fused AdamW step over tensors of one device and dtype. `steps` are float scalar tensors
/// (one per parameter) that are incremented before the update, as `torch.optim.AdamW` does.
/// `grad_divisor`, a float scalar tensor, divides the gradients first (and is written back into
/// them), in the same kernel.
pub fn fused_adamw(
    params: &[&Tensor],
    grads: &[&Tensor],
    exp_avgs: &[&Tensor],
    exp_avg_sqs: &[&Tensor],
    steps: &[&Tensor],
    hyper: AdamwHyper,
    grad_divisor: Option<&Tensor>,
) -> Result<(), TorchError> {
    same_length(
        "fused_adamw",
        &[
            params.len(),
            grads.len(),
            exp_avgs.len(),
            exp_avg_sqs.len(),
            steps.len(),
        ],
    )?;
    let (p, g, m, v, s) = (
        handles(params),
        handles(grads),
        handles(exp_avgs),
        handles(exp_avg_sqs),
        handles(steps),
    );
    // SAFETY: every handle borrows a live tensor for the duration of the call.
    check(unsafe {
        ffi::mrs_fused_adamw(
            p.as_ptr(),
            g.as_ptr(),
            m.as_ptr(),
            v.as_ptr(),
            s.as_ptr(),
            p.len(),
            hyper.lr,
            hyper.beta1,
            hyper.beta2,
            hyper.weight_decay,
            hyper.eps,
            grad_divisor.map_or(std::ptr::null_mut(), |t| ffi::handle(t)),
        )
    })
}

/// The L2 norm of all tensors together, as a float32 scalar on their device.
pub fn total_norm(tensors: &[&Tensor]) -> Result<Tensor, TorchError> {
    if tensors.is_empty() {
        return Ok(Tensor::zeros([], (tch::Kind::Float, tch::Device::Cpu)));
    }
    let list = handles(tensors);
    let mut out: TensorHandle = std::ptr::null_mut();
    // SAFETY: on success the shim writes a fresh handle that we own.
    check(unsafe { ffi::mrs_foreach_total_norm(list.as_ptr(), list.len(), &mut out) })?;
    Ok(unsafe { Tensor::from_ptr(out) })
}

/// `tensors[i] *= factor` in place; `factor` is a scalar tensor (it may live on the device, so
/// no host synchronisation is needed).
pub fn foreach_mul_(tensors: &[&Tensor], factor: &Tensor) -> Result<(), TorchError> {
    if tensors.is_empty() {
        return Ok(());
    }
    let list = handles(tensors);
    // SAFETY: borrowed handles, live for the call.
    check(unsafe { ffi::mrs_foreach_mul_(list.as_ptr(), list.len(), ffi::handle(factor)) })
}

/// `targets[i] += sources[i]` in place, converting to the target dtype.
pub fn foreach_add_(targets: &[&Tensor], sources: &[&Tensor]) -> Result<(), TorchError> {
    same_length("foreach_add_", &[targets.len(), sources.len()])?;
    if targets.is_empty() {
        return Ok(());
    }
    let (t, s) = (handles(targets), handles(sources));
    // SAFETY: borrowed handles, live for the call.
    check(unsafe { ffi::mrs_foreach_add_(t.as_ptr(), s.as_ptr(), t.len()) })
}

/// `targets[i].copy_(sources[i])`.
pub fn foreach_copy_(targets: &[&Tensor], sources: &[&Tensor]) -> Result<(), TorchError> {
    same_length("foreach_copy_", &[targets.len(), sources.len()])?;
    if targets.is_empty() {
        return Ok(());
    }
    let (t, s) = (handles(targets), handles(sources));
    // SAFETY: borrowed handles, live for the call.
    check(unsafe { ffi::mrs_foreach_copy_(t.as_ptr(), s.as_ptr(), t.len()) })
}

pub fn foreach_zero_(tensors: &[&Tensor]) -> Result<(), TorchError> {
    if tensors.is_empty() {
        return Ok(());
    }
    let list = handles(tensors);
    // SAFETY: borrowed handles, live for the call.
    check(unsafe { ffi::mrs_foreach_zero_(list.as_ptr(), list.len()) })
}

/// Multiplies every tensor by `inv_scale` and sets `found_inf` (a float32 scalar, expected 0)
/// to 1 when any value is infinite or NaN: the fp16 loss scaler's overflow check.
pub fn unscale_and_check_finite(
    tensors: &[&Tensor],
    found_inf: &Tensor,
    inv_scale: &Tensor,
) -> Result<(), TorchError> {
    if tensors.is_empty() {
        return Ok(());
    }
    let list = handles(tensors);
    // SAFETY: borrowed handles, live for the call.
    check(unsafe {
        ffi::mrs_unscale_and_check_finite(
            list.as_ptr(),
            list.len(),
            ffi::handle(found_inf),
            ffi::handle(inv_scale),
        )
    })
}

/// `torch.use_deterministic_algorithms` plus cuDNN's deterministic mode (`--deterministic-mode`).
pub fn set_deterministic(enabled: bool) -> Result<(), TorchError> {
    // SAFETY: plain flag setter.
    check(unsafe { ffi::mrs_set_deterministic(enabled.into()) })
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::{Device, Kind};

    fn close(a: &Tensor, b: &Tensor) -> bool {
        a.allclose(b, 1e-6, 1e-7, false)
    }

    #[test]
    fn fused_adamw_matches_the_adamw_formula() {
        let param = Tensor::from_slice(&[1.0f32, -2.0, 0.5]);
        let grad = Tensor::from_slice(&[0.1f32, 0.2, -0.3]);
        let (m, v) = (param.zeros_like(), param.zeros_like());
        let step = Tensor::zeros([], (Kind::Float, Device::Cpu));
        let hyper = AdamwHyper {
            lr: 0.01,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.1,
        };
        let expected_first = {
            // Step 1: m = 0.1 g, v = 0.001 g^2, bias corrections 0.1 and 0.001 cancel them.
            let decayed = &param * (1.0 - hyper.lr * hyper.weight_decay);
            let update = &grad / (grad.abs() + hyper.eps);
            decayed - update * hyper.lr
        };
        fused_adamw(&[&param], &[&grad], &[&m], &[&v], &[&step], hyper, None).unwrap();
        assert!(close(&param, &expected_first));
        assert_eq!(step.double_value(&[]), 1.0);
        assert!(close(&m, &(&grad * 0.1)));
    }

    #[test]
    fn a_gradient_divisor_equals_dividing_the_gradients_first() {
        let hyper = AdamwHyper {
            lr: 0.01,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-3,
            weight_decay: 0.1,
        };
        let run = |grad: Tensor, divisor: Option<&Tensor>| {
            let param = Tensor::from_slice(&[1.0f32, -2.0, 0.5]);
            let (m, v) = (param.zeros_like(), param.zeros_like());
            let step = Tensor::zeros([], (Kind::Float, Device::Cpu));
            fused_adamw(&[&param], &[&grad], &[&m], &[&v], &[&step], hyper, divisor).unwrap();
            (param, grad)
        };
        let grad = Tensor::from_slice(&[0.1f32, 0.2, -0.3]);
        let (divided, written) = run(grad.copy(), Some(&Tensor::from(4.0f32)));
        let (expected, _) = run(&grad / 4.0, None);
        assert!(close(&divided, &expected));
        assert!(close(&written, &(&grad / 4.0)));
    }

    #[test]
    fn norm_scale_add_copy_and_zero() {
        let a = Tensor::from_slice(&[3.0f32, 0.0]);
        let b = Tensor::from_slice(&[4.0f64]);
        assert!((total_norm(&[&a, &b]).unwrap().double_value(&[]) - 5.0).abs() < 1e-6);
        foreach_mul_(&[&a], &Tensor::from(0.5f32)).unwrap();
        assert!(close(&a, &Tensor::from_slice(&[1.5f32, 0.0])));
        let half = Tensor::from_slice(&[1.0f32, 2.0]).to_kind(Kind::BFloat16);
        foreach_add_(&[&a], &[&half]).unwrap();
        assert!(close(&a, &Tensor::from_slice(&[2.5f32, 2.0])));
        foreach_copy_(&[&half], &[&a]).unwrap();
        assert_eq!(half.to_kind(Kind::Float).double_value(&[0]), 2.5);
        foreach_zero_(&[&a]).unwrap();
        assert_eq!(a.abs().sum(Kind::Float).double_value(&[]), 0.0);
        assert!(foreach_add_(&[&a], &[]).is_err());
    }

    #[test]
    fn unscale_flags_non_finite_values() {
        let finite = Tensor::from_slice(&[2.0f32, 4.0]);
        let found = Tensor::zeros([], (Kind::Float, Device::Cpu));
        let inv = Tensor::from(0.5f32);
        unscale_and_check_finite(&[&finite], &found, &inv).unwrap();
        assert_eq!(found.double_value(&[]), 0.0);
        assert!(close(&finite, &Tensor::from_slice(&[1.0f32, 2.0])));
        let bad = Tensor::from_slice(&[f32::INFINITY]);
        unscale_and_check_finite(&[&bad], &found, &inv).unwrap();
        assert_eq!(found.double_value(&[]), 1.0);
    }
}
