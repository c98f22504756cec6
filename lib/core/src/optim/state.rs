//! The optimizer's tensors under stable names, for checkpoints.

use tch::Tensor;

/// `(name, tensor)` pairs: `main.<param>` (float32 master weights), `exp_avg.<param>`,
/// `exp_avg_sq.<param>`, `step.<param>` for Adam; `momentum.<param>` for SGD.
pub type OptimizerTensors = Vec<(String, Tensor)>;
