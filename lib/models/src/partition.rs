//! Which transformer layers each pipeline rank holds (spec §2.4): an even split, optionally
//! with a different count on the first and last stage, and with virtual pipelining chunk `c`
//! of rank `r` holding the contiguous block `c·p + r`.

use std::ops::Range;

use anyhow::{ensure, Result};

use super::chunk::ChunkSpec;

/// How the layers are spread over the pipeline.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PipelineSplit {
    pub num_layers: usize,
    pub stages: usize,
    /// Model chunks per stage (interleaved schedule); 1 without virtual pipelining.
    pub chunks: usize,
    /// `--decoder-first-pipeline-num-layers`.
    pub first_stage_layers: Option<usize>,
    /// `--decoder-last-pipeline-num-layers`.
    pub last_stage_layers: Option<usize>,
}

impl PipelineSplit {
    /// Global layer ranges of every stage, in stage order.
    fn stage_ranges(&self) -> Result<Vec<Range<usize>>> {
        let (layers, stages) = (self.num_layers, self.stages);
        let first = self.first_stage_layers;
        let last = self.last_stage_layers.filter(|_| stages > 1);
        let fixed = first.unwrap_or(0) + last.unwrap_or(0);
        let middle = stages - usize::from(first.is_some()) - usize::from(last.is_some());
        ensure!(fixed <= layers, "--decoder-first-pipeline-num-layers and --decoder-last-pipeline-num-layers ({fixed} together) exceed --num-layers {layers}");
        let rest = layers - fixed;
        let each = if middle == 0 {
            ensure!(rest == 0, "{rest} layers are left for no middle stage; adjust --decoder-first-pipeline-num-layers or --decoder-last-pipeline-num-layers");
            0
        } else {
            ensure!(
                rest % middle == 0,
                "--num-layers {layers} does not split evenly over {middle} pipeline stage(s) ({rest} layers left for them)"
            );
            rest / middle
        };
        let mut start = 0;
        Ok((0..stages)
            .map(|stage| {
                let count = match (stage, first, last) {
                    (0, Some(n), _) => n,
                    (s, _, Some(n)) if s == stages - 1 => n,
                    _ => each,
                };
                start += count;
                start - count..start
            })
            .collect())
    }

    /// The chunks of pipeline rank `stage`, in chunk order.
    pub fn chunks_of(&self, stage: usize) -> Result<Vec<ChunkSpec>> {
        let (p, v) = (self.stages, self.chunks);
        ensure!(stage < p, "pipeline stage {stage} of {p}");
        if v == 1 {
            let range = self.stage_ranges()?.swap_remove(stage);
            ensure!(
                !range.is_empty(),
                "pipeline stage {stage} would hold no layers"
            );
            return Ok(vec![ChunkSpec {
                pre_process: stage == 0,
                post_process: stage == p - 1,
                layers: range,
            }]);
        }
        ensure!(
            self.first_stage_layers.is_none() && self.last_stage_layers.is_none(),
            "--decoder-first-pipeline-num-layers and --decoder-last-pipeline-num-layers cannot be combined with virtual pipeline stages"
        );
        ensure!(
            p > 1,
            "virtual pipeline stages need --pipeline-model-parallel-size > 1"
        );
        ensure!(
            self.num_layers % (p * v) == 0,
            "--num-layers {} is not divisible by {p} stages × {v} virtual stages",
            self.num_layers
        );
        let block = self.num_layers / (p * v);
        Ok((0..v)
            .map(|c| {
                let index = c * p + stage;
                ChunkSpec {
                    pre_process: index == 0,
                    post_process: index == p * v - 1,
                    layers: index * block..(index + 1) * block,
                }
            })
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn split(num_layers: usize, stages: usize, chunks: usize) -> PipelineSplit {
        PipelineSplit {
            num_layers,
            stages,
            chunks,
            first_stage_layers: None,
            last_stage_layers: None,
        }
    }

    fn layers(split: &PipelineSplit, stage: usize) -> Vec<Range<usize>> {
        split
            .chunks_of(stage)
            .unwrap()
            .into_iter()
            .map(|c| c.layers)
            .collect()
    }

    #[test]
    fn even_and_interleaved_splits() {
        let even = split(8, 2, 1);
        assert_eq!(layers(&even, 0), [0..4]);
        assert_eq!(layers(&even, 1), [4..8]);
        // Spec §2.4: L=8, p=2, v=2 → stage 0 = [0,1],[4,5]; stage 1 = [2,3],[6,7].
        let virtual_split = split(8, 2, 2);
        assert_eq!(layers(&virtual_split, 0), [0..2, 4..6]);
        assert_eq!(layers(&virtual_split, 1), [2..4, 6..8]);
        let chunks = virtual_split.chunks_of(1).unwrap();
        assert!(!chunks[0].pre_process && !chunks[0].post_process && chunks[1].post_process);
        assert!(split(8, 3, 1)
            .chunks_of(0)
            .unwrap_err()
            .to_string()
            .contains("does not split evenly"));
    }

    #[test]
    fn uneven_first_and_last_stages() {
        let uneven = PipelineSplit {
            num_layers: 10,
            stages: 4,
            chunks: 1,
            first_stage_layers: Some(1),
            last_stage_layers: Some(3),
        };
        assert_eq!(
            (0..4).map(|s| layers(&uneven, s)).collect::<Vec<_>>(),
            [vec![0..1], vec![1..4], vec![4..7], vec![7..10]]
        );
        let bad = PipelineSplit {
            first_stage_layers: Some(2),
            ..uneven
        };
        assert!(bad.chunks_of(0).is_err());
    }
}
