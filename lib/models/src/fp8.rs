//! FP8 training (Megatron's `--fp8-format`, Transformer Engine's recipes): the recipe, and the
//! per-tensor scaling that turns a bf16 tensor into an fp8 one plus the inverse scale
//! `torch._scaled_mm` multiplies back in.
//!
//! A tensor `x` is stored as `q = fp8(clamp(x · scale, ±max))` and stands for `q · scale_inv`
//! with `scale_inv = 1 / scale`; `_scaled_mm(a, b, scale_a, scale_b)` computes
//! `scale_a · scale_b · (a · b)`, so it is given the inverse scales. The scale maps the
//! tensor's largest magnitude (its amax) to the format's largest finite value, divided by
//! `2^margin`: with current ("tensorwise") scaling from this very tensor, with delayed scaling
//! from the amax history of earlier uses of the same tensor (TE's `DelayedScaling`).

use std::collections::HashMap;
use std::sync::Mutex;

use anyhow::{ensure, Result};
use tch::{Device, Kind, Tensor};

use megatron_kernels::ops::fp8_cast::{self, ScaleSource};

/// `--fp8-format`: which fp8 type each pass uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fp8Format {
    /// e4m3 everywhere.
    E4m3,
    /// e4m3 for the forward pass (activations, weights), e5m2 for gradients (wider range).
    Hybrid,
}

/// `--fp8-amax-compute-algo`: how the history gives the amax a scale is computed from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AmaxAlgorithm {
    MostRecent,
    Max,
}

/// `--fp8-recipe`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fp8Scaling {
    /// `delayed`: the scale of a use comes from the amaxes of the previous `history_len` uses.
    Delayed {
        history_len: usize,
        algorithm: AmaxAlgorithm,
        margin: i32,
    },
    /// `tensorwise`: the scale of a use comes from the tensor itself (current scaling).
    Tensorwise,
}

/// Everything an fp8 linear needs to know.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fp8Recipe {
    pub format: Fp8Format,
    pub scaling: Fp8Scaling,
    /// The weight-gradient GEMM in fp8 too (Megatron's default; `--no-fp8-wgrad` keeps it in
    /// the activations' dtype).
    pub wgrad: bool,
}

impl Fp8Recipe {
    /// The type of activations and weights.
    pub fn forward_kind(&self) -> Kind {
        Kind::Float8e4m3fn
    }

    /// The type of output gradients.
    pub fn backward_kind(&self) -> Kind {
        match self.format {
            Fp8Format::E4m3 => Kind::Float8e4m3fn,
            Fp8Format::Hybrid => Kind::Float8e5m2,
        }
    }
}

/// Which transformer layers run in fp8, and how (`--first-last-layers-bf16` keeps
/// `--num-layers-at-start-in-bf16` and `--num-layers-at-end-in-bf16` of every layer stack in
/// the parameters' dtype).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fp8Plan {
    pub recipe: Fp8Recipe,
    pub bf16_layers_at_start: usize,
    pub bf16_layers_at_end: usize,
}

impl Fp8Plan {
    /// Whether layer `layer` (global index) of a stack of `num_layers` runs in fp8.
    pub fn in_fp8(&self, layer: usize, num_layers: usize) -> bool {
        layer >= self.bf16_layers_at_start && layer + self.bf16_layers_at_end < num_layers
    }
}

/// The largest finite value of an fp8 type.
pub fn fp8_max(kind: Kind) -> f64 {
    match kind {
        Kind::Float8e5m2 => 57344.0,
        _ => 448.0,
    }
}

/// An fp8 matrix (also transposed, when asked) and the float32 scalar that multiplies it back
/// to the values it stands for.
pub struct Fp8Tensor {
    pub data: Tensor,
    pub data_t: Option<Tensor>,
    pub scale_inv: Tensor,
}

/// `torch._scaled_mm(a, b, scale_a, scale_b, bias, out_dtype=kind, use_fast_accum)`: the
/// product of two fp8 matrices, times both inverse scales, plus `bias`, in `kind`. On a GPU
/// that is cuBLASLt's fp8 GEMM. libtorch's CPU `_scaled_mm` is a scalar loop (about 1 s for a
/// 512×64 by 64×256 product), so on a CPU the fp8 values, each exact in float32, are
/// multiplied by float32's GEMM: the same products, summed in another order.
pub fn scaled_mm(
    a: &Tensor,
    b: &Tensor,
    scale_a: &Tensor,
    scale_b: &Tensor,
    bias: Option<&Tensor>,
    kind: Kind,
    fast_accumulation: bool,
) -> Result<Tensor> {
    if a.device().is_cuda() {
        return Ok(a.f_internal_scaled_mm(
            b,
            scale_a,
            scale_b,
            bias,
            None::<&Tensor>,
            kind,
            fast_accumulation,
        )?);
    }
    let product = a
        .f_to_kind(Kind::Float)?
        .f_mm(&b.f_to_kind(Kind::Float)?)?
        .f_mul(&(scale_a * scale_b))?;
    let product = match bias {
        Some(bias) => product.f_add(&bias.f_to_kind(Kind::Float)?)?,
        None => product,
    };
    Ok(product.f_to_kind(kind)?)
}

