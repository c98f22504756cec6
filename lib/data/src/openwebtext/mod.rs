//! Megatron's `tools/openwebtext` web-text cleaning pipeline (spec §8): URL blacklisting,
//! text cleanup, MinHash/LSH near-duplicate detection and removal, downstream-task n-gram
//! decontamination, and the small merge/add-id helpers. Every step reads and writes loose
//! JSON (one object per line), so the steps chain through files or pipes.

pub mod blacklist;
pub mod cleanup;
pub mod find_duplicates;
pub mod groups;
pub mod json;
pub mod jsonl;
pub mod minhash;
pub mod ngrams;
pub mod pipeline;
pub mod steps;
pub mod textfix;
