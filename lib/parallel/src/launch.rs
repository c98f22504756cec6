//! Where a process sits in a multi-process job, read from the launcher's environment: torchrun
//! (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR`, `MASTER_PORT`), Slurm (`SLURM_PROCID`,
//! `SLURM_NTASKS`, `SLURM_LOCALID`, the first host of `SLURM_JOB_NODELIST`), Open MPI's
//! `mpirun` (`OMPI_COMM_WORLD_RANK`, `_SIZE`, `_LOCAL_RANK`) or MPICH/Intel MPI's (`PMI_RANK`,
//! `PMI_SIZE`, `MPI_LOCALRANKID`).

use anyhow::{bail, ensure, Context, Result};

/// torchrun's default rendezvous port.
pub const DEFAULT_MASTER_PORT: u16 = 29500;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LaunchEnv {
    pub rank: usize,
    pub world_size: usize,
    pub local_rank: usize,
    pub master_addr: String,
    pub master_port: u16,
    pub rendezvous: RendezvousPlace,
}

/// Where the ranks of a job meet.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RendezvousPlace {
    /// Rank 0 hosts the rendezvous on `MASTER_PORT`.
    MasterPort,
    /// torchrun's agent serves a c10d TCPStore on `MASTER_PORT`
    /// (`TORCHELASTIC_USE_AGENT_STORE`): rank 0 hosts the rendezvous on a port the system
    /// picks, so two jobs on one host never want the same one, and publishes its address in
    /// the agent's store under `key` (one per run and restart).
    TorchrunStore { key: String },
}

impl LaunchEnv {
    /// One process on its own: no launcher variables.
    pub fn single() -> Self {
        LaunchEnv {
            rank: 0,
            world_size: 1,
            local_rank: 0,
            master_addr: "127.0.0.1".into(),
            master_port: DEFAULT_MASTER_PORT,
            rendezvous: RendezvousPlace::MasterPort,
        }
    }

    /// Reads this process's environment.
    pub fn from_env() -> Result<Self> {
        Self::from_vars(|name| std::env::var(name).ok())
    }

    /// Reads the launcher variables through `var`; torchrun's take precedence over Slurm's,
    /// Slurm's over MPI's.
    pub fn from_vars(var: impl Fn(&str) -> Option<String>) -> Result<Self> {
        let number = |name: &str| -> Result<Option<usize>> {
            var(name)
                .map(|v| {
                    v.trim()
                        .parse::<usize>()
                        .with_context(|| format!("${name}={v:?} is not a number"))
                })
                .transpose()
        };
        let (rank, world_size, local_rank) = if let Some(world_size) = number("WORLD_SIZE")? {
            let rank = number("RANK")?.context("$WORLD_SIZE is set but $RANK is not")?;
            (rank, world_size, number("LOCAL_RANK")?.unwrap_or(0))
        } else if let Some(world_size) = number("SLURM_NTASKS")? {
            let rank =
                number("SLURM_PROCID")?.context("$SLURM_NTASKS is set but $SLURM_PROCID is not")?;
            (rank, world_size, number("SLURM_LOCALID")?.unwrap_or(0))
        } else if let Some(world_size) = number("OMPI_COMM_WORLD_SIZE")? {
            let rank = number("OMPI_COMM_WORLD_RANK")?
                .context("$OMPI_COMM_WORLD_SIZE is set but $OMPI_COMM_WORLD_RANK is not")?;
            (
                rank,
                world_size,
                number("OMPI_COMM_WORLD_LOCAL_RANK")?.unwrap_or(0),
            )
        } else if let Some(world_size) = number("PMI_SIZE")? {
            let rank = number("PMI_RANK")?.context("$PMI_SIZE is set but $PMI_RANK is not")?;
            (rank, world_size, number("MPI_LOCALRANKID")?.unwrap_or(0))
        } else {
            return Ok(Self::single());
        };
        ensure!(world_size > 0, "$WORLD_SIZE must be positive");
        ensure!(
            rank < world_size,
            "rank {rank} is outside a world of {world_size}"
        );
        let master_addr = match var("MASTER_ADDR") {
            Some(addr) => addr,
            None => match var("SLURM_JOB_NODELIST").or_else(|| var("SLURM_NODELIST")) {
                Some(list) => first_host(&list)?,
                None if world_size == 1 => "127.0.0.1".into(),
                None => bail!(
                    "$MASTER_ADDR is not set (nor a Slurm node list to take the first host from)"
                ),
            },
        };
        let master_port = match var("MASTER_PORT") {
            Some(port) => port
                .trim()
                .parse()
                .with_context(|| format!("$MASTER_PORT={port:?} is not a port number"))?,
            None => DEFAULT_MASTER_PORT,
        };
        let under_torchrun =
            var("TORCHELASTIC_USE_AGENT_STORE").is_some_and(|v| v.eq_ignore_ascii_case("true"));
        let rendezvous = if under_torchrun {
            RendezvousPlace::TorchrunStore {
                key: format!(
                    "megatron_rs/{}/{}/rendezvous",
                    var("TORCHELASTIC_RUN_ID").unwrap_or_default(),
                    var("TORCHELASTIC_RESTART_COUNT").unwrap_or_else(|| "0".into())
                ),
            }
        } else {
            RendezvousPlace::MasterPort
        };
        Ok(LaunchEnv {
            rank,
            world_size,
            local_rank,
            master_addr,
            master_port,
            rendezvous,
        })
    }

