//! `--distributed-backend gloo`: ranks as processes on CPUs, every pair connected by TCP.
//! Tensors travel whole and the collectives are computed on the host (see [`super::host`]),
//! which is what small CPU jobs and tests need; GPUs use NCCL.

use std::collections::{HashMap, VecDeque};
use std::io::{BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};
use serde::{Deserialize, Serialize};
use tch::{Device, Kind, Tensor};

use super::communicator::Communicator;
use super::host::{HostCollectives, HostTransport};
use super::rendezvous::Rendezvous;

/// What precedes a tensor's bytes on the wire.
#[derive(Serialize, Deserialize)]
struct Header {
    channel: u64,
    operation: String,
    kind: String,
    shape: Vec<i64>,
    bytes: u64,
}

struct Message {
    operation: String,
    tensor: Tensor,
}

/// Messages received from each peer, by (peer, channel).
#[derive(Default)]
struct Inbox {
    queues: HashMap<(usize, u64), VecDeque<Message>>,
    /// Peers whose connection ended, and why.
    closed: HashMap<usize, String>,
}

/// This process's connections to every other rank.
pub struct TcpMesh {
    rank: usize,
    timeout: Duration,
    writers: HashMap<usize, Mutex<TcpStream>>,
    inbox: Arc<(Mutex<Inbox>, Condvar)>,
}

fn kind_name(kind: Kind) -> Result<&'static str> {
    Ok(match kind {
        Kind::Float => "f32",
        Kind::Double => "f64",
        Kind::BFloat16 => "bf16",
        Kind::Half => "f16",
        Kind::Int64 => "i64",
        Kind::Int => "i32",
        Kind::Int8 => "i8",
        Kind::Uint8 => "u8",
        Kind::Bool => "bool",
        other => bail!("the gloo backend cannot send {other:?} tensors"),
    })
}

fn kind_of(name: &str) -> Result<Kind> {
    Ok(match name {
        "f32" => Kind::Float,
        "f64" => Kind::Double,
        "bf16" => Kind::BFloat16,
        "f16" => Kind::Half,
        "i64" => Kind::Int64,
        "i32" => Kind::Int,
        "i8" => Kind::Int8,
        "u8" => Kind::Uint8,
        "bool" => Kind::Bool,
        other => bail!("unknown tensor kind {other:?} on the wire"),
    })
}

fn tensor_bytes(tensor: &Tensor) -> Vec<u8> {
    let tensor = tensor.to_device(Device::Cpu).contiguous();
    let len = tensor.numel() * tensor.kind().elt_size_in_bytes();
    let mut bytes = vec![0u8; len];
    if len > 0 {
        // SAFETY: a contiguous CPU tensor owns `len` readable bytes at its data pointer.
        unsafe {
            std::ptr::copy_nonoverlapping(tensor.data_ptr() as *const u8, bytes.as_mut_ptr(), len)
        };
    }
    bytes
}

impl TcpMesh {
    /// Connects every pair of ranks: each listens, publishes its address through the
    /// rendezvous, and dials the ranks below it.
    pub fn connect(
        rendezvous: &Rendezvous,
        advertised_host: &str,
        timeout: Duration,
    ) -> Result<Arc<Self>> {
        let (rank, world) = (rendezvous.rank, rendezvous.world_size);
        let listener =
            TcpListener::bind("0.0.0.0:0").context("gloo backend: cannot listen on a TCP port")?;
        let port = listener.local_addr()?.port();
        rendezvous.set(
            &format!("gloo/address/{rank}"),
            format!("{advertised_host}:{port}").as_bytes(),
        )?;
        let mut streams = HashMap::new();
        for peer in 0..rank {
            let address = String::from_utf8(rendezvous.get(&format!("gloo/address/{peer}"))?)?;
            let mut stream = TcpStream::connect(&address)
                .with_context(|| format!("gloo backend: connecting to rank {peer} at {address}"))?;
            stream.write_all(&(rank as u64).to_le_bytes())?;
            streams.insert(peer, stream);
        }
        for _ in rank + 1..world {
            let (mut stream, _) = listener
                .accept()
                .context("gloo backend: accepting a peer")?;
            let mut peer = [0u8; 8];
            stream.read_exact(&mut peer)?;
            streams.insert(u64::from_le_bytes(peer) as usize, stream);
        }
        let inbox = Arc::new((Mutex::new(Inbox::default()), Condvar::new()));
        let mut writers = HashMap::new();
        for (peer, stream) in streams {
            stream.set_nodelay(true)?;
            let reader = stream.try_clone()?;
            let inbox = inbox.clone();
            std::thread::spawn(move || receive_from(peer, reader, inbox));
            writers.insert(peer, Mutex::new(stream));
        }
        Ok(Arc::new(TcpMesh {
            rank,
            timeout,
            writers,
            inbox,
        }))
    }

