//! The rendezvous of a multi-process job, like torch's TCPStore: rank 0 hosts a key-value store
//! on `MASTER_ADDR:MASTER_PORT`, the ranks exchange addresses and NCCL ids through it, and it
//! watches them. Every rank keeps a second connection open for its lifetime; when one closes
//! without saying goodbye (the process died), the store tells every other rank, which prints
//! why and exits non-zero instead of hanging in a collective that can never complete.

use std::collections::{BTreeSet, HashMap};
use std::io::{BufReader, BufWriter, Read, Write};
use std::net::{TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};

use megatron_kernels::runtime::TorchStore;

use super::launch::{LaunchEnv, RendezvousPlace};

#[derive(Debug, Serialize, Deserialize)]
enum Request {
    Set {
        key: String,
        value: Vec<u8>,
    },
    /// Waits up to `timeout_ms` for the key to be set.
    Get {
        key: String,
        timeout_ms: u64,
    },
    /// Adds to a counter and returns its new value.
    Add {
        key: String,
        amount: u64,
    },
    /// Opens the watch connection of `rank`.
    Watch {
        rank: usize,
    },
    /// Waits up to `timeout_ms` for every rank's watch connection.
    AwaitWorld {
        timeout_ms: u64,
    },
    /// This rank finished cleanly; its watch connection may close.
    Goodbye,
}

#[derive(Debug, Serialize, Deserialize)]
enum Reply {
    Value(Vec<u8>),
    Count(u64),
    Done,
    Failed(String),
    /// Sent on watch connections: another rank died.
    Abort(String),
}

fn write_frame<T: Serialize>(stream: &mut impl Write, message: &T) -> Result<()> {
    let bytes = serde_json::to_vec(message)?;
    stream.write_all(&(bytes.len() as u32).to_le_bytes())?;
    stream.write_all(&bytes)?;
    stream.flush()?;
    Ok(())
}

fn read_frame<T: for<'de> Deserialize<'de>>(stream: &mut impl Read) -> Result<T> {
    let mut length = [0u8; 4];
    stream.read_exact(&mut length)?;
    let mut bytes = vec![0u8; u32::from_le_bytes(length) as usize];
    stream.read_exact(&mut bytes)?;
    Ok(serde_json::from_slice(&bytes)?)
}

/// The store's state, on rank 0.
struct StoreState {
    world_size: usize,
    values: Mutex<HashMap<String, Vec<u8>>>,
    changed: Condvar,
    /// Ranks whose watch connection is open, and ranks that said goodbye.
    joined: Mutex<(BTreeSet<usize>, BTreeSet<usize>)>,
    joined_changed: Condvar,
    watchers: Mutex<Vec<TcpStream>>,
}

impl StoreState {
    fn serve(self: Arc<Self>, listener: TcpListener) {
        for stream in listener.incoming().flatten() {
            let state = self.clone();
            std::thread::spawn(move || state.connection(stream));
        }
    }

    fn connection(self: Arc<Self>, stream: TcpStream) {
        let _ = stream.set_nodelay(true);
        let Ok(writer) = stream.try_clone() else {
            return;
        };
        let (mut reader, mut writer) = (BufReader::new(stream), BufWriter::new(writer));
        let mut watching = None;
        loop {
            let request: Request = match read_frame(&mut reader) {
                Ok(request) => request,
                Err(_) => break,
            };
            let reply = match request {
                Request::Set { key, value } => {
                    self.values.lock().unwrap().insert(key, value);
                    self.changed.notify_all();
                    Reply::Done
                }
                Request::Get { key, timeout_ms } => {
                    self.get(&key, Duration::from_millis(timeout_ms))
                }
                Request::Add { key, amount } => {
                    let mut values = self.values.lock().unwrap();
                    let entry = values
                        .entry(key)
                        .or_insert_with(|| 0u64.to_le_bytes().to_vec());
                    let count =
                        u64::from_le_bytes(entry[..8].try_into().expect("counters are 8 bytes"))
                            + amount;
                    *entry = count.to_le_bytes().to_vec();
                    self.changed.notify_all();
                    Reply::Count(count)
                }
                Request::Watch { rank } => {
                    watching = Some(rank);
                    if let Ok(copy) = writer.get_ref().try_clone() {
                        self.watchers.lock().unwrap().push(copy);
                    }
                    self.joined.lock().unwrap().0.insert(rank);
                    self.joined_changed.notify_all();
                    Reply::Done
                }
                Request::AwaitWorld { timeout_ms } => {
                    self.await_world(Duration::from_millis(timeout_ms))
                }
                Request::Goodbye => {
                    if let Some(rank) = watching {
                        self.joined.lock().unwrap().1.insert(rank);
                        self.joined_changed.notify_all();
                    }
                    Reply::Done
                }
            };
            if write_frame(&mut writer, &reply).is_err() {
                break;
            }
        }
        if let Some(rank) = watching {
            if !self.joined.lock().unwrap().1.contains(&rank) {
                self.abort(&format!(
                    "rank {rank} exited unexpectedly (its connection to the rendezvous closed)"
                ));
            }
        }
    }

