//! Ranks as threads of one process: the in-process backend behind the CPU tests of
//! model-parallel code. Collectives reduce in rank order, so every rank gets bit-identical
//! results, as with NCCL's deterministic algorithms.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use tch::Tensor;

use super::communicator::Communicator;
use super::host::{HostCollectives, HostTransport};

const POLL: Duration = Duration::from_millis(50);

/// A world of `size` ranks living in one process.
#[derive(Clone)]
pub struct ThreadWorld {
    shared: Arc<WorldState>,
}

struct WorldState {
    size: usize,
    timeout: Duration,
    /// Set when a rank fails; every blocked rank then returns this error.
    failure: Mutex<Option<String>>,
    groups: Mutex<HashMap<Vec<usize>, Arc<GroupState>>>,
}

struct GroupState {
    label: String,
    members: Vec<usize>,
    round: Mutex<Round>,
    round_changed: Condvar,
    /// Point-to-point queues keyed by (source, destination) group rank.
    mail: Mutex<HashMap<(usize, usize), VecDeque<Tensor>>>,
    mail_arrived: Condvar,
}

/// One collective in flight: ranks deposit their contribution, and once all have, each reads
/// them all; the last to read opens the next round.
struct Round {
    collecting: bool,
    operation: Option<String>,
    contributions: Vec<Option<Tensor>>,
    departed: usize,
}

impl ThreadWorld {
    pub fn new(size: usize, timeout: Duration) -> Self {
        ThreadWorld {
            shared: Arc::new(WorldState {
                size,
                timeout,
                failure: Mutex::new(None),
                groups: Mutex::new(HashMap::new()),
            }),
        }
    }

    pub fn size(&self) -> usize {
        self.shared.size
    }

    /// `rank`'s communicator for the group of world ranks `members` (which must contain it);
    /// every member asking for the same list gets the same group.
    pub fn group(
        &self,
        label: &str,
        members: &[usize],
        rank: usize,
    ) -> Result<Arc<dyn Communicator>> {
        let position = members
            .iter()
            .position(|&m| m == rank)
            .with_context(|| format!("rank {rank} is not in {label} group {members:?}"))?;
        let state = self
            .shared
            .groups
            .lock()
            .unwrap()
            .entry(members.to_vec())
            .or_insert_with(|| {
                Arc::new(GroupState {
                    label: label.to_string(),
                    members: members.to_vec(),
                    round: Mutex::new(Round {
                        collecting: true,
                        operation: None,
                        contributions: (0..members.len()).map(|_| None).collect(),
                        departed: 0,
                    }),
                    round_changed: Condvar::new(),
                    mail: Mutex::new(HashMap::new()),
                    mail_arrived: Condvar::new(),
                })
            })
            .clone();
        Ok(Arc::new(HostCollectives(ThreadGroup {
            world: self.shared.clone(),
            state,
            position,
        })))
    }

    /// Marks the world failed: every rank blocked in (or later entering) a collective gets an
    /// error naming `rank` instead of waiting forever.
    pub fn fail(&self, rank: usize, message: &str) {
        let mut failure = self.shared.failure.lock().unwrap();
        if failure.is_none() {
            *failure = Some(format!("rank {rank} failed: {message}"));
        }
        drop(failure);
        for group in self.shared.groups.lock().unwrap().values() {
            let _round = group.round.lock().unwrap();
            group.round_changed.notify_all();
            let _mail = group.mail.lock().unwrap();
            group.mail_arrived.notify_all();
        }
    }

    /// Runs `body(rank)` on one thread per rank and returns the results in rank order. A rank
    /// that fails or panics fails the world, so the others stop instead of hanging; the error of
    /// the first failing rank is returned.
    pub fn run<T, F>(&self, body: F) -> Result<Vec<T>>
    where
        T: Send,
        F: Fn(usize) -> Result<T> + Sync,
    {
        let body = &body;
        std::thread::scope(|scope| {
            let handles: Vec<_> = (0..self.size())
                .map(|rank| {
                    scope.spawn(move || {
                        let outcome =
                            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| body(rank)))
                                .unwrap_or_else(|panic| {
                                    Err(anyhow!("panicked: {}", panic_message(&panic)))
                                });
                        if let Err(e) = &outcome {
                            self.fail(rank, &format!("{e:#}"));
                        }
                        outcome
                    })
                })
                .collect();
            let outcomes: Vec<Result<T>> = handles
                .into_iter()
                .map(|h| h.join().expect("rank threads catch panics"))
                .collect();
            let first_failure = self.shared.failure.lock().unwrap().clone();
            let mut results = Vec::with_capacity(outcomes.len());
            for (rank, outcome) in outcomes.into_iter().enumerate() {
                match outcome {
                    Ok(value) => results.push(value),
                    Err(e) => {
                        return Err(match first_failure {
                            Some(first) => anyhow!("{first}"),
                            None => e.context(format!("rank {rank}")),
                        })
                    }
                }
            }
            Ok(results)
        })
    }
}

