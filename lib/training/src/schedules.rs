//! Megatron's forward-backward schedules (spec §2.4): no pipelining, 1F1B, and interleaved 1F1B
//! over virtual chunks. Every exchange between neighbouring stages is one batched
//! send/receive ([`Communicator::exchange`]) issued at the same point of the schedule on both
//! sides, as in Megatron's non-overlapped path, so NCCL's grouped calls cannot deadlock.

use std::collections::HashMap;
use std::sync::Arc;

use anyhow::{ensure, Context, Result};
use tch::{Device, Kind, Tensor};

use megatron_kernels::autograd;
use megatron_parallel::{Communicator, P2pOp};

/// One pipeline rank's model chunks, as a schedule drives them.
pub trait PipelineStage {
    /// Forward of `chunk` on `microbatch`. `input` is the activation received from the previous
    /// virtual stage (`None` on the first). Returns the activation to send on, or on the last
    /// virtual stage the loss to backpropagate from (already scaled).
    fn forward(
        &mut self,
        chunk: usize,
        microbatch: usize,
        input: Option<&Tensor>,
    ) -> Result<Tensor>;

    /// Called after each micro-batch's backward (where gradients move to float32 buffers).
    fn backward_done(&mut self) -> Result<()> {
        Ok(())
    }
}

/// Shape, dtype and device of the activations exchanged between stages.
#[derive(Debug, Clone)]
pub struct ActivationSpec {
    pub shape: Vec<i64>,
    pub kind: Kind,
    pub device: Device,
}

/// Sizes of one schedule run.
#[derive(Debug, Clone, Copy)]
pub struct ScheduleShape {
    pub microbatches: usize,
    /// Model chunks per pipeline rank (1 without interleaving).
    pub chunks: usize,
    /// `--microbatch-group-size-per-virtual-pipeline-stage` (the pipeline size by default).
    pub group_size: usize,
    pub forward_only: bool,
}

/// Runs forward and backward of every micro-batch over the pipeline `group`, in the schedule
/// Megatron would use: none for one stage, 1F1B for one chunk per rank, interleaved otherwise.
pub fn forward_backward(
    stage: &mut dyn PipelineStage,
    group: &Arc<dyn Communicator>,
    activation: &ActivationSpec,
    shape: ScheduleShape,
) -> Result<()> {
    let links = Links {
        group: group.clone(),
        activation: activation.clone(),
    };
    if group.size() == 1 {
        ensure!(
            shape.chunks == 1,
            "virtual pipeline chunks need pipeline parallelism"
        );
        no_pipelining(stage, shape)
    } else if shape.chunks == 1 {
        one_f_one_b(stage, &links, shape)
    } else {
        interleaved(stage, &links, shape)
    }
}

/// Backward from `output` (the loss when `output_grad` is `None`); returns the gradient of the
/// received `input`, for the previous stage.
pub(crate) fn backward_step(
    stage: &mut dyn PipelineStage,
    input: Option<Tensor>,
    output: Tensor,
    output_grad: Option<Tensor>,
) -> Result<Option<Tensor>> {
    match output_grad {
        Some(grad) => autograd::backward(&[&output], &[&grad], false)?,
        None => autograd::backward(&[&output], &[&output.ones_like()], false)?,
    }
    stage.backward_done()?;
    Ok(input.map(|input| input.grad()))
}

fn no_pipelining(stage: &mut dyn PipelineStage, shape: ScheduleShape) -> Result<()> {
    for microbatch in 0..shape.microbatches {
        let output = stage.forward(0, microbatch, None)?;
        if !shape.forward_only {
            backward_step(stage, None, output, None)?;
        }
    }
    Ok(())
}

/// The batched exchanges between neighbouring stages; the ring wraps around, which only the
/// interleaved schedule uses.
struct Links {
    group: Arc<dyn Communicator>,
    activation: ActivationSpec,
}

impl Links {
    fn rank(&self) -> usize {
        self.group.rank()
    }

    fn size(&self) -> usize {
        self.group.size()
    }

    fn is_first(&self) -> bool {
        self.rank() == 0
    }

    fn is_last(&self) -> bool {
        self.rank() + 1 == self.size()
    }

