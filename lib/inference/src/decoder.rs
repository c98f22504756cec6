//! How generation runs the model: one paged KV cache under a memory budget, kept from request
//! to request, prefill chunks run eagerly, and on a GPU each decode step of the whole batch
//! replayed from a CUDA graph.
//!
//! A decode step of a 24-layer model is a few hundred small kernels; launched one by one from the
//! host they take several times longer than the GPU needs to run them. A graph launches them all
//! at once. Its shapes are fixed, so the batch is padded to the next bucket (a power of two) and
//! every row's block table has a fixed width, its window. With the paged decode kernel
//! ([`megatron_kernels::ops::paged_attention`], on GPUs) a row is read through its table up to its own
//! position, and windows grow in powers of two; with gathered attention every row attends to
//! its whole window of cache slots (masked past its position), and windows grow in steps of
//! [`WINDOW_STEP`]. There is one graph per bucket and window.

use std::collections::HashMap;

use anyhow::{ensure, Result};
use tch::{Device, Kind, Tensor};

use megatron_kernels::ops::{decode_gemv, paged_attention};
use megatron_kernels::runtime::{
    copy_from_host, cuda_free_memory, cuda_graphs_available, to_device_async, CudaGraph,
};
use megatron_models::layers::{PagedKvCache, PagedStep, BLOCK_SIZE};

use super::causal_lm::CausalLm;

const GIB: f64 = (1u64 << 30) as f64;

/// Decode windows, and so decode graphs, come in multiples of this many positions.
pub const WINDOW_STEP: i64 = 128;

/// How much memory the KV cache may take.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum KvBudget {
    /// At most this many bytes.
    Bytes(u64),
    /// At most this many GiB, as `--kv-cache-gb` gives it (named so in messages).
    Gib(f64),
    /// This fraction of the GPU memory free when the cache is made (on a CPU, of
    /// [`CPU_DEFAULT_BYTES`]).
    FreeFraction(f64),
}

/// What [`KvBudget::FreeFraction`] takes a fraction of on a CPU.
pub const CPU_DEFAULT_BYTES: u64 = 4 << 30;

impl Default for KvBudget {
    fn default() -> Self {
        KvBudget::FreeFraction(0.5)
    }
}

impl KvBudget {
    fn bytes(&self, device: Device) -> Result<u64> {
        Ok(match *self {
            KvBudget::Bytes(bytes) => bytes,
            KvBudget::Gib(gib) => (gib * (1u64 << 30) as f64) as u64,
            KvBudget::FreeFraction(fraction) => {
                (free_memory(device)?.unwrap_or(CPU_DEFAULT_BYTES) as f64 * fraction) as u64
            }
        })
    }
}

impl std::fmt::Display for KvBudget {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            KvBudget::Bytes(bytes) => write!(f, "a KV cache budget of {bytes} bytes"),
            KvBudget::Gib(gib) => write!(f, "--kv-cache-gb {gib}"),
            KvBudget::FreeFraction(fraction) => {
                write!(f, "a KV cache of {fraction} of the free memory")
            }
        }
    }
}

/// Bytes free on a CUDA `device`; `None` on a CPU, whose memory is the system's.
fn free_memory(device: Device) -> Result<Option<u64>> {
    match device {
        Device::Cuda(index) => cuda_free_memory(index).map(Some).ok_or_else(|| {
            anyhow::anyhow!(
                "cannot read the free memory of cuda:{index}; give the KV cache size \
                 (--kv-cache-gb)"
            )
        }),
        _ => Ok(None),
    }
}

/// Memory a new KV cache may take on `device`: the GPU's free memory, or the system's
/// available memory (`MemAvailable` of `/proc/meminfo`) on a CPU; `None` where unknown.
fn room_for_cache(device: Device) -> Result<Option<u64>> {
    if let Some(free) = free_memory(device)? {
        return Ok(Some(free));
    }
    let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    Ok(meminfo
        .lines()
        .find_map(|line| line.strip_prefix("MemAvailable:"))
        .and_then(|rest| {
            rest.trim()
                .trim_end_matches("kB")
                .trim()
                .parse::<u64>()
                .ok()
        })
        .map(|kib| kib * 1024))
}

