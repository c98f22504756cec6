//! Where each rank sits in the tensor × context × data × pipeline grid, and which ranks form
//! each group, in Megatron's default `tp-cp-ep-dp-pp` order (spec §8): the tensor-parallel rank
//! varies fastest, then the context-parallel rank, then the data-parallel rank, then the
//! pipeline stage.
//!
//! The experts of Mixture-of-Experts layers see a grid of their own over the same ranks
//! (Megatron's decoupled expert rank generator, with expert tensor parallelism 1): within a
//! pipeline stage the expert-parallel rank varies fastest, then the expert-data-parallel
//! rank, so the tensor × context × data ranks of a stage are refolded as expert × expert-data.

use anyhow::{ensure, Result};
use serde::{Deserialize, Serialize};

/// The parallel sizes of a job.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ParallelLayout {
    pub world_size: usize,
    pub tensor: usize,
    /// `--context-parallel-size`: the ranks that split each sequence between them.
    #[serde(default = "one")]
    pub context: usize,
    pub pipeline: usize,
    pub data: usize,
    /// `--expert-model-parallel-size`: the ranks each Mixture-of-Experts layer's experts are
    /// split over; `None` for a model without such layers, which needs no expert groups.
    #[serde(default)]
    pub expert: Option<usize>,
}

fn one() -> usize {
    1
}

/// One rank's coordinates.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Coordinates {
    pub tensor: usize,
    pub context: usize,
    pub data: usize,
    pub pipeline: usize,
}

/// The kinds of process group a rank belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum GroupKind {
    Tensor,
    /// The ranks holding the pieces of the same sequences (same tensor, data and pipeline
    /// rank).
    Context,
    Data,
    /// Data × context: the ranks whose gradients are summed (Megatron's data-parallel group
    /// with context parallelism).
    DataWithContext,
    Pipeline,
    /// Tensor × pipeline: the ranks that together hold one replica of the model.
    Model,
    /// The first and last stage of a pipeline (same tensor and data rank), which share the
    /// tied word embeddings.
    Embedding,
    World,
    /// The ranks that split one layer's experts between them (Megatron's `ep` group).
    Expert,
    /// The ranks holding the same experts, over which their gradients are reduced.
    ExpertData,
    /// Expert × pipeline: the ranks that together hold one replica of the experts (the
    /// experts' share of the gradient norm).
    ExpertModel,
}

impl GroupKind {
    pub fn name(self) -> &'static str {
        match self {
            GroupKind::Tensor => "tensor",
            GroupKind::Context => "context",
            GroupKind::Data => "data",
            GroupKind::DataWithContext => "data-context",
            GroupKind::Pipeline => "pipeline",
            GroupKind::Model => "model",
            GroupKind::Embedding => "embedding",
            GroupKind::World => "world",
            GroupKind::Expert => "expert",
            GroupKind::ExpertData => "expert-data",
            GroupKind::ExpertModel => "expert-model",
        }
    }
}

impl ParallelLayout {
    /// `--tensor-model-parallel-size t --pipeline-model-parallel-size p` over `world_size` ranks;
    /// the data-parallel size is what remains.
    pub fn new(world_size: usize, tensor: usize, pipeline: usize) -> Result<Self> {
        Self::with_context(world_size, tensor, 1, pipeline)
    }

    /// [`new`](Self::new) with `--context-parallel-size context`: the data-parallel size is
    /// what remains of the world after tensor × context × pipeline.
    pub fn with_context(
        world_size: usize,
        tensor: usize,
        context: usize,
        pipeline: usize,
    ) -> Result<Self> {
        ensure!(
            tensor > 0 && context > 0 && pipeline > 0,
            "parallel sizes must be positive"
        );
        let model = tensor * context * pipeline;
        ensure!(
            world_size % model == 0,
            "world size {world_size} is not divisible by --tensor-model-parallel-size {tensor} × \
             --context-parallel-size {context} × --pipeline-model-parallel-size {pipeline}"
        );
        Ok(ParallelLayout {
            world_size,
            tensor,
            context,
            pipeline,
            data: world_size / model,
            expert: None,
        })
    }