    /// The communicator of the group of world ranks `members` (containing this rank).
    pub fn group(
        self: &Arc<Self>,
        label: &str,
        members: &[usize],
    ) -> Result<Arc<dyn Communicator>> {
        let position = members
            .iter()
            .position(|&m| m == self.rank)
            .with_context(|| format!("rank {} is not in {label} group {members:?}", self.rank))?;
        // Groups of different kinds can hold the same ranks; the label keeps their traffic apart.
        let member_bytes = members.iter().flat_map(|&m| (m as u64).to_le_bytes());
        let channel = megatron_kernels::fnv::fnv1a(label.bytes().chain(member_bytes));
        Ok(Arc::new(HostCollectives(TcpGroup {
            mesh: self.clone(),
            label: label.to_string(),
            members: members.to_vec(),
            position,
            channel,
        })))
    }

    fn send(&self, peer: usize, channel: u64, operation: &str, tensor: &Tensor) -> Result<()> {
        let bytes = tensor_bytes(tensor);
        let header = Header {
            channel,
            operation: operation.to_string(),
            kind: kind_name(tensor.kind())?.into(),
            shape: tensor.size(),
            bytes: bytes.len() as u64,
        };
        let header = serde_json::to_vec(&header)?;
        let writer = self
            .writers
            .get(&peer)
            .with_context(|| format!("no connection to rank {peer}"))?;
        let mut stream = writer.lock().unwrap();
        let sent = stream
            .write_all(&(header.len() as u32).to_le_bytes())
            .and_then(|_| stream.write_all(&header))
            .and_then(|_| stream.write_all(&bytes));
        sent.with_context(|| {
            format!(
                "gloo backend: sending to rank {peer} failed (rank {peer} exited unexpectedly?)"
            )
        })
    }

    fn receive(&self, peer: usize, channel: u64, waiting_for: &str) -> Result<Message> {
        let (inbox, arrived) = &*self.inbox;
        let started = Instant::now();
        let mut guard = inbox.lock().unwrap();
        loop {
            if let Some(message) = guard
                .queues
                .get_mut(&(peer, channel))
                .and_then(VecDeque::pop_front)
            {
                return Ok(message);
            }
            if let Some(reason) = guard.closed.get(&peer) {
                bail!("rank {peer} exited unexpectedly (its connection closed: {reason}) while rank {} waited for {waiting_for}", self.rank);
            }
            if started.elapsed() > self.timeout {
                bail!(
                    "rank {}: timed out after {:.0} s waiting for {waiting_for} from rank {peer}",
                    self.rank,
                    self.timeout.as_secs_f64()
                );
            }
            guard = arrived
                .wait_timeout(guard, Duration::from_millis(100))
                .unwrap()
                .0;
        }
    }
}

fn receive_from(peer: usize, stream: TcpStream, inbox: Arc<(Mutex<Inbox>, Condvar)>) {
    let mut reader = BufReader::new(stream);
    let reason = loop {
        match read_message(&mut reader) {
            Ok((channel, message)) => {
                let (inbox, arrived) = &*inbox;
                inbox
                    .lock()
                    .unwrap()
                    .queues
                    .entry((peer, channel))
                    .or_default()
                    .push_back(message);
                arrived.notify_all();
            }
            Err(e) => break format!("{e:#}"),
        }
    };
    let (inbox, arrived) = &*inbox;
    inbox.lock().unwrap().closed.insert(peer, reason);
    arrived.notify_all();
}