/// One row of a decode step: the token to run, its position, and the row's cache blocks.
pub struct DecodeRow<'a> {
    pub token: i64,
    pub position: i64,
    pub blocks: &'a [i64],
}

/// A piece of a prompt to prefill: its tokens at positions `start..`, of the sequence that owns
/// `blocks`.
pub struct PrefillChunk<'a> {
    pub tokens: &'a [i64],
    pub start: i64,
    pub blocks: &'a [i64],
}

/// Whether decode steps use one of our kernels: wanted unless turned off, and used where it
/// applies once its self-check passed on the device (a failure is reported once and the
/// fallback used from then on).
#[derive(Debug, Clone, Copy)]
struct KernelChoice {
    on: bool,
    checked: bool,
}

impl KernelChoice {
    /// Wanted when `on`, not yet self-checked.
    fn wanted(on: bool) -> Self {
        KernelChoice { on, checked: false }
    }

    /// Whether the kernel serves steps on `device`, given whether it `applies` to the model;
    /// `check` runs the self-check on the CUDA device's index the first time. Never called
    /// inside a graph capture: the warm-up and every decode step ask before they capture.
    fn usable(
        &mut self,
        device: Device,
        applies: bool,
        check: impl FnOnce(usize) -> Result<()>,
        fallback: &str,
    ) -> bool {
        let Device::Cuda(index) = device else {
            self.on = false;
            return false;
        };
        if !applies {
            self.on = false;
        }
        if self.on && !self.checked {
            self.checked = true;
            if let Err(e) = check(index) {
                eprintln!("warning: {fallback}: {e:#}");
                self.on = false;
            }
        }
        self.on
    }
}

/// How decode steps run and how much memory the KV cache may take. Everything is on by
/// default; the server's `--no-*` flags turn each off, e.g. to compare the two ways.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DecodeSettings {
    /// Decode steps replayed from CUDA graphs when the model runs on a GPU and this build can
    /// capture them (see [`cuda_graphs_available`]); else launched kernel by kernel.
    pub cuda_graphs: bool,
    /// Decode attention through the paged decode kernel
    /// ([`megatron_kernels::ops::paged_attention`]), reading the blocks in place on GPUs, instead
    /// of gathering each row's window of cache slots for libtorch's attention under a mask (the
    /// only way on a CPU).
    pub paged_attention: bool,
    /// Decode steps of few rows through the fused decode kernels
    /// ([`megatron_kernels::ops::decode_gemv`]) on GPUs, instead of libtorch's linear layers
    /// (cuBLAS) with the norms, bias adds, GeLU and residual adds as kernels of their own.
    pub fused_kernels: bool,
    /// The next decode step queued before the last one's tokens are read when it runs the same
    /// rows one position on (see [`crate::Batcher`]), instead of reading each step's tokens
    /// first.
    pub overlap: bool,
    /// The memory the KV cache may take.
    pub kv_budget: KvBudget,
    /// Positions of one sequence the KV cache must hold whole (`--seq-length`), else the
    /// cache is refused when it is made; by default one block's.
    pub min_sequence: i64,
}

impl Default for DecodeSettings {
    fn default() -> Self {
        DecodeSettings {
            cuda_graphs: true,
            paged_attention: true,
            fused_kernels: true,
            overlap: true,
            kv_budget: KvBudget::default(),
            min_sequence: BLOCK_SIZE,
        }
    }
}

/// Runs prefill and decode steps of generations; keep one per model and reuse it.
pub struct Decoder {
    /// Decode steps replayed from CUDA graphs on CUDA devices.
    cuda_graphs: bool,
    /// Decode attention through the paged kernel on CUDA devices (else gathered windows).
    paged_kernel: KernelChoice,
    /// Decode steps of few rows through the fused decode kernels on CUDA devices.
    decode_fusion: KernelChoice,
    overlap: bool,
    budget: KvBudget,
    min_sequence: i64,
    cache: Option<PagedKvCache>,
    graphs: HashMap<(i64, i64), StepGraph>,
    inputs: HashMap<i64, GraphInputs>,
}

