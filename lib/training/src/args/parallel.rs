//! Model- and data-parallelism flags (spec §2, §4.6, §8).

use anyhow::Result;
use clap::Args;
use megatron_cli::ranges;
use megatron_models::layers::ContextExchange;

#[derive(Debug, Clone, Args, serde::Serialize)]
pub struct ParallelArgs {
    /// Tensor-parallel size: attention heads, MLP columns and the vocabulary are split over this
    /// many GPUs.
    #[arg(long, default_value_t = 1)]
    pub tensor_model_parallel_size: usize,
    /// Pipeline-parallel size: the layers are split into this many stages.
    #[arg(long, default_value_t = 1)]
    pub pipeline_model_parallel_size: usize,
    /// Split activations outside the tensor-parallel regions along the sequence (needs tensor
    /// parallelism).
    #[arg(long)]
    pub sequence_parallel: bool,
    /// Context-parallel size: each sequence is cut into 2 × this many chunks and every rank of
    /// a context-parallel group keeps two of them (chunks r and 2·CP−1−r), attending to the
    /// others' keys and values as --cp-comm-type says.
    #[arg(long, default_value_t = 1, value_parser = context_parallel_size)]
    pub context_parallel_size: usize,
    /// How context-parallel ranks share keys and values: p2p (a ring passing them on, partial
    /// results merged by their log-sum-exp), allgather (keys and values gathered, their
    /// gradients reduce-scattered) or a2a (Ulysses: heads exchanged for sequence, so the
    /// attention heads per tensor-parallel rank must divide by the context-parallel size) or
    /// a2a+p2p (a2a within groups of adjacent ranks, p2p across them, sized by
    /// --hierarchical-context-parallel-sizes). One type for every layer.
    #[arg(long, num_args = 1.., default_values_t = [CpCommType::P2p], value_enum, value_name = "TYPE")]
    pub cp_comm_type: Vec<CpCommType>,
    /// Sizes of the two levels of a2a+p2p context parallelism, whose product is the
    /// context-parallel size: `A B` runs a2a within each A adjacent context-parallel ranks and
    /// p2p over the B ranks at the same place of every such group.
    #[arg(long, num_args = 1.., value_name = "N")]
    pub hierarchical_context_parallel_sizes: Option<Vec<usize>>,
    /// Layers per virtual pipeline stage (interleaved 1F1B schedule).
    #[arg(long)]
    pub num_layers_per_virtual_pipeline_stage: Option<usize>,
    /// Virtual pipeline stages per pipeline rank (interleaved 1F1B schedule).
    #[arg(long)]
    pub num_virtual_stages_per_pipeline_rank: Option<usize>,
    /// Consecutive micro-batches a virtual stage runs before switching chunks [default: the
    /// pipeline size].
    #[arg(long)]
    pub microbatch_group_size_per_virtual_pipeline_stage: Option<usize>,
    /// Layers on the first pipeline stage (the rest split evenly).
    #[arg(long)]
    pub decoder_first_pipeline_num_layers: Option<usize>,
    /// Layers on the last pipeline stage (the rest split evenly).
    #[arg(long)]
    pub decoder_last_pipeline_num_layers: Option<usize>,
    /// Shard the float32 main parameters and optimizer state over the data-parallel group
    /// (gradients reduce-scattered, parameters all-gathered).
    #[arg(long)]
    pub use_distributed_optimizer: bool,
    /// Reduce gradient buckets while the last micro-batch's backward runs.
    #[arg(long)]
    pub overlap_grad_reduce: bool,
    /// All-gather the distributed optimizer's updated parameters bucket by bucket, overlapped
    /// with the next forward.
    #[arg(long)]
    pub overlap_param_gather: bool,
    /// Elements per data-parallel communication bucket [default: max(40M, 1M × data-parallel
    /// size)].
    #[arg(long)]
    pub ddp_bucket_size: Option<usize>,
    /// nccl (GPUs) or gloo (CPU processes, over TCP).
    #[arg(long, default_value = "nccl")]
    pub distributed_backend: String,
    /// Minutes a rank waits for the others (rendezvous and collectives) before giving up.
    #[arg(long, default_value_t = 10.0, value_parser = ranges::positive, allow_hyphen_values = true)]
    pub distributed_timeout_minutes: f64,
    /// This process's GPU on its node [default: $LOCAL_RANK].
    #[arg(long)]
    pub local_rank: Option<usize>,
}