/// The scaling state of one tensor role (a linear's input, weight or output gradient).
pub struct TensorScaling {
    kind: Kind,
    scaling: Fp8Scaling,
    delayed: Mutex<Option<History>>,
}

/// Delayed scaling's state, on the tensor's device so that no step waits on the host.
struct History {
    /// Amaxes of the latest uses: newest first on the CPU, a ring on CUDA devices (only their
    /// maximum and the newest matter).
    amaxes: Tensor,
    /// The scale the next use quantizes with.
    scale: Tensor,
    /// On CUDA devices, the cast kernel's amax of the current use and the ring's next slot
    /// (int32, see `ops::fp8_cast`).
    counters: Tensor,
}

impl TensorScaling {
    pub fn new(kind: Kind, scaling: Fp8Scaling) -> Self {
        TensorScaling {
            kind,
            scaling,
            delayed: Mutex::new(None),
        }
    }

    /// Quantizes `x` (a matrix of any float dtype; any shape on the CPU) to this role's fp8
    /// type, also transposed with `transposed`, and with delayed scaling records its amax for
    /// the next uses. On CUDA devices one kernel reads `x` once (`ops::fp8_cast`).
    pub fn quantize(&self, x: &Tensor, transposed: bool) -> Result<Fp8Tensor> {
        let max = fp8_max(self.kind);
        let on_gpu = matches!(x.device(), Device::Cuda(_));
        match self.scaling {
            Fp8Scaling::Tensorwise => {
                let amax = amax(x);
                if on_gpu {
                    let source = ScaleSource::Amax(&amax);
                    return Ok(fp8_cast::cast(x, self.kind, max, source, transposed)?.into());
                }
                let scale = scale_from_amax(&amax, max, 0, &Tensor::ones_like(&amax));
                Ok(cast(x, &scale, self.kind, transposed))
            }
            Fp8Scaling::Delayed {
                history_len,
                algorithm,
                margin,
            } => {
                let mut state = self
                    .delayed
                    .lock()
                    .map_err(|_| anyhow::anyhow!("fp8 scaling state poisoned by a panic"))?;
                // Transformer Engine starts from scale 1, which flushes small gradients to
                // zero in the first step; the first use takes its own amax instead.
                let history = state.get_or_insert_with(|| {
                    let amax = amax(x);
                    History {
                        amaxes: Tensor::zeros([history_len as i64], (Kind::Float, x.device())),
                        scale: scale_from_amax(&amax, max, margin, &Tensor::ones_like(&amax)),
                        counters: Tensor::zeros([2], (Kind::Int, x.device())),
                    }
                });
                let max_over_margin = max / 2f64.powi(margin);
                if on_gpu {
                    let source = ScaleSource::Delayed {
                        scale: &history.scale,
                        amax_out: &history.counters,
                    };
                    let quantized = fp8_cast::cast(x, self.kind, max, source, transposed)?;
                    fp8_cast::delayed_update(
                        &history.scale,
                        &history.counters,
                        &history.amaxes,
                        algorithm == AmaxAlgorithm::Max,
                        max_over_margin,
                    )?;
                    return Ok(quantized.into());
                }
                let amax = amax(x);
                let quantized = cast(x, &history.scale, self.kind, transposed);
                if history_len > 1 {
                    let rolled = history.amaxes.roll([1], [0]);
                    history.amaxes.copy_(&rolled);
                }
                history.amaxes.get(0).copy_(&amax);
                let reduced = match algorithm {
                    AmaxAlgorithm::MostRecent => amax,
                    AmaxAlgorithm::Max => history.amaxes.max(),
                };
                let next = scale_from_amax(&reduced, max, margin, &history.scale);
                history.scale.copy_(&next);
                Ok(quantized)
            }
        }
    }