/// The static input buffers of the decode graphs of one bucket: views of one device buffer,
/// so that a step's inputs go to the device in one copy.
struct GraphInputs {
    /// `[tokens, positions, write slots, tables]` back to back.
    packed: Tensor,
    tokens: Tensor,
    positions: Tensor,
    write_slots: Tensor,
    /// Block tables, `[bucket · window / BLOCK_SIZE]` used of the largest window.
    tables: Tensor,
}

impl GraphInputs {
    fn new(bucket: i64, capacity: i64, device: Device) -> Self {
        let per_table = bucket * capacity / BLOCK_SIZE;
        let packed = Tensor::zeros([3 * bucket + per_table], (Kind::Int64, device));
        GraphInputs {
            tokens: packed.narrow(0, 0, bucket).view([bucket, 1]),
            positions: packed.narrow(0, bucket, bucket).view([bucket, 1]),
            write_slots: packed.narrow(0, 2 * bucket, bucket),
            tables: packed.narrow(0, 3 * bucket, per_table),
            packed,
        }
    }
}

/// A decode step's inputs as [`Decoder::decode`] lays them out, padded to the bucket.
struct StepInputs<'a> {
    tokens: &'a [i64],
    drawn: Option<&'a Tensor>,
    positions: &'a [i64],
    write: &'a [i64],
    tables: &'a [i64],
}

struct StepGraph {
    graph: CudaGraph,
    logits: Tensor,
}

impl Decoder {
    pub fn new(settings: DecodeSettings) -> Self {
        Decoder {
            cuda_graphs: settings.cuda_graphs && cuda_graphs_available(),
            paged_kernel: KernelChoice::wanted(settings.paged_attention),
            decode_fusion: KernelChoice::wanted(settings.fused_kernels),
            overlap: settings.overlap,
            budget: settings.kv_budget,
            min_sequence: settings.min_sequence.max(1),
            cache: None,
            graphs: HashMap::new(),
            inputs: HashMap::new(),
        }
    }

    /// Every step launched kernel by kernel, everything else as [`DecodeSettings::default`].
    pub fn eager() -> Self {
        Decoder::new(DecodeSettings {
            cuda_graphs: false,
            ..DecodeSettings::default()
        })
    }

    /// Whether the next decode step may be queued before the last one's tokens are read.
    pub fn overlap(&self) -> bool {
        self.overlap
    }

    /// Whether decode steps use the paged decode kernel (known after the warm-up or the first
    /// step).
    pub fn paged_attention(&self) -> bool {
        self.paged_kernel.on
    }

    /// Whether decode steps on `device` use the paged decode kernel: on CUDA devices, for the
    /// head sizes and dtypes it has, once it compiled and passed its self-check (a failure is
    /// reported once, and the gathered attention used instead). Never called inside a graph
    /// capture: the warm-up and every decode step ask before they capture.
    fn uses_paged_kernel<M: CausalLm + ?Sized>(&mut self, model: &M) -> bool {
        let (kind, d) = (model.dtype(), model.head_size());
        self.paged_kernel.usable(
            model.device(),
            paged_attention::supports(d, kind),
            |index| paged_attention::self_check(index, kind, d),
            "decoding with gathered attention",
        )
    }

    /// Whether decode steps of few rows use the fused decode kernels (known after the warm-up
    /// or the first step).
    pub fn decode_fusion(&self) -> bool {
        self.decode_fusion.on
    }

    /// Whether decode steps of `model` use the fused decode kernels: on CUDA devices, for
    /// models they serve (see [`CausalLm::supports_decode_fusion`]), once they compiled and
    /// passed their self-check (a failure is reported once, and the unfused layers used
    /// instead). Never called inside a graph capture, like [`Self::uses_paged_kernel`].
    fn uses_decode_fusion<M: CausalLm + ?Sized>(&mut self, model: &M) -> bool {
        let kind = model.dtype();
        self.decode_fusion.usable(
            model.device(),
            model.supports_decode_fusion(),
            |index| decode_gemv::self_check(index, kind),
            "decoding without the fused decode kernels",
        )
    }

    /// Drops the cache and graphs (every sequence in it is forgotten).
    pub fn reset(&mut self) {
        // Graphs first: they point into the cache.
        self.graphs.clear();
        self.inputs.clear();
        self.cache = None;
    }

