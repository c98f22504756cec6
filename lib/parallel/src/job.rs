//! A process's membership in a multi-process job: the rendezvous, the backend, and the
//! parallel state built from them.

use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use tch::Device;

use super::communicator::Communicator;
use super::launch::LaunchEnv;
use super::layout::ParallelLayout;
use super::rendezvous::Rendezvous;
use super::tcp::TcpMesh;
use super::ParallelState;

/// `--distributed-backend`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    /// NCCL on GPUs.
    Nccl,
    /// Host collectives over TCP, for CPU processes.
    Gloo,
}

impl Backend {
    pub fn parse(name: &str) -> Result<Self> {
        match name {
            "nccl" => Ok(Backend::Nccl),
            "gloo" => Ok(Backend::Gloo),
            other => bail!("--distributed-backend {other:?}: expected nccl or gloo"),
        }
    }
}

/// This process in its job. A single process (no launcher variables) has no rendezvous.
pub struct Job {
    pub env: LaunchEnv,
    rendezvous: Option<Rendezvous>,
    timeout: Duration,
}

impl Job {
    /// Joins the job the environment describes (see [`LaunchEnv`]), waiting at most `timeout`
    /// for the other ranks.
    pub fn join(env: LaunchEnv, timeout: Duration) -> Result<Self> {
        let rendezvous = (env.world_size > 1)
            .then(|| Rendezvous::join(&env, timeout))
            .transpose()?;
        Ok(Job {
            env,
            rendezvous,
            timeout,
        })
    }

    /// The parallel state of this rank in `layout`. The backend must suit `device`: NCCL
    /// needs a GPU, gloo runs anywhere.
    pub fn parallel_state(
        &self,
        layout: ParallelLayout,
        sequence_parallel: bool,
        backend: Backend,
        device: Device,
    ) -> Result<ParallelState> {
        let Some(rendezvous) = &self.rendezvous else {
            return Ok(ParallelState {
                layout,
                sequence_parallel: false,
                ..ParallelState::single()
            });
        };
        let rank = self.env.rank;
        match backend {
            Backend::Gloo => {
                let host = self.env.advertised_host()?;
                let mesh = TcpMesh::connect(rendezvous, &host, self.timeout)?;
                ParallelState::build(layout, rank, sequence_parallel, |kind, members| {
                    mesh.group(kind.name(), members)
                })
            }
            Backend::Nccl => {
                if !device.is_cuda() {
                    bail!("--distributed-backend nccl needs GPUs but this rank runs on {device:?}; use --distributed-backend gloo on CPUs");
                }
                ParallelState::build(layout, rank, sequence_parallel, |kind, members| {
                    let key = format!("nccl/{}/{members:?}", kind.name());
                    let position = members
                        .iter()
                        .position(|&m| m == rank)
                        .expect("groups contain their rank");
                    let id: [u8; 128] = if position == 0 {
                        let id = super::nccl::NcclCommunicator::unique_id()?;
                        rendezvous.set(&key, &id)?;
                        id
                    } else {
                        rendezvous
                            .get(&key)?
                            .try_into()
                            .map_err(|_| anyhow::anyhow!("malformed NCCL id under {key}"))?
                    };
                    let communicator =
                        super::nccl::NcclCommunicator::new(id, members.len(), position, device)
                            .with_context(|| {
                                format!(
                                    "creating the NCCL communicator of the {} group {members:?}",
                                    kind.name()
                                )
                            })?;
                    Ok(Arc::new(communicator) as Arc<dyn Communicator>)
                })
            }
        }
    }

    /// Ends this rank's part cleanly so the others' watchdogs stay quiet.
    pub fn finish(&self) -> Result<()> {
        match &self.rendezvous {
            Some(rendezvous) => rendezvous.finish(),
            None => Ok(()),
        }
    }
}