    /// The same grid for a model with Mixture-of-Experts layers, whose experts are split over
    /// `expert` ranks (`--expert-model-parallel-size`; the experts' tensor parallelism is 1).
    pub fn with_expert_parallel(self, expert: usize) -> Result<Self> {
        let stage = self.stage_size();
        ensure!(
            expert > 0 && stage % expert == 0,
            "--expert-model-parallel-size {expert} does not divide the {stage} ranks of a \
             pipeline stage (world size {} / --pipeline-model-parallel-size {})",
            self.world_size,
            self.pipeline
        );
        Ok(ParallelLayout {
            expert: Some(expert),
            ..self
        })
    }

    /// The ranks of one pipeline stage: tensor × context × data.
    fn stage_size(&self) -> usize {
        self.tensor * self.context * self.data
    }

    /// The expert-parallel size (1 without Mixture-of-Experts layers).
    pub fn expert_size(&self) -> usize {
        self.expert.unwrap_or(1)
    }

    /// The expert-data-parallel size: the ranks of a stage holding the same experts.
    pub fn expert_data(&self) -> usize {
        self.stage_size() / self.expert_size()
    }

    /// `rank`'s expert-parallel and expert-data-parallel indices in the expert grid.
    pub fn expert_coordinates(&self, rank: usize) -> (usize, usize) {
        let within_stage = rank % self.stage_size();
        let size = self.expert_size();
        (within_stage % size, within_stage / size)
    }

    fn expert_rank_of(&self, expert: usize, expert_data: usize, pipeline: usize) -> usize {
        expert + self.expert_size() * (expert_data + self.expert_data() * pipeline)
    }

    pub fn single() -> Self {
        ParallelLayout {
            world_size: 1,
            tensor: 1,
            context: 1,
            pipeline: 1,
            data: 1,
            expert: None,
        }
    }

    pub fn coordinates(&self, rank: usize) -> Coordinates {
        Coordinates {
            tensor: rank % self.tensor,
            context: rank / self.tensor % self.context,
            data: rank / (self.tensor * self.context) % self.data,
            pipeline: rank / (self.tensor * self.context * self.data),
        }
    }

    pub fn rank_of(&self, c: Coordinates) -> usize {
        c.tensor + self.tensor * (c.context + self.context * (c.data + self.data * c.pipeline))
    }

    /// The ranks of `rank`'s group of `kind`, in group-rank order.
    pub fn group(&self, kind: GroupKind, rank: usize) -> Vec<usize> {
        let c = self.coordinates(rank);
        match kind {
            GroupKind::Tensor => (0..self.tensor)
                .map(|tensor| self.rank_of(Coordinates { tensor, ..c }))
                .collect(),
            GroupKind::Context => (0..self.context)
                .map(|context| self.rank_of(Coordinates { context, ..c }))
                .collect(),
            GroupKind::Data => (0..self.data)
                .map(|data| self.rank_of(Coordinates { data, ..c }))
                .collect(),
            GroupKind::DataWithContext => (0..self.data)
                .flat_map(|data| {
                    (0..self.context).map(move |context| Coordinates { context, data, ..c })
                })
                .map(|c| self.rank_of(c))
                .collect(),
            GroupKind::Pipeline => (0..self.pipeline)
                .map(|pipeline| self.rank_of(Coordinates { pipeline, ..c }))
                .collect(),
            // Megatron's model-parallel group leaves the context-parallel ranks out: each holds
            // a whole replica's parameters.
            GroupKind::Model => (0..self.pipeline)
                .flat_map(|pipeline| {
                    (0..self.tensor).map(move |tensor| Coordinates {
                        tensor,
                        pipeline,
                        ..c
                    })
                })
                .map(|c| self.rank_of(c))
                .collect(),
            GroupKind::Embedding => {
                let pipeline = self.group(GroupKind::Pipeline, rank);
                let (first, last) = (pipeline[0], pipeline[pipeline.len() - 1]);
                if first == last {
                    vec![first]
                } else {
                    vec![first, last]
                }
            }
            GroupKind::World => (0..self.world_size).collect(),
            GroupKind::Expert => {
                let (_, expert_data) = self.expert_coordinates(rank);
                (0..self.expert_size())
                    .map(|e| self.expert_rank_of(e, expert_data, c.pipeline))
                    .collect()
            }
            GroupKind::ExpertData => {
                let (expert, _) = self.expert_coordinates(rank);
                (0..self.expert_data())
                    .map(|d| self.expert_rank_of(expert, d, c.pipeline))
                    .collect()
            }
            GroupKind::ExpertModel => {
                let (_, expert_data) = self.expert_coordinates(rank);
                (0..self.pipeline)
                    .flat_map(|p| (0..self.expert_size()).map(move |e| (e, p)))
                    .map(|(e, p)| self.expert_rank_of(e, expert_data, p))
                    .collect()
            }
        }
    }

