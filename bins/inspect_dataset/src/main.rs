//! `inspect_dataset`: debug a Megatron dataset the way training will read it.

mod decode;
mod info;
mod samples;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    version,
    about = "Inspect Megatron indexed datasets (.bin/.idx) and GPT, BERT and T5 training samples"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Counts, dtype, token totals and a sequence-length histogram of PREFIX.bin/.idx.
    Info(info::InfoArgs),
    /// Token ids (and, with --vocab-file, decoded text) of one sequence.
    Dump(info::DumpArgs),
    /// GPT, BERT or T5 training samples exactly as training reads them, one JSON object per line.
    Samples(Box<samples::SamplesArgs>),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    megatron_cli::run(|| match cli.command {
        Command::Info(args) => info::run_info(&args),
        Command::Dump(args) => info::run_dump(&args),
        Command::Samples(args) => samples::run(&args),
    })
}