    /// Sends and receives in one batch: to the next and previous stage, from the previous
    /// (an activation) and the next (a gradient).
    fn communicate(
        &self,
        send_next: Option<&Tensor>,
        send_prev: Option<&Tensor>,
        recv_prev: bool,
        recv_next: bool,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let (next, prev) = (
            (self.rank() + 1) % self.size(),
            (self.rank() + self.size() - 1) % self.size(),
        );
        let buffer = || {
            Tensor::empty(
                self.activation.shape.as_slice(),
                (self.activation.kind, self.activation.device),
            )
        };
        let from_prev = recv_prev.then(buffer);
        let from_next = recv_next.then(buffer);
        let sends: Vec<Tensor> = [send_next, send_prev]
            .iter()
            .flatten()
            .map(|t| t.detach().contiguous())
            .collect();
        let mut ops = Vec::new();
        let mut sent = sends.iter();
        if send_next.is_some() {
            ops.push(P2pOp::Send {
                tensor: sent.next().expect("one per send"),
                peer: next,
            });
        }
        if send_prev.is_some() {
            ops.push(P2pOp::Send {
                tensor: sent.next().expect("one per send"),
                peer: prev,
            });
        }
        if let Some(buffer) = &from_prev {
            ops.push(P2pOp::Recv { buffer, peer: prev });
        }
        if let Some(buffer) = &from_next {
            ops.push(P2pOp::Recv { buffer, peer: next });
        }
        if !ops.is_empty() {
            self.group.exchange(&ops).context("pipeline exchange")?;
        }
        // A received activation is a leaf whose gradient goes back to the previous stage.
        Ok((from_prev.map(|t| t.set_requires_grad(true)), from_next))
    }
}

/// Non-interleaved 1F1B: `p - rank - 1` warm-up forwards, then alternate one forward and one
/// backward, then the remaining backwards.
fn one_f_one_b(stage: &mut dyn PipelineStage, links: &Links, shape: ScheduleShape) -> Result<()> {
    let microbatches = shape.microbatches;
    let warmup = (links.size() - links.rank() - 1).min(microbatches);
    let remaining = microbatches - warmup;
    let (first, last) = (links.is_first(), links.is_last());
    let recv_forward =
        || -> Result<Option<Tensor>> { Ok(links.communicate(None, None, !first, false)?.0) };
    let send_forward = |output: &Tensor| -> Result<()> {
        if !last {
            links.communicate(Some(output), None, false, false)?;
        }
        Ok(())
    };
    let send_backward = |grad: Option<&Tensor>| -> Result<()> {
        if !first {
            links.communicate(None, grad, false, false)?;
        }
        Ok(())
    };
    let mut in_flight: std::collections::VecDeque<(Option<Tensor>, Tensor)> = Default::default();
    for microbatch in 0..warmup {
        let input = recv_forward()?;
        let output = stage.forward(0, microbatch, input.as_ref())?;
        send_forward(&output)?;
        if !shape.forward_only {
            in_flight.push_back((input, output));
        }
    }
    let mut input = if remaining > 0 { recv_forward()? } else { None };
    for i in 0..remaining {
        let last_iteration = i + 1 == remaining;
        let output = stage.forward(0, warmup + i, input.as_ref())?;
        if shape.forward_only {
            send_forward(&output)?;
            if !last_iteration {
                input = recv_forward()?;
            }
            continue;
        }
        let output_grad = if last {
            None
        } else {
            links.communicate(Some(&output), None, false, true)?.1
        };
        in_flight.push_back((input.take(), output));
        let (oldest_input, oldest_output) = in_flight.pop_front().expect("just pushed");
        let input_grad = backward_step(stage, oldest_input, oldest_output, output_grad)?;
        if last_iteration {
            send_backward(input_grad.as_ref())?;
        } else if first {
            input = None;
        } else {
            input = links.communicate(None, input_grad.as_ref(), true, false)?.0;
        }
    }
    if !shape.forward_only {
        for _ in 0..warmup {
            let (input, output) = in_flight.pop_front().expect("one per warm-up forward");
            let output_grad = if last {
                None
            } else {
                links.communicate(None, None, false, true)?.1
            };
            let input_grad = backward_step(stage, input, output, output_grad)?;
            send_backward(input_grad.as_ref())?;
        }
    }
    Ok(())
}

/// `(microbatch, chunk)` of every virtual micro-batch: groups of `group_size` micro-batches run
/// through each chunk in turn (Megatron's schedule table).
pub fn schedule_table(
    microbatches: usize,
    chunks: usize,
    group_size: usize,
) -> Vec<(usize, usize)> {
    let mut table = Vec::with_capacity(microbatches * chunks);
    let mut start = 0;
    while start < microbatches {
        let end = if start + group_size >= microbatches {
            microbatches
        } else {
            start + group_size
        };
        for chunk in 0..chunks {
            table.extend((start..end).map(|microbatch| (microbatch, chunk)));
        }
        start = end;
    }
    table
}

