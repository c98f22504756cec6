//! The output layer and the cross entropy fused, chunk by chunk over the tokens
//! (`--cross-entropy-loss-fusion`, Liger-Kernel's idea): the full `[s·b, V/t]` logits, their
//! float32 copy and their gradient never exist at once. The forward pass computes each chunk's
//! logits, its losses and at once its gradient with respect to the logits, turns that into the
//! chunk's share of the hidden-state, weight and bias gradients, and frees the chunk; the
//! backward pass only scales those gradients by the incoming one. The output is the masked sum
//! of the token losses, a scalar, so the incoming gradient is one number and the loss mask is
//! folded into the saved gradients.

use std::sync::Arc;

use anyhow::{ensure, Context, Result};
use tch::{Kind, Tensor};

use super::layers::main_grad_linear::{accumulate_product, product_in_float};
use super::param::{MainGrad, Param};
use megatron_kernels::autograd::{self, CustomFunction, SavedTensors};
use megatron_kernels::ops::softmax_cross_entropy;
use megatron_parallel::{Communicator, ReduceOp};

/// `Σ loss_mask · cross_entropy(hidden · weightᵀ + bias, labels)`, float32, for `hidden`
/// `[s, b, h]` (the whole sequence, on every tensor-parallel rank), this rank's output weight
/// `[V/t, h]` and bias, and `labels`, `loss_mask` `[b, s]`. `chunk_tokens` overrides how many
/// tokens a chunk holds (see [`default_chunk_tokens`]). When the optimizer gave the weight a
/// main-gradient view, its gradient is added there in float32.
pub fn fused_output_cross_entropy(
    hidden: &Tensor,
    weight: &Param,
    bias: Option<&Tensor>,
    labels: &Tensor,
    loss_mask: &Tensor,
    group: &Arc<dyn Communicator>,
    chunk_tokens: Option<i64>,
) -> Result<Tensor> {
    let (s, b, h) = hidden.size3().context("the output layer's input")?;
    let (local_vocab, weight_h) = weight.size2().context("the output weight")?;
    ensure!(
        weight_h == h,
        "the output weight [{local_vocab}, {weight_h}] does not fit hidden size {h}"
    );
    ensure!(
        labels.size() == [b, s] && loss_mask.size() == [b, s],
        "labels {:?} and loss mask {:?} do not match the output layer's [b, s] = [{b}, {s}]",
        labels.size(),
        loss_mask.size()
    );
    let tokens = s * b;
    // The logits have the hidden states' dtype.
    let softmax_kernel =
        group.size() == 1 && softmax_cross_entropy::usable_on(hidden.device(), hidden.kind());
    let function = FusedOutputCrossEntropy {
        weight: weight.tensor().shallow_clone(),
        bias: bias.map(Tensor::shallow_clone),
        target: labels.transpose(0, 1).reshape([tokens]),
        token_weights: loss_mask.transpose(0, 1).reshape([tokens]),
        group: group.clone(),
        chunk: chunk_tokens
            .unwrap_or_else(|| default_chunk_tokens(tokens, local_vocab, h, softmax_kernel)),
        softmax_kernel,
        weight_main_grad: weight.main_grad().get(),
        grads: None,
    };
    let differentiable = [Some(hidden), Some(weight.tensor()), bias];
    if !differentiable.into_iter().flatten().any(records_gradient) {
        return function.loss_only(&hidden.reshape([tokens, h]));
    }
    let mut inputs = vec![hidden, weight.tensor()];
    inputs.extend(bias);
    let mut outputs = autograd::apply(function, &inputs).context("fused output cross entropy")?;
    Ok(outputs.remove(0))
}

/// How many tokens a chunk holds by default: a power of two that makes a chunk's logits about
/// eight times the size of all the hidden states (Liger-Kernel takes once). Each chunk adds its
/// weight gradient into a float32 `[V/t, h]` buffer, a pass over it, so few large chunks beat
/// many small ones while a chunk's float32 logits stay at a few hundred MB for GPT-sized models.
/// With `in_place` (the fused softmax kernel writes the gradient over the 16-bit logits, and no
/// float32 copy exists) a chunk needs a quarter of the memory per token, so it holds four
/// times as many.
pub fn default_chunk_tokens(tokens: i64, local_vocab: i64, hidden: i64, in_place: bool) -> i64 {
    let per_chunk = if in_place { 32 } else { 8 } * hidden;
    let ratio = (local_vocab + per_chunk - 1) / per_chunk.max(1);
    let chunk = (tokens + ratio - 1) / ratio.max(1);
    (chunk.max(1) as u64).next_power_of_two() as i64
}

