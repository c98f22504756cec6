//! How the generation loop runs the model: one KV cache kept from request to request while the
//! batch shape repeats, and on a GPU each single-position decode step replayed from a CUDA graph.
//!
//! A decode step of a 24-layer model is a few hundred small kernels; launched one by one from the
//! host they take several times longer than the GPU needs to run them. A graph launches them all
//! at once. Its shapes are fixed, so the step attends to a fixed window of cache slots (masked
//! past the current position) and there is one graph per window, in steps of [`WINDOW_STEP`].

use anyhow::Result;
use tch::{Device, Kind, Tensor};

use crate::model::layers::KvCache;
use crate::model::GptModel;
use crate::runtime::{cuda_graphs_available, CudaGraph};

/// Cache slots are allocated, and decode graphs captured, in multiples of this many positions.
pub const WINDOW_STEP: i64 = 128;

/// Runs prefill and decode steps of generations; keep one per model and reuse it.
pub struct Decoder {
    cuda_graphs: bool,
    session: Option<Session>,
}

/// A KV cache of one shape and the decode graphs captured over it.
struct Session {
    cache: KvCache,
    graphs: Option<StepGraphs>,
}

/// The static input buffers of the decode graphs and a graph per attention window.
struct StepGraphs {
    device: usize,
    tokens: Tensor,
    position: Tensor,
    windows: Vec<WindowGraph>,
}

struct WindowGraph {
    window: i64,
    graph: CudaGraph,
    logits: Tensor,
}

impl Decoder {
    /// Every step launched kernel by kernel.
    pub fn eager() -> Self {
        Decoder {
            cuda_graphs: false,
            session: None,
        }
    }

    /// Decode steps from CUDA graphs when the model runs on a GPU and this build can capture
    /// them (see [`cuda_graphs_available`]); eager otherwise.
    pub fn with_cuda_graphs() -> Self {
        Decoder {
            cuda_graphs: cuda_graphs_available(),
            session: None,
        }
    }

    /// Drops the kept cache and graphs.
    pub fn reset(&mut self) {
        self.session = None;
    }

    /// Starts a generation of `batch` sequences of up to `total` positions: an empty cache,
    /// reused from the previous generation when the batch and rounded capacity match.
    pub fn start<'a>(
        &'a mut self,
        model: &'a GptModel,
        batch: i64,
        total: i64,
    ) -> Result<Steps<'a>> {
        let capacity = round_up(total, WINDOW_STEP);
        let reusable = self
            .session
            .as_ref()
            .is_some_and(|s| s.cache.batch() == batch && s.cache.capacity() == capacity);
        if !reusable {
            // The old cache and graphs go first: their memory may be needed for the new ones.
            self.session = None;
            let cache = model.new_kv_cache(batch, capacity)?;
            let graphs = match model.options().device {
                Device::Cuda(device) if self.cuda_graphs => Some(StepGraphs {
                    device,
                    tokens: Tensor::zeros([batch, 1], (Kind::Int64, Device::Cuda(device))),
                    position: Tensor::zeros([1], (Kind::Int64, Device::Cuda(device))),
                    windows: Vec::new(),
                }),
                _ => None,
            };
            self.session = Some(Session { cache, graphs });
        }
        let session = self.session.as_mut().expect("a session was just made");
        session.cache.set_len(0);
        Ok(Steps { model, session })
    }
}

/// The steps of one generation.
pub struct Steps<'a> {
    model: &'a GptModel,
    session: &'a mut Session,
}

impl Steps<'_> {
    /// Logits `[s, b, padded vocabulary]` of `tokens` (`[b, s]`), the positions after those
    /// already cached.
    pub fn forward(&mut self, tokens: &Tensor) -> Result<Tensor> {
        let cache = &mut self.session.cache;
        match &mut self.session.graphs {
            Some(graphs) if tokens.size()[1] == 1 => {
                let position = cache.len();
                let logits = graphs.step(self.model, cache, tokens, position)?;
                cache.set_len(position + 1);
                Ok(logits)
            }
            _ => self.model.forward_cached(tokens, cache),
        }
    }
}

impl StepGraphs {
    /// Replays the graph of the window that covers `position`, capturing it first if needed.
    /// The logits live in the graph's output buffer until its next replay.
    fn step(
        &mut self,
        model: &GptModel,
        cache: &mut KvCache,
        tokens: &Tensor,
        position: i64,
    ) -> Result<Tensor> {
        self.tokens.copy_(tokens);
        let _ = self.position.fill_(position);
        let window = round_up(position + 1, WINDOW_STEP).min(cache.capacity());
        let index = match self.windows.iter().position(|w| w.window == window) {
            Some(index) => index,
            None => {
                self.capture(model, cache, window)?;
                self.windows.len() - 1
            }
        };
        let captured = &self.windows[index];
        captured.graph.replay()?;
        Ok(captured.logits.shallow_clone())
    }

    fn capture(&mut self, model: &GptModel, cache: &mut KvCache, window: i64) -> Result<()> {
        // One eager run first: lazy initialisation (cuBLAS workspaces, kernel loading) must
        // not happen inside the capture. It writes the same slot the replay will.
        let _ = model.forward_decode_step(&self.tokens, &self.position, window, cache)?;
        let (graph, logits) =
            CudaGraph::capture(self.device, self.windows.first().map(|w| &w.graph), || {
                model.forward_decode_step(&self.tokens, &self.position, window, cache)
            })?;
        self.windows.push(WindowGraph {
            window,
            graph,
            logits,
        });
        Ok(())
    }
}

fn round_up(value: i64, step: i64) -> i64 {
    (value + step - 1) / step * step
}
