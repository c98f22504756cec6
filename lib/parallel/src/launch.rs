//! Where a process sits in a multi-process job, read from the launcher's environment: torchrun
//! (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`, `GROUP_RANK`, `GROUP_WORLD_SIZE`,
//! `MASTER_ADDR`, `MASTER_PORT`), Slurm (`SLURM_PROCID`, `SLURM_NTASKS`, `SLURM_LOCALID`,
//! `SLURM_NODEID`, `SLURM_NNODES`, `SLURM_TASKS_PER_NODE`, the first host of
//! `SLURM_JOB_NODELIST`), Open MPI's `mpirun` (`OMPI_COMM_WORLD_RANK`, `_SIZE`, `_LOCAL_RANK`,
//! `_LOCAL_SIZE`) or MPICH/Intel MPI's (`PMI_RANK`, `PMI_SIZE`, `MPI_LOCALRANKID`,
//! `MPI_LOCALNRANKS`).

use anyhow::{bail, ensure, Context, Result};

use super::address::{choose_address, interfaces, route_to};

/// torchrun's default rendezvous port.
pub const DEFAULT_MASTER_PORT: u16 = 29500;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LaunchEnv {
    pub rank: usize,
    pub world_size: usize,
    pub local_rank: usize,
    pub node: NodePlace,
    pub master_addr: String,
    pub master_port: u16,
    pub rendezvous: RendezvousPlace,
}

/// The node a process runs on, among the job's nodes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NodePlace {
    /// This node's index (torchrun's `GROUP_RANK`, `SLURM_NODEID`).
    pub node_rank: usize,
    /// How many nodes the job spans (`GROUP_WORLD_SIZE`, `SLURM_NNODES`).
    pub nodes: usize,
    /// How many of the job's processes run on this node (`LOCAL_WORLD_SIZE`).
    pub local_world_size: usize,
}

impl NodePlace {
    /// Every process of a `world_size` job on one node: what a launcher that says nothing
    /// about nodes (`RANK` and `WORLD_SIZE` set by hand) is taken to mean.
    pub fn one_node(world_size: usize) -> Self {
        NodePlace {
            node_rank: 0,
            nodes: 1,
            local_world_size: world_size,
        }
    }

    /// Whether consecutive groups of `size` ranks (tensor-parallel groups: Megatron numbers
    /// their ranks consecutively) each stay inside one node.
    pub fn holds_whole_groups(&self, size: usize) -> bool {
        self.nodes <= 1 || self.local_world_size % size.max(1) == 0
    }