/// The log-partition function of each row of `logits` over this rank's slice, from its
/// log-softmax: the row's largest logit minus its log-probability, which is near 0 and so
/// exact to float32 rounding.
fn local_log_partition(logits: &Tensor, log_probs: &Tensor) -> Tensor {
    let (max, argmax) = logits.max_dim(-1, true);
    (max.to_kind(Kind::Float) - log_probs.gather(-1, &argmax, false)).squeeze_dim(-1)
}

/// Whether autograd would record an operation on `tensor`: it requires gradients and gradient
/// mode is on (under `no_grad` even a view of it does not require gradients).
fn records_gradient(tensor: &Tensor) -> bool {
    tensor.requires_grad() && tensor.alias().requires_grad()
}

/// The factor the gradients are held at between the forward and the backward pass, undone
/// then: float16 holds `softmax - one_hot` times 1024, so that probabilities down to 1e-7 stay
/// normal numbers (the role the loss scale plays for the unfused path, whose gradient is
/// scaled before it is rounded); a power of two, so scaling and unscaling are exact.
fn held_gradient_scale(kind: Kind) -> f64 {
    if kind == Kind::Half {
        1024.0
    } else {
        1.0
    }
}

struct FusedOutputCrossEntropy {
    weight: Tensor,
    bias: Option<Tensor>,
    /// Labels and loss-mask values in the hidden states' token order (`[s·b]`, sequence-major).
    target: Tensor,
    token_weights: Tensor,
    group: Arc<dyn Communicator>,
    chunk: i64,
    /// One rank on a GPU: the loss and its gradient are one kernel of ours
    /// ([`softmax_cross_entropy`]), writing the gradient over the logits.
    softmax_kernel: bool,
    weight_main_grad: Option<MainGrad>,
    /// What the forward pass computed for the backward pass.
    grads: Option<UnscaledGrads>,
}

/// The gradients of the masked loss sum, before the incoming gradient scales them.
struct UnscaledGrads {
    /// `[s·b, h]`, in the hidden states' dtype, and the hidden states' shape.
    hidden: Tensor,
    hidden_shape: Vec<i64>,
    /// `[V/t, h]` and `[1, V/t]`, float32.
    weight: Tensor,
    bias: Option<Tensor>,
}

impl FusedOutputCrossEntropy {
    /// The chunks `(start, length)` of `tokens` tokens.
    fn chunks(&self, tokens: i64) -> impl Iterator<Item = (i64, i64)> {
        let chunk = self.chunk.max(1);
        (0..tokens)
            .step_by(chunk as usize)
            .map(move |start| (start, chunk.min(tokens - start)))
    }

    /// One chunk's per-token losses (float32) and, when `with_grad`, `softmax - one_hot(target)`
    /// in the dtype of the logits, rounded once from float32 (times the held scale).
    fn chunk_loss(
        &self,
        input: &Tensor,
        target: &Tensor,
        with_grad: bool,
    ) -> Result<(Tensor, Option<Tensor>)> {
        let logits = input.linear(&self.weight, self.bias.as_ref());
        if self.softmax_kernel {
            // One kernel: the losses, and the gradient written over the logits.
            let scale = with_grad.then(|| held_gradient_scale(logits.kind()));
            let loss = softmax_cross_entropy::softmax_cross_entropy(&logits, target, scale)?;
            return Ok((loss, with_grad.then_some(logits)));
        }
        // One fused log-softmax pass over this rank's slice of the vocabulary.
        let mut log_probs = logits.log_softmax(-1, Kind::Float);
        let (local_target, inside) = self.local_targets(target, logits.size()[1]);
        if self.group.size() > 1 {
            // Each rank's slice is normalised by its own partition function: shift every row
            // by the difference to the global one, `log Σ_ranks exp(lse_rank)`.
            let local_lse = local_log_partition(&logits, &log_probs);
            let global_lse = local_lse.copy();
            self.group.all_reduce(&global_lse, ReduceOp::Max)?;
            let sum_exp = (&local_lse - &global_lse).exp();
            self.group.all_reduce(&sum_exp, ReduceOp::Sum)?;
            let shift = local_lse - (global_lse + sum_exp.log());
            let _ = log_probs.g_add_(&shift.unsqueeze(-1));
        }
        let target_log_probs = log_probs.gather(-1, &local_target, false);
        let loss = target_log_probs
            .squeeze_dim(-1)
            .masked_fill(&inside.logical_not().squeeze_dim(-1), 0.0);
        if self.group.size() > 1 {
            self.group.all_reduce(&loss, ReduceOp::Sum)?;
        }
        let loss = loss.neg();
        if !with_grad {
            return Ok((loss, None));
        }
        // The softmax is written in the logits' dtype by the exponential itself (one pass); the
        // targets' entries are overwritten with `p - 1` computed in float32 (a target on another
        // rank rewrites entry 0 with its own value): every entry is rounded once, as in the
        // unfused path.
        let scale = held_gradient_scale(logits.kind());
        if scale != 1.0 {
            let _ = log_probs.g_add_scalar_(scale.ln());
        }
        let mut grad = logits.empty_like();
        let _ = log_probs.exp_out(&grad);
        let target_grad =
            ((target_log_probs.exp() - inside.to_kind(Kind::Float)) * scale).to_kind(grad.kind());
        let _ = grad.scatter_(-1, &local_target, &target_grad);
        Ok((loss, Some(grad)))
    }