    fn get(&self, key: &str, timeout: Duration) -> Reply {
        let deadline = Instant::now() + timeout;
        let mut values = self.values.lock().unwrap();
        loop {
            if let Some(value) = values.get(key) {
                return Reply::Value(value.clone());
            }
            let now = Instant::now();
            if now >= deadline {
                return Reply::Failed(format!(
                    "timed out after {:.0} s waiting for {key:?}",
                    timeout.as_secs_f64()
                ));
            }
            values = self.changed.wait_timeout(values, deadline - now).unwrap().0;
        }
    }

    fn await_world(&self, timeout: Duration) -> Reply {
        let deadline = Instant::now() + timeout;
        let mut joined = self.joined.lock().unwrap();
        while joined.0.len() < self.world_size {
            let now = Instant::now();
            if now >= deadline {
                let missing: Vec<String> = (0..self.world_size)
                    .filter(|r| !joined.0.contains(r))
                    .map(|r| r.to_string())
                    .collect();
                return Reply::Failed(format!(
                    "rank(s) {} of {} did not join within {:.0} s",
                    missing.join(", "),
                    self.world_size,
                    timeout.as_secs_f64()
                ));
            }
            joined = self
                .joined_changed
                .wait_timeout(joined, deadline - now)
                .unwrap()
                .0;
        }
        Reply::Done
    }

    fn abort(&self, message: &str) {
        for watcher in self.watchers.lock().unwrap().iter_mut() {
            let _ = write_frame(watcher, &Reply::Abort(message.to_string()));
        }
    }

    /// Waits (bounded) until every rank said goodbye, so rank 0 does not close the store under
    /// ranks that are still finishing.
    fn await_goodbyes(&self, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        let mut joined = self.joined.lock().unwrap();
        while joined.1.len() < self.world_size && Instant::now() < deadline {
            joined = self
                .joined_changed
                .wait_timeout(joined, Duration::from_millis(50))
                .unwrap()
                .0;
        }
    }
}

/// This rank's handle on the job's rendezvous.
pub struct Rendezvous {
    pub rank: usize,
    pub world_size: usize,
    timeout: Duration,
    client: Mutex<TcpStream>,
    watch: Mutex<TcpStream>,
    finished: Arc<AtomicBool>,
    store: Option<Arc<StoreState>>,
    address: String,
}

/// Rank 0's listener for the rendezvous and the address the other ranks connect to: on
/// `MASTER_PORT`, or under torchrun on a port the system picks, published in torchrun's store.
fn listen(env: &LaunchEnv, timeout: Duration) -> Result<(TcpListener, String)> {
    match &env.rendezvous {
        RendezvousPlace::MasterPort => {
            let listener = TcpListener::bind(("0.0.0.0", env.master_port)).with_context(|| {
                format!(
                    "rank 0 cannot listen on port {} for the rendezvous ($MASTER_PORT): \
                     another job may hold it; pick a free port",
                    env.master_port
                )
            })?;
            Ok((listener, format!("{}:{}", env.master_addr, env.master_port)))
        }
        RendezvousPlace::TorchrunStore { key } => {
            let listener = TcpListener::bind("0.0.0.0:0")
                .context("rank 0 cannot listen on a TCP port for the rendezvous")?;
            let address = format!(
                "{}:{}",
                env.advertised_host()?,
                listener.local_addr()?.port()
            );
            torchrun_store(env, timeout)?
                .set(key, address.as_bytes())
                .with_context(|| {
                    format!("publishing the rendezvous in torchrun's store ({key})")
                })?;
            Ok((listener, address))
        }
    }
}

