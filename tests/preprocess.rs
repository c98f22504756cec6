//! `preprocess_data` and `merge_datasets` against the outputs of Megatron's own tools.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use megatron_e2e::{bin, run_ok, shared_dir};

fn golden() -> PathBuf {
    shared_dir().join("golden/preprocess")
}

fn data(name: &str) -> String {
    shared_dir().join("data").join(name).display().to_string()
}

fn assert_same_files(ours: &Path, theirs: &Path) {
    for ext in ["bin", "idx"] {
        let a = std::fs::read(format!("{}.{ext}", ours.display())).unwrap();
        let b = std::fs::read(format!("{}.{ext}", theirs.display())).unwrap();
        assert!(
            a == b,
            "{}.{ext} differs from Megatron's {}.{ext}",
            ours.display(),
            theirs.display()
        );
    }
}

fn gpt2(cmd: &mut Command) -> &mut Command {
    cmd.args([
        "--tokenizer-type",
        "GPT2BPETokenizer",
        "--vocab-file",
        &data("gpt2-vocab.json"),
    ])
    .args([
        "--merge-file",
        &data("gpt2-merges.txt"),
        "--append-eod",
        "--workers",
        "2",
    ])
}

fn bert(cmd: &mut Command) -> &mut Command {
    cmd.args([
        "--tokenizer-type",
        "BertWordPieceLowerCase",
        "--vocab-file",
        &data("bert-large-uncased-vocab.txt"),
    ])
    .args(["--punkt-dir", &data("punkt_tab_english"), "--workers", "2"])
}