    /// `local_world_size` processes on each node, ranks numbered node after node (mpirun's
    /// default mapping by slot).
    fn by_slot(rank: usize, world_size: usize, local_world_size: usize) -> Self {
        NodePlace {
            node_rank: rank / local_world_size.max(1),
            nodes: world_size.div_ceil(local_world_size.max(1)),
            local_world_size,
        }
    }
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
            node: NodePlace::one_node(1),
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
        let (rank, world_size, local_rank, node) = if let Some(world_size) = number("WORLD_SIZE")? {
            let rank = number("RANK")?.context("$WORLD_SIZE is set but $RANK is not")?;
            let node = match number("LOCAL_WORLD_SIZE")? {
                Some(local_world_size) => NodePlace {
                    node_rank: number("GROUP_RANK")?.unwrap_or(0),
                    nodes: number("GROUP_WORLD_SIZE")?.unwrap_or(1),
                    local_world_size,
                },
                None => NodePlace::one_node(world_size),
            };
            (rank, world_size, number("LOCAL_RANK")?.unwrap_or(0), node)
        } else if let Some(world_size) = number("SLURM_NTASKS")? {
            let rank =
                number("SLURM_PROCID")?.context("$SLURM_NTASKS is set but $SLURM_PROCID is not")?;
            let node_rank = number("SLURM_NODEID")?.unwrap_or(0);
            let nodes = match number("SLURM_NNODES")? {
                Some(nodes) => nodes,
                None => number("SLURM_JOB_NUM_NODES")?.unwrap_or(1),
            };
            let local_world_size = match var("SLURM_STEP_TASKS_PER_NODE")
                .map(|v| ("SLURM_STEP_TASKS_PER_NODE", v))
                .or_else(|| var("SLURM_TASKS_PER_NODE").map(|v| ("SLURM_TASKS_PER_NODE", v)))
            {
                Some((name, counts)) => tasks_on_node(&counts, node_rank)
                    .with_context(|| format!("${name}={counts:?}"))?,
                None => world_size.div_ceil(nodes.max(1)),
            };
            let node = NodePlace {
                node_rank,
                nodes,
                local_world_size,
            };
            (
                rank,
                world_size,
                number("SLURM_LOCALID")?.unwrap_or(0),
                node,
            )
        } else if let Some(world_size) = number("OMPI_COMM_WORLD_SIZE")? {
            let rank = number("OMPI_COMM_WORLD_RANK")?
                .context("$OMPI_COMM_WORLD_SIZE is set but $OMPI_COMM_WORLD_RANK is not")?;
            let node = match number("OMPI_COMM_WORLD_LOCAL_SIZE")? {
                Some(local) => NodePlace::by_slot(rank, world_size, local),
                None => NodePlace::one_node(world_size),
            };
            (
                rank,
                world_size,
                number("OMPI_COMM_WORLD_LOCAL_RANK")?.unwrap_or(0),
                node,
            )
        } else if let Some(world_size) = number("PMI_SIZE")? {
            let rank = number("PMI_RANK")?.context("$PMI_SIZE is set but $PMI_RANK is not")?;
            let node = match number("MPI_LOCALNRANKS")? {
                Some(local) => NodePlace::by_slot(rank, world_size, local),
                None => NodePlace::one_node(world_size),
            };
            (
                rank,
                world_size,
                number("MPI_LOCALRANKID")?.unwrap_or(0),
                node,
            )
        } else {
            return Ok(Self::single());
        };
        ensure!(world_size > 0, "$WORLD_SIZE must be positive");
        ensure!(
            rank < world_size,
            "rank {rank} is outside a world of {world_size}"
        );
        ensure!(
            local_rank < node.local_world_size,
            "local rank {local_rank} is outside the {} process(es) of its node",
            node.local_world_size
        );
        ensure!(
            node.node_rank < node.nodes,
            "node {} is outside a job of {} node(s)",
            node.node_rank,
            node.nodes
        );
        ensure!(
            node.local_world_size <= world_size,
            "{} processes per node in a world of {world_size}",
            node.local_world_size
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
            node,
            master_addr,
            master_port,
            rendezvous,
        })
    }

    /// The address other ranks reach this one at (see [`choose_address`]).
    pub fn advertised_host(&self) -> Result<String> {
        let route = route_to(&format!("{}:{}", self.master_addr, self.master_port))?;
        let ifname = std::env::var("GLOO_SOCKET_IFNAME").ok();
        let ifname = ifname.as_deref().filter(|name| !name.is_empty());
        let needs_interfaces = ifname.is_some() || (route.is_loopback() && self.node.nodes > 1);
        let interfaces = if needs_interfaces {
            interfaces()?
        } else {
            Vec::new()
        };
        let address = choose_address(route, self.node.nodes, ifname, &interfaces)?;
        Ok(match address {
            std::net::IpAddr::V6(v6) => format!("[{v6}]"),
            v4 => v4.to_string(),
        })
    }
}

