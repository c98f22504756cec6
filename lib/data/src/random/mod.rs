//! numpy's random streams, reproduced draw for draw: the legacy `RandomState` (MT19937) that
//! Megatron's shuffles and masking use, `default_rng` (PCG64 seeded through `SeedSequence`)
//! behind its mock dataset, and C++'s `std::mt19937_64`, which shuffles the BERT/T5 mapping;
//! and Python's `random`, which Megatron's inference examples simulate request arrivals with.

mod generator;
mod mt19937;
mod pcg64;
mod python_random;
mod random_state;
mod seed_sequence;

pub use generator::Generator;
pub use mt19937::{Mt19937, Mt19937_64};
pub use pcg64::Pcg64;
pub use python_random::PythonRandom;
pub use random_state::RandomState;
pub use seed_sequence::SeedSequence;
