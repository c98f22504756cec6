//! The model being served with what turns requests into its rows and its generations into
//! answers: the tokenizer and its special tokens, the settings, and the tensor-parallel group.
//! The request kinds add their own parts ([`megatron_api`], [`completions`]).

mod completions;
mod megatron_api;

pub(crate) use completions::CompletionState;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use megatron_data::tokenizer::Tokenizer;
use megatron_inference::{
    generate_tokens, CausalLm, Decoder, Generation, GenerationRequest, RowSpec,
};
use megatron_parallel::Communicator;

use super::queue::Answer;
use super::tensor_parallel::SharedJob;
use super::workload::Workload;
use super::ServiceError;
use crate::settings::ServingSettings;

/// Token ids the request flags refer to, found through the tokenizer (GPT-2: 198, 628, 25).
pub(super) struct SpecialTokens {
    pub eod: i64,
    pub newline: Option<i64>,
    pub double_newline: Option<i64>,
    pub colon: Option<i64>,
}

/// The model and how requests become its rows; owned by the scheduler while it runs.
pub(super) struct ServedModel<M> {
    pub model: M,
    pub tokenizer: Arc<dyn Tokenizer>,
    pub settings: ServingSettings,
    pub special: SpecialTokens,
    /// With tensor parallelism: the group whose other ranks run every step with rank 0.
    pub mirror: Option<Arc<dyn Communicator>>,
    /// What the scheduler shows of its work.
    pub workload: Arc<Workload>,
}

/// A request turned into what runs.
pub(super) enum Prepared {
    /// Megatron's `/api`: rows batched with the others, from prompts of this many tokens.
    Api { prompt_tokens: usize },
    /// An OpenAI completion: rows batched with the others, streamed as they go.
    Completion(Box<CompletionState>),
}

/// What a request needs once validated.
pub(super) enum Start {
    /// Rows for the batcher.
    Rows(Prepared, Vec<RowSpec>),
    /// Answered at once, outside the batch (beam search, prompt scoring).
    Now(Result<Answer, ServiceError>),
}

impl<M: CausalLm> ServedModel<M> {
    pub fn new(
        model: M,
        tokenizer: Arc<dyn Tokenizer>,
        settings: ServingSettings,
    ) -> anyhow::Result<Self> {
        // A larger tokenizer would hand the model ids its embedding table does not have.
        anyhow::ensure!(
            tokenizer.vocab_size() as i64 <= model.vocab_size(),
            "the tokenizer has {} tokens but the checkpoint's model knows {}: give the \
             tokenizer flags the model was trained with",
            tokenizer.vocab_size(),
            model.vocab_size()
        );
        let eod = tokenizer
            .eod()
            .map(i64::from)
            .ok_or_else(|| anyhow::anyhow!("the tokenizer has no end-of-document token"))?;
        let special = SpecialTokens {
            eod,
            newline: single_token(tokenizer.as_ref(), "\n"),
            double_newline: single_token(tokenizer.as_ref(), "\n\n"),
            colon: single_token(tokenizer.as_ref(), ":"),
        };
        Ok(ServedModel {
            model,
            tokenizer,
            settings,
            special,
            mirror: None,
            workload: Arc::default(),
        })
    }

    /// Rank 0's part of a submitted request before every rank runs it: a seed when it names
    /// none, and with `fill_context` (a chat without `max_tokens`) the room left after its
    /// prompt as its `max_tokens`.
    pub fn shared_job(&self, job: SharedJob, fill_context: bool) -> SharedJob {
        match job {
            SharedJob::Api(mut request) => {
                request.random_seed = Some(request.random_seed.unwrap_or_else(fresh_seed));
                SharedJob::Api(request)
            }
            SharedJob::Completion(mut request) => {
                if fill_context {
                    let prompt = request.prompts.first().map(String::as_str).unwrap_or("");
                    let length = self.tokenizer.tokenize(prompt).map_or(0, |ids| ids.len());
                    // At least one: a conversation that fills the context is refused with the
                    // length message rather than answered empty.
                    request.max_tokens = self.room_after(length).max(1);
                }
                request.seed = Some(request.seed.unwrap_or_else(fresh_seed));
                SharedJob::Completion(request)
            }
        }
    }