fn panic_message(panic: &Box<dyn std::any::Any + Send>) -> String {
    panic
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_else(|| "unknown panic".to_string())
}

struct ThreadGroup {
    world: Arc<WorldState>,
    state: Arc<GroupState>,
    position: usize,
}

impl ThreadGroup {
    fn check_failure(&self) -> Result<()> {
        match &*self.world.failure.lock().unwrap() {
            Some(failure) => bail!("{} group: {failure}", self.state.label),
            None => Ok(()),
        }
    }

    /// Waits on `condvar` until `done` holds, the world fails or the timeout passes.
    fn wait<'a, S>(
        &self,
        mut guard: MutexGuard<'a, S>,
        condvar: &Condvar,
        started: Instant,
        mut done: impl FnMut(&S) -> bool,
        waiting_for: impl Fn(&S) -> String,
    ) -> Result<MutexGuard<'a, S>> {
        while !done(&guard) {
            self.check_failure()?;
            if started.elapsed() > self.world.timeout {
                bail!(
                    "{} group {:?}: timed out after {:.0} s waiting for {}",
                    self.state.label,
                    self.state.members,
                    self.world.timeout.as_secs_f64(),
                    waiting_for(&guard)
                );
            }
            guard = condvar.wait_timeout(guard, POLL).unwrap().0;
        }
        Ok(guard)
    }

    /// Deposits `contribution` for `operation` and returns every rank's contribution.
    fn collective(&self, operation: String, contribution: Tensor) -> Result<Vec<Tensor>> {
        let state = &self.state;
        let started = Instant::now();
        let members = state.members.clone();
        let missing = |round: &Round| {
            let ranks: Vec<usize> = round
                .contributions
                .iter()
                .zip(&members)
                .filter(|(c, _)| c.is_none())
                .map(|(_, &m)| m)
                .collect();
            format!("ranks {ranks:?}")
        };
        let round = state.round.lock().unwrap();
        let mut round = self.wait(
            round,
            &state.round_changed,
            started,
            |r| r.collecting,
            |_| "the previous collective to finish".into(),
        )?;
        match &round.operation {
            Some(other) if *other != operation => bail!(
                "{} group: rank {} called {operation} while others called {other}",
                state.label,
                state.members[self.position]
            ),
            _ => round.operation = Some(operation),
        }
        round.contributions[self.position] = Some(contribution);
        if round.contributions.iter().all(Option::is_some) {
            round.collecting = false;
            state.round_changed.notify_all();
        }
        let mut round = self.wait(
            round,
            &state.round_changed,
            started,
            |r| !r.collecting,
            missing,
        )?;
        let all: Vec<Tensor> = round
            .contributions
            .iter()
            .map(|c| c.as_ref().expect("all arrived").shallow_clone())
            .collect();
        round.departed += 1;
        if round.departed == state.members.len() {
            round.contributions.iter_mut().for_each(|c| *c = None);
            round.operation = None;
            round.departed = 0;
            round.collecting = true;
            state.round_changed.notify_all();
        }
        Ok(all)
    }
}

impl HostTransport for ThreadGroup {
    fn rank(&self) -> usize {
        self.position
    }

    fn size(&self) -> usize {
        self.state.members.len()
    }

    fn collect(&self, operation: String, contribution: Tensor) -> Result<Vec<Tensor>> {
        self.collective(operation, contribution)
    }

    fn send(&self, peer: usize, tensor: Tensor) -> Result<()> {
        let mut mail = self.state.mail.lock().unwrap();
        mail.entry((self.position, peer))
            .or_default()
            .push_back(tensor);
        self.state.mail_arrived.notify_all();
        Ok(())
    }

    fn recv(&self, peer: usize) -> Result<Tensor> {
        let state = &self.state;
        let key = (peer, self.position);
        let from = state.members[peer];
        let mail = state.mail.lock().unwrap();
        let mut mail = self.wait(
            mail,
            &state.mail_arrived,
            Instant::now(),
            |m| m.get(&key).is_some_and(|q| !q.is_empty()),
            |_| format!("a message from rank {from}"),
        )?;
        Ok(mail
            .get_mut(&key)
            .and_then(VecDeque::pop_front)
            .expect("waited for it"))
    }

