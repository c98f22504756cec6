//! libtorch's random generators: snapshots of the default generators, so that recomputed
//! activations replay exactly the dropout masks of the original forward pass, and Megatron's
//! model-parallel stream (its CUDA RNG tracker, spec §3.2).

use std::sync::{Arc, Mutex};

use crate::autograd::ffi;
use crate::TorchError;
use std::os::raw::c_int;
use tch::{Device, Tensor};

/// The state of the default generator of one device.
pub struct GeneratorState {
    device: Device,
    state: Tensor,
}

impl GeneratorState {
    pub fn capture(device: Device) -> Result<Self, TorchError> {
        let mut handle: ffi::TensorHandle = std::ptr::null_mut();
        // SAFETY: on success the shim writes a fresh handle we own.
        crate::error::check(unsafe { ffi::mrs_rng_get_state(device_index(device), &mut handle) })?;
        Ok(Self {
            device,
            state: unsafe { Tensor::from_ptr(handle) },
        })
    }

    /// The generator state as a uint8 tensor (what checkpoints store).
    pub fn tensor(&self) -> &Tensor {
        &self.state
    }

    /// A state previously taken from the generator of `device`.
    pub fn from_tensor(device: Device, state: Tensor) -> Self {
        Self { device, state }
    }

    pub fn restore(&self) -> Result<(), TorchError> {
        // SAFETY: the handle is live for the call; the generator copies the state.
        crate::error::check(unsafe {
            ffi::mrs_rng_set_state(device_index(self.device), ffi::handle(&self.state))
        })
    }
}

impl Clone for GeneratorState {
    fn clone(&self) -> Self {
        GeneratorState {
            device: self.device,
            state: self.state.copy(),
        }
    }
}

/// Reseeds the default generator of `device`.
pub fn manual_seed(device: Device, seed: u64) -> Result<(), TorchError> {
    // SAFETY: plain call; the shim locks the generator.
    crate::error::check(unsafe { ffi::mrs_rng_manual_seed(device_index(device), seed) })
}

/// The generator states of the CPU and of every CUDA device among `devices`, and of the
/// model-parallel stream.
pub struct RngSnapshot {
    defaults: Vec<GeneratorState>,
    model_parallel: Option<Tensor>,
}

impl RngSnapshot {
    pub fn capture(devices: impl IntoIterator<Item = Device>) -> Result<Self, TorchError> {
        let mut wanted = vec![Device::Cpu];
        for device in devices {
            if !wanted.contains(&device) {
                wanted.push(device);
            }
        }
        let defaults = wanted
            .into_iter()
            .map(GeneratorState::capture)
            .collect::<Result<_, _>>()?;
        Ok(RngSnapshot {
            defaults,
            model_parallel: model_parallel_rng_state()?,
        })
    }

    pub fn restore(&self) -> Result<(), TorchError> {
        self.defaults.iter().try_for_each(GeneratorState::restore)?;
        match (&self.model_parallel, model_parallel_generator()) {
            (Some(state), Some(stream)) => stream.set_state(state),
            _ => Ok(()),
        }
    }
}

/// A CUDA generator of its own (not a device's default one).
pub struct CudaGenerator {
    device: Device,
    handle: *mut ffi::GeneratorHandle,
}

// SAFETY: the shim locks the generator for every state access; the handle is freed once.
unsafe impl Send for CudaGenerator {}
unsafe impl Sync for CudaGenerator {}

impl CudaGenerator {
    fn new(device: Device, seed: u64) -> Result<Self, TorchError> {
        let mut handle = std::ptr::null_mut();
        // SAFETY: on success the shim writes a generator handle we own.
        crate::error::check(unsafe {
            ffi::mrs_cuda_generator_new(device_index(device), seed, &mut handle)
        })?;
        Ok(CudaGenerator { device, handle })
    }

    /// The state as a uint8 tensor (what checkpoints store).
    pub fn state(&self) -> Result<Tensor, TorchError> {
        let mut handle: ffi::TensorHandle = std::ptr::null_mut();
        // SAFETY: the generator is live; on success the shim writes a fresh tensor handle.
        crate::error::check(unsafe { ffi::mrs_generator_get_state(self.handle, &mut handle) })?;
        Ok(unsafe { Tensor::from_ptr(handle) })
    }