    /// Each target's column `[c, 1]` in this rank's slice of `local_vocab` entries (0 where it
    /// lies on another rank) and whether it lies here.
    fn local_targets(&self, target: &Tensor, local_vocab: i64) -> (Tensor, Tensor) {
        let local = (target - self.group.rank() as i64 * local_vocab).unsqueeze(-1);
        let inside = local.ge(0).logical_and(&local.lt(local_vocab));
        (local.masked_fill(&inside.logical_not(), 0), inside)
    }

    /// The masked loss sum without gradients (evaluation), still chunk by chunk.
    fn loss_only(&self, hidden: &Tensor) -> Result<Tensor> {
        let tokens = hidden.size()[0];
        let losses = Tensor::empty([tokens], (Kind::Float, hidden.device()));
        for (start, length) in self.chunks(tokens) {
            let target = self.target.narrow(0, start, length);
            let (loss, _) = self.chunk_loss(&hidden.narrow(0, start, length), &target, false)?;
            losses.narrow(0, start, length).copy_(&loss);
        }
        Ok((losses * &self.token_weights).sum(Kind::Float))
    }
}

impl CustomFunction for FusedOutputCrossEntropy {
    fn forward(&mut self, inputs: &[Tensor], _saved: &mut SavedTensors) -> Result<Vec<Tensor>> {
        let hidden_shape = inputs[0].size();
        let h = *hidden_shape.last().expect("[s, b, h]");
        let hidden = inputs[0].reshape([-1, h]);
        let tokens = hidden.size()[0];
        let (kind, device) = (hidden.kind(), hidden.device());
        let local_vocab = self.weight.size()[0];
        let losses = Tensor::empty([tokens], (Kind::Float, device));
        let grad_hidden = Tensor::empty([tokens, h], (kind, device));
        // Written by the first chunk's product (no zero fill of a vocabulary-sized buffer).
        let mut grad_weight: Option<Tensor> = None;
        let grad_bias = self
            .bias
            .as_ref()
            .map(|_| Tensor::zeros([1, local_vocab], (Kind::Float, device)));
        for (start, length) in self.chunks(tokens) {
            let input = hidden.narrow(0, start, length);
            let target = self.target.narrow(0, start, length);
            let (loss, grad) = self.chunk_loss(&input, &target, true)?;
            let grad = grad.expect("asked for");
            losses.narrow(0, start, length).copy_(&loss);
            // Row i of every gradient is token i's weight times its unweighted row: the weights
            // scale the [chunk, h] operands and results instead of the [chunk, V/t] gradient.
            // (In the activations' dtype, which holds a loss mask's 0 and 1 exactly.)
            let token_weights = self.token_weights.narrow(0, start, length).to_kind(kind);
            let row_weights = token_weights.unsqueeze(-1);
            if let Some(grad_bias) = &grad_bias {
                accumulate_product(grad_bias, &token_weights.unsqueeze(0), &grad)?;
            }
            let mut grad_input = grad_hidden.narrow(0, start, length);
            let _ = grad.mm_out(&grad_input, &self.weight);
            let _ = grad_input.g_mul_(&row_weights);
            let weighted_input = &input * &row_weights;
            grad_weight = Some(match grad_weight {
                None => product_in_float(&grad.tr(), &weighted_input)?,
                Some(sum) => {
                    accumulate_product(&sum, &grad.tr(), &weighted_input)?;
                    sum
                }
            });
        }
        let grad_weight =
            grad_weight.unwrap_or_else(|| Tensor::zeros([local_vocab, h], (Kind::Float, device)));
        self.grads = Some(UnscaledGrads {
            hidden: grad_hidden,
            hidden_shape,
            weight: grad_weight,
            bias: grad_bias,
        });
        Ok(vec![(losses * &self.token_weights).sum(Kind::Float)])
    }

