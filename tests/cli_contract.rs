//! The command-line contract README states for every binary: a usage error — no arguments where
//! some are needed, an unknown flag, a value a flag refuses, flags that cannot go together —
//! exits 2 with a message naming the flag, whether clap or a later check found it; a runtime
//! failure exits 1. And no message names a flag that no binary accepts, or that its own binary
//! refuses.

use std::collections::BTreeSet;
use std::path::Path;
use std::process::Output;

use megatron_e2e::{bin, workspace_root, TINY_MOCK_GPT};

/// How a binary's command line can go wrong.
struct Binary {
    name: &'static str,
    /// What the message names when the binary runs with no arguments (a flag, or the
    /// subcommands it needs); `None` where no arguments is a valid invocation.
    missing: Option<&'static str>,
    /// A flag with a value it refuses; the message names the flag.
    bad_value: [&'static str; 2],
}

const BINARIES: &[Binary] = &[
    Binary {
        name: "checkpoint_convert",
        missing: Some("--model-type"),
        bad_value: ["--loader", "pickle"],
    },
    Binary {
        name: "collect_env",
        missing: None,
        bad_value: ["--self-test=maybe", ""],
    },
    Binary {
        name: "eval_tasks",
        missing: Some("--task"),
        bad_value: ["--task", "SQUAD"],
    },
    Binary {
        name: "generate_samples_gpt",
        missing: Some("--load"),
        bad_value: ["--tokenizer-type", "GPT2"],
    },
    Binary {
        name: "generate_samples_t5",
        missing: Some("score"),
        bad_value: ["score", "--num-samples=many"],
    },
    Binary {
        name: "gpt_dynamic_inference",
        missing: Some("--load"),
        bad_value: ["--model-provider", "llama"],
    },
    Binary {
        name: "inspect_dataset",
        missing: Some("info"),
        bad_value: ["samples", "--seq-length=long"],
    },
    Binary {
        name: "merge_datasets",
        missing: Some("--input"),
        bad_value: ["--input", ""],
    },
    Binary {
        name: "openwebtext_filter",
        missing: Some("cleanup"),
        bad_value: ["find-duplicates", "--jaccard=some"],
    },
    Binary {
        name: "preprocess_data",
        missing: Some("--input"),
        bad_value: ["--tokenizer-type", "GPT2"],
    },
    Binary {
        name: "pretrain_bert",
        missing: Some("--num-layers"),
        bad_value: ["--optimizer", "lamb"],
    },
    Binary {
        name: "pretrain_gpt",
        missing: Some("--num-layers"),
        bad_value: ["--lr-decay-style", "wiggly"],
    },
    Binary {
        name: "pretrain_t5",
        missing: Some("--num-layers"),
        bad_value: ["--normalization", "BatchNorm"],
    },
    Binary {
        name: "text_generation_cli",
        missing: Some("<SERVER>"),
        bad_value: ["--tokens-to-generate", "many"],
    },
    Binary {
        name: "text_generation_server",
        missing: Some("--load"),
        bad_value: ["--tokenizer-type", "GPT2"],
    },
    Binary {
        name: "train_tokenizer",
        missing: Some("--input"),
        bad_value: ["--vocab-size", "big"],
    },
];

/// The flag an argument like `--flag` or `--flag=value` names.
fn flag_of(argument: &str) -> &str {
    argument.split('=').next().unwrap_or(argument)
}

fn run(name: &str, args: &[&str]) -> Output {
    bin(name)
        .args(args.iter().filter(|a| !a.is_empty()))
        .output()
        .unwrap_or_else(|e| panic!("starting {name}: {e}"))
}

/// Why `name args` is not a usage error naming `named` (exit 2, an `error:` message, clap's
/// hint at `--help`), if it is not. A binary of subcommands answers no arguments with its help
/// on stderr instead, which lists them.
fn not_a_usage_error(name: &str, args: &[&str], named: &str) -> Option<String> {
    let out = run(name, args);
    let stderr = String::from_utf8_lossy(&out.stderr);
    let fine = out.status.code() == Some(2)
        && (stderr.starts_with("error: ") || stderr.contains("\nCommands:\n"))
        && stderr.contains(named)
        && stderr.contains("--help");
    (!fine).then(|| {
        format!(
            "`{name} {}` exited {:?}, expected 2 and a message naming {named}:\n{stderr}",
            args.join(" "),
            out.status.code()
        )
    })
}

fn assert_none_fail(problems: Vec<String>) {
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

#[test]
fn the_table_lists_every_binary() {
    let mut found: Vec<String> = std::fs::read_dir(workspace_root().join("bins"))
        .unwrap()
        .map(|entry| entry.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    found.sort();
    let listed: Vec<&str> = BINARIES.iter().map(|b| b.name).collect();
    assert_eq!(found, listed);
}

#[test]
fn no_arguments_is_a_usage_error_naming_what_is_missing() {
    let problems = BINARIES
        .iter()
        .filter_map(|b| b.missing.map(|missing| (b.name, missing)))
        .filter_map(|(name, missing)| not_a_usage_error(name, &[], missing))
        .collect();
    assert_none_fail(problems);
}

#[test]
fn an_unknown_flag_is_a_usage_error_naming_it() {
    let problems = BINARIES
        .iter()
        .filter_map(|b| not_a_usage_error(b.name, &["--no-such-flag"], "'--no-such-flag'"))
        .collect();
    assert_none_fail(problems);
}

#[test]
fn a_refused_value_is_a_usage_error_naming_its_flag() {
    let problems = BINARIES
        .iter()
        .filter_map(|b| {
            let flag = b.bad_value.iter().copied().find(|a| a.starts_with("--"));
            not_a_usage_error(b.name, &b.bad_value, flag_of(flag.expect("a flag")))
        })
        .collect();
    assert_none_fail(problems);
}

/// Checks made after clap parsed the flags exit 2 as well; a failure of the work exits 1.
#[test]
fn checks_after_parsing_exit_two_and_failures_of_the_work_one() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("no-checkpoint");
    let missing = missing.to_str().unwrap();
    let save = dir.path().join("out");
    let save = save.to_str().unwrap();
    let convert = ["--load-dir", missing, "--save-dir", save];
    let t5_to_hf = [&["--model-type", "T5", "--saver", "hf"][..], &convert].concat();
    let pipelined = [
        "--load",
        missing,
        "--prompt",
        "x",
        "--pipeline-model-parallel-size",
        "2",
    ];
    // --sft builds GPT conversation samples: the masked-LM families refuse it.
    let sft = [
        &["--sft", "--train-iters", "1", "--device", "cpu"],
        TINY_MOCK_GPT,
    ]
    .concat();
    let problems = [
        not_a_usage_error("pretrain_bert", &sft, "--sft"),
        not_a_usage_error("pretrain_t5", &sft, "--sft"),
        not_a_usage_error("checkpoint_convert", &t5_to_hf, "--saver hf"),
        not_a_usage_error(
            "generate_samples_gpt",
            &pipelined,
            "--pipeline-model-parallel-size 2",
        ),
        not_a_usage_error(
            "eval_tasks",
            &["--task", "LAMBADA", "--load", missing],
            "--valid-data",
        ),
        not_a_usage_error(
            "generate_samples_gpt",
            &[
                "--load",
                missing,
                "--prompt",
                "x",
                "--tokenizer-type",
                "Llama2Tokenizer",
            ],
            "--tokenizer-model",
        ),
    ];
    assert_none_fail(problems.into_iter().flatten().collect());

    let gpt = [
        &["--model-type", "GPT", "--loader", "megatron-rs"][..],
        &convert,
    ]
    .concat();
    let out = run("checkpoint_convert", &gpt);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.starts_with("error: ")
            && stderr.contains("no-checkpoint")
            && !stderr.contains("--help"),
        "{stderr}"
    );
}

/// Every `--flag` mentioned in `text` (not patterns such as `--lr-warmup-*`).
fn flags_in(text: &str) -> BTreeSet<String> {
    let mut flags = BTreeSet::new();
    for (at, _) in text.match_indices("--") {
        let before = text[..at].chars().next_back();
        if before.is_some_and(|c| c.is_alphanumeric() || c == '-' || c == '_') {
            continue;
        }
        let rest = &text[at + 2..];
        let name: String = rest
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '-' || *c == '_')
            .collect();
        let pattern = rest[name.len()..].starts_with('*');
        if name.starts_with(|c: char| c.is_ascii_lowercase()) && !pattern {
            flags.insert(format!("--{}", name.trim_end_matches('-')));
        }
    }
    flags
}