/// Interleaved 1F1B over `chunks` model chunks per rank (chunk c of rank r is virtual stage
/// `c·p + r`).
fn interleaved(stage: &mut dyn PipelineStage, links: &Links, shape: ScheduleShape) -> Result<()> {
    let (p, rank, chunks, microbatches) =
        (links.size(), links.rank(), shape.chunks, shape.microbatches);
    let group_size = shape.group_size;
    ensure!(
        (p..=microbatches).contains(&group_size),
        "the interleaved schedule needs {p} ≤ micro-batches per group ({group_size}) ≤ micro-batches ({microbatches})"
    );
    let tail = microbatches % group_size;
    ensure!(
        tail == 0 || tail >= p,
        "the interleaved schedule needs the number of micro-batches ({microbatches}) modulo the group size ({group_size}) to be 0 or at least the pipeline size {p}"
    );
    let total = microbatches * chunks;
    let mut warmup = if shape.forward_only {
        total
    } else {
        (p - rank - 1) * 2 + (chunks - 1) * group_size
    };
    let all_warmup = warmup >= total;
    warmup = warmup.min(total);
    let remaining = total - warmup;
    let table = schedule_table(microbatches, chunks, group_size);
    let chunk_of = |k: usize, forward: bool| {
        let chunk = table[k % total].1;
        if forward {
            chunk
        } else {
            chunks - 1 - chunk
        }
    };
    let is_vp_first = |chunk: usize| rank == 0 && chunk == 0;
    let is_vp_last = |chunk: usize| rank == p - 1 && chunk == chunks - 1;
    // Whether the exchange after virtual step k receives, and for which chunk (Megatron's
    // `recv_tensor_from_previous_stage`): the leading stage runs p - 1 steps ahead of the
    // trailing one, whose last chunk produces nothing.
    let receive_for = |k: usize, forward: bool| -> (bool, usize) {
        let leading = if forward { rank == 0 } else { rank == p - 1 };
        let last_chunk = if forward { chunks - 1 } else { 0 };
        if !leading {
            return (true, chunk_of(k + 1, forward));
        }
        let (mut receive, aligned) = if k < p - 1 {
            (false, chunk_of(k + 1, forward))
        } else {
            (true, chunk_of(k - (p - 1), forward))
        };
        if aligned == last_chunk {
            receive = false;
        }
        (
            receive,
            if forward {
                aligned + 1
            } else {
                aligned.wrapping_sub(1)
            },
        )
    };

    let mut state = Interleaving::default();
    // The first chunk's first input.
    if !is_vp_first(0) {
        let received = links.communicate(None, None, true, false)?.0;
        state.push_input(0, received);
    }
    let forward_helper = |k: usize,
                          state: &mut Interleaving,
                          stage: &mut dyn PipelineStage|
     -> Result<Option<Tensor>> {
        let (microbatch, chunk) = table[k];
        let input = if is_vp_first(chunk) {
            None
        } else {
            state
                .inputs
                .get(&(chunk, microbatch))
                .and_then(|t| t.as_ref().map(Tensor::shallow_clone))
        };
        let output = stage.forward(chunk, microbatch, input.as_ref())?;
        let sent = (!is_vp_last(chunk)).then(|| output.shallow_clone());
        if shape.forward_only {
            state.inputs.remove(&(chunk, microbatch));
        } else {
            state.outputs.insert((chunk, microbatch), output);
        }
        Ok(sent)
    };
    let backward_helper = |k: usize,
                           state: &mut Interleaving,
                           stage: &mut dyn PipelineStage|
     -> Result<Option<Tensor>> {
        let microbatch = table[k].0;
        let chunk = chunk_of(k, false);
        let input = if is_vp_first(chunk) {
            None
        } else {
            state.inputs.remove(&(chunk, microbatch)).flatten()
        };
        let output = state
            .outputs
            .remove(&(chunk, microbatch))
            .context("backward before forward")?;
        let output_grad = if is_vp_last(chunk) {
            None
        } else {
            state.output_grads.remove(&(chunk, microbatch)).flatten()
        };
        let input_grad = backward_step(stage, input, output, output_grad)?;
        Ok(if is_vp_first(chunk) { None } else { input_grad })
    };

    for k in 0..warmup {
        let (mut recv_prev, next_chunk) = receive_for(k, true);
        if k + 1 == total {
            recv_prev = false;
        }
        let output = forward_helper(k, &mut state, stage)?;
        if k + 1 == warmup && !shape.forward_only && !all_warmup {
            let recv_next = !links.is_last();
            let (input, output_grad) =
                links.communicate(output.as_ref(), None, recv_prev, recv_next)?;
            if recv_next {
                state.push_output_grad(chunks - 1, output_grad);
            }
            if recv_prev {
                state.push_input(next_chunk, input);
            }
        } else {
            let (input, _) = links.communicate(output.as_ref(), None, recv_prev, false)?;
            if recv_prev {
                state.push_input(next_chunk, input);
            }
        }
    }
    for k in 0..remaining {
        let forward_k = k + warmup;
        let output = forward_helper(forward_k, &mut state, stage)?;
        let input_grad = backward_helper(k, &mut state, stage)?;
        let (mut recv_prev, next_forward_chunk) = receive_for(forward_k, true);
        let (recv_next, next_backward_chunk) = receive_for(k, false);
        if k + 1 == remaining {
            recv_prev = false;
        }
        let (input, output_grad) =
            links.communicate(output.as_ref(), input_grad.as_ref(), recv_prev, recv_next)?;
        if recv_prev {
            state.push_input(next_forward_chunk, input);
        }
        if recv_next {
            state.push_output_grad(next_backward_chunk, output_grad);
        }
    }
    if !shape.forward_only {
        if all_warmup && !links.is_last() {
            let output_grad = links.communicate(None, None, false, true)?.1;
            state.push_output_grad(chunks - 1, output_grad);
        }
        for k in remaining..total {
            let (mut recv_next, next_chunk) = receive_for(k, false);
            if k + 1 == total {
                recv_next = false;
            }
            let input_grad = backward_helper(k, &mut state, stage)?;
            let (_, output_grad) =
                links.communicate(None, input_grad.as_ref(), false, recv_next)?;
            if recv_next {
                state.push_output_grad(next_chunk, output_grad);
            }
        }
    }
    ensure!(
        state.outputs.is_empty() || shape.forward_only,
        "interleaved schedule left activations without backward"
    );
    Ok(())
}

