//! Snapshots of libtorch's default random generators, so that recomputed activations replay
//! exactly the dropout masks of the original forward pass.

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
        Ok(Self { device, state: unsafe { Tensor::from_ptr(handle) } })
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
        crate::error::check(unsafe { ffi::mrs_rng_set_state(device_index(self.device), ffi::handle(&self.state)) })
    }
}

/// The generator states of the CPU and of every CUDA device among `devices`.
pub struct RngSnapshot(Vec<GeneratorState>);

impl RngSnapshot {
    pub fn capture(devices: impl IntoIterator<Item = Device>) -> Result<Self, TorchError> {
        let mut wanted = vec![Device::Cpu];
        for device in devices {
            if !wanted.contains(&device) {
                wanted.push(device);
            }
        }
        wanted.into_iter().map(GeneratorState::capture).collect::<Result<_, _>>().map(Self)
    }

    pub fn restore(&self) -> Result<(), TorchError> {
        self.0.iter().try_for_each(GeneratorState::restore)
    }
}

fn device_index(device: Device) -> c_int {
    match device {
        Device::Cuda(index) => index as c_int,
        _ => -1,
    }
}
