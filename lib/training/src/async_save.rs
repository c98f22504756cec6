//! The bookkeeping of `--async-save`: at most one checkpoint in flight, written by a background
//! thread on every rank, then committed by the rank that commits (rank 0) in a thread of its
//! own, and finalized on all ranks together once every rank says its part is done.
//!
//! Whether the ranks are done is agreed by a small collective each time the engine polls
//! (Megatron's `maybe_finalize_async_save`), so every rank finalizes at the same iteration and
//! an error on any rank stops all of them. A new save first finishes the one in flight, so host
//! memory holds one snapshot at most.

use std::thread::JoinHandle;
use std::time::Instant;

use anyhow::{anyhow, Context, Result};

/// What the committing rank runs once every rank's files are written.
pub type Commit = Box<dyn FnOnce() -> Result<()> + Send>;

/// A rank's part of a save, run on a background thread: writes this rank's files and returns
/// the commit when this rank is the one that commits.
pub type Write = Box<dyn FnOnce() -> Result<Option<Commit>> + Send>;

/// What each rank contributes to the agreement, reduced by maximum over the ranks:
/// `[busy, failed]`, each 0 or 1.
pub type Flags = [f64; 2];

/// A save every rank has finished: committed, the tracker names it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Finalized {
    pub iteration: u64,
    /// Since the save was scheduled.
    pub seconds: f64,
}

/// A background thread of a save and, once joined, its outcome.
struct Task {
    running: Option<JoinHandle<Result<Option<Commit>>>>,
    outcome: Option<Result<Option<Commit>>>,
}

impl Task {
    fn spawn(
        name: &str,
        job: impl FnOnce() -> Result<Option<Commit>> + Send + 'static,
    ) -> Result<Self> {
        let handle = std::thread::Builder::new()
            .name(name.to_string())
            .spawn(job)
            .context("starting a checkpoint writer thread")?;
        Ok(Task {
            running: Some(handle),
            outcome: None,
        })
    }

    fn done(outcome: Result<Option<Commit>>) -> Self {
        Task {
            running: None,
            outcome: Some(outcome),
        }
    }

    /// Joins the thread once it has finished, or at once with `wait`.
    fn settle(&mut self, wait: bool) {
        if self
            .running
            .as_ref()
            .is_some_and(|h| wait || h.is_finished())
        {
            let handle = self.running.take().expect("checked above");
            self.outcome = Some(
                handle
                    .join()
                    .unwrap_or_else(|_| Err(anyhow!("the checkpoint writer thread panicked"))),
            );
        }
    }

    fn flags(&self) -> Flags {
        let busy = self.running.is_some();
        let failed = matches!(self.outcome, Some(Err(_)));
        [f64::from(u8::from(busy)), f64::from(u8::from(failed))]
    }

    /// The outcome of a settled task.
    fn take(&mut self) -> Result<Option<Commit>> {
        self.outcome.take().expect("taken once settled")
    }
}

enum Stage {
    /// This rank's files are being written.
    Writing,
    /// Every rank's files are complete; the committing rank runs the commit.
    Committing,
}

struct InFlight {
    iteration: u64,
    scheduled: Instant,
    stage: Stage,
    task: Task,
}

/// The saves of one rank under `--async-save`: none or one in flight.
#[derive(Default)]
pub struct AsyncSaves {
    in_flight: Option<InFlight>,
}

impl AsyncSaves {
    /// The iteration of the save in flight.
    pub fn in_flight(&self) -> Option<u64> {
        self.in_flight.as_ref().map(|f| f.iteration)
    }

    /// Schedules the save of `iteration`: finishes the save in flight first (after `on_wait`,
    /// which says so), so that host memory holds one snapshot at most, then takes this rank's
    /// snapshot and starts writing it in the background. Returns the save finished on the way.
    pub fn schedule(
        &mut self,
        iteration: u64,
        agree: &mut dyn FnMut(Flags) -> Result<Flags>,
        on_wait: impl FnOnce(),
        snapshot: impl FnOnce() -> Result<Write>,
    ) -> Result<Option<Finalized>> {
        let finished = if self.in_flight.is_some() {
            on_wait();
            let finished = self.poll(true, agree)?;
            debug_assert!(self.in_flight.is_none(), "a blocking poll finalizes");
            finished
        } else {
            None
        };
        let write = snapshot()?;
        self.in_flight = Some(InFlight {
            iteration,
            scheduled: Instant::now(),
            stage: Stage::Writing,
            task: Task::spawn(&format!("save iter {iteration}"), write)?,
        });
        Ok(finished)
    }