/// The string literals of a Rust source, test modules left out: what the program prints.
fn string_literals(source: &str) -> Vec<String> {
    let code = source.split("#[cfg(test)]").next().unwrap_or(source);
    let mut literals = Vec::new();
    let mut chars = code.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '/' if chars.peek() == Some(&'/') => {
                for c in chars.by_ref() {
                    if c == '\n' {
                        break;
                    }
                }
            }
            // A character literal: '"' is no string.
            '\'' if chars.clone().take(2).eq(['"', '\'']) => {
                chars.nth(1);
            }
            '"' => {
                let mut literal = String::new();
                while let Some(c) = chars.next() {
                    match c {
                        '\\' => {
                            chars.next();
                        }
                        '"' => break,
                        c => literal.push(c),
                    }
                }
                literals.push(literal);
            }
            _ => {}
        }
    }
    literals
}

/// `(flag, file)` for the flags mentioned in the messages of the Rust sources under `dir`.
fn flags_in_messages(dir: &Path) -> BTreeSet<(String, String)> {
    let mut found = BTreeSet::new();
    let mut pending = vec![dir.to_path_buf()];
    while let Some(dir) = pending.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                pending.push(path);
            } else if path.extension().is_some_and(|e| e == "rs") {
                let source = std::fs::read_to_string(&path).unwrap();
                let file = path
                    .strip_prefix(workspace_root())
                    .unwrap()
                    .display()
                    .to_string();
                for literal in string_literals(&source) {
                    for flag in flags_in(&literal) {
                        found.insert((flag, file.clone()));
                    }
                }
            }
        }
    }
    found
}

