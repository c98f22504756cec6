//! Whether a model's MoE layers train without reading anything back from the device: the
//! dropless routing on one expert-parallel rank, with the experts as grouped GEMMs, keeps every
//! count on the device (router, top-k, auxiliary losses, expert-bias counts, the permutation
//! by a sort, the grouped GEMMs' row offsets, the weighted sum back by `index_add`), so a CUDA
//! graph can hold a micro-batch's forward and backward. Elsewhere a batch size comes from the
//! routing through the host.

use tch::{Device, Kind};

use super::grouped_gemm;
use crate::config::TransformerConfig;

/// Why the MoE layers of `config` (its parameters `dtype` on `device`, the experts split over
/// `expert_parallel` ranks) wait for the device in training, or `None` when they do not (and
/// when the model has no MoE layers).
pub fn host_wait_reason(
    config: &TransformerConfig,
    dtype: Kind,
    device: Device,
    expert_parallel: usize,
) -> Option<&'static str> {
    let moe = config.moe.as_ref()?;
    let expert = TransformerConfig {
        ffn_hidden_size: moe.ffn_hidden_size,
        ..config.clone()
    };
    let widths = [expert.fc1_width(), config.hidden_size, moe.ffn_hidden_size];
    if moe.capacity.is_some() {
        Some("--moe-expert-capacity-factor sizes the experts' batches on the host")
    } else if expert_parallel > 1 {
        Some("expert parallelism exchanges the experts' token counts through the host")
    } else if !moe.grouped_gemm {
        Some(
            "without --moe-grouped-gemm the experts run one after the other over batches \
             sized on the host",
        )
    } else if config.add_bias_linear || !grouped_gemm::kernel_takes(dtype, device, &widths) {
        Some(
            "libtorch's grouped GEMM does not take these experts (it needs bf16 and rows of a \
             multiple of 16 bytes), which then run one after the other over batches sized on \
             the host",
        )
    } else {
        None
    }
}