    pub fn set_state(&self, state: &Tensor) -> Result<(), TorchError> {
        // SAFETY: both handles are live for the call; the generator copies the state.
        crate::error::check(unsafe {
            ffi::mrs_generator_set_state(self.handle, ffi::handle(state))
        })
    }

    /// Makes the device's default generator draw from this generator's state until the returned
    /// generator (the default's previous state) is swapped back in.
    fn swap_into_default(&self) -> Result<CudaGenerator, TorchError> {
        let mut previous = std::ptr::null_mut();
        // SAFETY: the generator is live; on success the shim writes a handle we own.
        crate::error::check(unsafe {
            ffi::mrs_rng_swap_default_state(device_index(self.device), self.handle, &mut previous)
        })?;
        Ok(CudaGenerator {
            device: self.device,
            handle: previous,
        })
    }

    pub(crate) fn handle(&self) -> *mut ffi::GeneratorHandle {
        self.handle
    }
}

impl Drop for CudaGenerator {
    fn drop(&mut self) {
        // SAFETY: the handle came from the shim and is freed once.
        unsafe { ffi::mrs_generator_free(self.handle) }
    }
}

/// Megatron's `model-parallel-rng`: a CUDA stream seeded differently on every tensor-parallel
/// rank, for dropout on tensors that are split across them.
static MODEL_PARALLEL: Mutex<Option<Arc<CudaGenerator>>> = Mutex::new(None);

/// Seeds the model-parallel stream of `device` with `seed` (Megatron: `seed + 2718 + tp_rank`).
/// On the CPU there is one generator per process and no stream is kept: dropout everywhere
/// draws from the CPU generator.
pub fn seed_model_parallel_rng(device: Device, seed: u64) -> Result<(), TorchError> {
    if !device.is_cuda() {
        return Ok(());
    }
    *MODEL_PARALLEL.lock().unwrap() = Some(Arc::new(CudaGenerator::new(device, seed)?));
    Ok(())
}

/// The model-parallel stream, when one is seeded: a CUDA graph that forks to it during its
/// capture must register it.
pub fn model_parallel_generator() -> Option<Arc<CudaGenerator>> {
    MODEL_PARALLEL.lock().unwrap().clone()
}

/// The model-parallel stream's state, for checkpoints.
pub fn model_parallel_rng_state() -> Result<Option<Tensor>, TorchError> {
    model_parallel_generator()
        .map(|stream| stream.state())
        .transpose()
}

/// Restores a state from [`model_parallel_rng_state`] into the stream of `device`.
pub fn set_model_parallel_rng_state(device: Device, state: &Tensor) -> Result<(), TorchError> {
    let stream = match model_parallel_generator().filter(|s| s.device == device) {
        Some(stream) => stream,
        None => {
            let stream = Arc::new(CudaGenerator::new(device, 0)?);
            *MODEL_PARALLEL.lock().unwrap() = Some(stream.clone());
            stream
        }
    };
    stream.set_state(state)
}

/// Runs `body` with `device`'s default generator drawing from the model-parallel stream
/// (Megatron's `get_cuda_rng_tracker().fork()`), which keeps its advance. The swap exchanges
/// generator states on the host only, so it may happen while a CUDA graph captures.
/// Without a seeded stream (CPU, or before seeding) `body` runs as is.
pub fn with_model_parallel_rng<T>(
    device: Device,
    body: impl FnOnce() -> T,
) -> Result<T, TorchError> {
    let Some(stream) = model_parallel_generator().filter(|s| s.device == device) else {
        return Ok(body());
    };
    let previous = stream.swap_into_default()?;
    let out = body();
    previous.swap_into_default()?;
    Ok(out)
}

fn device_index(device: Device) -> c_int {
    match device {
        Device::Cuda(index) => index as c_int,
        _ => -1,
    }
}

/// N(0, std) float32 values from a generator seeded with `seed` (not the global one).
pub fn seeded_normal(shape: &[i64], std: f64, seed: u64) -> Tensor {
    let mut handle: ffi::TensorHandle = std::ptr::null_mut();
    // SAFETY: `shape` is live for the call; on success the shim writes a fresh handle we own.
    crate::error::check(unsafe {
        ffi::mrs_seeded_normal(shape.as_ptr(), shape.len(), 0.0, std, seed, &mut handle)
    })
    .expect("drawing from a CPU generator cannot fail");
    unsafe { Tensor::from_ptr(handle) }
}
