//! libtorch's random generators: snapshots of the default generators, so that recomputed
//! activations replay exactly the dropout masks of the original forward pass, and Megatron's
//! model-parallel stream (its CUDA RNG tracker, spec §3.2).

use std::sync::Mutex;

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
    model_parallel: Option<GeneratorState>,
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
            model_parallel: MODEL_PARALLEL.lock().unwrap().clone(),
        })
    }

    pub fn restore(&self) -> Result<(), TorchError> {
        self.defaults.iter().try_for_each(GeneratorState::restore)?;
        if let Some(state) = &self.model_parallel {
            *MODEL_PARALLEL.lock().unwrap() = Some(state.clone());
        }
        Ok(())
    }
}

/// Megatron's `model-parallel-rng`: a CUDA stream seeded differently on every tensor-parallel
/// rank, for dropout on tensors that are split across them.
static MODEL_PARALLEL: Mutex<Option<GeneratorState>> = Mutex::new(None);

/// Seeds the model-parallel stream of `device` with `seed` (Megatron: `seed + 2718 + tp_rank`).
/// On the CPU there is one generator per process and no stream is kept: dropout everywhere
/// draws from the CPU generator.
pub fn seed_model_parallel_rng(device: Device, seed: u64) -> Result<(), TorchError> {
    if !device.is_cuda() {
        return Ok(());
    }
    let saved = GeneratorState::capture(device)?;
    manual_seed(device, seed)?;
    let seeded = GeneratorState::capture(device)?;
    saved.restore()?;
    *MODEL_PARALLEL.lock().unwrap() = Some(seeded);
    Ok(())
}

/// The model-parallel stream's state, for checkpoints.
pub fn model_parallel_rng_state() -> Option<Tensor> {
    MODEL_PARALLEL
        .lock()
        .unwrap()
        .as_ref()
        .map(|s| s.state.copy())
}

/// Restores a state from [`model_parallel_rng_state`].
pub fn set_model_parallel_rng_state(device: Device, state: Tensor) {
    *MODEL_PARALLEL.lock().unwrap() = Some(GeneratorState::from_tensor(device, state));
}

/// Runs `body` with `device`'s default generator swapped for the model-parallel stream
/// (Megatron's `get_cuda_rng_tracker().fork()`); the advanced stream is kept for next time.
/// Without a seeded stream (CPU, or before seeding) `body` runs as is.
pub fn with_model_parallel_rng<T>(
    device: Device,
    body: impl FnOnce() -> T,
) -> Result<T, TorchError> {
    let tracked = MODEL_PARALLEL.lock().unwrap().clone();
    let Some(tracked) = tracked.filter(|t| t.device == device) else {
        return Ok(body());
    };
    let saved = GeneratorState::capture(device)?;
    tracked.restore()?;
    let out = body();
    let advanced = GeneratorState::capture(device)?;
    saved.restore()?;
    *MODEL_PARALLEL.lock().unwrap() = Some(advanced);
    Ok(out)
}

fn device_index(device: Device) -> c_int {
    match device {
        Device::Cuda(index) => index as c_int,
        _ => -1,
    }
}