/// Activations and gradients received or kept between the steps of the interleaved schedule.
/// Each chunk receives its micro-batches in increasing order, so the n-th tensor received for
/// a chunk belongs to its micro-batch n.
#[derive(Default)]
struct Interleaving {
    inputs: HashMap<(usize, usize), Option<Tensor>>,
    outputs: HashMap<(usize, usize), Tensor>,
    output_grads: HashMap<(usize, usize), Option<Tensor>>,
    inputs_received: HashMap<usize, usize>,
    grads_received: HashMap<usize, usize>,
}

impl Interleaving {
    fn push_input(&mut self, chunk: usize, tensor: Option<Tensor>) {
        let n = self.inputs_received.entry(chunk).or_default();
        self.inputs.insert((chunk, *n), tensor);
        *n += 1;
    }

    fn push_output_grad(&mut self, chunk: usize, tensor: Option<Tensor>) {
        let n = self.grads_received.entry(chunk).or_default();
        self.output_grads.insert((chunk, *n), tensor);
        *n += 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use megatron_parallel::ThreadWorld;
    use std::time::Duration;

    #[test]
    fn schedule_table_matches_megatrons_example() {
        // PP2, 5 micro-batches, 2 chunks, groups of 3 (the example in Megatron's schedules.py).
        let table = schedule_table(5, 2, 3);
        let microbatches: Vec<usize> = table.iter().map(|t| t.0).collect();
        let chunks: Vec<usize> = table.iter().map(|t| t.1).collect();
        assert_eq!(microbatches, [0, 1, 2, 0, 1, 2, 3, 4, 3, 4]);
        assert_eq!(chunks, [0, 0, 0, 1, 1, 1, 0, 0, 1, 1]);
    }

    /// A toy "model" of `layers` scalar layers `x ← w_l · x + l` split over the pipeline like a
    /// GPT: virtual stage `c·p + r` holds one block of consecutive layers. The loss of
    /// micro-batch m is `x_out²` for input `m + 1`; weights' gradients must equal the
    /// unpipelined computation's.
    struct ToyStage {
        /// Per chunk, its layers' weights (leaves) and global indices.
        chunks: Vec<Vec<(Tensor, usize)>>,
        first: bool,
        last: bool,
        log: Vec<(usize, usize)>,
    }

    impl PipelineStage for ToyStage {
        fn forward(
            &mut self,
            chunk: usize,
            microbatch: usize,
            input: Option<&Tensor>,
        ) -> Result<Tensor> {
            self.log.push((chunk, microbatch));
            let chunk_count = self.chunks.len();
            let mut x = match input {
                Some(x) => x.shallow_clone(),
                None => {
                    assert!(
                        self.first && chunk == 0,
                        "only the first virtual stage starts from data"
                    );
                    Tensor::from_slice(&[microbatch as f64 + 1.0])
                }
            };
            for (weight, index) in &self.chunks[chunk] {
                x = weight * x + *index as f64;
            }
            Ok(if self.last && chunk == chunk_count - 1 {
                x.square().sum(Kind::Double)
            } else {
                x
            })
        }
    }

    fn reference_gradients(layers: usize, microbatches: usize) -> Vec<f64> {
        let weights: Vec<Tensor> = (0..layers)
            .map(|l| Tensor::from_slice(&[0.5 + 0.1 * l as f64]).set_requires_grad(true))
            .collect();
        for m in 0..microbatches {
            let mut x = Tensor::from_slice(&[m as f64 + 1.0]);
            for (l, w) in weights.iter().enumerate() {
                x = w * x + l as f64;
            }
            x.square().sum(Kind::Double).backward();
        }
        weights
            .iter()
            .map(|w| w.grad().double_value(&[0]))
            .collect()
    }

    fn pipelined_gradients(
        p: usize,
        chunks: usize,
        microbatches: usize,
        group_size: usize,
    ) -> Vec<f64> {
        let layers = 2 * p * chunks;
        let per_block = layers / (p * chunks);
        let world = ThreadWorld::new(p, Duration::from_secs(30));
        let per_rank = world
            .run(|rank| {
                let group = world.group("pipeline", &(0..p).collect::<Vec<_>>(), rank)?;
                let chunk_layers: Vec<Vec<(Tensor, usize)>> = (0..chunks)
                    .map(|c| {
                        let block = c * p + rank;
                        (block * per_block..(block + 1) * per_block)
                            .map(|l| {
                                (
                                    Tensor::from_slice(&[0.5 + 0.1 * l as f64])
                                        .set_requires_grad(true),
                                    l,
                                )
                            })
                            .collect()
                    })
                    .collect();
                let mut stage = ToyStage {
                    chunks: chunk_layers,
                    first: rank == 0,
                    last: rank == p - 1,
                    log: Vec::new(),
                };
                let activation = ActivationSpec {
                    shape: vec![1],
                    kind: Kind::Double,
                    device: Device::Cpu,
                };
                let shape = ScheduleShape {
                    microbatches,
                    chunks,
                    group_size,
                    forward_only: false,
                };
                forward_backward(&mut stage, &group, &activation, shape)?;
                assert_eq!(stage.log.len(), microbatches * chunks);
                Ok(stage
                    .chunks
                    .into_iter()
                    .flatten()
                    .map(|(w, l)| (l, w.grad().double_value(&[0])))
                    .collect::<Vec<_>>())
            })
            .unwrap();
        let mut grads: Vec<(usize, f64)> = per_rank.into_iter().flatten().collect();
        grads.sort_by_key(|g| g.0);
        grads.into_iter().map(|g| g.1).collect()
    }

    fn assert_close(a: &[f64], b: &[f64]) {
        assert_eq!(a.len(), b.len());
        for (x, y) in a.iter().zip(b) {
            assert!((x - y).abs() <= 1e-9 * y.abs().max(1.0), "{a:?} != {b:?}");
        }
    }

    #[test]
    fn one_f_one_b_gives_the_unpipelined_gradients() {
        for (p, microbatches) in [(2, 1), (2, 4), (4, 3), (4, 8)] {
            assert_close(
                &pipelined_gradients(p, 1, microbatches, p),
                &reference_gradients(2 * p, microbatches),
            );
        }
    }

    #[test]
    fn interleaved_gives_the_unpipelined_gradients() {
        for (p, chunks, microbatches, group_size) in [
            (2, 2, 4, 2),
            (2, 3, 6, 2),
            (4, 2, 8, 4),
            (2, 2, 5, 3),
            (4, 2, 4, 4),
            (2, 2, 2, 2),
        ] {
            assert_close(
                &pipelined_gradients(p, chunks, microbatches, group_size),
                &reference_gradients(2 * p * chunks, microbatches),
            );
        }
    }
}