/// Files in `dir`, sorted.
fn listing(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

#[test]
fn gpt2_document_level_matches_megatron() {
    let dir = tempfile::tempdir().unwrap();
    let prefix = dir.path().join("small_gpt2");
    run_ok(gpt2(
        bin("preprocess_data")
            .arg("--input")
            .arg(golden().join("small_corpus.jsonl"))
            .arg("--output-prefix")
            .arg(&prefix),
    ));
    assert_same_files(
        &dir.path().join("small_gpt2_text_document"),
        &golden().join("gpt2/small_gpt2_text_document"),
    );
}

#[test]
fn bert_sentence_and_document_level_match_megatron_legacy_and_head() {
    let dir = tempfile::tempdir().unwrap();
    for (variant, extra) in [
        ("bert_legacy", None),
        ("bert_head", Some("--tokenizer-hf-include-special-tokens")),
    ] {
        for (name, split) in [("small_bert", true), ("small_bertdoc", false)] {
            let prefix = dir.path().join(variant).join(name);
            std::fs::create_dir_all(prefix.parent().unwrap()).unwrap();
            let mut cmd = bin("preprocess_data");
            bert(&mut cmd)
                .arg("--input")
                .arg(golden().join("small_corpus.jsonl"))
                .arg("--output-prefix")
                .arg(&prefix);
            cmd.args(split.then_some("--split-sentences")).args(extra);
            run_ok(&mut cmd);
            let level = if split {
                "text_sentence"
            } else {
                "text_document"
            };
            assert_same_files(
                &dir.path().join(variant).join(format!("{name}_{level}")),
                &golden().join(variant).join(format!("{name}_{level}")),
            );
        }
    }
}

#[test]
fn pre_split_sentences_file_gives_the_same_output() {
    // Megatron's second run encodes its `_ss` intermediate; arrays of sentences are taken as is.
    let dir = tempfile::tempdir().unwrap();
    let prefix = dir.path().join("small_bert");
    let mut cmd = bin("preprocess_data");
    bert(&mut cmd)
        .arg("--input")
        .arg(golden().join("small_corpus_ss.jsonl"))
        .arg("--output-prefix")
        .arg(&prefix);
    run_ok(cmd.arg("--split-sentences"));
    assert_same_files(
        &dir.path().join("small_bert_text_sentence"),
        &golden().join("bert_legacy/small_bert_text_sentence"),
    );
}

#[test]
fn stdin_input_matches_file_input() {
    let dir = tempfile::tempdir().unwrap();
    let prefix = dir.path().join("small_gpt2");
    let mut cmd = bin("preprocess_data");
    gpt2(&mut cmd)
        .args(["--input", "-"])
        .arg("--output-prefix")
        .arg(&prefix);
    let mut child = cmd
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let corpus = std::fs::read(golden().join("small_corpus.jsonl")).unwrap();
    child.stdin.take().unwrap().write_all(&corpus).unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_same_files(
        &dir.path().join("small_gpt2_text_document"),
        &golden().join("gpt2/small_gpt2_text_document"),
    );
}

/// The corpus split into `parts` files by `assign(line_number)`.
fn split_corpus(dir: &Path, parts: usize, assign: impl Fn(usize) -> usize) -> Vec<PathBuf> {
    let corpus = std::fs::read_to_string(golden().join("small_corpus.jsonl")).unwrap();
    let mut chunks = vec![String::new(); parts];
    for (i, line) in corpus.lines().enumerate() {
        chunks[assign(i)].push_str(line);
        chunks[assign(i)].push('\n');
    }
    chunks
        .iter()
        .enumerate()
        .map(|(i, c)| {
            let p = dir.join(format!("part{i}.jsonl"));
            std::fs::write(&p, c).unwrap();
            p
        })
        .collect()
}

#[test]
fn merging_parts_equals_one_shot_preprocessing() {
    let dir = tempfile::tempdir().unwrap();
    let parts = split_corpus(dir.path(), 3, |i| (i * 3) / 554);
    let shards = dir.path().join("shards");
    std::fs::create_dir(&shards).unwrap();
    for (i, part) in parts.iter().enumerate() {
        run_ok(gpt2(
            bin("preprocess_data")
                .arg("--input")
                .arg(part)
                .arg("--output-prefix")
                .arg(shards.join(format!("s{i}"))),
        ));
    }
    let merged = dir.path().join("merged");
    run_ok(
        bin("merge_datasets")
            .arg("--input")
            .arg(&shards)
            .arg("--output-prefix")
            .arg(&merged),
    );
    assert_same_files(&merged, &golden().join("gpt2/small_gpt2_text_document"));

    // Several inputs (a glob) in one run are the same concatenation.
    let globbed = dir.path().join("globbed");
    run_ok(gpt2(
        bin("preprocess_data")
            .arg("--input")
            .arg(dir.path().join("part*.jsonl"))
            .arg("--output-prefix")
            .arg(&globbed),
    ));
    assert_same_files(
        &dir.path().join("globbed_text_document"),
        &golden().join("gpt2/small_gpt2_text_document"),
    );
}

#[test]
fn partitions_reorder_documents_round_robin_like_megatron() {
    let dir = tempfile::tempdir().unwrap();
    let parts = split_corpus(dir.path(), 2, |i| i % 2);
    let shards = dir.path().join("shards");
    std::fs::create_dir(&shards).unwrap();
    for (i, part) in parts.iter().enumerate() {
        run_ok(gpt2(
            bin("preprocess_data")
                .arg("--input")
                .arg(part)
                .arg("--output-prefix")
                .arg(shards.join(format!("p{i}"))),
        ));
    }
    let expected = dir.path().join("expected");
    run_ok(
        bin("merge_datasets")
            .arg("--input")
            .arg(&shards)
            .arg("--output-prefix")
            .arg(&expected),
    );
    let out = dir.path().join("out");
    std::fs::create_dir(&out).unwrap();
    run_ok(gpt2(
        bin("preprocess_data")
            .arg("--input")
            .arg(golden().join("small_corpus.jsonl"))
            .arg("--output-prefix")
            .arg(out.join("rr"))
            .args(["--partitions", "2"]),
    ));
    assert_same_files(&out.join("rr_text_document"), &expected);
    assert_eq!(
        listing(&out),
        ["rr_text_document.bin", "rr_text_document.idx"],
        "partition files must be cleaned up"
    );

    let seq = out.join("seq");
    run_ok(gpt2(
        bin("preprocess_data")
            .arg("--input")
            .arg(golden().join("small_corpus.jsonl"))
            .arg("--output-prefix")
            .arg(&seq)
            .args(["--partitions", "2", "--keep-sequential-samples"]),
    ));
    assert_same_files(
        &out.join("seq_text_document"),
        &golden().join("gpt2/small_gpt2_text_document"),
    );
}

#[test]
fn bad_json_stops_with_file_and_line_and_leaves_no_output() {
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("bad.jsonl");
    std::fs::write(
        &input,
        "{\"text\": \"fine\"}\n{\"text\": \"also fine\"}\n{\"text\": broken}\n{\"text\": \"x\"}\n",
    )
    .unwrap();
    let out_dir = dir.path().join("out");
    std::fs::create_dir(&out_dir).unwrap();
    let out = gpt2(
        bin("preprocess_data")
            .arg("--input")
            .arg(&input)
            .arg("--output-prefix")
            .arg(out_dir.join("o")),
    )
    .output()
    .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains(&format!("error: {}:3: invalid JSON", input.display())),
        "{stderr}"
    );
    assert!(
        listing(&out_dir).is_empty(),
        "left behind: {:?}",
        listing(&out_dir)
    );

    std::fs::write(
        &input,
        "{\"text\": \"fine\"}\n{\"body\": \"no text key\"}\n",
    )
    .unwrap();
    let out = gpt2(
        bin("preprocess_data")
            .arg("--input")
            .arg(&input)
            .arg("--output-prefix")
            .arg(out_dir.join("o")),
    )
    .output()
    .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1));
    assert!(stderr.contains(":2: missing key \"text\""), "{stderr}");
    assert!(
        listing(&out_dir).is_empty(),
        "left behind: {:?}",
        listing(&out_dir)
    );
}