    /// The cache, made on first use with room for `rows` sequences of the model's full length
    /// at most, within the budget; remade larger when `empty` says no sequence lives in it and
    /// the budget allows more blocks than it has.
    pub fn cache<M: CausalLm + ?Sized>(
        &mut self,
        model: &M,
        rows: i64,
        empty: bool,
    ) -> Result<&mut PagedKvCache> {
        let wanted = rows
            .max(1)
            .saturating_mul(PagedKvCache::blocks_for(model.max_positions()))
            .saturating_add(1);
        let has = |cache: &Option<PagedKvCache>| cache.as_ref().map(|c| c.usable_blocks() + 1);
        let settled = has(&self.cache).is_some_and(|blocks| blocks >= wanted || !empty);
        if !settled {
            let block = model.kv_block_bytes()?;
            let budget = self.budget.bytes(model.device())?;
            let blocks = (budget / block.max(1)).min(wanted as u64) as i64;
            if has(&self.cache).is_none_or(|held| held < blocks) {
                let needed = PagedKvCache::blocks_for(self.min_sequence);
                ensure!(
                    blocks > needed,
                    "{} holds {} KV blocks of {BLOCK_SIZE} positions ({block} bytes each, and \
                     one more reserved); one sequence of {} positions needs {needed}",
                    self.budget,
                    (blocks - 1).max(0),
                    self.min_sequence
                );
                let bytes = blocks as u64 * block;
                if let Some(room) = room_for_cache(model.device())? {
                    let place = match model.device() {
                        Device::Cuda(index) => format!("cuda:{index} has"),
                        _ => "the machine has".to_string(),
                    };
                    ensure!(
                        bytes <= room,
                        "{} asks for a KV cache of {blocks} blocks ({:.2} GiB) but {place} \
                         {:.2} GiB free",
                        self.budget,
                        bytes as f64 / GIB,
                        room as f64 / GIB
                    );
                }
                // The old cache and graphs go first: their memory is needed for the new ones.
                self.reset();
                let made = model.new_paged_kv_cache(blocks).map_err(|e| {
                    // libtorch's message is its first line; a C++ backtrace follows.
                    let message = format!("{e:#}");
                    anyhow::anyhow!(
                        "cannot make a KV cache of {blocks} blocks ({:.2} GiB) for {}: {}",
                        bytes as f64 / GIB,
                        self.budget,
                        message.lines().next().unwrap_or_default()
                    )
                })?;
                self.cache = Some(made);
            }
        }
        Ok(self.cache.as_mut().expect("the cache was made"))
    }

    /// Makes the cache (room for `rows` sequences) and, on a GPU with graphs, captures the
    /// decode graph of every bucket up to `rows` rows and every window, so that no request
    /// waits for a capture. Returns the number of graphs.
    pub fn warm_up<M: CausalLm + ?Sized>(&mut self, model: &M, rows: i64) -> Result<usize> {
        // Each row owns a block at least: no more rows than blocks ever run together.
        let rows = rows
            .min(self.cache(model, rows, true)?.usable_blocks())
            .max(1);
        let index = match model.device() {
            Device::Cuda(index) if self.cuda_graphs => index,
            _ => return Ok(0),
        };
        let capacity = round_up(model.max_positions(), WINDOW_STEP);
        let in_place = self.uses_paged_kernel(model);
        let fused = self.uses_decode_fusion(model);
        let mut size = 1;
        loop {
            for window in windows(capacity, in_place) {
                // Padding rows only: they write to and read the reserved block.
                let zeros = vec![0i64; size as usize];
                let tables = vec![0i64; (size * window / BLOCK_SIZE) as usize];
                let inputs = StepInputs {
                    tokens: &zeros,
                    drawn: None,
                    positions: &zeros,
                    write: &zeros,
                    tables: &tables,
                };
                let _ = self.replay(model, index, size, window, inputs, in_place, fused)?;
            }
            if size >= rows {
                return Ok(self.graphs.len());
            }
            size *= 2;
        }
    }

