//! The scheduler: one thread that owns the model, the KV cache (through the [`Decoder`]) and
//! the [`Batcher`], and runs steps. Between steps it takes what arrived in its queue, drops what
//! its callers gave up, and answers what finished; a request joins the running batch at the
//! next step and leaves when its rows stop. Under tensor parallelism rank 0 leads (it takes the
//! requests and tells the other ranks each step's [`Plan`]) and the other ranks follow.

use std::collections::HashMap;
use std::sync::atomic::Ordering;

use anyhow::Result;
use megatron_inference::{Batcher, CausalLm, Decoder, Refusal};
use tch::Device;

use super::queue::{Answer, Caller, Inbox, Submission};
use super::served_model::{Prepared, ServedModel, Start};
use super::tensor_parallel::{share_plan, Plan, SharedJob};
use super::ServiceError;
use crate::metrics::ServerMetrics;

/// A request being served: how its answer is built, and (on rank 0) who asked.
struct Active {
    job: Prepared,
    caller: Option<Caller>,
}

/// The batcher and the decoder (declared first, dropped before the model: tearing down an
/// NCCL communicator waits until the CUDA graphs that captured its collectives are gone), and
/// the requests in flight.
pub(super) struct Scheduler<'a, M> {
    decoder: Decoder,
    batcher: Batcher,
    served: &'a ServedModel<M>,
    /// Where rank 0 reports what it serves (a server's; none for a library's caller).
    metrics: Option<&'a ServerMetrics>,
    active: HashMap<u64, Active>,
    /// The id of the next request rank 0 takes.
    next_id: u64,
}

impl<'a, M: CausalLm> Scheduler<'a, M> {
    pub fn new(served: &'a ServedModel<M>, metrics: Option<&'a ServerMetrics>) -> Self {
        let settings = served.settings;
        Scheduler {
            decoder: Decoder::new(settings.decode),
            batcher: Batcher::new(settings.limits),
            served,
            metrics,
            active: HashMap::new(),
            next_id: 0,
        }
    }

    /// Rank 0: makes the KV cache and captures the decode graphs (a failure is returned:
    /// a server that cannot decode does not serve), calls `ready`, then takes requests from
    /// `inbox` until it is closed, tells the other ranks each step's plan, runs it; stops (and
    /// stops them) once every request taken is answered.
    pub fn lead(mut self, inbox: &Inbox, ready: impl FnOnce()) -> Result<()> {
        if let Device::Cuda(index) = self.served.model.device() {
            let _ = megatron_kernels::runtime::set_cuda_device(index);
        }
        self.warm_up()?;
        ready();
        inbox.open();
        let mut closed = false;
        loop {
            let mut plan = Plan::default();
            let mut callers = HashMap::new();
            if self.batcher.is_idle() && !closed {
                match inbox.wait() {
                    Some(submission) => self.take(submission, &mut plan, &mut callers),
                    None => closed = true,
                }
            }
            while let Some(submission) = inbox.try_take() {
                self.take(submission, &mut plan, &mut callers);
            }
            for (&id, active) in &self.active {
                if active.caller.as_ref().is_some_and(Caller::gone) {
                    plan.cancel.push(id);
                }
            }
            // Stop once the requests in flight are done.
            plan.stop = closed && self.batcher.is_idle() && plan.submit.is_empty();
            if let Some(group) = &self.served.mirror {
                if let Err(e) = share_plan(group, self.served.model.device(), Some(&plan)) {
                    eprintln!("text_generation_server: telling the other ranks failed: {e:#}");
                }
            }
            if self.run(plan, &mut callers) {
                return Ok(());
            }
        }
    }

    /// Adds a submitted request to `plan` (its caller to `callers`), or answers it at once when
    /// its caller has already given it up.
    fn take(
        &mut self,
        submission: Submission,
        plan: &mut Plan,
        callers: &mut HashMap<u64, Caller>,
    ) {
        let Submission {
            job,
            fill_context,
            reply,
            cancel,
            arrived,
        } = submission;
        let caller = Caller::new(reply, cancel, arrived);
        if caller.gone() {
            caller.abandoned(self.metrics);
            return;
        }
        let job = self.served.shared_job(job, fill_context);
        self.served.workload.serving.fetch_add(1, Ordering::SeqCst);
        let id = self.next_id;
        self.next_id += 1;
        plan.submit.push((id, job));
        callers.insert(id, caller);
    }

    /// The other ranks: runs each plan rank 0 announces until it says stop.
    pub fn follow(mut self) -> Result<()> {
        let group = self
            .served
            .mirror
            .clone()
            .ok_or_else(|| anyhow::anyhow!("following needs tensor parallelism"))?;
        self.warm_up()?;
        loop {
            let plan = share_plan(&group, self.served.model.device(), None)?;
            if self.run(plan, &mut HashMap::new()) {
                return Ok(());
            }
        }
    }