    fn backward(
        &mut self,
        grad_outputs: &[Tensor],
        _saved: &[Tensor],
    ) -> Result<Vec<Option<Tensor>>> {
        let grads = self
            .grads
            .take()
            .context("the fused output cross entropy's backward ran twice")?;
        let scale = &grad_outputs[0] / held_gradient_scale(grads.hidden.kind());
        let grad_hidden = (grads.hidden * &scale).view(grads.hidden_shape.as_slice());
        // Scaled as it is added: one pass over the vocabulary-sized buffers, not two.
        let grad_weight = match &self.weight_main_grad {
            Some(main_grad) => {
                let _ = main_grad
                    .shallow_clone()
                    .f_addcmul_(&grads.weight, &scale)?;
                main_grad.accumulated();
                None
            }
            None => Some((grads.weight * &scale).to_kind(self.weight.kind())),
        };
        let mut out = vec![Some(grad_hidden), grad_weight];
        if let (Some(bias), Some(grad_bias)) = (&self.bias, grads.bias) {
            out.push(Some((grad_bias * &scale).view([-1]).to_kind(bias.kind())));
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cross_entropy::cross_entropy;
    use megatron_parallel::SingleRank;
    use tch::Device;

    /// Deterministic values without the global generator, which parallel tests share.
    fn values(shape: &[i64], seed: f64, kind: Kind) -> Tensor {
        let count: i64 = shape.iter().product();
        let t = Tensor::arange(count, (Kind::Double, Device::Cpu));
        ((t * (0.37 + seed)).sin() * 2.0).view(shape).to_kind(kind)
    }

    struct Case {
        hidden: Tensor,
        weight: Param,
        bias: Param,
        labels: Tensor,
        mask: Tensor,
    }

    /// 5 positions × 2 sequences, hidden size 4, a vocabulary of 11; a mask with zeros and a
    /// non-binary weight.
    fn case(kind: Kind) -> Case {
        case_on(kind, Device::Cpu)
    }

    fn case_on(kind: Kind, device: Device) -> Case {
        let (s, b, h, v) = (5, 2, 4, 11);
        let labels = (Tensor::arange(b * s, (Kind::Int64, Device::Cpu)) * 7).remainder(v);
        let mask = Tensor::from_slice(&[1.0f32, 1.0, 0.0, 1.0, 0.5, 1.0, 0.0, 1.0, 1.0, 1.0]);
        Case {
            hidden: values(&[s, b, h], 1.0, kind)
                .to_device(device)
                .set_requires_grad(true),
            weight: Param::new(values(&[v, h], 2.0, kind).to_device(device)),
            bias: Param::new(values(&[v], 3.0, kind).to_device(device)),
            labels: labels.view([b, s]).to_device(device),
            mask: mask.view([b, s]).to_device(device),
        }
    }

    /// The fused loss of `c` in chunks of `chunk` tokens.
    fn fused_loss(c: &Case, chunk: i64) -> Tensor {
        let group: Arc<dyn Communicator> = Arc::new(SingleRank);
        fused_output_cross_entropy(
            &c.hidden,
            &c.weight,
            Some(&c.bias),
            &c.labels,
            &c.mask,
            &group,
            Some(chunk),
        )
        .unwrap()
    }

    /// The loss (times an upstream gradient that is not 1) and the gradients of the hidden
    /// states, weight and bias.
    fn run(c: &Case, fused: Option<i64>) -> (f64, Tensor, Tensor, Tensor) {
        let group: Arc<dyn Communicator> = Arc::new(SingleRank);
        let loss = match fused {
            Some(chunk) => fused_loss(c, chunk),
            None => {
                let logits = c.hidden.linear(c.weight.tensor(), Some(c.bias.tensor()));
                (cross_entropy(&logits, &c.labels, &group).unwrap() * &c.mask).sum(Kind::Float)
            }
        };
        let grads = Tensor::run_backward(
            &[&loss * 0.37],
            &[&c.hidden, c.weight.tensor(), c.bias.tensor()],
            false,
            false,
        );
        (
            loss.double_value(&[]),
            grads[0].to_kind(Kind::Float),
            grads[1].to_kind(Kind::Float),
            grads[2].to_kind(Kind::Float),
        )
    }

    fn relative_difference(a: &Tensor, b: &Tensor) -> f64 {
        let scale = b.abs().max().double_value(&[]).max(f64::MIN_POSITIVE);
        (a - b).abs().max().double_value(&[]) / scale
    }

    #[test]
    fn loss_and_every_gradient_equal_the_unfused_path_for_any_chunking() {
        let c = case(Kind::Float);
        let (loss, hidden, weight, bias) = run(&c, None);
        // One chunk, uneven chunks (the last is shorter), one token per chunk.
        for chunk in [16, 3, 1] {
            let (f_loss, f_hidden, f_weight, f_bias) = run(&case(Kind::Float), Some(chunk));
            assert!(
                (f_loss - loss).abs() <= 1e-6 * loss.abs(),
                "chunk {chunk}: loss {f_loss} vs {loss}"
            );
            for (name, fused, plain) in [
                ("hidden", &f_hidden, &hidden),
                ("weight", &f_weight, &weight),
                ("bias", &f_bias, &bias),
            ] {
                let difference = relative_difference(fused, plain);
                assert!(
                    difference < 1e-6,
                    "chunk {chunk}: {name} gradient differs by {difference:e}"
                );
            }
        }
    }

    #[test]
    fn a_masked_token_contributes_nothing() {
        let c = case(Kind::Float);
        let (_, hidden, ..) = run(&c, Some(3));
        // Mask index [1, 1] (sequence 1, position 1) is row s·b = 1·2 + 1 of the hidden states.
        assert_eq!(c.mask.double_value(&[1, 1]), 0.0);
        assert_eq!(hidden.get(1).get(1).abs().max().double_value(&[]), 0.0);
        assert!(hidden.get(0).get(1).abs().max().double_value(&[]) > 0.0);
    }

    #[test]
    fn bfloat16_gradients_agree_to_bfloat16_precision() {
        let (loss, hidden, weight, bias) = run(&case(Kind::BFloat16), None);
        let (f_loss, f_hidden, f_weight, f_bias) = run(&case(Kind::BFloat16), Some(3));
        assert!((f_loss - loss).abs() <= 1e-3 * loss.abs());
        for (fused, plain) in [(&f_hidden, &hidden), (&f_weight, &weight), (&f_bias, &bias)] {
            assert!(relative_difference(fused, plain) < 2e-2);
        }
    }

    /// On a GPU the weight and bias gradients accumulate through cuBLAS GEMMs with bf16 inputs
    /// and a float32 output: the same gradients as the unfused path to bf16 precision, the
    /// weight's in its main-gradient view.
    #[test]
    fn on_a_gpu_bfloat16_gradients_agree_with_the_unfused_path() {
        if !tch::Cuda::is_available() {
            eprintln!("skipped: no CUDA device");
            return;
        }
        let device = Device::Cuda(0);
        let (loss, hidden, weight, bias) = run(&case_on(Kind::BFloat16, device), None);
        let (f_loss, f_hidden, f_weight, f_bias) = run(&case_on(Kind::BFloat16, device), Some(3));
        assert!((f_loss - loss).abs() <= 1e-3 * loss.abs());
        for (fused, plain) in [(&f_hidden, &hidden), (&f_weight, &weight), (&f_bias, &bias)] {
            assert!(relative_difference(fused, plain) < 2e-2);
        }
        let c = case_on(Kind::BFloat16, device);
        let main_grad = Tensor::zeros([11, 4], (Kind::Float, device));
        c.weight.main_grad().set(Some(main_grad.shallow_clone()));
        run_backward_only(&c);
        assert!(relative_difference(&main_grad, &weight) < 2e-2);
    }

    /// Float16 with a vocabulary entry of probability ~3e-7, far below float16's smallest
    /// normal number (6e-5): its weight gradient (tiny, but Adam normalises every entry),
    /// accumulated into a float32 main gradient, still agrees with a float64 computation from
    /// the same inputs to float16 precision. Held unscaled between the passes, its
    /// probabilities would be subnormal and the gradient off by over 10%.
    #[test]
    fn float16_gradients_keep_tiny_probabilities() {
        let case_in = |kind: Kind| {
            let mut c = case(Kind::Half);
            let bias = c.bias.tensor().detach();
            let _ = bias.get(4).fill_(-13.0);
            c.bias = Param::new(bias.to_kind(kind));
            c.weight = Param::new(c.weight.tensor().detach().to_kind(kind));
            c.hidden = c.hidden.detach().to_kind(kind).set_requires_grad(true);
            c
        };
        let exact = run(&case_in(Kind::Double), None)
            .2
            .get(4)
            .to_kind(Kind::Double);
        assert!(exact.abs().max().double_value(&[]) < 1e-6);
        let c = case_in(Kind::Half);
        let main_grad = Tensor::zeros([11, 4], (Kind::Float, Device::Cpu));
        c.weight.main_grad().set(Some(main_grad.shallow_clone()));
        run_backward_only(&c);
        let fused = main_grad.get(4).to_kind(Kind::Double);
        let worst = ((&fused - &exact).abs() / exact.abs())
            .max()
            .double_value(&[]);
        assert!(worst < 2e-2, "an entry differs by {worst:e} (relative)");
    }

    #[test]
    fn a_main_gradient_view_receives_the_weight_gradient() {
        let (_, _, weight, _) = run(&case(Kind::Float), None);
        let c = case(Kind::Float);
        let main_grad = Tensor::ones([11, 4], (Kind::Float, Device::Cpu));
        c.weight.main_grad().set(Some(main_grad.shallow_clone()));
        run_backward_only(&c);
        assert!(!c.weight.grad().defined());
        assert!(relative_difference(&(main_grad - 1.0), &weight) < 1e-6);
    }

    fn run_backward_only(c: &Case) {
        (fused_loss(c, 4) * 0.37).backward();
    }

    #[test]
    fn tied_weights_sum_the_embedding_and_output_gradients() {
        // The hidden states are an embedding lookup of the output weight itself.
        let tokens = Tensor::from_slice(&[3i64, 1, 4, 1, 5, 9, 2, 6, 5, 3]).view([5, 2]);
        let group: Arc<dyn Communicator> = Arc::new(SingleRank);
        let tied_loss = |fused: bool| {
            let c = case(Kind::Float);
            let hidden = Tensor::embedding(c.weight.tensor(), &tokens, -1, false, false);
            let loss = if fused {
                fused_output_cross_entropy(
                    &hidden,
                    &c.weight,
                    None,
                    &c.labels,
                    &c.mask,
                    &group,
                    Some(3),
                )
                .unwrap()
            } else {
                let logits = hidden.linear::<&Tensor>(c.weight.tensor(), None);
                (cross_entropy(&logits, &c.labels, &group).unwrap() * &c.mask).sum(Kind::Float)
            };
            loss.backward();
            c.weight.grad().copy()
        };
        let difference = relative_difference(&tied_loss(true), &tied_loss(false));
        assert!(difference < 1e-6, "tied gradient differs by {difference:e}");
    }

    #[test]
    fn a_frozen_output_weight_still_passes_the_gradient_to_the_hidden_states() {
        let c = case(Kind::Float);
        let (_, hidden, ..) = run(&c, None);
        let frozen = case(Kind::Float);
        let _ = frozen
            .weight
            .tensor()
            .shallow_clone()
            .set_requires_grad(false);
        let _ = frozen
            .bias
            .tensor()
            .shallow_clone()
            .set_requires_grad(false);
        (fused_loss(&frozen, 3) * 0.37).backward();
        assert!(relative_difference(&frozen.hidden.grad(), &hidden) < 1e-6);
    }

    #[test]
    fn without_gradients_only_the_loss_is_computed() {
        let c = case(Kind::Float);
        let (loss, ..) = run(&c, None);
        let evaluated = tch::no_grad(|| fused_loss(&c, 3));
        assert!(!evaluated.requires_grad());
        assert!((evaluated.double_value(&[]) - loss).abs() <= 1e-6 * loss.abs());
    }

    #[test]
    fn a_chunk_holds_a_fraction_of_the_logits_of_gpt_sized_models() {
        // GPT-345M and 1.3B at micro-batch 8 × 1024 tokens, vocabulary 50304 on one rank:
        // the largest [chunk, V] buffer is a quarter of the full logits on libtorch's path.
        assert_eq!(default_chunk_tokens(8192, 50304, 1024, false), 2048);
        assert_eq!(default_chunk_tokens(8192, 50304, 2048, false), 2048);
        // With the gradient written over the bf16 logits: half, and all of them.
        assert_eq!(default_chunk_tokens(8192, 50304, 1024, true), 4096);
        assert_eq!(default_chunk_tokens(8192, 50304, 2048, true), 8192);
        // A power of two, at least one token.
        assert_eq!(default_chunk_tokens(10, 11, 4, false), 16);
        assert_eq!(default_chunk_tokens(1, 1 << 20, 4, true), 1);
    }
}

/// Peak memory, measured in child processes of the test binary (a process's peak resident size
/// is all Linux keeps, so each path gets a fresh process).
#[cfg(all(test, target_os = "linux"))]
mod peak_memory {
    use super::*;
    use crate::cross_entropy::cross_entropy;
    use megatron_parallel::SingleRank;
    use std::process::Command;
    use tch::Device;

    const PROBE: &str = "MEGATRON_RS_LOSS_MEMORY_PROBE";

    /// The harness's name of the test below: its module path without the crate, so that the
    /// probe still finds it when the module moves.
    fn test_name() -> String {
        let module = module_path!();
        let module = module.split_once("::").map_or(module, |(_, inside)| inside);
        format!("{module}::the_fused_loss_peaks_far_below_the_unfused_one")
    }

    /// 1024 tokens, a vocabulary of 32768, hidden size 64: the float32 logits are 128 MiB.
    fn loss_and_backward(fused: bool) {
        let (s, b, h, v) = (512, 2, 64, 32768);
        let hidden =
            (Tensor::randn([s, b, h], (Kind::Float, Device::Cpu)) * 0.1).set_requires_grad(true);
        let weight = Param::new(Tensor::randn([v, h], (Kind::Float, Device::Cpu)) * 0.1);
        let labels = Tensor::randint(v, [b, s], (Kind::Int64, Device::Cpu));
        let mask = Tensor::ones([b, s], (Kind::Float, Device::Cpu));
        let group: Arc<dyn Communicator> = Arc::new(SingleRank);
        let loss = if fused {
            fused_output_cross_entropy(&hidden, &weight, None, &labels, &mask, &group, None)
                .unwrap()
        } else {
            let logits = hidden.linear::<&Tensor>(weight.tensor(), None);
            (cross_entropy(&logits, &labels, &group).unwrap() * &mask).sum(Kind::Float)
        };
        loss.backward();
        assert!(hidden.grad().defined() && weight.grad().defined());
    }

    /// The peak resident size of this process, in KiB.
    fn peak_kib() -> u64 {
        let status = std::fs::read_to_string("/proc/self/status").unwrap();
        let line = status.lines().find(|l| l.starts_with("VmHWM:")).unwrap();
        line.split_whitespace().nth(1).unwrap().parse().unwrap()
    }

    fn child_peak(path: &str) -> u64 {
        let output = Command::new(std::env::current_exe().unwrap())
            .args([
                &test_name(),
                "--exact",
                "--nocapture",
                "--test-threads",
                "1",
            ])
            .env(PROBE, path)
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&output.stdout);
        assert!(output.status.success(), "{path} probe failed: {stdout}");
        // The test harness prints the test's name on the same line.
        let after = stdout
            .split("peak_kib=")
            .nth(1)
            .unwrap_or_else(|| panic!("no peak from the {path} probe: {stdout}"));
        let digits: String = after.chars().take_while(char::is_ascii_digit).collect();
        digits.parse().unwrap()
    }

    #[test]
    fn the_fused_loss_peaks_far_below_the_unfused_one() {
        if let Ok(path) = std::env::var(PROBE) {
            loss_and_backward(path == "fused");
            println!("peak_kib={}", peak_kib());
            return;
        }
        let (fused, unfused) = (child_peak("fused"), child_peak("unfused"));
        eprintln!("peak resident size: fused {fused} KiB, unfused {unfused} KiB");
        // The unfused path holds the logits, their float32 log-softmax and the logits'
        // gradient (128 MiB each); the fused one a few chunks of 8 MiB.
        assert!(
            fused + 200 * 1024 < unfused,
            "fused {fused} KiB vs unfused {unfused} KiB"
        );
    }
}
