//! Serving with tensor parallelism: every rank runs every step. Before each step rank 0 tells
//! the other ranks, its followers, which requests joined and which were cancelled (a
//! [`Plan`]), so that they build the same rows and run the same forwards.

use std::sync::Arc;

use anyhow::Result;
use serde::{Deserialize, Serialize};
use tch::{Device, Kind, Tensor};

use crate::api::ApiRequest;
use crate::openai::CompletionRequest;
use megatron_parallel::Communicator;

/// A request as every tensor-parallel rank runs it (its seed chosen by rank 0).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) enum SharedJob {
    Api(ApiRequest),
    Completion(CompletionRequest),
}

/// What rank 0 tells the other ranks before each step.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub(crate) struct Plan {
    pub submit: Vec<(u64, SharedJob)>,
    pub cancel: Vec<u64>,
    pub stop: bool,
}

/// Broadcasts `plan` from rank 0 of `group` (`Some`), or receives it on the other ranks
/// (`None`); `device` is where the group's collectives run.
pub(crate) fn share_plan(
    group: &Arc<dyn Communicator>,
    device: Device,
    plan: Option<&Plan>,
) -> Result<Plan> {
    let bytes = plan.map(serde_json::to_vec).transpose()?;
    let received = share_bytes(group.as_ref(), device, bytes.as_deref())?;
    Ok(serde_json::from_slice(&received)?)
}

/// Broadcasts bytes from rank 0 of `group` (its length first); the other ranks pass `None`.
fn share_bytes(group: &dyn Communicator, device: Device, bytes: Option<&[u8]>) -> Result<Vec<u8>> {
    let length = Tensor::from_slice(&[bytes.map_or(0, |b| b.len() as i64)]).to_device(device);
    group.broadcast(&length, 0)?;
    let length = length.int64_value(&[0]);
    let payload = match bytes {
        Some(bytes) => Tensor::from_slice(bytes).to_device(device),
        None => Tensor::zeros([length], (Kind::Uint8, device)),
    };
    group.broadcast(&payload, 0)?;
    Ok(Vec::<u8>::try_from(payload.to_device(Device::Cpu))?)
}