/// Where rank 0 hosts the rendezvous, as the other ranks learn it.
fn rank_zero_address(env: &LaunchEnv, timeout: Duration) -> Result<String> {
    match &env.rendezvous {
        RendezvousPlace::MasterPort => Ok(format!("{}:{}", env.master_addr, env.master_port)),
        RendezvousPlace::TorchrunStore { key } => {
            let address = torchrun_store(env, timeout)?.get(key).with_context(|| {
                format!(
                    "rank {}: rank 0 never published the rendezvous in torchrun's store ({key}) \
                     within {} s",
                    env.rank,
                    timeout.as_secs()
                )
            })?;
            String::from_utf8(address).context("a malformed rendezvous address in torchrun's store")
        }
    }
}

/// torchrun's agent store on `MASTER_ADDR:MASTER_PORT`.
fn torchrun_store(env: &LaunchEnv, timeout: Duration) -> Result<TorchStore> {
    TorchStore::connect(&env.master_addr, env.master_port, timeout).with_context(|| {
        format!(
            "rank {}: cannot reach torchrun's store at {}:{}",
            env.rank, env.master_addr, env.master_port
        )
    })
}

impl Rendezvous {
    /// Joins the job: rank 0 starts the store, everyone connects (retrying until `timeout`),
    /// and all wait until every rank has joined. From then on a rank that dies makes the
    /// others exit.
    pub fn join(env: &LaunchEnv, timeout: Duration) -> Result<Self> {
        let (store, address) = if env.rank == 0 {
            let (listener, address) = listen(env, timeout)?;
            let state = Arc::new(StoreState {
                world_size: env.world_size,
                values: Mutex::new(HashMap::new()),
                changed: Condvar::new(),
                joined: Mutex::new((BTreeSet::new(), BTreeSet::new())),
                joined_changed: Condvar::new(),
                watchers: Mutex::new(Vec::new()),
            });
            let serving = state.clone();
            std::thread::spawn(move || serving.serve(listener));
            (Some(state), address)
        } else {
            (None, rank_zero_address(env, timeout)?)
        };
        let client = connect(&address, timeout, env.rank)?;
        let mut watch = connect(&address, timeout, env.rank)?;
        write_frame(&mut watch, &Request::Watch { rank: env.rank })?;
        expect_done(read_frame(&mut watch)?, &address)?;
        let rendezvous = Rendezvous {
            rank: env.rank,
            world_size: env.world_size,
            timeout,
            client: Mutex::new(client),
            watch: Mutex::new(watch.try_clone()?),
            finished: Arc::new(AtomicBool::new(false)),
            store,
            address: address.clone(),
        };
        let reply = rendezvous.request(&Request::AwaitWorld {
            timeout_ms: timeout.as_millis() as u64,
        })?;
        expect_done(reply, &address)?;
        let finished = rendezvous.finished.clone();
        let rank = env.rank;
        std::thread::spawn(move || watchdog(watch, finished, rank));
        Ok(rendezvous)
    }

    fn request(&self, request: &Request) -> Result<Reply> {
        let mut client = self.client.lock().unwrap();
        write_frame(&mut *client, request)
            .and_then(|_| read_frame(&mut *client))
            .with_context(|| {
                format!(
                    "rank {}: lost the rendezvous at {} (rank 0 may have exited)",
                    self.rank, self.address
                )
            })
    }

    pub fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        expect_done(
            self.request(&Request::Set {
                key: key.into(),
                value: value.to_vec(),
            })?,
            &self.address,
        )
    }

    /// The value of `key`, waiting for another rank to set it.
    pub fn get(&self, key: &str) -> Result<Vec<u8>> {
        match self.request(&Request::Get {
            key: key.into(),
            timeout_ms: self.timeout.as_millis() as u64,
        })? {
            Reply::Value(value) => Ok(value),
            Reply::Failed(message) => bail!(
                "rank {}: rendezvous at {}: {message}",
                self.rank,
                self.address
            ),
            other => bail!("rendezvous at {}: unexpected reply {other:?}", self.address),
        }
    }

    /// Waits until all ranks reached the barrier called `name`.
    pub fn barrier(&self, name: &str) -> Result<()> {
        let key = format!("barrier/{name}");
        let Reply::Count(count) = self.request(&Request::Add {
            key: key.clone(),
            amount: 1,
        })?
        else {
            bail!(
                "rendezvous at {}: unexpected reply to a counter",
                self.address
            );
        };
        if count as usize == self.world_size {
            self.set(&format!("{key}/done"), &[])?;
        }
        self.get(&format!("{key}/done"))
            .with_context(|| format!("barrier {name:?}"))?;
        Ok(())
    }

    /// Ends this rank's part cleanly: after it, closing the connections alarms nobody. Rank 0
    /// keeps the store up until every rank has finished.
    pub fn finish(&self) -> Result<()> {
        self.barrier("finish")?;
        self.finished.store(true, Ordering::SeqCst);
        {
            let mut watch = self.watch.lock().unwrap();
            write_frame(&mut *watch, &Request::Goodbye)?;
        }
        if let Some(store) = &self.store {
            store.await_goodbyes(Duration::from_secs(30));
        }
        Ok(())
    }
}