    /// The cache, when it has been made.
    pub fn existing_cache(&mut self) -> Option<&mut PagedKvCache> {
        self.cache.as_mut()
    }

    /// Prompt chunks of several sequences in one forward: each chunk's logits
    /// (`[its length, padded vocabulary]`), its keys and values stored in its blocks. Shorter
    /// chunks are padded with positions that write to and read the reserved block.
    pub fn prefill<M: CausalLm + ?Sized>(
        &mut self,
        model: &M,
        chunks: &[PrefillChunk],
    ) -> Result<Vec<Tensor>> {
        ensure!(!chunks.is_empty(), "a prefill needs chunks");
        let device = model.device();
        let width = chunks.iter().map(|c| c.tokens.len()).max().unwrap_or(0);
        // In whole steps of WINDOW_STEP (masked past each row's positions): few distinct
        // attention shapes, and rows of the bias aligned as GPU attention kernels want them.
        let window = chunks
            .iter()
            .map(|c| c.start + c.tokens.len() as i64)
            .max()
            .map_or(0, |end| round_up(end, WINDOW_STEP)) as usize;
        let rows = chunks.len();
        let mut tokens = vec![0i64; rows * width];
        let mut positions = vec![0i64; rows * width];
        let mut write = vec![0i64; rows * width];
        let mut read = vec![0i64; rows * window];
        for (r, chunk) in chunks.iter().enumerate() {
            let count = chunk.tokens.len() as i64;
            let end = chunk.start + count;
            ensure!(
                count > 0 && end <= chunk.blocks.len() as i64 * BLOCK_SIZE,
                "positions {}..{end} do not fit the {} blocks of the sequence",
                chunk.start,
                chunk.blocks.len()
            );
            for (j, p) in (chunk.start..end).enumerate() {
                tokens[r * width + j] = chunk.tokens[j];
                positions[r * width + j] = p;
                write[r * width + j] = slot(chunk.blocks, p);
            }
            for p in 0..end {
                read[r * window + p as usize] = slot(chunk.blocks, p);
            }
        }
        // One copy to the device; the inputs are views of it.
        let (rows, width, window) = (rows as i64, width as i64, window as i64);
        let packed =
            Tensor::from_slice(&[tokens, positions, write, read].concat()).to_device(device);
        let tokens = packed.narrow(0, 0, rows * width).view([rows, width]);
        let positions = packed
            .narrow(0, rows * width, rows * width)
            .view([rows, width]);
        let step = PagedStep::new(
            packed.narrow(0, 2 * rows * width, rows * width),
            packed
                .narrow(0, 3 * rows * width, rows * window)
                .view([rows, window]),
            &positions,
            model.dtype(),
        );
        let cache = self
            .cache
            .as_mut()
            .expect("prefill after the cache was made");
        let logits = tch::no_grad(|| model.forward_paged(&tokens, &positions, cache, &step))?;
        Ok(chunks
            .iter()
            .enumerate()
            .map(|(r, chunk)| {
                logits
                    .select(1, r as i64)
                    .narrow(0, 0, chunk.tokens.len() as i64)
            })
            .collect())
    }

