//! The local experts' weights of one linear as the `[experts, out, in]` operand of the grouped
//! GEMM, without copying them. Each expert keeps its own parameter (its checkpoint name, its
//! slot in the optimizer's buffers, the per-expert loop's weight), but the experts of a linear
//! lie evenly spaced in one storage: the layer allocates them as one stack
//! ([`share_one_storage`]), and the optimizer's flat buffer, which takes the parameters in
//! Megatron's order (reversed: the last expert first), keeps them so unless a bucket's padding
//! falls between them. The operand is then a strided view of that storage, its groups in the
//! storage's order (descending experts in the optimizer's buffer), and its backward hands each
//! expert its slice of the operand's gradient. Weights that do not lie so are stacked by a copy
//! (as before, in ascending order).

use anyhow::Result;
use tch::Tensor;

use megatron_kernels::autograd::{self, CustomFunction, SavedTensors};

use crate::param::Param;

/// The order of the experts' groups in an operand: the tokens must be grouped alike.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GroupOrder {
    /// Local expert 0 first.
    Ascending,
    /// The last local expert first.
    Descending,
}

/// How the experts' weights lie in memory, when evenly spaced in one storage.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Spacing {
    order: GroupOrder,
    /// Elements from one group's weight to the next's.
    step: i64,
}

/// Where `weights` (one per expert, in expert order) lie evenly spaced, contiguous and apart, at
/// 16-byte boundaries (the grouped kernel's loads need them), or `None`. Whether they share one
/// storage is left to the view's bounds check.
fn spacing(weights: &[&Tensor]) -> Option<Spacing> {
    let first = weights.first()?;
    let (shape, kind, device) = (first.size(), first.kind(), first.device());
    let numel: i64 = shape.iter().product();
    let alike = weights.iter().all(|w| {
        w.size() == shape && w.kind() == kind && w.device() == device && w.is_contiguous()
    });
    if !alike || numel == 0 {
        return None;
    }
    let address = |w: &Tensor| w.data_ptr() as i64;
    if address(first) % 16 != 0 {
        return None;
    }
    let [_, second, ..] = weights else {
        return Some(Spacing {
            order: GroupOrder::Ascending,
            step: numel,
        });
    };
    let bytes = kind.elt_size_in_bytes() as i64;
    let step_bytes = address(second) - address(first);
    let even = weights
        .windows(2)
        .all(|pair| address(pair[1]) - address(pair[0]) == step_bytes);
    if !even || step_bytes % 16 != 0 || (step_bytes / bytes).abs() < numel {
        return None;
    }
    Some(Spacing {
        order: if step_bytes > 0 {
            GroupOrder::Ascending
        } else {
            GroupOrder::Descending
        },
        step: (step_bytes / bytes).abs(),
    })
}

/// The operand over `weights` (in expert order) as one view of their storage, its groups in
/// `spacing`'s order; `None` when the view would leave the first group's storage (the weights
/// lie apart).
fn view(weights: &[Tensor], spacing: Spacing) -> Option<Tensor> {
    let lowest = match spacing.order {
        GroupOrder::Ascending => weights.first()?,
        GroupOrder::Descending => weights.last()?,
    };
    let mut size = vec![weights.len() as i64];
    size.extend(lowest.size());
    let mut strides = vec![spacing.step];
    strides.extend(lowest.stride());
    // Detached again, so that the custom function's output is no view in autograd's eyes.
    let view = lowest.detach().f_as_strided(size, strides, None).ok()?;
    Some(view.detach())
}

/// The experts' weights `[out, in]` as one `[experts, out, in]` operand: a view of their
/// storage in its order when they lie evenly spaced in one (in descending order only when
/// `any_order`), else a copy in ascending order.
pub fn stacked(weights: &[&Param], any_order: bool) -> Result<(Tensor, GroupOrder)> {
    let tensors: Vec<&Tensor> = weights.iter().map(|w| w.tensor()).collect();
    let spacing = spacing(&tensors).filter(|s| any_order || s.order == GroupOrder::Ascending);
    if let Some(spacing) = spacing {
        let owned: Vec<Tensor> = tensors.iter().map(|t| t.shallow_clone()).collect();
        if view(&owned, spacing).is_some() {
            let mut outputs = autograd::apply(StorageView { spacing }, &tensors)?;
            return Ok((outputs.remove(0), spacing.order));
        }
    }
    Ok((Tensor::stack(&tensors, 0), GroupOrder::Ascending))
}