    /// The delayed-scaling state under `prefix` (`<prefix>.amax_history`, `.scale`,
    /// `.counters`) for a checkpoint; nothing before the first use or with current scaling.
    pub fn state_tensors(&self, prefix: &str, out: &mut Vec<(String, Tensor)>) -> Result<()> {
        let state = self
            .delayed
            .lock()
            .map_err(|_| anyhow::anyhow!("fp8 scaling state poisoned by a panic"))?;
        if let Some(history) = state.as_ref() {
            for (name, tensor) in [
                ("amax_history", &history.amaxes),
                ("scale", &history.scale),
                ("counters", &history.counters),
            ] {
                out.push((format!("{prefix}.{name}"), tensor.detach().copy()));
            }
        }
        Ok(())
    }

    /// Restores what [`state_tensors`](Self::state_tensors) saved under `prefix` onto `device`.
    /// Whether it did: with current scaling there is nothing to restore, and a state absent
    /// from `tensors` or saved with another history length starts afresh.
    pub fn load_state(
        &self,
        prefix: &str,
        tensors: &HashMap<String, Tensor>,
        device: Device,
    ) -> Result<bool> {
        let Fp8Scaling::Delayed { history_len, .. } = self.scaling else {
            return Ok(true);
        };
        let get = |name: &str| tensors.get(&format!("{prefix}.{name}"));
        let (Some(amaxes), Some(scale), Some(counters)) =
            (get("amax_history"), get("scale"), get("counters"))
        else {
            return Ok(false);
        };
        ensure!(
            amaxes.dim() == 1
                && scale.numel() == 1
                && counters.size() == [2]
                && counters.kind() == Kind::Int,
            "{prefix}: malformed fp8 scaling state (amax history {:?}, scale {:?}, counters {:?})",
            amaxes.size(),
            scale.size(),
            counters.size()
        );
        if amaxes.size() != [history_len as i64] {
            return Ok(false);
        }
        let mut state = self
            .delayed
            .lock()
            .map_err(|_| anyhow::anyhow!("fp8 scaling state poisoned by a panic"))?;
        let on = |t: &Tensor, kind: Kind| t.to_device(device).to_kind(kind).copy();
        *state = Some(History {
            amaxes: on(amaxes, Kind::Float),
            scale: on(scale, Kind::Float).view([]),
            counters: on(counters, Kind::Int),
        });
        Ok(true)
    }

    /// The scale the next use will quantize with (delayed scaling, after a first use).
    pub fn next_scale(&self) -> Option<Tensor> {
        let state = self.delayed.lock().ok()?;
        state.as_ref().map(|h| h.scale.copy())
    }
}

/// The largest magnitude of `x`, a float32 scalar on its device.
fn amax(x: &Tensor) -> Tensor {
    // Flattened: over a matrix, `linalg_norm` would take the matrix norm. In the input's own
    // dtype (a maximum is exact in any), so that no float32 copy of the tensor is made.
    x.detach()
        .reshape([-1])
        .linalg_norm(f64::INFINITY, None::<&[i64]>, false, None::<Kind>)
        .to_kind(Kind::Float)
}

/// `max / amax / 2^margin`, or `fallback` where amax is zero or not finite (TE's rule); kept
/// finite for amaxes so small that the quotient overflows float32.
fn scale_from_amax(amax: &Tensor, max: f64, margin: i32, fallback: &Tensor) -> Tensor {
    // One float32 division, as Transformer Engine computes it: the scaled values of bf16
    // tensors can fall exactly on the midpoint between two fp8 values, where a scale one ulp
    // off rounds them the other way.
    let scale = (Tensor::full_like(amax, max / 2f64.powi(margin)) / amax)
        .to_kind(Kind::Float)
        .clamp_max(f32::MAX as f64);
    let usable = amax.gt(0.0).logical_and(&amax.isfinite());
    scale.where_self(&usable, fallback)
}

/// `fp8(clamp(x · scale, ±max))` in float32 arithmetic, so the only rounding is fp8's.
fn cast(x: &Tensor, scale: &Tensor, kind: Kind, transposed: bool) -> Fp8Tensor {
    let max = fp8_max(kind);
    let data = (x.detach().to_kind(Kind::Float) * scale)
        .clamp_(-max, max)
        .to_kind(kind)
        .contiguous();
    Fp8Tensor {
        data_t: transposed.then(|| data.tr().contiguous()),
        data,
        scale_inv: scale.reciprocal(),
    }
}

impl From<fp8_cast::Cast> for Fp8Tensor {
    fn from(cast: fp8_cast::Cast) -> Self {
        Fp8Tensor {
            data: cast.data,
            data_t: cast.data_t,
            scale_inv: cast.scale_inv,
        }
    }
}