    /// Logits `[rows, padded vocabulary]` of one decode step of `rows`, each token's keys and
    /// values stored at its position. On a GPU with graphs the logits live in the graph's
    /// output buffer until the next step. `drawn`, when given, holds the rows' tokens on the
    /// device (`[rows]` int64, as the previous step drew them) and is read instead of their
    /// `token`s: the step is queued before those tokens reach the host. On a GPU nothing here
    /// waits for the work queued before.
    pub fn decode<M: CausalLm + ?Sized>(
        &mut self,
        model: &M,
        rows: &[DecodeRow],
        drawn: Option<&Tensor>,
    ) -> Result<Tensor> {
        let count = rows.len() as i64;
        ensure!(count > 0, "a decode step needs rows");
        if let Some(drawn) = drawn {
            ensure!(
                drawn.size() == [count],
                "{:?} drawn tokens for {count} rows",
                drawn.size()
            );
        }
        let in_place = self.uses_paged_kernel(model);
        let fused = self.uses_decode_fusion(model);
        let furthest = rows.iter().map(|r| r.position).max().unwrap_or(0);
        let capacity = round_up(model.max_positions(), WINDOW_STEP);
        let window = window_for(furthest + 1, capacity, in_place);
        let bucket = bucket(count);
        let device = model.device();
        let graphed = match device {
            Device::Cuda(index) if self.cuda_graphs => Some(index),
            _ => None,
        };
        // Eager steps run exactly the rows; graphs the bucket, padding rows at position 0 of
        // the padding block.
        let padded = if graphed.is_some() { bucket } else { count };
        let per_row = window / BLOCK_SIZE;
        let mut tokens = vec![0i64; padded as usize];
        let mut positions = vec![0i64; padded as usize];
        let mut write = vec![0i64; padded as usize];
        let mut tables = vec![0i64; (padded * per_row) as usize];
        for (i, row) in rows.iter().enumerate() {
            ensure!(
                row.position < row.blocks.len() as i64 * BLOCK_SIZE,
                "position {} is past the {} blocks of its sequence",
                row.position,
                row.blocks.len()
            );
            tokens[i] = row.token;
            positions[i] = row.position;
            write[i] = slot(row.blocks, row.position);
            let used = row.blocks.len().min(per_row as usize);
            tables[i * per_row as usize..][..used].copy_from_slice(&row.blocks[..used]);
        }
        let logits = match graphed {
            Some(index) => self.replay(
                model,
                index,
                bucket,
                window,
                StepInputs {
                    tokens: &tokens,
                    drawn,
                    positions: &positions,
                    write: &write,
                    tables: &tables,
                },
                in_place,
                fused,
            )?,
            None => {
                // One copy to the device; the inputs are views of it.
                let packed = to_device_async(
                    &Tensor::from_slice(&[&tokens[..], &positions, &write, &tables].concat()),
                    device,
                )?;
                let part = |k: i64| packed.narrow(0, k * padded, padded);
                let step_tokens = match drawn {
                    Some(drawn) => drawn.view([padded, 1]),
                    None => part(0).view([padded, 1]),
                };
                let table = packed
                    .narrow(0, 3 * padded, padded * per_row)
                    .view([padded, per_row]);
                let cache = self
                    .cache
                    .as_mut()
                    .expect("decode after the cache was made");
                tch::no_grad(|| {
                    decode_step(
                        model,
                        cache,
                        &step_tokens,
                        &part(1).view([padded, 1]),
                        &part(2),
                        &table,
                        in_place,
                        fused,
                    )
                })?
            }
        };
        Ok(logits.narrow(0, 0, count))
    }

    /// Copies the step's inputs into the bucket's static buffers and replays the graph of its
    /// bucket and window, capturing it first if needed.
    #[allow(clippy::too_many_arguments)]
    fn replay<M: CausalLm + ?Sized>(
        &mut self,
        model: &M,
        device: usize,
        bucket: i64,
        window: i64,
        step: StepInputs,
        in_place: bool,
        fused: bool,
    ) -> Result<Tensor> {
        let cuda = Device::Cuda(device);
        let capacity = round_up(model.max_positions(), WINDOW_STEP);
        let inputs = self
            .inputs
            .entry(bucket)
            .or_insert_with(|| GraphInputs::new(bucket, capacity, cuda));
        let packed = [step.tokens, step.positions, step.write, step.tables].concat();
        copy_from_host(
            &inputs.packed.narrow(0, 0, packed.len() as i64),
            &Tensor::from_slice(&packed),
        )?;
        if let Some(drawn) = step.drawn {
            let count = drawn.size()[0];
            inputs
                .tokens
                .narrow(0, 0, count)
                .copy_(&drawn.view([count, 1]));
        }
        let used = step.tables.len() as i64;
        let cache = self
            .cache
            .as_mut()
            .expect("decode after the cache was made");
        if !self.graphs.contains_key(&(bucket, window)) {
            let per_row = window / BLOCK_SIZE;
            let run = |cache: &mut PagedKvCache| {
                let table = inputs.tables.narrow(0, 0, used).view([bucket, per_row]);
                decode_step(
                    model,
                    cache,
                    &inputs.tokens,
                    &inputs.positions,
                    &inputs.write_slots,
                    &table,
                    in_place,
                    fused,
                )
            };
            // One eager run first: lazy initialisation (cuBLAS workspaces, kernel loading) must
            // not happen inside the capture. It writes the same slots the replay will.
            let _ = tch::no_grad(|| run(cache))?;
            let pool = self.graphs.values().next().map(|g| &g.graph);
            let (graph, logits) =
                CudaGraph::capture(device, pool, &[], || tch::no_grad(|| run(cache)))?;
            self.graphs
                .insert((bucket, window), StepGraph { graph, logits });
        }
        let captured = &self.graphs[&(bucket, window)];
        captured.graph.replay()?;
        Ok(captured.logits.shallow_clone())
    }
}

