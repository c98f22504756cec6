//! Finetuning data of Megatron's `tasks/` (spec §7.4–7.5): RACE multiple choice and the GLUE
//! classification tasks MNLI and QQP, read from each task's official files and turned into
//! BERT pair inputs exactly as Megatron does.

mod glue;
mod pair;
mod race;
mod text;

pub use glue::{read_glue_tsv, ClassificationSample, GlueFile, GlueRow, GlueTask};
pub use pair::{PairInput, PairSpecials};
pub use race::{read_race_dir, RaceSample, MAX_QA_LENGTH, NUM_CHOICES};
pub use text::clean_text;
