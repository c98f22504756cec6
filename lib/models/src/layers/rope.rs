//! Rotary position embeddings, non-interleaved ("rotate half") as Megatron's default (spec §1.2).
//! In training on GPUs the rotation is one kernel forward and one backward
//! ([`megatron_kernels::ops::rope`], Megatron's `apply_rope_fusion`); elsewhere, and with
//! `--no-rope-fusion`, libtorch's ops.

use std::f64::consts::PI;

use anyhow::{Context, Result};
use tch::{Device, Kind, Tensor};

use crate::rope_scaling::{Llama3Scaling, RopeScaling, YarnScaling};
use megatron_kernels::autograd::{self, CustomFunction, SavedTensors};
use megatron_kernels::ops::rope::{self as rope_kernel, Direction};

/// `inv_freq[i] = base^(-2i/r)` for the first `r` channels of each head, rescaled as the
/// model's [`RopeScaling`] says (Llama 3.x bands, linear interpolation or YaRN).
#[derive(Clone)]
pub struct RotaryEmbedding {
    rotary_dim: i64,
    base: f64,
    scaling: Option<RopeScaling>,
    fused: bool,
}

/// cos/sin of the angles for a range of positions, `[s, 1, 1, r]` in float32 (`[s, b, 1, r]`
/// for rows at their own positions).
pub struct RotaryTables {
    cos: Tensor,
    sin: Tensor,
    /// Whether the rotation may run as the fused kernel (never for tables per row).
    fused: bool,
}

impl RotaryEmbedding {
    /// `fused`: whether rotations run as the fused kernel where it applies (training;
    /// `--no-rope-fusion` turns it off).
    pub fn new(rotary_dim: i64, base: f64, scaling: Option<RopeScaling>, fused: bool) -> Self {
        RotaryEmbedding {
            rotary_dim,
            base,
            scaling,
            fused,
        }
    }

    /// Tables for positions `start..start + length`.
    pub fn tables(&self, start: i64, length: i64, device: Device) -> RotaryTables {
        self.tables_at(&Tensor::arange_start(
            start,
            start + length,
            (Kind::Int64, device),
        ))
    }

    /// Tables for the positions in `positions` (`[s]`, int64, on the device), without reading
    /// them on the host (CUDA graph capture). YaRN's attention factor multiplies both.
    pub fn tables_at(&self, positions: &Tensor) -> RotaryTables {
        let inv_freq = self.inv_freq(positions.device());
        let angles = positions.to_kind(Kind::Float).outer(&inv_freq);
        let length = positions.size()[0];
        let angles = Tensor::cat(&[&angles, &angles], -1).view([length, 1, 1, self.rotary_dim]);
        let (cos, sin) = match &self.scaling {
            Some(RopeScaling::Yarn(yarn)) => {
                let factor = yarn.attention_factor();
                (angles.cos() * factor, angles.sin() * factor)
            }
            _ => (angles.cos(), angles.sin()),
        };
        RotaryTables {
            cos,
            sin,
            fused: self.fused,
        }
    }

    /// The `r/2` rotation frequencies (float32), scaled as the model's RoPE scaling says.
    /// Computed on the device: a host-to-device copy cannot be captured in a CUDA graph.
    pub fn inv_freq(&self, device: Device) -> Tensor {
        let options = (Kind::Float, device);
        let exponents =
            Tensor::arange_start_step(0, self.rotary_dim, 2, options) / self.rotary_dim as f64;
        let inv_freq = Tensor::full([] as [i64; 0], self.base, options)
            .pow(&exponents)
            .reciprocal();
        match &self.scaling {
            None => inv_freq,
            Some(RopeScaling::Llama3(scaling)) => llama3_inv_freq(&inv_freq, scaling),
            Some(RopeScaling::Linear { factor }) => inv_freq / *factor,
            Some(RopeScaling::Yarn(scaling)) => {
                yarn_inv_freq(&inv_freq, scaling, self.base, self.rotary_dim)
            }
        }
    }
}

impl RotaryEmbedding {
    /// Tables for the positions of every row, `positions` `[b, s]` (int64, on the device):
    /// `[s, b, 1, r]`, for batches whose rows sit at different positions. They rotate through
    /// libtorch's ops: the kernel takes one table row per position.
    pub fn tables_per_row(&self, positions: &Tensor) -> RotaryTables {
        let (b, s) = (positions.size()[0], positions.size()[1]);
        let flat = self.tables_at(&positions.reshape([-1]));
        let shape = |t: Tensor| t.view([b, s, 1, self.rotary_dim]).transpose(0, 1);
        RotaryTables {
            cos: shape(flat.cos),
            sin: shape(flat.sin),
            fused: false,
        }
    }
}