fn read_message(reader: &mut impl Read) -> Result<(u64, Message)> {
    let mut length = [0u8; 4];
    reader.read_exact(&mut length)?;
    let mut header = vec![0u8; u32::from_le_bytes(length) as usize];
    reader.read_exact(&mut header)?;
    let header: Header = serde_json::from_slice(&header)?;
    let mut bytes = vec![0u8; header.bytes as usize];
    reader.read_exact(&mut bytes)?;
    let kind = kind_of(&header.kind)?;
    let expected = header.shape.iter().product::<i64>() as usize * kind.elt_size_in_bytes();
    ensure!(
        expected == bytes.len(),
        "a {:?} {} tensor arrived with {} bytes",
        header.shape,
        header.kind,
        bytes.len()
    );
    let tensor = Tensor::from_data_size(&bytes, &header.shape, kind);
    Ok((
        header.channel,
        Message {
            operation: header.operation,
            tensor,
        },
    ))
}

struct TcpGroup {
    mesh: Arc<TcpMesh>,
    label: String,
    members: Vec<usize>,
    position: usize,
    channel: u64,
}

impl TcpGroup {
    fn p2p_channel(&self) -> u64 {
        self.channel.wrapping_add(1)
    }
}

impl HostTransport for TcpGroup {
    fn rank(&self) -> usize {
        self.position
    }

    fn size(&self) -> usize {
        self.members.len()
    }

    fn label(&self) -> &str {
        &self.label
    }

    fn collect(&self, operation: String, contribution: Tensor) -> Result<Vec<Tensor>> {
        for (position, &peer) in self.members.iter().enumerate() {
            if position != self.position {
                self.mesh
                    .send(peer, self.channel, &operation, &contribution)?;
            }
        }
        let mut all = Vec::with_capacity(self.members.len());
        for (position, &peer) in self.members.iter().enumerate() {
            if position == self.position {
                all.push(contribution.shallow_clone());
                continue;
            }
            let message = self.mesh.receive(
                peer,
                self.channel,
                &format!("{} group: {operation}", self.label),
            )?;
            ensure!(
                message.operation == operation,
                "{} group: rank {peer} called {} while rank {} called {operation}",
                self.label,
                message.operation,
                self.mesh.rank
            );
            all.push(message.tensor);
        }
        Ok(all)
    }

    fn send(&self, peer: usize, tensor: Tensor) -> Result<()> {
        self.mesh
            .send(self.members[peer], self.p2p_channel(), "send", &tensor)
    }

    fn recv(&self, peer: usize) -> Result<Tensor> {
        let waiting_for = format!("{} group: a point-to-point message", self.label);
        Ok(self
            .mesh
            .receive(self.members[peer], self.p2p_channel(), &waiting_for)?
            .tensor)
    }
}

#[cfg(test)]
mod tests {
    use std::net::TcpListener;

    use super::*;
    use crate::launch::{LaunchEnv, NodePlace, RendezvousPlace};

    /// Three ranks over real sockets on this host (the gloo backend of CPU jobs).
    #[test]
    fn all_to_all_with_uneven_and_empty_splits() {
        let port = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let timeout = Duration::from_secs(30);
        std::thread::scope(|scope| {
            let ranks: Vec<_> = (0..3)
                .map(|rank| {
                    scope.spawn(move || -> Result<()> {
                        let env = LaunchEnv {
                            rank,
                            world_size: 3,
                            local_rank: rank,
                            node: NodePlace::one_node(3),
                            master_addr: "127.0.0.1".into(),
                            master_port: port,
                            rendezvous: RendezvousPlace::MasterPort,
                        };
                        let rendezvous = Rendezvous::join(&env, timeout)?;
                        let mesh = TcpMesh::connect(&rendezvous, "127.0.0.1", timeout)?;
                        let group = mesh.group("expert", &[0, 1, 2])?;
                        crate::communicator::check_all_to_all(group.as_ref())?;
                        rendezvous.finish()
                    })
                })
                .collect();
            for (rank, handle) in ranks.into_iter().enumerate() {
                handle
                    .join()
                    .unwrap()
                    .unwrap_or_else(|e| panic!("rank {rank}: {e:#}"));
            }
        });
    }
}
