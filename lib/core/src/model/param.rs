//! Parameter handles and their creation with Megatron's initialisation (spec §3.1).

use std::ops::Deref;

use tch::{Device, Kind, Tensor};

/// A parameter tensor. Cloning is shallow: clones share storage and gradient, which lets a
/// recomputed block own its layers while the model keeps them too.
pub struct Param(Tensor);

impl Param {
    /// Wraps `tensor` as a leaf that requires grad.
    pub fn new(tensor: Tensor) -> Self {
        Param(tensor.set_requires_grad(true))
    }

    pub fn tensor(&self) -> &Tensor {
        &self.0
    }
}

impl Clone for Param {
    fn clone(&self) -> Self {
        Param(self.0.shallow_clone())
    }
}

impl Deref for Param {
    type Target = Tensor;

    fn deref(&self) -> &Tensor {
        &self.0
    }
}

/// Creates parameters the way Megatron does with `--use-cpu-initialization`: every draw is made
/// in float32 from the CPU generator over the *full* weight, in module construction order, and
/// a tensor-parallel rank keeps its slice. The same seed therefore gives the same model for any
/// tensor-parallel size (spec §3.2), and the same model on CPU and GPU.
#[derive(Debug, Clone, Copy)]
pub struct Initializer {
    pub dtype: Kind,
    pub device: Device,
    pub tensor_parallel_rank: i64,
    pub tensor_parallel_size: i64,
}

impl Initializer {
    fn place(&self, tensor: Tensor) -> Param {
        Param::new(tensor.to_kind(self.dtype).to_device(self.device))
    }

    /// N(0, std) over the whole `shape`.
    pub fn normal(&self, shape: &[i64], std: f64) -> Param {
        self.place(full_normal(shape, std))
    }

    /// N(0, std) drawn over the full `shape`, keeping this rank's slice along `dim`.
    pub fn normal_partitioned(&self, shape: &[i64], std: f64, dim: usize) -> Param {
        let full = full_normal(shape, std);
        self.place(self.slice(&full, dim))
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

    fn slice(&self, full: &Tensor, dim: usize) -> Tensor {
        let width = full.size()[dim] / self.tensor_parallel_size;
        full.narrow(dim as i64, self.tensor_parallel_rank * width, width).contiguous()
    }
}

fn full_normal(shape: &[i64], std: f64) -> Tensor {
    let mut tensor = Tensor::empty(shape, (Kind::Float, Device::Cpu));
    let _ = tensor.normal_(0.0, std);
    tensor
}