/// The view as an autograd node over the experts' weights: its gradient's groups go back to
/// their experts.
struct StorageView {
    spacing: Spacing,
}

impl CustomFunction for StorageView {
    fn forward(&mut self, inputs: &[Tensor], _: &mut SavedTensors) -> Result<Vec<Tensor>> {
        let view = view(inputs, self.spacing)
            .ok_or_else(|| anyhow::anyhow!("the experts' weights moved out of one storage"))?;
        Ok(vec![view])
    }

    fn backward(&mut self, grads: &[Tensor], _: &[Tensor]) -> Result<Vec<Option<Tensor>>> {
        let groups = grads[0].size()[0];
        Ok((0..groups)
            .map(|expert| {
                let group = match self.spacing.order {
                    GroupOrder::Ascending => expert,
                    GroupOrder::Descending => groups - 1 - expert,
                };
                Some(grads[0].select(0, group))
            })
            .collect())
    }
}

/// Moves `weights` (one per expert, of one shape) into one `[experts, out, in]` allocation,
/// each expert's parameter a slice of it, so that the grouped GEMM views them without a copy.
pub fn share_one_storage(weights: &mut [&mut Param]) {
    let stack = tch::no_grad(|| {
        Tensor::stack(
            &weights
                .iter()
                .map(|w| w.tensor().detach())
                .collect::<Vec<_>>(),
            0,
        )
    });
    for (e, weight) in weights.iter_mut().enumerate() {
        **weight = Param::new(stack.select(0, e as i64).detach());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::{Device, Kind};

    fn params(count: i64) -> Vec<Param> {
        (0..count)
            .map(|e| Param::new(Tensor::full([4, 2], e as f64, (Kind::Float, Device::Cpu))))
            .collect()
    }

    /// Weights in one allocation are viewed in their order, weights apart are copied, and the
    /// view's gradient reaches each expert as the copy's does.
    #[test]
    fn weights_in_one_storage_are_viewed_in_its_order() {
        let mut apart = params(3);
        let (copy, order) = stacked(&apart.iter().collect::<Vec<_>>(), true).unwrap();
        assert_eq!(order, GroupOrder::Ascending);
        assert_ne!(copy.data_ptr(), apart[0].data_ptr());

        let mut together = params(3);
        share_one_storage(&mut together.iter_mut().collect::<Vec<_>>());
        let (view, order) = stacked(&together.iter().collect::<Vec<_>>(), true).unwrap();
        assert_eq!(order, GroupOrder::Ascending);
        assert_eq!(view.data_ptr(), together[0].data_ptr());
        assert!(view.equal(&copy));

        // As the optimizer lays them out: the last expert first, at aligned offsets.
        let buffer = Tensor::zeros([4 + 3 * 12], (Kind::Float, Device::Cpu));
        for (slot, param) in apart.iter_mut().rev().enumerate() {
            let place = buffer.narrow(0, 4 + slot as i64 * 12, 8).view([4, 2]);
            tch::no_grad(|| place.shallow_clone().copy_(param.tensor()));
            let mut tensor = param.tensor().shallow_clone();
            tensor.set_data(&place);
        }
        let (reversed, order) = stacked(&apart.iter().collect::<Vec<_>>(), true).unwrap();
        assert_eq!(order, GroupOrder::Descending);
        assert_eq!(reversed.data_ptr(), apart[2].data_ptr());
        assert!(reversed.equal(&copy.flip([0])));
        let weights = Tensor::from_slice(&[1.0f32, 10.0, 100.0]).view([3, 1, 1]);
        (&reversed * &weights).sum(Kind::Float).backward();
        for (e, param) in apart.iter().enumerate() {
            let expected = [100.0, 10.0, 1.0][e];
            assert_eq!(
                Vec::<f32>::try_from(&param.grad().view([-1])).unwrap(),
                [expected as f32; 8],
                "expert {e}"
            );
        }
        // Ascending only, when asked: a copy.
        let (copied, order) = stacked(&apart.iter().collect::<Vec<_>>(), false).unwrap();
        assert_eq!(order, GroupOrder::Ascending);
        assert!(copied.equal(&copy));
    }
}
