//! Model FLOPs per global batch (Megatron core_v0.14's `num_floating_point_operations`,
//! transformer without MLA or MTP; Mixture-of-Experts layers count the experts a token is routed
//! to, the active parameters) and the tensor-core peak of known GPUs for MFU.

use megatron_models::{Activation, TransformerConfig};

/// The model shape the FLOPs formula reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FlopsModel {
    pub num_layers: u64,
    pub hidden_size: u64,
    pub ffn_hidden_size: u64,
    pub num_attention_heads: u64,
    /// The key/value heads: `--num-query-groups` with `--group-query-attention`, otherwise
    /// `num_attention_heads`.
    pub num_query_groups: u64,
    pub kv_channels: u64,
    pub seq_length: u64,
    pub padded_vocab_size: u64,
    pub swiglu: bool,
    pub moe: Option<MoeFlops>,
}

/// The Mixture-of-Experts layers' share of the formula.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MoeFlops {
    pub num_moe_layers: u64,
    pub moe_ffn_hidden_size: u64,
    /// `--moe-router-topk`: the experts each token passes through.
    pub topk: u64,
    /// `--moe-shared-expert-intermediate-size`, 0 without a shared expert.
    pub shared_expert_ffn_hidden_size: u64,
}

impl FlopsModel {
    /// The shape of `config`'s trunk with `num_layers` layers at `seq_length`.
    pub fn of_trunk(config: &TransformerConfig, num_layers: u64, seq_length: i64) -> Self {
        FlopsModel {
            num_layers,
            hidden_size: config.hidden_size as u64,
            ffn_hidden_size: config.ffn_hidden_size as u64,
            num_attention_heads: config.num_attention_heads as u64,
            num_query_groups: config.num_query_groups as u64,
            kv_channels: config.kv_channels as u64,
            seq_length: seq_length as u64,
            padded_vocab_size: config.padded_vocab_size(1) as u64,
            swiglu: config.activation == Activation::Swiglu,
            moe: config.moe.as_ref().map(|moe| MoeFlops {
                num_moe_layers: moe.num_moe_layers() as u64,
                moe_ffn_hidden_size: moe.ffn_hidden_size as u64,
                topk: moe.topk as u64,
                shared_expert_ffn_hidden_size: moe.shared_expert_intermediate_size.unwrap_or(0)
                    as u64,
            }),
        }
    }
}

/// Training FLOPs (forward and backward) of `batch_size` sequences:
///
/// `B·s·[12·L·h·F + 12·L·h²·Q·(1 + g/n + s/(2h)) + 6·h·V]` with `Q = n·d/h` and `F` the FFN
/// width, × 1.5 with SwiGLU. With Mixture-of-Experts layers `F` is the layers' average:
/// `F·(dense/L) + (F_moe·k + F_shared)·(moe/L)`, each width × 1.5 with SwiGLU. The factor 12 is 3 GEMMs per weight (forward, two backward) × 2
/// FLOPs per multiply-add × 2 GEMMs per block (up/down projection; QKV/output projection); the
/// attention matrix counts half, being causal.
pub fn num_floating_point_operations(model: &FlopsModel, batch_size: u64) -> f64 {
    // Evaluated in the order (and with the integer/float split) of Megatron's expression, so the
    // result is the same f64: the integer products are exact in f64 at any realistic size.
    let layers = model.num_layers as f64;
    let hidden = model.hidden_size as f64;
    let heads = model.num_attention_heads as f64;
    let seq = model.seq_length as f64;
    let gemm_factor = 12.0;
    let query_to_hidden = (model.kv_channels * model.num_attention_heads) as f64 / hidden;
    let gated_multiplier = if model.swiglu { 1.5 } else { 1.0 };
    let dense_width = model.ffn_hidden_size as f64 * gated_multiplier;
    let widths = match model.moe {
        None => dense_width,
        Some(moe) => {
            let moe_layers = moe.num_moe_layers as f64;
            dense_width * ((layers - moe_layers) / layers)
                + (moe.moe_ffn_hidden_size as f64 * moe.topk as f64 * gated_multiplier)
                    * (moe_layers / layers)
                + (moe.shared_expert_ffn_hidden_size as f64 * gated_multiplier)
                    * (moe_layers / layers)
        }
    };
    let mlp = gemm_factor * layers * hidden * widths;
    let attention = gemm_factor
        * layers
        * hidden
        * hidden
        * ((1.0 + model.num_query_groups as f64 / heads + seq / hidden / 2.0) * query_to_hidden);
    let logits = 6.0 * hidden * model.padded_vocab_size as f64;
    batch_size as f64 * seq * (mlp + attention + logits)
}

