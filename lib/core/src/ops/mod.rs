//! Tensor operations libtorch has but tch-rs does not bind, reached through the C++ shim.

pub mod fp8_cast;
pub mod multi_tensor;
pub mod paged_attention;

pub use multi_tensor::{
    foreach_add_, foreach_copy_, foreach_mul_, foreach_zero_, fused_adamw, set_deterministic,
    total_norm, unscale_and_check_finite, AdamwHyper,
};