    fn label(&self) -> &str {
        &self.state.label
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{P2pOp, ReduceOp};
    use tch::{Device, Kind};

    fn world(size: usize) -> ThreadWorld {
        ThreadWorld::new(size, Duration::from_secs(20))
    }

    #[test]
    fn collectives_give_every_rank_the_same_result() {
        let world = world(3);
        let results = world
            .run(|rank| {
                let group = world.group("test", &[0, 1, 2], rank)?;
                let x = Tensor::from_slice(&[rank as f32, 10.0 * rank as f32]);
                group.all_reduce(&x, ReduceOp::Sum)?;
                let m = Tensor::from_slice(&[rank as f32, -(rank as f32)]);
                group.all_reduce(&m, ReduceOp::Max)?;
                let gathered = group.all_gather(&Tensor::from_slice(&[rank as i64]), 0)?;
                let scattered =
                    group.reduce_scatter(&Tensor::ones([6], (Kind::Float, Device::Cpu)), 0)?;
                let b = Tensor::from_slice(&[rank as f32]);
                group.broadcast(&b, 2)?;
                group.barrier()?;
                Ok((
                    Vec::<f32>::try_from(&x)?,
                    Vec::<f32>::try_from(&m)?,
                    Vec::<i64>::try_from(&gathered)?,
                    Vec::<f32>::try_from(&scattered)?,
                    b.double_value(&[0]),
                ))
            })
            .unwrap();
        for (x, m, gathered, scattered, b) in results {
            assert_eq!(x, [3.0, 30.0]);
            assert_eq!(m, [2.0, 0.0]);
            assert_eq!(gathered, [0, 1, 2]);
            assert_eq!(scattered, [3.0, 3.0]);
            assert_eq!(b, 2.0);
        }
    }

    #[test]
    fn subgroups_and_point_to_point() {
        let world = world(4);
        let received = world
            .run(|rank| {
                // Pairs {0, 1} and {2, 3}; each sends its rank to the other and receives.
                let members = if rank < 2 { vec![0, 1] } else { vec![2, 3] };
                let group = world.group("pair", &members, rank)?;
                let peer = 1 - group.rank();
                let mine = Tensor::from_slice(&[rank as f32; 2]);
                let buffer = Tensor::zeros([2], (Kind::Float, Device::Cpu));
                group.exchange(&[
                    P2pOp::Send {
                        tensor: &mine,
                        peer,
                    },
                    P2pOp::Recv {
                        buffer: &buffer,
                        peer,
                    },
                ])?;
                Ok(buffer.double_value(&[0]))
            })
            .unwrap();
        assert_eq!(received, [1.0, 0.0, 3.0, 2.0]);
    }

    #[test]
    fn all_to_all_with_uneven_and_empty_splits() {
        let world = world(3);
        world
            .run(|rank| {
                let group = world.group("expert", &[0, 1, 2], rank)?;
                crate::communicator::check_all_to_all(group.as_ref())
            })
            .unwrap();
    }

    #[test]
    fn a_failing_rank_releases_the_others() {
        let world = ThreadWorld::new(2, Duration::from_secs(60));
        let started = Instant::now();
        let error = world
            .run(|rank| {
                let group = world.group("test", &[0, 1], rank)?;
                if rank == 1 {
                    bail!("out of data");
                }
                group.barrier()
            })
            .unwrap_err()
            .to_string();
        assert!(error.contains("rank 1 failed: out of data"), "{error}");
        assert!(started.elapsed() < Duration::from_secs(5));
    }

    #[test]
    fn a_missing_rank_times_out_with_its_name() {
        let world = ThreadWorld::new(2, Duration::from_millis(300));
        let error = world
            .run(|rank| {
                let group = world.group("data", &[0, 1], rank)?;
                if rank == 0 {
                    group.barrier()?;
                }
                Ok(())
            })
            .unwrap_err()
            .to_string();
        assert!(
            error.contains("timed out") && error.contains("ranks [1]"),
            "{error}"
        );
    }

    #[test]
    fn mismatched_collectives_are_reported() {
        let world = world(2);
        let error = world
            .run(|rank| {
                let group = world.group("tensor", &[0, 1], rank)?;
                let x = Tensor::zeros([2], (Kind::Float, Device::Cpu));
                if rank == 0 {
                    group.all_reduce(&x, ReduceOp::Sum)
                } else {
                    group.broadcast(&x, 0)
                }
            })
            .unwrap_err()
            .to_string();
        assert!(error.contains("while others called"), "{error}");
    }
}