    /// The most tokens a completion of a `prompt_tokens` long prompt may ask for: the
    /// model's positions and the request budget (`--max-tokens-to-oom`) left after it.
    fn room_after(&self, prompt_tokens: usize) -> usize {
        let longest = self.longest_sequence().min(self.settings.max_tokens);
        longest.saturating_sub(prompt_tokens)
    }

    /// The longest prompt + generation of a request: the model's positions, or
    /// `--inference-max-seq-length` when it is less.
    pub fn longest_sequence(&self) -> usize {
        self.sequence_limit().0
    }

    /// [`Self::longest_sequence`] and what sets it, for messages.
    pub fn sequence_limit(&self) -> (usize, String) {
        let positions = self.model.max_positions() as usize;
        match self.settings.max_sequence {
            Some(most) if most < positions => (most, format!("--inference-max-seq-length {most}")),
            _ => (positions, format!("the model's {positions} positions")),
        }
    }

    /// Token ids of `prompts`, each after an end-of-document token with `add_bos`.
    pub fn tokenize(&self, prompts: &[String], add_bos: bool) -> anyhow::Result<Vec<Vec<i64>>> {
        prompts
            .iter()
            .map(|prompt| {
                let bos = add_bos.then_some(self.special.eod);
                let ids = self.tokenizer.tokenize(prompt)?.into_iter().map(i64::from);
                Ok(bos.into_iter().chain(ids).collect())
            })
            .collect()
    }

    /// Sampling keeps at most the whole vocabulary.
    pub fn check_top_k(&self, top_k: i64) -> Result<(), ServiceError> {
        let vocabulary = self.model.vocab_size();
        if top_k > vocabulary {
            return Err(ServiceError::Rejected(format!(
                "top_k ({top_k}) must not exceed the vocabulary size ({vocabulary})"
            )));
        }
        Ok(())
    }

    /// The rows of `generation` (drawing from `seed`) for the batch, to be answered as
    /// `prepared` says; with no new tokens, its prompts scored in one forward and answered now.
    pub fn start(
        &self,
        prepared: Prepared,
        generation: &GenerationRequest,
        seed: Option<u64>,
    ) -> Result<Start, ServiceError> {
        self.start_sampled(prepared, generation, seed, 1)
    }

    /// [`Self::start`] with `samples` rows per prompt, sharing its prefill.
    pub fn start_sampled(
        &self,
        prepared: Prepared,
        generation: &GenerationRequest,
        seed: Option<u64>,
        samples: usize,
    ) -> Result<Start, ServiceError> {
        if generation.tokens_to_generate == 0 {
            let scored = generate_tokens(&self.model, generation, &mut Decoder::eager())
                .map_err(|e| ServiceError::Failed(format!("{e:#}")));
            return Ok(Start::Now(
                scored.and_then(|out| self.finish(prepared, out)),
            ));
        }
        let rows = generation
            .sampled_rows(seed.unwrap_or(0), samples)
            .map_err(|e| ServiceError::Rejected(format!("{e:#}")))?;
        Ok(Start::Rows(prepared, rows))
    }

    /// The answer to a request prepared as `prepared`, from its rows' tokens.
    pub fn finish(&self, prepared: Prepared, out: Generation) -> Result<Answer, ServiceError> {
        match prepared {
            Prepared::Api { prompt_tokens } => self.finish_api(out, prompt_tokens),
            Prepared::Completion(state) => self.finish_completion(*state, out),
        }
    }
}

fn single_token(tokenizer: &dyn Tokenizer, text: &str) -> Option<i64> {
    tokenizer
        .tokenize(text)
        .ok()
        .and_then(|ids| ids.first().map(|&id| i64::from(id)))
}

/// A fresh random seed for a request that names none.
fn fresh_seed() -> u64 {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default()
        .as_nanos() as u64;
    megatron_inference::row_seed(nanos, COUNTER.fetch_add(1, Ordering::Relaxed) as usize)
}