    /// Every distinct group of `kind`, each in group-rank order, ordered by its first rank.
    pub fn all_groups(&self, kind: GroupKind) -> Vec<Vec<usize>> {
        let mut groups: Vec<Vec<usize>> = Vec::new();
        for rank in 0..self.world_size {
            let group = self.group(kind, rank);
            if !groups.contains(&group) {
                groups.push(group);
            }
        }
        groups.sort_by_key(|g| g[0]);
        groups
    }

    /// `TP=2 PP=2 DP=2` (with `CP=` when the sequences are split and `EP=` with expert
    /// parallelism), for messages.
    pub fn describe(&self) -> String {
        let mut out = format!("TP={}", self.tensor);
        if self.context > 1 {
            out += &format!(" CP={}", self.context);
        }
        out += &format!(" PP={} DP={}", self.pipeline, self.data);
        if self.expert_size() > 1 {
            out += &format!(" EP={}", self.expert_size());
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn groups_follow_megatrons_rank_order() {
        // Spec §8: world 8, t=2, p=2, dp=2.
        let layout = ParallelLayout::new(8, 2, 2).unwrap();
        assert_eq!(layout.data, 2);
        assert_eq!(
            layout.all_groups(GroupKind::Tensor),
            [[0, 1], [2, 3], [4, 5], [6, 7]]
        );
        assert_eq!(
            layout.all_groups(GroupKind::Data),
            [[0, 2], [1, 3], [4, 6], [5, 7]]
        );
        assert_eq!(
            layout.all_groups(GroupKind::Pipeline),
            [[0, 4], [1, 5], [2, 6], [3, 7]]
        );
        assert_eq!(
            layout.all_groups(GroupKind::Model),
            [[0, 1, 4, 5], [2, 3, 6, 7]]
        );
        assert_eq!(
            layout.all_groups(GroupKind::Embedding),
            [[0, 4], [1, 5], [2, 6], [3, 7]]
        );
        assert_eq!(
            layout.coordinates(6),
            Coordinates {
                tensor: 0,
                context: 0,
                data: 1,
                pipeline: 1
            }
        );
        for rank in 0..8 {
            assert_eq!(layout.rank_of(layout.coordinates(rank)), rank);
        }
    }

    /// Megatron's expert rank generator (core_v0.14.0 `RankGenerator(tp=1, ep, dp=world /
    /// (ep·pp), pp)` in the `tp-cp-ep-dp-pp` order): world 8, TP=2, PP=2, EP=2.
    #[test]
    fn expert_groups_follow_megatrons_expert_rank_generator() {
        let layout = ParallelLayout::new(8, 2, 2)
            .unwrap()
            .with_expert_parallel(2)
            .unwrap();
        assert_eq!(layout.expert_data(), 2);
        assert_eq!(
            layout.all_groups(GroupKind::Expert),
            [[0, 1], [2, 3], [4, 5], [6, 7]]
        );
        assert_eq!(
            layout.all_groups(GroupKind::ExpertData),
            [[0, 2], [1, 3], [4, 6], [5, 7]]
        );
        assert_eq!(
            layout.all_groups(GroupKind::ExpertModel),
            [[0, 1, 4, 5], [2, 3, 6, 7]]
        );
        // World 8, TP=2, PP=1, EP=4: a stage of 8 refolded as 4 experts × 2.
        let wide = ParallelLayout::new(8, 2, 1)
            .unwrap()
            .with_expert_parallel(4)
            .unwrap();
        assert_eq!(
            wide.all_groups(GroupKind::Expert),
            [[0, 1, 2, 3], [4, 5, 6, 7]]
        );
        assert_eq!(
            wide.all_groups(GroupKind::ExpertData),
            [[0, 4], [1, 5], [2, 6], [3, 7]]
        );
        // EP=1: every rank of a stage holds every expert.
        let dense = ParallelLayout::new(4, 2, 1)
            .unwrap()
            .with_expert_parallel(1)
            .unwrap();
        assert_eq!(dense.all_groups(GroupKind::ExpertData), [[0, 1, 2, 3]]);
        assert_eq!(dense.all_groups(GroupKind::Expert), [[0], [1], [2], [3]]);
        let error = ParallelLayout::new(6, 1, 2)
            .unwrap()
            .with_expert_parallel(2)
            .unwrap_err()
            .to_string();
        assert!(
            error.contains("--expert-model-parallel-size 2 does not divide the 3 ranks"),
            "{error}"
        );
    }

    #[test]
    fn context_parallel_ranks_sit_between_tensor_and_data() {
        // Megatron's `tp-cp-ep-dp-pp` order, world 16, t=2, cp=2, p=2, dp=2.
        let layout = ParallelLayout::with_context(16, 2, 2, 2).unwrap();
        assert_eq!(layout.data, 2);
        assert_eq!(
            layout.all_groups(GroupKind::Tensor)[..3],
            [[0, 1], [2, 3], [4, 5]]
        );
        assert_eq!(
            layout.all_groups(GroupKind::Context)[..4],
            [[0, 2], [1, 3], [4, 6], [5, 7]]
        );
        assert_eq!(
            layout.all_groups(GroupKind::Data)[..4],
            [[0, 4], [1, 5], [2, 6], [3, 7]]
        );
        assert_eq!(
            layout.all_groups(GroupKind::DataWithContext),
            [[0, 2, 4, 6], [1, 3, 5, 7], [8, 10, 12, 14], [9, 11, 13, 15]]
        );
        assert_eq!(
            layout.all_groups(GroupKind::Pipeline)[..2],
            [[0, 8], [1, 9]]
        );
        assert_eq!(
            layout.all_groups(GroupKind::Model)[..2],
            [[0, 1, 8, 9], [2, 3, 10, 11]]
        );
        assert_eq!(
            layout.coordinates(6),
            Coordinates {
                tensor: 0,
                context: 1,
                data: 1,
                pipeline: 0
            }
        );
        for rank in 0..16 {
            assert_eq!(layout.rank_of(layout.coordinates(rank)), rank);
        }
        assert_eq!(layout.describe(), "TP=2 CP=2 PP=2 DP=2");
    }

    #[test]
    fn sizes_must_divide_the_world() {
        assert!(ParallelLayout::new(6, 4, 1)
            .unwrap_err()
            .to_string()
            .contains("not divisible"));
        let single = ParallelLayout::new(1, 1, 1).unwrap();
        assert_eq!(single, ParallelLayout::single());
        assert_eq!(single.all_groups(GroupKind::Embedding), [[0]]);
    }
}