    /// The address other ranks reach this one at: the interface that routes to the master.
    pub fn advertised_host(&self) -> Result<String> {
        let probe = std::net::UdpSocket::bind("0.0.0.0:0")?;
        let master = format!("{}:{}", self.master_addr, self.master_port);
        probe
            .connect(&master)
            .with_context(|| format!("no route to the master at {master}"))?;
        Ok(probe.local_addr()?.ip().to_string())
    }
}

/// The first host of a Slurm node list such as `gpu[003-007,010],login1`.
pub fn first_host(list: &str) -> Result<String> {
    let list = list.trim();
    let end = list.find([',', '[']).unwrap_or(list.len());
    let prefix = &list[..end];
    if list[end..].starts_with('[') {
        let inner = &list[end + 1..];
        let first = inner
            .split([',', '-', ']'])
            .next()
            .filter(|s| !s.is_empty());
        let first = first.with_context(|| format!("malformed Slurm node list {list:?}"))?;
        return Ok(format!("{prefix}{first}"));
    }
    ensure!(!prefix.is_empty(), "empty Slurm node list");
    Ok(prefix.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn env(pairs: &[(&str, &str)]) -> Result<LaunchEnv> {
        let vars: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        LaunchEnv::from_vars(|name| vars.get(name).cloned())
    }

    #[test]
    fn torchrun_variables() {
        let e = env(&[
            ("RANK", "3"),
            ("WORLD_SIZE", "8"),
            ("LOCAL_RANK", "3"),
            ("MASTER_ADDR", "node1"),
            ("MASTER_PORT", "6000"),
        ])
        .unwrap();
        assert_eq!(
            e,
            LaunchEnv {
                rank: 3,
                world_size: 8,
                local_rank: 3,
                master_addr: "node1".into(),
                master_port: 6000,
                rendezvous: RendezvousPlace::MasterPort,
            }
        );
        let torchrun = env(&[
            ("RANK", "0"),
            ("WORLD_SIZE", "2"),
            ("MASTER_ADDR", "h"),
            ("MASTER_PORT", "6000"),
            ("TORCHELASTIC_USE_AGENT_STORE", "True"),
            ("TORCHELASTIC_RUN_ID", "job7"),
            ("TORCHELASTIC_RESTART_COUNT", "2"),
        ]);
        assert_eq!(
            torchrun.unwrap().rendezvous,
            RendezvousPlace::TorchrunStore {
                key: "megatron_rs/job7/2/rendezvous".into()
            }
        );
        assert_eq!(env(&[]).unwrap(), LaunchEnv::single());
    }

    #[test]
    fn slurm_variables_and_node_lists() {
        let e = env(&[
            ("SLURM_PROCID", "9"),
            ("SLURM_NTASKS", "16"),
            ("SLURM_LOCALID", "1"),
            ("SLURM_JOB_NODELIST", "gpu[003-004]"),
        ]);
        let e = e.unwrap();
        assert_eq!(
            (
                e.rank,
                e.world_size,
                e.local_rank,
                e.master_addr.as_str(),
                e.master_port
            ),
            (9, 16, 1, "gpu003", 29500)
        );
        assert_eq!(first_host("a1,b2").unwrap(), "a1");
        assert_eq!(first_host("n[7,9-12],x").unwrap(), "n7");
        assert!(first_host("n[]").is_err());
    }

    #[test]
    fn mpirun_variables() {
        let open_mpi = env(&[
            ("OMPI_COMM_WORLD_RANK", "5"),
            ("OMPI_COMM_WORLD_SIZE", "8"),
            ("OMPI_COMM_WORLD_LOCAL_RANK", "1"),
            ("MASTER_ADDR", "n0"),
        ])
        .unwrap();
        assert_eq!(
            (open_mpi.rank, open_mpi.world_size, open_mpi.local_rank),
            (5, 8, 1)
        );
        let mpich = env(&[
            ("PMI_RANK", "3"),
            ("PMI_SIZE", "4"),
            ("MPI_LOCALRANKID", "3"),
            ("MASTER_ADDR", "n0"),
        ])
        .unwrap();
        assert_eq!((mpich.rank, mpich.world_size, mpich.local_rank), (3, 4, 3));
        let half = env(&[("OMPI_COMM_WORLD_SIZE", "2")]).unwrap_err();
        assert!(format!("{half:#}").contains("$OMPI_COMM_WORLD_RANK"));
    }

    #[test]
    fn inconsistent_variables_are_named() {
        assert!(format!("{:#}", env(&[("WORLD_SIZE", "2")]).unwrap_err()).contains("$RANK"));
        assert!(format!(
            "{:#}",
            env(&[("WORLD_SIZE", "2"), ("RANK", "2")]).unwrap_err()
        )
        .contains("outside"));
        assert!(format!(
            "{:#}",
            env(&[("WORLD_SIZE", "2"), ("RANK", "0")]).unwrap_err()
        )
        .contains("MASTER_ADDR"));
        assert!(format!(
            "{:#}",
            env(&[("WORLD_SIZE", "x"), ("RANK", "0")]).unwrap_err()
        )
        .contains("WORLD_SIZE"));
    }
}
