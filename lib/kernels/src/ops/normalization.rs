//! Which normalization a layer applies; the fused norm kernels take it too.

use anyhow::{bail, Result};
use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Normalization {
    LayerNorm,
    RMSNorm,
}

impl Normalization {
    pub fn parse(value: &str) -> Result<Self> {
        Ok(match value {
            "LayerNorm" => Self::LayerNorm,
            "RMSNorm" => Self::RMSNorm,
            other => bail!("--normalization {other:?}: expected LayerNorm or RMSNorm"),
        })
    }
}