/// Flags the libraries name that belong to other programs, not to ours.
const FOREIGN_FLAGS: &[&str] = &[
    // nvidia-smi's, which the training device probe runs.
    "--query-gpu",
    "--format",
    "--id",
    // NVRTC's, which compiles our CUDA kernels at run time.
    "--gpu-architecture",
    "--std",
    // Megatron's, named where its checkpoints are read.
    "--no-save-model",
    "--ckpt-fully-parallel-save",
];

/// The flags `name --help` lists, with those of its subcommands (and of eval_tasks'
/// finetuning parser, `eval_tasks --task MNLI --help`). A message should name no flag that
/// the help hides.
fn listed_flags(name: &str) -> BTreeSet<String> {
    let help = |args: &[&str]| String::from_utf8_lossy(&run(name, args).stdout).into_owned();
    let top = help(&["--help"]);
    let mut listed = flags_in(&top);
    if let Some(commands) = top.split("Commands:\n").nth(1) {
        // A command's line starts with its name, two spaces in; wrapped text is further in.
        for line in commands.lines().take_while(|l| !l.trim().is_empty()) {
            let command = line.strip_prefix("  ").filter(|l| !l.starts_with(' '));
            match command.and_then(|l| l.split_whitespace().next()) {
                Some("help") | None => {}
                Some(command) => listed.extend(flags_in(&help(&[command, "--help"]))),
            }
        }
    }
    if name == "eval_tasks" {
        listed.extend(flags_in(&help(&["--task", "MNLI", "--help"])));
    }
    listed
}

#[test]
fn messages_name_flags_their_binaries_accept() {
    let root = workspace_root();
    let mut listed_anywhere = BTreeSet::new();
    let mut problems = Vec::new();
    for binary in BINARIES {
        let listed = listed_flags(binary.name);
        let own = flags_in_messages(&root.join("bins").join(binary.name));
        if binary.name == "checkpoint_convert" {
            let file = "bins/checkpoint_convert/src/main.rs".to_string();
            assert!(own.contains(&("--saver".to_string(), file)), "{own:?}");
            assert!(listed.contains("--target-tensor-parallel-size"));
        }
        for (flag, file) in own {
            if !listed.contains(&flag) {
                problems.push(format!(
                    "{file} names {flag}, which {} does not list",
                    binary.name
                ));
            }
        }
        listed_anywhere.extend(listed);
    }
    // A library's message may be printed by any binary above it: one at least must take it.
    for library in std::fs::read_dir(root.join("lib")).unwrap() {
        for (flag, file) in flags_in_messages(&library.unwrap().path().join("src")) {
            if !FOREIGN_FLAGS.contains(&flag.as_str()) && !listed_anywhere.contains(&flag) {
                problems.push(format!("{file} names {flag}, which no binary lists"));
            }
        }
    }
    assert_none_fail(problems);
}

#[test]
fn flags_are_found_in_messages_as_printed() {
    let source = r#"
        // "--in-a-comment" is not printed
        let quote = '"';
        bail!("--loader {other}: give --saver megatron-rs or --lr-warmup-* (see --help)");
        #[cfg(test)]
        mod tests { const IN_TESTS: &str = "--in-tests"; }
    "#;
    let literals = string_literals(source);
    assert_eq!(
        literals,
        ["--loader {other}: give --saver megatron-rs or --lr-warmup-* (see --help)"]
    );
    assert_eq!(
        flags_in(&literals[0]).into_iter().collect::<Vec<_>>(),
        ["--help", "--loader", "--saver"]
    );
}