fn expect_done(reply: Reply, address: &str) -> Result<()> {
    match reply {
        Reply::Done => Ok(()),
        Reply::Failed(message) => bail!("rendezvous at {address}: {message}"),
        other => bail!("rendezvous at {address}: unexpected reply {other:?}"),
    }
}

fn connect(address: &str, timeout: Duration, rank: usize) -> Result<TcpStream> {
    let deadline = Instant::now() + timeout;
    loop {
        let attempt = address
            .to_socket_addrs()
            .map_err(anyhow::Error::from)
            .and_then(|mut addrs| {
                let addr = addrs
                    .next()
                    .with_context(|| format!("{address} resolves to no address"))?;
                Ok(TcpStream::connect_timeout(&addr, Duration::from_secs(5))?)
            });
        match attempt {
            Ok(stream) => {
                stream.set_nodelay(true)?;
                return Ok(stream);
            }
            Err(e) if Instant::now() >= deadline => {
                bail!(
                    "rank {rank}: could not reach the rendezvous at {address} within {:.0} s ({e}); is rank 0 running, \
                     and are $MASTER_ADDR/$MASTER_PORT right?",
                    timeout.as_secs_f64()
                )
            }
            Err(_) => std::thread::sleep(Duration::from_millis(100)),
        }
    }
}

/// Runs for the life of the process: exits it when the store reports a dead rank, or when the
/// store itself (rank 0) goes away before this rank finished.
fn watchdog(watch: TcpStream, finished: Arc<AtomicBool>, rank: usize) {
    let mut reader = BufReader::new(watch);
    let message = loop {
        match read_frame::<Reply>(&mut reader) {
            Ok(Reply::Abort(message)) => break message,
            Ok(_) => continue,
            Err(_) if finished.load(Ordering::SeqCst) => return,
            Err(_) => {
                break "rank 0 exited unexpectedly (the rendezvous it hosts closed)".to_string()
            }
        }
    };
    if finished.load(Ordering::SeqCst) {
        return;
    }
    eprintln!("error: rank {rank}: {message}; stopping this rank too");
    // A collective with a dead peer never returns, and CUDA teardown could wait on it, so
    // leave without running destructors.
    unsafe { libc::_exit(1) };
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::launch::NodePlace;

    fn free_port() -> u16 {
        TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port()
    }

    fn env(rank: usize, world_size: usize, port: u16) -> LaunchEnv {
        LaunchEnv {
            rank,
            world_size,
            local_rank: rank,
            node: NodePlace::one_node(world_size),
            master_addr: "127.0.0.1".into(),
            master_port: port,
            rendezvous: RendezvousPlace::MasterPort,
        }
    }

    #[test]
    fn ranks_exchange_values_and_meet_at_barriers() {
        let port = free_port();
        let results: Vec<Vec<u8>> = std::thread::scope(|scope| {
            let handles: Vec<_> = (0..3)
                .map(|rank| {
                    scope.spawn(move || {
                        let r =
                            Rendezvous::join(&env(rank, 3, port), Duration::from_secs(20)).unwrap();
                        r.set(&format!("addr/{rank}"), &[rank as u8]).unwrap();
                        r.barrier("set").unwrap();
                        let next = r.get(&format!("addr/{}", (rank + 1) % 3)).unwrap();
                        r.finish().unwrap();
                        next
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        assert_eq!(results, vec![vec![1], vec![2], vec![0]]);
    }

    #[test]
    fn a_missing_rank_is_named_after_the_timeout() {
        let port = free_port();
        let error = std::thread::scope(|scope| {
            let follower =
                scope.spawn(move || Rendezvous::join(&env(1, 3, port), Duration::from_secs(2)));
            let leader = Rendezvous::join(&env(0, 3, port), Duration::from_secs(2));
            let _ = follower.join();
            leader.err().expect("rank 2 never joins")
        });
        let message = format!("{error:#}");
        assert!(message.contains("rank(s) 2 of 3 did not join"), "{message}");
    }
}
