//! How many passes over a split's tokens a requested number of samples needs, and whether the
//! final pass is shuffled on its own.

/// Epoch plan of one GPT dataset.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EpochPlan {
    pub tokens_per_epoch: u64,
    pub num_epochs: u64,
    /// Present when the final epoch is shuffled separately: the samples drawn from the others.
    pub samples_before_final_epoch: Option<u64>,
}

impl EpochPlan {
    /// `extra` is 1 when samples carry the extra label token. `num_samples = None` is one epoch.
    pub fn new(
        tokens_per_epoch: u64,
        sequence_length: u64,
        num_samples: Option<u64>,
        extra: u64,
    ) -> Result<EpochPlan, String> {
        let Some(num_samples) = num_samples else {
            return Ok(EpochPlan {
                tokens_per_epoch,
                num_epochs: 1,
                samples_before_final_epoch: None,
            });
        };
        if tokens_per_epoch <= extra {
            return Err(format!(
                "the split holds {tokens_per_epoch} tokens, too few to build any sample"
            ));
        }
        let needed = num_samples * sequence_length + extra;
        let num_epochs = needed.div_ceil(tokens_per_epoch).max(1);
        let mut plan = EpochPlan {
            tokens_per_epoch,
            num_epochs,
            samples_before_final_epoch: None,
        };
        if num_epochs > 1 {
            let sans_final = ((num_epochs - 1) * tokens_per_epoch - extra) / sequence_length;
            let from_final = num_samples - sans_final;
            let per_epoch = (tokens_per_epoch - extra) / sequence_length;
            debug_assert!(from_final <= per_epoch + 1);
            // Megatron compares against int(0.80 * per_epoch), a float product truncated.
            if from_final < (0.80 * per_epoch as f64) as u64 {
                plan.samples_before_final_epoch = Some(sans_final);
            }
        }
        Ok(plan)
    }

    pub fn separate_final_epoch(&self) -> bool {
        self.samples_before_final_epoch.is_some()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spec_example_separates_the_final_epoch() {
        let plan = EpochPlan::new(24, 4, Some(7), 1).unwrap();
        assert_eq!(plan.num_epochs, 2);
        assert_eq!(plan.samples_before_final_epoch, Some(5));
    }

    #[test]
    fn one_epoch_without_a_sample_count_and_no_separation_when_final_epoch_is_large() {
        assert_eq!(EpochPlan::new(100, 4, None, 1).unwrap().num_epochs, 1);
        // 24 tokens, seq 4: per epoch 5 samples; asking 10 leaves 5 for the final epoch ≥ 4.
        let plan = EpochPlan::new(24, 4, Some(10), 1).unwrap();
        assert_eq!(plan.num_epochs, 2);
        assert!(!plan.separate_final_epoch());
    }
}
