//! Parameter handles and their creation with Megatron's initialisation (spec §3.1).

use std::ops::Deref;
use std::sync::{Arc, Mutex, MutexGuard};

use tch::{Device, Kind, Tensor};

use megatron_kernels::rng::seeded_normal;

/// A parameter tensor. Cloning is shallow: clones share storage, gradient and main gradient,
/// which lets a recomputed block own its layers while the model keeps them too.
pub struct Param {
    tensor: Tensor,
    main_grad: MainGradSlot,
}

impl Param {
    /// Wraps `tensor` as a leaf that requires grad.
    pub fn new(tensor: Tensor) -> Self {
        Param {
            tensor: tensor.set_requires_grad(true),
            main_grad: MainGradSlot::default(),
        }
    }

    pub fn tensor(&self) -> &Tensor {
        &self.tensor
    }

    /// Where the optimizer wants this parameter's gradient accumulated directly (Megatron's
    /// `param.main_grad` with `--gradient-accumulation-fusion`).
    pub fn main_grad(&self) -> &MainGradSlot {
        &self.main_grad
    }
}

impl Clone for Param {
    fn clone(&self) -> Self {
        Param {
            tensor: self.tensor.shallow_clone(),
            main_grad: self.main_grad.clone(),
        }
    }
}

impl Deref for Param {
    type Target = Tensor;

    fn deref(&self) -> &Tensor {
        &self.tensor
    }
}

/// A float32 view of the optimizer's gradient buffer shaped like one parameter, shared by the
/// parameter's clones. While set, layers that support it add the parameter's gradient into
/// it during backward and leave `grad` undefined, saving a low-precision gradient, its
/// accumulation kernel and its zeroing.
#[derive(Clone, Default)]
pub struct MainGradSlot(Arc<Mutex<Option<MainGrad>>>);

impl MainGradSlot {
    pub fn set(&self, view: Option<Tensor>) {
        *self.lock() = view.map(|view| MainGrad {
            view,
            on_accumulated: None,
        });
    }

    /// Sets the view, and what a layer calls each time its backward has added a gradient into
    /// it: `--overlap-grad-reduce` counts these to start a bucket's reduction once the step's
    /// last gradient of every parameter in it is in.
    pub fn set_notifying(&self, view: Tensor, on_accumulated: Arc<dyn Fn() + Send + Sync>) {
        *self.lock() = Some(MainGrad {
            view,
            on_accumulated: Some(on_accumulated),
        });
    }

    /// The view, when the optimizer set one.
    pub fn get(&self) -> Option<MainGrad> {
        self.lock().clone()
    }

    fn lock(&self) -> MutexGuard<'_, Option<MainGrad>> {
        // A panic while holding this lock cannot leave the slot half-written.
        self.0
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

/// A parameter's main-gradient view (it dereferences to the float32 tensor). A layer that adds
/// into it calls [`MainGrad::accumulated`] once its additions are enqueued.
pub struct MainGrad {
    view: Tensor,
    on_accumulated: Option<Arc<dyn Fn() + Send + Sync>>,
}

impl MainGrad {
    /// Says that this backward pass's gradient was added (enqueued on the current stream).
    pub fn accumulated(&self) {
        if let Some(notify) = &self.on_accumulated {
            notify();
        }
    }
}

impl Clone for MainGrad {
    fn clone(&self) -> Self {
        MainGrad {
            view: self.view.shallow_clone(),
            on_accumulated: self.on_accumulated.clone(),
        }
    }
}

impl Deref for MainGrad {
    type Target = Tensor;

    fn deref(&self) -> &Tensor {
        &self.view
    }
}

/// Creates parameters the way Megatron does with `--use-cpu-initialization`: every draw is made
/// in float32 on the CPU over the *full* weight, and a tensor-parallel rank keeps its slice.
///
/// Each parameter draws from its own generator, seeded by the run's seed and the parameter's
/// global name (`decoder.layers.7.mlp.linear_fc1.weight`, with the global layer number). So the
/// same seed gives the same model for any tensor- or pipeline-parallel layout, on CPU and GPU,
/// whatever order the ranks build their layers in.
#[derive(Debug, Clone)]
pub struct Initializer {
    pub dtype: Kind,
    pub device: Device,
    pub tensor_parallel_rank: i64,
    pub tensor_parallel_size: i64,
    pub seed: u64,
    prefix: String,
}

impl Initializer {
    pub fn new(
        dtype: Kind,
        device: Device,
        tensor_parallel_rank: i64,
        tensor_parallel_size: i64,
        seed: u64,
    ) -> Self {
        Initializer {
            dtype,
            device,
            tensor_parallel_rank,
            tensor_parallel_size,
            seed,
            prefix: String::new(),
        }
    }

    /// An initializer whose parameter names start with `name.`.
    pub fn scope(&self, name: &str) -> Initializer {
        Initializer {
            prefix: format!("{}{name}.", self.prefix),
            ..self.clone()
        }
    }