#[test]
fn skip_invalid_counts_bad_lines_and_keeps_the_rest() {
    let dir = tempfile::tempdir().unwrap();
    let corpus = std::fs::read_to_string(golden().join("small_corpus.jsonl")).unwrap();
    let mut lines: Vec<&str> = corpus.lines().collect();
    lines.insert(100, "not json at all");
    lines.insert(300, "{\"text\": 12}");
    let input = dir.path().join("dirty.jsonl");
    std::fs::write(&input, lines.join("\n") + "\n").unwrap();
    let prefix = dir.path().join("clean");
    let out = run_ok(gpt2(
        bin("preprocess_data")
            .arg("--input")
            .arg(&input)
            .arg("--output-prefix")
            .arg(&prefix)
            .arg("--skip-invalid"),
    ));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("554 documents (2 skipped)"), "{stdout}");
    assert_same_files(
        &dir.path().join("clean_text_document"),
        &golden().join("gpt2/small_gpt2_text_document"),
    );
}

#[test]
fn usage_errors_exit_2_and_missing_files_exit_1() {
    let out = bin("preprocess_data")
        .args(["--input", "x.jsonl"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let out = gpt2(bin("preprocess_data").args([
        "--input",
        "/nonexistent/in.jsonl",
        "--output-prefix",
        "/tmp/never",
    ]))
    .output()
    .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr)
        .contains("error: --input /nonexistent/in.jsonl: no such file"));
}

#[test]
fn merge_rejects_corrupt_and_unpaired_files() {
    let dir = tempfile::tempdir().unwrap();
    let shards = dir.path().join("shards");
    std::fs::create_dir(&shards).unwrap();
    let g = golden().join("gpt2/small_gpt2_text_document");
    std::fs::copy(g.with_extension("bin"), shards.join("a.bin")).unwrap();
    let mut idx = std::fs::read(g.with_extension("idx")).unwrap();
    idx.truncate(idx.len() - 5);
    std::fs::write(shards.join("a.idx"), &idx).unwrap();
    let out = bin("merge_datasets")
        .arg("--input")
        .arg(&shards)
        .arg("--output-prefix")
        .arg(dir.path().join("m"))
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("a.idx: size mismatch") && stderr.contains("truncated"),
        "{stderr}"
    );
    assert!(!dir.path().join("m.bin").exists() && !dir.path().join("m.idx").exists());
    assert!(!dir.path().join("m.bin.tmp").exists());

    std::fs::remove_file(shards.join("a.idx")).unwrap();
    let out = bin("merge_datasets")
        .arg("--input")
        .arg(&shards)
        .arg("--output-prefix")
        .arg(dir.path().join("m"))
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("a.bin has no matching .idx file"));
}

#[test]
fn huggingface_tokenizer_json_reproduces_megatron_outputs() {
    let dir = tempfile::tempdir().unwrap();
    let input = golden().join("small_corpus.jsonl");
    let gpt = dir.path().join("hf_gpt2");
    run_ok(
        bin("preprocess_data")
            .args([
                "--tokenizer-type",
                "HuggingFaceTokenizer",
                "--tokenizer-model",
                &data("gpt2-tokenizer.json"),
            ])
            .args(["--append-eod", "--workers", "2", "--input"])
            .arg(&input)
            .arg("--output-prefix")
            .arg(&gpt),
    );
    assert_same_files(
        &dir.path().join("hf_gpt2_text_document"),
        &golden().join("gpt2/small_gpt2_text_document"),
    );
    // Megatron's 2026 BERT is a HuggingFace tokenizer: [CLS] ... [SEP] around every document.
    let bert = dir.path().join("hf_bert");
    run_ok(
        bin("preprocess_data")
            .args([
                "--tokenizer-type",
                "HuggingFaceTokenizer",
                "--tokenizer-model",
                &data("bert-base-uncased-tokenizer.json"),
            ])
            .args(["--workers", "2", "--input"])
            .arg(&input)
            .arg("--output-prefix")
            .arg(&bert),
    );
    assert_same_files(
        &dir.path().join("hf_bert_text_document"),
        &golden().join("bert_head/small_bertdoc_text_document"),
    );
}