/// The number of tasks on node `node` from a Slurm task count list such as `2(x3),1`.
pub fn tasks_on_node(counts: &str, node: usize) -> Result<usize> {
    let mut first_node = 0;
    for entry in counts.trim().split(',') {
        let (count, repeat) = match entry.split_once("(x") {
            Some((count, repeat)) => {
                let repeat = repeat
                    .strip_suffix(')')
                    .with_context(|| format!("malformed entry {entry:?}"))?;
                (
                    count,
                    repeat
                        .parse::<usize>()
                        .with_context(|| format!("malformed entry {entry:?}"))?,
                )
            }
            None => (entry, 1),
        };
        let count: usize = count
            .parse()
            .with_context(|| format!("malformed entry {entry:?}"))?;
        if node < first_node + repeat {
            return Ok(count);
        }
        first_node += repeat;
    }
    bail!("no task count for node {node} (the list covers {first_node} node(s))")
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

    /// The error `pairs` are refused with, as printed.
    fn refusal(pairs: &[(&str, &str)]) -> String {
        format!("{:#}", env(pairs).unwrap_err())
    }

    /// Rank, world size, local rank, master address and port.
    fn ranks_and_master(e: &LaunchEnv) -> (usize, usize, usize, &str, u16) {
        (
            e.rank,
            e.world_size,
            e.local_rank,
            e.master_addr.as_str(),
            e.master_port,
        )
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
                node: NodePlace::one_node(8),
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
        assert_eq!(ranks_and_master(&e.unwrap()), (9, 16, 1, "gpu003", 29500));
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
        assert!(refusal(&[("OMPI_COMM_WORLD_SIZE", "2")]).contains("$OMPI_COMM_WORLD_RANK"));
    }

    #[test]
    fn inconsistent_variables_are_named() {
        assert!(refusal(&[("WORLD_SIZE", "2")]).contains("$RANK"));
        assert!(refusal(&[("WORLD_SIZE", "2"), ("RANK", "2")]).contains("outside"));
        assert!(refusal(&[("WORLD_SIZE", "2"), ("RANK", "0")]).contains("MASTER_ADDR"));
        assert!(refusal(&[("WORLD_SIZE", "x"), ("RANK", "0")]).contains("WORLD_SIZE"));
    }

    #[test]
    fn torchrun_nodes() {
        // `torchrun --nnodes 2 --nproc-per-node 2`: the second process of the second node.
        let e = env(&[
            ("RANK", "3"),
            ("WORLD_SIZE", "4"),
            ("LOCAL_RANK", "1"),
            ("LOCAL_WORLD_SIZE", "2"),
            ("GROUP_RANK", "1"),
            ("GROUP_WORLD_SIZE", "2"),
            ("MASTER_ADDR", "node1"),
        ])
        .unwrap();
        assert_eq!((e.rank, e.local_rank), (3, 1));
        assert_eq!(
            e.node,
            NodePlace {
                node_rank: 1,
                nodes: 2,
                local_world_size: 2
            }
        );
        let message = refusal(&[
            ("RANK", "3"),
            ("WORLD_SIZE", "4"),
            ("LOCAL_RANK", "2"),
            ("LOCAL_WORLD_SIZE", "2"),
            ("MASTER_ADDR", "node1"),
        ]);
        assert!(
            message.contains("local rank 2 is outside the 2 process(es)"),
            "{message}"
        );
    }

    #[test]
    fn slurm_two_nodes() {
        // `srun -N 2 --ntasks-per-node 2` on gpu[01-02]: task 2 is the first of the second
        // node, and without $MASTER_ADDR the master is the first node.
        let e = env(&[
            ("SLURM_PROCID", "2"),
            ("SLURM_NTASKS", "4"),
            ("SLURM_LOCALID", "0"),
            ("SLURM_NODEID", "1"),
            ("SLURM_NNODES", "2"),
            ("SLURM_TASKS_PER_NODE", "2(x2)"),
            ("SLURM_JOB_NODELIST", "gpu[01-02]"),
            ("MASTER_PORT", "6000"),
        ])
        .unwrap();
        assert_eq!(ranks_and_master(&e), (2, 4, 0, "gpu01", 6000));
        assert_eq!(
            e.node,
            NodePlace {
                node_rank: 1,
                nodes: 2,
                local_world_size: 2
            }
        );
        // Uneven nodes, the step's own count first, and $SLURM_JOB_NUM_NODES.
        let uneven = env(&[
            ("SLURM_PROCID", "4"),
            ("SLURM_NTASKS", "5"),
            ("SLURM_LOCALID", "0"),
            ("SLURM_NODEID", "2"),
            ("SLURM_JOB_NUM_NODES", "3"),
            ("SLURM_TASKS_PER_NODE", "8(x3)"),
            ("SLURM_STEP_TASKS_PER_NODE", "2(x2),1"),
            ("SLURM_JOB_NODELIST", "a[7,9],b3"),
        ])
        .unwrap();
        assert_eq!(uneven.node.local_world_size, 1);
        assert_eq!(uneven.node.nodes, 3);
        assert_eq!(uneven.master_addr, "a7");
        // Without a task count, the tasks are spread evenly.
        let even = env(&[
            ("SLURM_PROCID", "1"),
            ("SLURM_NTASKS", "8"),
            ("SLURM_LOCALID", "1"),
            ("SLURM_NODEID", "0"),
            ("SLURM_NNODES", "2"),
            ("SLURM_NODELIST", "n1,n2"),
        ])
        .unwrap();
        assert_eq!(even.node.local_world_size, 4);
        let message = refusal(&[
            ("SLURM_PROCID", "3"),
            ("SLURM_NTASKS", "4"),
            ("SLURM_NODEID", "2"),
            ("SLURM_NNODES", "2"),
            ("SLURM_TASKS_PER_NODE", "2(x2)"),
            ("SLURM_JOB_NODELIST", "gpu[01-02]"),
        ]);
        assert!(
            message.contains("SLURM_TASKS_PER_NODE") && message.contains("node 2"),
            "{message}"
        );
    }

    #[test]
    fn tensor_parallel_groups_inside_nodes() {
        let two_by_four = NodePlace {
            node_rank: 0,
            nodes: 2,
            local_world_size: 4,
        };
        assert!(two_by_four.holds_whole_groups(2));
        assert!(two_by_four.holds_whole_groups(4));
        assert!(!two_by_four.holds_whole_groups(8));
        assert!(!two_by_four.holds_whole_groups(3));
        assert!(NodePlace::one_node(6).holds_whole_groups(4));
    }

    #[test]
    fn slurm_task_counts() {
        assert_eq!(tasks_on_node("4", 0).unwrap(), 4);
        assert_eq!(tasks_on_node("2(x3),1", 2).unwrap(), 2);
        assert_eq!(tasks_on_node("2(x3),1", 3).unwrap(), 1);
        assert!(tasks_on_node("2(x3),1", 4).is_err());
        assert!(format!("{:#}", tasks_on_node("2(x3", 0).unwrap_err()).contains("2(x3"));
        assert!(tasks_on_node("", 0).is_err());
    }

    #[test]
    fn mpirun_nodes_follow_the_slot_mapping() {
        let open_mpi = env(&[
            ("OMPI_COMM_WORLD_RANK", "5"),
            ("OMPI_COMM_WORLD_SIZE", "8"),
            ("OMPI_COMM_WORLD_LOCAL_RANK", "1"),
            ("OMPI_COMM_WORLD_LOCAL_SIZE", "4"),
            ("MASTER_ADDR", "n0"),
        ])
        .unwrap();
        assert_eq!(
            open_mpi.node,
            NodePlace {
                node_rank: 1,
                nodes: 2,
                local_world_size: 4
            }
        );
        let mpich = env(&[
            ("PMI_RANK", "3"),
            ("PMI_SIZE", "4"),
            ("MPI_LOCALRANKID", "1"),
            ("MPI_LOCALNRANKS", "2"),
            ("MASTER_ADDR", "n0"),
        ])
        .unwrap();
        assert_eq!((mpich.node.node_rank, mpich.node.nodes), (1, 2));
    }
}