/// Checks what cuBLASLt's fp8 GEMMs need of the weight of the linear `name`.
pub fn check_gemm_shape(name: &str, out_features: i64, in_features: i64) -> Result<()> {
    ensure!(
        out_features % 16 == 0 && in_features % 16 == 0,
        "fp8 GEMMs need both dimensions of every transformer-layer weight to be multiples of 16; \
         {name} is [{out_features}, {in_features}] on this rank"
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::Device;

    fn delayed(history_len: usize, algorithm: AmaxAlgorithm) -> Fp8Scaling {
        Fp8Scaling::Delayed {
            history_len,
            algorithm,
            margin: 0,
        }
    }

    #[test]
    fn tensorwise_scaling_maps_the_amax_to_the_largest_value() {
        let x = Tensor::from_slice(&[0.5f32, -2.0, 1.0, 0.25]);
        let q = TensorScaling::new(Kind::Float8e4m3fn, Fp8Scaling::Tensorwise)
            .quantize(&x, false)
            .unwrap();
        assert_eq!(q.data.kind(), Kind::Float8e4m3fn);
        // Powers of two stay exact: 448/2 = 224 is a multiple of a power of two in e4m3.
        let back = q.data.to_kind(Kind::Float) * &q.scale_inv;
        assert!(back.allclose(&x, 0.0, 1e-6, false), "{back}");
        let top = q.data.to_kind(Kind::Float).abs().max().double_value(&[]);
        assert_eq!(top, 448.0);
    }

    #[test]
    fn a_zero_tensor_keeps_scale_one() {
        let x = Tensor::zeros([4], (Kind::Float, Device::Cpu));
        let q = TensorScaling::new(Kind::Float8e5m2, Fp8Scaling::Tensorwise)
            .quantize(&x, false)
            .unwrap();
        assert_eq!(q.scale_inv.double_value(&[]), 1.0);
        assert_eq!(
            q.data.to_kind(Kind::Float).abs().max().double_value(&[]),
            0.0
        );
    }

    #[test]
    fn delayed_scaling_uses_the_previous_amax_and_saturates() {
        let scaling = TensorScaling::new(Kind::Float8e4m3fn, delayed(1, AmaxAlgorithm::MostRecent));
        let first = Tensor::from_slice(&[1.0f32, -0.5]);
        let q = scaling.quantize(&first, false).unwrap();
        let inverse = (1.0f32 / 448.0) as f64;
        assert_eq!(q.scale_inv.double_value(&[]), inverse);
        // The second use doubles the amax: quantized with the first use's scale, it saturates.
        let second = Tensor::from_slice(&[2.0f32, 0.5]);
        let q = scaling.quantize(&second, false).unwrap();
        assert_eq!(q.scale_inv.double_value(&[]), inverse);
        assert_eq!(q.data.to_kind(Kind::Float).double_value(&[0]), 448.0);
        // ...and the third use scales by it.
        let next = scaling.next_scale().unwrap().double_value(&[]);
        assert_eq!(next, 224.0);
    }

    #[test]
    fn delayed_scaling_with_max_takes_the_largest_amax_of_the_history() {
        let scaling = TensorScaling::new(Kind::Float8e4m3fn, delayed(3, AmaxAlgorithm::Max));
        for amax in [4.0f32, 1.0, 2.0] {
            scaling
                .quantize(&Tensor::from_slice(&[amax]), false)
                .unwrap();
        }
        assert_eq!(scaling.next_scale().unwrap().double_value(&[]), 448.0 / 4.0);
        // The fourth use pushes 4.0 out of the three-long history.
        scaling
            .quantize(&Tensor::from_slice(&[0.5f32]), false)
            .unwrap();
        assert_eq!(scaling.next_scale().unwrap().double_value(&[]), 448.0 / 2.0);
    }

    #[test]
    fn the_margin_divides_the_scale_by_a_power_of_two() {
        let scaling = TensorScaling::new(
            Kind::Float8e4m3fn,
            Fp8Scaling::Delayed {
                history_len: 1,
                algorithm: AmaxAlgorithm::MostRecent,
                margin: 2,
            },
        );
        scaling
            .quantize(&Tensor::from_slice(&[7.0f32]), false)
            .unwrap();
        assert_eq!(
            scaling.next_scale().unwrap().double_value(&[]),
            448.0 / 7.0 / 4.0
        );
    }

    #[test]
    fn the_delayed_state_round_trips_and_another_history_length_starts_afresh() {
        let scaling = TensorScaling::new(Kind::Float8e4m3fn, delayed(2, AmaxAlgorithm::Max));
        for amax in [4.0f32, 2.0] {
            scaling
                .quantize(&Tensor::from_slice(&[amax]), false)
                .unwrap();
        }
        let mut saved = Vec::new();
        scaling.state_tensors("qkv.input", &mut saved).unwrap();
        let names: Vec<&str> = saved.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(
            names,
            [
                "qkv.input.amax_history",
                "qkv.input.scale",
                "qkv.input.counters"
            ]
        );
        let saved: HashMap<String, Tensor> = saved.into_iter().collect();
        let restored = TensorScaling::new(Kind::Float8e4m3fn, delayed(2, AmaxAlgorithm::Max));
        assert!(restored
            .load_state("qkv.input", &saved, Device::Cpu)
            .unwrap());
        assert_eq!(
            restored.next_scale().unwrap().double_value(&[]),
            448.0 / 4.0
        );
        let longer = TensorScaling::new(Kind::Float8e4m3fn, delayed(8, AmaxAlgorithm::Max));
        assert!(!longer.load_state("qkv.input", &saved, Device::Cpu).unwrap());
        assert!(longer.next_scale().is_none());
        assert!(!restored
            .load_state("proj.input", &saved, Device::Cpu)
            .unwrap());
    }

    #[test]
    fn first_and_last_layers_stay_in_bf16_when_asked() {
        let plan = Fp8Plan {
            recipe: Fp8Recipe {
                format: Fp8Format::Hybrid,
                scaling: Fp8Scaling::Tensorwise,
                wgrad: true,
            },
            bf16_layers_at_start: 1,
            bf16_layers_at_end: 2,
        };
        let fp8: Vec<usize> = (0..6).filter(|&i| plan.in_fp8(i, 6)).collect();
        assert_eq!(fp8, [1, 2, 3]);
    }

    #[test]
    fn gemm_shapes_must_be_multiples_of_16() {
        assert!(check_gemm_shape("linear_qkv", 96, 32).is_ok());
        let err = check_gemm_shape("linear_fc1", 40, 32)
            .unwrap_err()
            .to_string();
        assert!(err.contains("linear_fc1 is [40, 32]"), "{err}");
    }

    /// On a GPU the cast kernels give the CPU's fp8 values, transposes and inverse scales
    /// exactly, for bf16, fp16 and float32 inputs, shapes that take the one-element kernels
    /// (70 × 45, odd) and the four-element ones (96 × 160, 36 × 20: multiples of 4 but not of
    /// the tiles), both fp8 types, current scaling and delayed scaling over several uses
    /// (history of 3, max), including an amax that grows past the delayed scale (saturation).
    #[test]
    fn on_a_gpu_the_cast_kernels_equal_the_cpu_quantization() {
        if !tch::Cuda::is_available() {
            eprintln!("skipped: no CUDA device");
            return;
        }
        for shape in [[70, 45], [96, 160], [36, 20]] {
            check_cast_kernels(shape);
        }
    }

    fn check_cast_kernels([rows, cols]: [i64; 2]) {
        let cuda = Device::Cuda(0);
        let uses: Vec<Tensor> = [1.0, 3.0, 0.25, 2.0]
            .iter()
            .map(|&size| {
                let t = (Tensor::arange(rows * cols, (Kind::Float, Device::Cpu)) * 12.9898).sin()
                    * 43758.5453;
                (t.frac() * size).view([rows, cols])
            })
            .collect();
        for kind in [Kind::BFloat16, Kind::Half, Kind::Float] {
            for fp8 in [Kind::Float8e4m3fn, Kind::Float8e5m2] {
                for scaling in [Fp8Scaling::Tensorwise, delayed(3, AmaxAlgorithm::Max)] {
                    let (cpu, gpu) = (
                        TensorScaling::new(fp8, scaling),
                        TensorScaling::new(fp8, scaling),
                    );
                    for x in &uses {
                        let x = x.to_kind(kind);
                        let want = cpu.quantize(&x, true).unwrap();
                        let got = gpu.quantize(&x.to_device(cuda), true).unwrap();
                        let bits = |t: &Tensor| t.to_device(Device::Cpu).view_dtype(Kind::Uint8);
                        let what = format!("{rows}×{cols} {kind:?} to {fp8:?}, {scaling:?}");
                        assert!(bits(&got.data).equal(&bits(&want.data)), "{what}: data");
                        let (got_t, want_t) = (got.data_t.unwrap(), want.data_t.unwrap());
                        assert!(bits(&got_t).equal(&bits(&want_t)), "{what}: transpose");
                        assert_eq!(
                            got.scale_inv.double_value(&[]),
                            want.scale_inv.double_value(&[]),
                            "{what}: inverse scale"
                        );
                    }
                }
            }
        }
    }
}