/// Llama 3.x: frequencies whose wavelength exceeds `original / low_freq_factor` are divided
/// by `factor`, those under `original / high_freq_factor` kept, and the band between blended
/// linearly in `original / wavelength`. Elementwise on the device (CUDA graph capture).
fn llama3_inv_freq(inv_freq: &Tensor, scaling: &Llama3Scaling) -> Tensor {
    let original = scaling.original_max_position_embeddings as f64;
    let (low, high) = (scaling.low_freq_factor, scaling.high_freq_factor);
    let wavelength = inv_freq.reciprocal() * (2.0 * PI);
    let stretched = inv_freq / scaling.factor;
    let blend = (original / &wavelength - low) / (high - low);
    let smoothed = &stretched * (1.0f64 - &blend) + inv_freq * &blend;
    let long = wavelength.gt(original / low);
    let short = wavelength.lt(original / high);
    let between = smoothed.where_self(&short.logical_not(), inv_freq);
    stretched.where_self(&long, &between)
}

/// YaRN (Megatron's `YarnRotaryEmbedding`, transformers' `_compute_yarn_parameters`): channel
/// pair `i` keeps its frequency below the ramp, takes `inv_freq / factor` above it, and blends
/// linearly between the channels where a frequency turns `beta_fast` and `beta_slow` times
/// over the original context. The ramp's ends are host numbers; the ramp itself is built on
/// the device (CUDA graph capture).
fn yarn_inv_freq(inv_freq: &Tensor, scaling: &YarnScaling, base: f64, dim: i64) -> Tensor {
    let original = scaling.original_max_position_embeddings as f64;
    let channel_of =
        |turns: f64| dim as f64 * (original / (turns * 2.0 * PI)).ln() / (2.0 * base.ln());
    let (mut low, mut high) = (channel_of(scaling.beta_fast), channel_of(scaling.beta_slow));
    if scaling.correction_range_round_to_int {
        (low, high) = (low.floor(), high.ceil());
    }
    let (low, high) = (low.max(0.0), high.min((dim - 1) as f64));
    // Equal ends would divide by zero: both references widen the ramp by a thousandth.
    let high = if low == high { high + 0.001 } else { high };
    let ramp = ((Tensor::arange(dim / 2, (Kind::Float, inv_freq.device())) - low) / (high - low))
        .clamp(0.0, 1.0);
    let interpolated = inv_freq / scaling.factor;
    &interpolated * &ramp + inv_freq * (1.0f64 - &ramp)
}

impl Clone for RotaryTables {
    fn clone(&self) -> Self {
        RotaryTables {
            cos: self.cos.shallow_clone(),
            sin: self.sin.shallow_clone(),
            fused: self.fused,
        }
    }
}

impl RotaryTables {
    /// Rotates the first `r` channels of `x` (`[s, b, heads, d]`); the rest pass through. With
    /// fusion on, GPUs run the fused kernel (training and its evaluation, a recomputed forward
    /// alike).
    pub fn apply(&self, x: &Tensor) -> Result<Tensor> {
        if self.fused && rope_kernel::usable_on(x.device(), x.kind()) {
            let function = FusedRotation {
                cos: self.cos.shallow_clone(),
                sin: self.sin.shallow_clone(),
            };
            let mut outputs = autograd::apply(function, &[x]).context("fused rotary embedding")?;
            return Ok(outputs.remove(0));
        }
        Ok(rope_kernel::rotate_unfused(x, &self.cos, &self.sin))
    }
}

/// The rotation as one kernel each way; the tables are constants, not inputs.
struct FusedRotation {
    cos: Tensor,
    sin: Tensor,
}

impl CustomFunction for FusedRotation {
    fn forward(&mut self, inputs: &[Tensor], _: &mut SavedTensors) -> Result<Vec<Tensor>> {
        let rotated = rope_kernel::rotate(&inputs[0], &self.cos, &self.sin, Direction::Forward)?;
        Ok(vec![rotated])
    }

    fn backward(&mut self, grads: &[Tensor], _: &[Tensor]) -> Result<Vec<Option<Tensor>>> {
        if !grads[0].defined() {
            return Ok(vec![None]);
        }
        let grad = rope_kernel::rotate(&grads[0], &self.cos, &self.sin, Direction::Backward)?;
        Ok(vec![Some(grad)])
    }
}