/// One decode step of `tokens` (`[b, 1]`) at `positions` (`[b, 1]`), written at `write_slots`
/// (`[b]`), each row attending to the first positions of the blocks of its `table` row, through
/// the fused decode kernels when `fused`. Logits `[b, padded vocabulary]`.
#[allow(clippy::too_many_arguments)]
fn decode_step<M: CausalLm + ?Sized>(
    model: &M,
    cache: &mut PagedKvCache,
    tokens: &Tensor,
    positions: &Tensor,
    write_slots: &Tensor,
    table: &Tensor,
    in_place: bool,
    fused: bool,
) -> Result<Tensor> {
    let (rows, per_row) = (table.size()[0], table.size()[1]);
    let step = if in_place {
        PagedStep::decode_in_place(
            write_slots.shallow_clone(),
            table.shallow_clone(),
            positions.view([rows]),
        )
    } else {
        let offsets = Tensor::arange(BLOCK_SIZE, (Kind::Int64, table.device()));
        let read = (table.unsqueeze(2) * BLOCK_SIZE + offsets).view([rows, per_row * BLOCK_SIZE]);
        PagedStep::new(write_slots.shallow_clone(), read, positions, model.dtype())
    };
    let step = step.with_decode_fusion(fused);
    Ok(model
        .forward_paged(tokens, positions, cache, &step)?
        .select(0, 0))
}

/// The pool slot of `position` of the sequence that owns `blocks`.
fn slot(blocks: &[i64], position: i64) -> i64 {
    blocks[(position / BLOCK_SIZE) as usize] * BLOCK_SIZE + position % BLOCK_SIZE
}

/// The batch size a decode graph runs for `rows` rows: the next power of two.
pub fn bucket(rows: i64) -> i64 {
    (rows.max(1) as u64).next_power_of_two() as i64
}

/// The window of a decode step whose furthest row has `length` positions, of `capacity`
/// (a multiple of [`WINDOW_STEP`]). The paged kernel reads a row only up to its position,
/// whatever its table's width, so its windows grow in powers of two (a few graphs per bucket,
/// block tables at most twice what the rows use); gathered attention reads the whole window,
/// so its windows grow in steps of [`WINDOW_STEP`].
fn window_for(length: i64, capacity: i64, in_place: bool) -> i64 {
    let window = if in_place {
        (length.max(WINDOW_STEP) as u64).next_power_of_two() as i64
    } else {
        round_up(length, WINDOW_STEP)
    };
    window.min(capacity)
}

/// Every window [`window_for`] gives.
fn windows(capacity: i64, in_place: bool) -> Vec<i64> {
    let mut all: Vec<i64> = (1..=capacity / WINDOW_STEP)
        .map(|w| window_for(w * WINDOW_STEP, capacity, in_place))
        .collect();
    all.dedup();
    all
}

fn round_up(value: i64, step: i64) -> i64 {
    (value + step - 1) / step * step
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kernel_windows_double_and_gathered_windows_step() {
        assert_eq!(windows(1024, true), [128, 256, 512, 1024]);
        assert_eq!(windows(384, true), [128, 256, 384]);
        assert_eq!(windows(384, false), [128, 256, 384]);
        assert_eq!(windows(1024, false).len(), 8);
        assert_eq!(window_for(300, 1024, true), 512);
        assert_eq!(window_for(300, 1024, false), 384);
        assert_eq!(window_for(1, 1024, true), 128);
        assert_eq!(window_for(1024, 1024, true), 1024);
    }
}