/// Dense (no sparsity) BF16 tensor-core peak in TFLOP/s of the CUDA device called
/// `device_name` (as `cudaGetDeviceProperties` names it, e.g. `NVIDIA H100 80GB HBM3`), from
/// NVIDIA's datasheets; `None` for devices not listed here (and for CPUs).
pub fn peak_bf16_tflops(device_name: &str) -> Option<f64> {
    let tokens: Vec<String> = device_name
        .split(|c: char| !c.is_ascii_alphanumeric())
        .filter(|token| !token.is_empty())
        .map(str::to_uppercase)
        .collect();
    let has = |token: &str| tokens.iter().any(|t| t == token);
    let peak = if has("B200") {
        2250.0
    } else if has("GH200") {
        989.4
    } else if has("H100") || has("H200") || has("H800") {
        if has("PCIE") {
            756.0
        } else if has("NVL") {
            835.5
        } else {
            989.4
        }
    } else if has("A100") || has("A800") {
        312.0
    } else if has("L40S") {
        362.0
    } else if has("L40") {
        181.0
    } else if has("A30") {
        165.0
    } else if has("A10") {
        125.0
    } else if has("L4") {
        121.0
    } else {
        return None;
    };
    Some(peak)
}

#[cfg(test)]
mod tests {
    use super::*;

    const GPT_345M: FlopsModel = FlopsModel {
        num_layers: 24,
        hidden_size: 1024,
        ffn_hidden_size: 4096,
        num_attention_heads: 16,
        num_query_groups: 16,
        kv_channels: 64,
        seq_length: 1024,
        padded_vocab_size: 50304,
        swiglu: false,
        moe: None,
    };

    // Expected values: Megatron core_v0.13's expression evaluated by python3 (dense branch, no
    // MoE/MTP terms), e.g. 1·1024·(12·24·1024·4096 + 12·24·1024²·(1 + 1 + 1024/1024/2)·1 + 6·1024·50304)
    // = 1024 · (1207959552 + 754974720 + 309067776) = 2326530097152.
    #[test]
    fn gpt_345m() {
        assert_eq!(num_floating_point_operations(&GPT_345M, 1), 2326530097152.0);
        assert_eq!(
            num_floating_point_operations(&GPT_345M, 8),
            18612240777216.0
        );
    }

    #[test]
    fn gqa_swiglu_model() {
        // A LLaMA-7B-like shape with 8 KV groups: python3 gives 623113855303680.0 for batch 4.
        let model = FlopsModel {
            num_layers: 32,
            hidden_size: 4096,
            ffn_hidden_size: 11008,
            num_attention_heads: 32,
            num_query_groups: 8,
            kv_channels: 128,
            seq_length: 4096,
            padded_vocab_size: 32000,
            swiglu: true,
            moe: None,
        };
        assert_eq!(num_floating_point_operations(&model, 4), 623113855303680.0);
    }

    #[test]
    fn moe_layers_count_the_experts_tokens_are_routed_to() {
        // Megatron core_v0.14's expression by python3 for a Mixtral-like shape: 32 layers,
        // every other one MoE with 8 experts of width 14336, top-2, a shared expert of 4096,
        // SwiGLU, GQA 8, batch 2 at 4096: 2·4096·(12·32·4096·(14336·1.5·(16/32) +
        // 14336·2·1.5·(16/32) + 4096·1.5·(16/32)) + attention + 6·4096·32000)
        // = 553999241576448.0.
        let model = FlopsModel {
            num_layers: 32,
            hidden_size: 4096,
            ffn_hidden_size: 14336,
            num_attention_heads: 32,
            num_query_groups: 8,
            kv_channels: 128,
            seq_length: 4096,
            padded_vocab_size: 32000,
            swiglu: true,
            moe: Some(MoeFlops {
                num_moe_layers: 16,
                moe_ffn_hidden_size: 14336,
                topk: 2,
                shared_expert_ffn_hidden_size: 4096,
            }),
        };
        assert_eq!(num_floating_point_operations(&model, 2), 553999241576448.0);
    }

    #[test]
    fn device_peaks() {
        for (name, peak) in [
            ("NVIDIA H100 80GB HBM3", Some(989.4)),
            ("NVIDIA H100 PCIe", Some(756.0)),
            ("NVIDIA H100 NVL", Some(835.5)),
            ("NVIDIA H200", Some(989.4)),
            ("NVIDIA GH200 480GB", Some(989.4)),
            ("NVIDIA A100-SXM4-80GB", Some(312.0)),
            ("NVIDIA A100 80GB PCIe", Some(312.0)),
            ("NVIDIA A10", Some(125.0)),
            ("NVIDIA L40S", Some(362.0)),
            ("NVIDIA L4", Some(121.0)),
            ("Tesla V100-SXM2-32GB", None),
            ("cpu", None),
            ("", None),
        ] {
            assert_eq!(peak_bf16_tflops(name), peak, "{name}");
        }
    }
}