impl ParallelArgs {
    /// Elements per gradient bucket for `data_parallel_size` ranks: --ddp-bucket-size or its
    /// default.
    pub fn bucket_size(&self, data_parallel_size: usize) -> usize {
        self.ddp_bucket_size.unwrap_or_else(|| {
            megatron_optim::DEFAULT_BUCKET_SIZE.max(1_000_000 * data_parallel_size)
        })
    }

    /// Model chunks per pipeline rank.
    pub fn virtual_stages(&self, num_layers: usize) -> anyhow::Result<usize> {
        let p = self.pipeline_model_parallel_size;
        match (self.num_layers_per_virtual_pipeline_stage, self.num_virtual_stages_per_pipeline_rank) {
            (Some(_), Some(_)) => megatron_cli::bail_usage!(
                "give only one of --num-layers-per-virtual-pipeline-stage and --num-virtual-stages-per-pipeline-rank"
            ),
            (Some(per_stage), None) => {
                anyhow::ensure!(
                    per_stage > 0 && num_layers % (p * per_stage) == 0,
                    "--num-layers {num_layers} is not divisible by --pipeline-model-parallel-size {p} × \
                     --num-layers-per-virtual-pipeline-stage {per_stage}"
                );
                Ok(num_layers / (p * per_stage))
            }
            (None, Some(chunks)) => Ok(chunks.max(1)),
            (None, None) => Ok(1),
        }
    }
}

/// `--context-parallel-size`: at least 1.
fn context_parallel_size(value: &str) -> std::result::Result<usize, String> {
    match value.parse::<usize>() {
        Ok(0) => Err("must be at least 1".into()),
        Ok(size) => Ok(size),
        Err(e) => Err(e.to_string()),
    }
}

/// `--cp-comm-type`'s values, Megatron's names.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
pub enum CpCommType {
    #[value(name = "p2p")]
    #[serde(rename = "p2p")]
    P2p,
    #[value(name = "allgather")]
    #[serde(rename = "allgather")]
    Allgather,
    #[value(name = "a2a")]
    #[serde(rename = "a2a")]
    A2a,
    #[value(name = "a2a+p2p")]
    #[serde(rename = "a2a+p2p")]
    A2aP2p,
}

impl ParallelArgs {
    /// The one `--cp-comm-type` of every layer, refusing what is not supported by name.
    pub fn context_parallel_exchange(&self) -> Result<ContextExchange> {
        let size = self.context_parallel_size;
        let levels = self.hierarchical_context_parallel_sizes.as_deref();
        if let Some(sizes) = levels {
            if sizes.iter().product::<usize>() != size {
                megatron_cli::bail_usage!(
                    "--hierarchical-context-parallel-sizes {sizes:?}: their product is not \
                     --context-parallel-size {size}"
                );
            }
        }
        let first = self.cp_comm_type[0];
        if self.cp_comm_type.iter().any(|&t| t != first) {
            megatron_cli::bail_usage!(
                "--cp-comm-type: one type per layer ({:?}) is not supported; give one type for \
                 every layer",
                self.cp_comm_type
            );
        }
        Ok(match first {
            CpCommType::P2p => ContextExchange::Ring,
            CpCommType::Allgather => ContextExchange::AllGather,
            CpCommType::A2a => ContextExchange::AllToAll,
            CpCommType::A2aP2p => match levels {
                Some(&[a2a_size, _]) => ContextExchange::AllToAllThenRing { a2a_size },
                Some(sizes) => megatron_cli::bail_usage!(
                    "--cp-comm-type a2a+p2p: --hierarchical-context-parallel-sizes {sizes:?} \
                     must be two sizes, the a2a level's and the p2p level's"
                ),
                None => megatron_cli::bail_usage!(
                    "--cp-comm-type a2a+p2p needs --hierarchical-context-parallel-sizes (the \
                     a2a level's size and the p2p level's)"
                ),
            },
        })
    }
}
