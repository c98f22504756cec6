//! `--moe-grouped-gemm`: the local experts' fc1, and then their fc2, as one grouped GEMM each
//! over all the routed tokens (libtorch's `_grouped_mm`, CUTLASS on Hopper), in place of one
//! GEMM per expert. The experts keep their own parameters (the names and checkpoints of the
//! per-expert loop); the kernel takes each linear's as one `[experts, out, in]` operand, a view
//! of the storage they share ([`expert_stack`](super::expert_stack)), whose backward hands each
//! expert its weight gradient.

use anyhow::Result;
use tch::{Device, Kind, Tensor};

use super::expert_stack::{self, GroupOrder};
use crate::layers::mlp::Mlp;

/// Whether libtorch's grouped GEMM takes these experts over `tokens`: bias-free experts
/// outside fp8, bf16 on a GPU (float32, bf16 or fp16 on the CPU), and rows of every operand a
/// multiple of 16 bytes. Elsewhere the experts run one after the other, with the same results.
pub fn takes(experts: &[Mlp], tokens: &Tensor) -> bool {
    let Some(first) = experts.first() else {
        return false;
    };
    let kind = tokens.kind();
    let plain = experts.iter().all(|expert| {
        let (fc1, fc2) = (&expert.linear_fc1, &expert.linear_fc2);
        fc1.bias.is_none()
            && fc2.bias.is_none()
            && fc1.fp8().is_none()
            && fc2.fp8().is_none()
            && fc1.weight.kind() == kind
            && fc2.weight.kind() == kind
    });
    let fc1 = first.linear_fc1.weight.size();
    let widths = [fc1[0], fc1[1], first.linear_fc2.weight.size()[1]];
    plain && kernel_takes(kind, tokens.device(), &widths)
}

/// Whether libtorch's grouped GEMM runs in `kind` on `device` over operands whose rows are
/// `widths` elements wide: bf16 on a GPU (float32, bf16 or fp16 on the CPU), every row a
/// multiple of 16 bytes.
pub fn kernel_takes(kind: Kind, device: Device, widths: &[i64]) -> bool {
    let kind_runs = match device {
        Device::Cpu => matches!(kind, Kind::Float | Kind::BFloat16 | Kind::Half),
        Device::Cuda(_) => kind == Kind::BFloat16,
        _ => false,
    };
    let bytes = kind.elt_size_in_bytes() as i64;
    kind_runs && widths.iter().all(|width| width * bytes % 16 == 0)
}

/// The local experts' fc1 and fc2 weights as the kernel's operands, their groups in `order`.
pub struct StackedWeights {
    fc1: Tensor,
    fc2: Tensor,
    pub order: GroupOrder,
}

impl StackedWeights {
    /// `experts`' weights, in the order they lie in memory when `any_order` (the same for both
    /// linears), else ascending.
    pub fn of(experts: &[Mlp], any_order: bool) -> Result<Self> {
        let fc1: Vec<_> = experts.iter().map(|e| &e.linear_fc1.weight).collect();
        let fc2: Vec<_> = experts.iter().map(|e| &e.linear_fc2.weight).collect();
        let (fc1_operand, fc1_order) = expert_stack::stacked(&fc1, any_order)?;
        let (fc2_operand, fc2_order) = expert_stack::stacked(&fc2, any_order)?;
        if fc1_order == fc2_order {
            return Ok(StackedWeights {
                fc1: fc1_operand,
                fc2: fc2_operand,
                order: fc1_order,
            });
        }
        Ok(StackedWeights {
            fc1: expert_stack::stacked(&fc1, false)?.0,
            fc2: expert_stack::stacked(&fc2, false)?.0,
            order: GroupOrder::Ascending,
        })
    }
}

/// The experts over `tokens` `[assignments, h]` grouped expert by expert in `weights`' order,
/// group g's rows ending at `ends[g]` (int32, cumulative): fc1, the activation (`expert`'s),
/// each row scaled by its router probability `probs` `[assignments]`, fc2, as the per-expert
/// loop computes them.
pub fn forward(
    expert: &Mlp,
    weights: &StackedWeights,
    tokens: &Tensor,
    probs: &Tensor,
    ends: &Tensor,
) -> Result<Tensor> {
    let intermediate = grouped_linear(tokens, &weights.fc1, ends)?;
    let activated = expert.activate(&intermediate);
    let scaled = (&activated * probs.unsqueeze(-1)).to_kind(activated.kind());
    grouped_linear(&scaled, &weights.fc2, ends)
}

/// Each group of rows of `input` `[rows, in]` times its weight of `weights` `[groups, out, in]`,
/// transposed: `[rows, out]`.
fn grouped_linear(input: &Tensor, weights: &Tensor, ends: &Tensor) -> Result<Tensor> {
    Ok(input.contiguous().f_internal_grouped_mm(
        &weights.transpose(1, 2),
        Some(ends),
        None,
        None,
    )?)
}