    /// Makes the KV cache and captures the decode graphs before the first request (every rank
    /// does, in the same order).
    fn warm_up(&mut self) -> Result<()> {
        let started = std::time::Instant::now();
        let rows = self.served.settings.limits.max_batch_size as i64;
        let graphs = self
            .decoder
            .warm_up(&self.served.model, rows)
            .map_err(|e| e.context("cannot make the KV cache and decode graphs"))?;
        if graphs > 0 {
            eprintln!(
                "text_generation_server: captured {graphs} decode graphs (batch buckets up to {}, \
                 {} attention, {}) in {:.1} s",
                megatron_inference::bucket(rows),
                if self.decoder.paged_attention() {
                    "paged decode"
                } else {
                    "gathered"
                },
                if self.decoder.decode_fusion() {
                    "fused decode kernels"
                } else {
                    "unfused layers"
                },
                started.elapsed().as_secs_f64()
            );
        }
        Ok(())
    }

    /// Applies `plan` and runs one step; `true` when the plan says stop. `callers` are rank
    /// 0's callers of the plan's new requests.
    fn run(&mut self, plan: Plan, callers: &mut HashMap<u64, Caller>) -> bool {
        let cancelled: Vec<Active> = plan
            .cancel
            .iter()
            .filter_map(|&id| {
                self.batcher.cancel(&mut self.decoder, id);
                self.active.remove(&id)
            })
            .collect();
        // Their blocks are free before their callers hear of it.
        self.publish();
        for active in cancelled {
            if let Some(caller) = active.caller {
                caller.cancelled(self.metrics);
                self.answered();
            }
        }
        for (id, job) in plan.submit {
            let caller = callers.remove(&id);
            self.start(id, job, caller);
        }
        if plan.stop {
            return true;
        }
        if !self.batcher.is_idle() {
            self.step();
        }
        self.publish();
        false
    }

    /// Shows the cache's use to the service and the server.
    fn publish(&self) {
        *self
            .served
            .workload
            .cache
            .lock()
            .unwrap_or_else(|p| p.into_inner()) = self.batcher.cache_use();
    }

    /// Sends `outcome` to `caller` (rank 0), which the scheduler then no longer serves.
    fn answer(&self, caller: Option<Caller>, outcome: Result<Answer, ServiceError>) {
        if let Some(caller) = caller {
            caller.answer(outcome, self.metrics);
            self.answered();
        }
    }

    fn answered(&self) {
        self.served.workload.serving.fetch_sub(1, Ordering::SeqCst);
    }

    /// Validates a request and queues its rows, or answers it.
    fn start(&mut self, id: u64, job: SharedJob, caller: Option<Caller>) {
        let prepared = guarded(|| match &job {
            SharedJob::Api(request) => self.served.prepare_api(request),
            SharedJob::Completion(request) => {
                self.served.prepare_completion(request, caller.as_ref())
            }
        });
        let (job, rows) = match prepared {
            Ok(Start::Rows(job, rows)) => (job, rows),
            Ok(Start::Now(outcome)) => return self.answer(caller, outcome),
            Err(e) => return self.answer(caller, Err(e)),
        };
        match self
            .batcher
            .submit(&self.served.model, &mut self.decoder, id, rows)
        {
            Ok(()) => {
                self.active.insert(id, Active { job, caller });
            }
            Err(refusal) => {
                let error = match refusal {
                    Refusal::Busy(text) => ServiceError::Busy(text),
                    Refusal::TooLarge(text) => ServiceError::Rejected(text),
                    Refusal::Failed(e) => ServiceError::Failed(format!("{e:#}")),
                };
                self.answer(caller, Err(error));
            }
        }
    }

    /// One batcher step: streams the new tokens and answers the finished requests. A failed
    /// step fails every request in flight and starts the cache afresh.
    fn step(&mut self) {
        let served = self.served;
        let metrics = self.metrics;
        let active = &mut self.active;
        let batcher = &mut self.batcher;
        let decoder = &mut self.decoder;
        let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            batcher.step(
                &served.model,
                decoder,
                &mut |new| match active.get_mut(&new.request) {
                    Some(Active {
                        job: Prepared::Completion(state),
                        caller,
                    }) => served.observe(state, caller.as_mut(), new, metrics),
                    _ => false,
                },
            )
        }));
        let finished = match outcome {
            Ok(Ok(finished)) => finished,
            Ok(Err(e)) => return self.fail_all(format!("{e:#}")),
            Err(_) => return self.fail_all("generation panicked".into()),
        };
        // The finished rows' blocks are free before their callers hear of it.
        self.publish();
        for (id, generation) in finished {
            let Some(active) = self.active.remove(&id) else {
                continue;
            };
            let outcome = guarded(|| self.served.finish(active.job, generation));
            self.answer(active.caller, outcome);
        }
    }

    fn fail_all(&mut self, message: String) {
        self.batcher.clear(&mut self.decoder);
        self.decoder.reset();
        for (_, active) in std::mem::take(&mut self.active) {
            self.answer(active.caller, Err(ServiceError::Failed(message.clone())));
        }
    }
}

/// Runs `body`, a panic turned into a failure: one request's panic answers it with an error
/// instead of ending the server.
fn guarded<T>(body: impl FnOnce() -> Result<T, ServiceError>) -> Result<T, ServiceError> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(body))
        .unwrap_or_else(|_| Err(ServiceError::Failed("generation panicked".into())))
}