    /// Moves the save in flight on as far as every rank agrees it can, and returns it once
    /// finalized. Every rank calls this at the same points: each round of `agree` is a
    /// collective (the identity for one rank). With `blocking`, waits until the save is
    /// finalized. An error on any rank is an error on all; the failing rank's names the cause.
    pub fn poll(
        &mut self,
        blocking: bool,
        agree: &mut dyn FnMut(Flags) -> Result<Flags>,
    ) -> Result<Option<Finalized>> {
        while let Some(flight) = self.in_flight.as_mut() {
            flight.task.settle(blocking);
            let [busy, failed] = agree(flight.task.flags())?;
            if failed > 0.0 {
                let flight = self.in_flight.take().expect("in flight");
                return Err(failure(flight));
            }
            if busy > 0.0 {
                return Ok(None);
            }
            match flight.stage {
                Stage::Writing => {
                    let commit = flight.task.take().expect("agreed it did not fail");
                    flight.stage = Stage::Committing;
                    flight.task = match commit {
                        Some(commit) => {
                            Task::spawn(&format!("commit iter {}", flight.iteration), move || {
                                commit().map(|()| None)
                            })?
                        }
                        None => Task::done(Ok(None)),
                    };
                }
                Stage::Committing => {
                    let flight = self.in_flight.take().expect("in flight");
                    return Ok(Some(Finalized {
                        iteration: flight.iteration,
                        seconds: flight.scheduled.elapsed().as_secs_f64(),
                    }));
                }
            }
        }
        Ok(None)
    }
}