    /// An initializer of parameters every rank holds whole, whatever the tensor parallelism
    /// (the routed experts, whose tensor parallelism is their own).
    pub fn whole(&self) -> Initializer {
        Initializer {
            tensor_parallel_rank: 0,
            tensor_parallel_size: 1,
            ..self.clone()
        }
    }

    /// N(0, std) over the whole `shape`.
    pub fn normal(&self, name: &str, shape: &[i64], std: f64) -> Param {
        self.place(self.full_normal(name, shape, std))
    }

    /// N(0, std) drawn over the full `shape`, keeping this rank's slice along `dim`.
    pub fn normal_partitioned(&self, name: &str, shape: &[i64], std: f64, dim: usize) -> Param {
        self.normal_partitioned_strided(name, shape, std, dim, 1)
    }

    /// Like [`normal_partitioned`](Self::normal_partitioned), with the full weight cut into
    /// `t · stride` pieces along `dim` of which rank r keeps pieces `r, r + t, …` (Megatron's
    /// `stride`): SwiGLU's fc1 `[gate; up]` gives rank r `[gate_r; up_r]`.
    pub fn normal_partitioned_strided(
        &self,
        name: &str,
        shape: &[i64],
        std: f64,
        dim: usize,
        stride: i64,
    ) -> Param {
        let full = self.full_normal(name, shape, std);
        let pieces = self.tensor_parallel_size * stride;
        let width = full.size()[dim] / pieces;
        let kept: Vec<Tensor> = (0..stride)
            .map(|s| {
                full.narrow(
                    dim as i64,
                    (s * self.tensor_parallel_size + self.tensor_parallel_rank) * width,
                    width,
                )
            })
            .collect();
        self.place(Tensor::cat(&kept, dim as i64))
    }

    pub fn constant(&self, shape: &[i64], value: f64) -> Param {
        self.place(Tensor::full(shape, value, (Kind::Float, Device::Cpu)))
    }

    /// A constant tensor of which this rank holds its slice along dimension 0.
    pub fn constant_partitioned(&self, shape: &[i64], value: f64) -> Param {
        let mut local = shape.to_vec();
        local[0] /= self.tensor_parallel_size;
        self.constant(&local, value)
    }

    fn place(&self, tensor: Tensor) -> Param {
        Param::new(
            tensor
                .contiguous()
                .to_kind(self.dtype)
                .to_device(self.device),
        )
    }

    fn full_normal(&self, name: &str, shape: &[i64], std: f64) -> Tensor {
        seeded_normal(
            shape,
            std,
            parameter_seed(self.seed, &format!("{}{name}", self.prefix)),
        )
    }
}

/// The generator seed of the parameter `name`: FNV-1a over the run's seed and the name.
pub fn parameter_seed(seed: u64, name: &str) -> u64 {
    let hash = megatron_kernels::fnv::fnv1a(seed.to_le_bytes().into_iter().chain(name.bytes()));
    // libtorch's CPU generator keeps 32 bits of its seed; fold the hash so all of it counts.
    (hash ^ (hash >> 32)) & 0xffff_ffff
}

#[cfg(test)]
mod tests {
    use super::*;

    fn initializer(rank: i64, size: i64) -> Initializer {
        Initializer::new(Kind::Float, Device::Cpu, rank, size, 1234).scope("decoder.layers.3")
    }

    #[test]
    fn draws_depend_on_seed_and_name_only() {
        let a = initializer(0, 1).normal("w", &[4, 3], 1.0);
        let b = initializer(0, 1).normal("w", &[4, 3], 1.0);
        let other = initializer(0, 1).normal("v", &[4, 3], 1.0);
        assert!(a.equal(&b));
        assert!(!a.equal(&other));
        let reseeded = Initializer::new(Kind::Float, Device::Cpu, 0, 1, 99)
            .scope("decoder.layers.3")
            .normal("w", &[4, 3], 1.0);
        assert!(!a.equal(&reseeded));
        assert!((a.std(false).double_value(&[]) - 1.0).abs() < 0.8);
    }

    #[test]
    fn tensor_parallel_shards_concatenate_to_the_full_weight() {
        let full = initializer(0, 1).normal("w", &[8, 6], 0.02);
        let rows: Vec<Tensor> = (0..2)
            .map(|r| {
                initializer(r, 2)
                    .normal_partitioned("w", &[8, 6], 0.02, 0)
                    .tensor()
                    .shallow_clone()
            })
            .collect();
        assert!(Tensor::cat(&rows, 0).equal(&full));
        let columns: Vec<Tensor> = (0..2)
            .map(|r| {
                initializer(r, 2)
                    .normal_partitioned("w", &[8, 6], 0.02, 1)
                    .tensor()
                    .shallow_clone()
            })
            .collect();
        assert!(Tensor::cat(&columns, 1).equal(&full));
        // Stride 2 over [gate; up]: rank r holds [gate_r; up_r].
        let strided = initializer(1, 2).normal_partitioned_strided("w", &[8, 6], 0.02, 0, 2);
        let expected = Tensor::cat(&[full.narrow(0, 2, 2), full.narrow(0, 6, 2)], 0);
        assert!(strided.equal(&expected));
    }
}