/// The error of a save that failed: this rank's own, or that another rank's part failed.
fn failure(mut flight: InFlight) -> anyhow::Error {
    let what = format!("the async save of iteration {}", flight.iteration);
    // A rank whose own part is still running waits for it, so no thread outlives the error.
    flight.task.settle(true);
    match flight.task.take() {
        Err(error) => error.context(what),
        Ok(_) => anyhow!("{what} failed on another rank"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::mpsc;
    use std::sync::{Arc, Mutex};

    /// Stands for a snapshot in host memory: counts the ones alive and the most ever alive.
    struct Snapshot(Arc<(AtomicUsize, AtomicUsize)>);

    impl Snapshot {
        fn new(counts: &Arc<(AtomicUsize, AtomicUsize)>) -> Self {
            let alive = counts.0.fetch_add(1, Ordering::SeqCst) + 1;
            counts.1.fetch_max(alive, Ordering::SeqCst);
            Snapshot(counts.clone())
        }
    }

    impl Drop for Snapshot {
        fn drop(&mut self) {
            self.0 .0.fetch_sub(1, Ordering::SeqCst);
        }
    }

    fn one_rank(flags: Flags) -> Result<Flags> {
        Ok(flags)
    }

    fn no_wait() {}

    /// Host memory is bounded to one snapshot: the second save's snapshot is taken only once
    /// the first save, whose writer is held until the second save says it waits, is written,
    /// committed and finalized. Were the second save not to wait, its snapshot would be taken
    /// while the first writer still holds its own.
    #[test]
    fn a_second_save_waits_for_the_one_in_flight_before_taking_its_snapshot() {
        let counts = Arc::new((AtomicUsize::new(0), AtomicUsize::new(0)));
        let events = Arc::new(Mutex::new(Vec::<String>::new()));
        let (release, held) = mpsc::channel::<()>();
        let mut saves = AsyncSaves::default();

        let log = events.clone();
        let first = Snapshot::new(&counts);
        let finished = saves
            .schedule(1, &mut one_rank, no_wait, || {
                Ok(Box::new(move || -> Result<Option<Commit>> {
                    held.recv().expect("released");
                    drop(first);
                    log.lock().unwrap().push("written 1".into());
                    let log = log.clone();
                    Ok(Some(Box::new(move || -> Result<()> {
                        log.lock().unwrap().push("committed 1".into());
                        Ok(())
                    }) as Commit))
                }) as Write)
            })
            .unwrap();
        assert_eq!(finished, None);
        assert_eq!(saves.in_flight(), Some(1));
        // Not finished while its writer is held.
        assert_eq!(saves.poll(false, &mut one_rank).unwrap(), None);
        assert_eq!(saves.in_flight(), Some(1));

        let log = events.clone();
        let waited = release.clone();
        let finished = saves
            .schedule(
                2,
                &mut one_rank,
                move || waited.send(()).unwrap(),
                || {
                    log.lock().unwrap().push("snapshot 2".into());
                    let second = Snapshot::new(&counts);
                    Ok(Box::new(move || -> Result<Option<Commit>> {
                        drop(second);
                        Ok(None)
                    }) as Write)
                },
            )
            .unwrap();
        // Lets a first writer go that the second save did not wait for (there is none when
        // the bookkeeping is right), so that the assertions below report instead of hanging.
        let _ = release.send(());
        assert_eq!(finished.map(|f| f.iteration), Some(1));
        assert_eq!(
            *events.lock().unwrap(),
            ["written 1", "committed 1", "snapshot 2"]
        );
        let last = saves.poll(true, &mut one_rank).unwrap();
        assert_eq!(last.map(|f| f.iteration), Some(2));
        assert_eq!(saves.in_flight(), None);
        assert_eq!(counts.0.load(Ordering::SeqCst), 0);
        assert_eq!(
            counts.1.load(Ordering::SeqCst),
            1,
            "two snapshots were in memory at once"
        );
    }

    /// A rank whose writer fails names the cause; a rank told by the agreement that another
    /// failed says so; neither keeps the save in flight.
    #[test]
    fn a_failed_write_is_an_error_on_every_rank() {
        let mut saves = AsyncSaves::default();
        saves
            .schedule(3, &mut one_rank, no_wait, || {
                Ok(Box::new(|| -> Result<Option<Commit>> { Err(anyhow!("disk full")) }) as Write)
            })
            .unwrap();
        let error = saves.poll(true, &mut one_rank).unwrap_err();
        assert_eq!(
            format!("{error:#}"),
            "the async save of iteration 3: disk full"
        );
        assert_eq!(saves.in_flight(), None);

        saves
            .schedule(4, &mut one_rank, no_wait, || {
                Ok(Box::new(|| -> Result<Option<Commit>> { Ok(None) }) as Write)
            })
            .unwrap();
        let mut another_failed = |[busy, _]: Flags| -> Result<Flags> { Ok([busy, 1.0]) };
        let error = saves.poll(true, &mut another_failed).unwrap_err();
        assert_eq!(
            format!("{error:#}"),
            "the async save of iteration 4 failed on another rank"
        );
        assert_eq!(saves.in_flight(), None);
    }

    /// A save is finalized only when every rank is done: while the agreement says another rank
    /// is still busy, it stays in flight, at the writing stage and then at the commit.
    #[test]
    fn a_save_is_finalized_only_once_every_rank_is_done() {
        let committed = Arc::new(AtomicUsize::new(0));
        let mut saves = AsyncSaves::default();
        let count = committed.clone();
        saves
            .schedule(5, &mut one_rank, no_wait, || {
                Ok(Box::new(move || -> Result<Option<Commit>> {
                    Ok(Some(Box::new(move || -> Result<()> {
                        count.fetch_add(1, Ordering::SeqCst);
                        Ok(())
                    }) as Commit))
                }) as Write)
            })
            .unwrap();
        let mut other_rank_busy = |[_, failed]: Flags| -> Result<Flags> { Ok([1.0, failed]) };
        for _ in 0..3 {
            assert_eq!(saves.poll(false, &mut other_rank_busy).unwrap(), None);
        }
        assert_eq!(committed.load(Ordering::SeqCst), 0, "committed too early");
        let finalized = saves.poll(true, &mut one_rank).unwrap();
        assert_eq!(finalized.map(|f| f.iteration), Some(5));
        assert_eq!(committed.load(Ordering::SeqCst), 1);
    }
}
