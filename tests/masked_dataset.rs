//! `inspect_dataset samples --model bert|t5` as a user runs it, against Megatron core_v0.14.0's
//! samples (`../shared/golden/{bert,t5}_dataset`): every printed field of the dumped samples of
//! every split, the cache files (BERT: names and bytes), and the refusal of document-level data.

use std::path::Path;
use std::process::Output;

use megatron_e2e::{bin, run_ok, shared_dir};
use serde_json::Value;

const PREFIX: &str = "small_bert_text_sentence";
const VOCAB: &str = "bert-large-uncased-vocab.txt";

/// A working directory laid out like the golden's: the sentence data and the vocabulary under
/// their bare names (the names enter the cache hash).
fn workdir() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let input = shared_dir().join("golden/preprocess/bert_legacy");
    for name in [
        format!("{PREFIX}.bin"),
        format!("{PREFIX}.idx"),
        "small_bertdoc_text_document.bin".into(),
        "small_bertdoc_text_document.idx".into(),
    ] {
        std::fs::copy(input.join(&name), dir.path().join(&name)).unwrap();
    }
    std::fs::copy(
        shared_dir().join("data").join(VOCAB),
        dir.path().join(VOCAB),
    )
    .unwrap();
    dir
}

fn samples(dir: &Path, model_args: &[&str], split: &str) -> Output {
    run_ok(
        bin("inspect_dataset")
            .current_dir(dir)
            .args(["samples", "--data-path", PREFIX, "--split", "969,30,1"])
            .args([
                "--num-samples",
                "200,20,5",
                "--split-name",
                split,
                "--first",
                "10",
            ])
            .args([
                "--tokenizer-type",
                "BertWordPieceLowerCase",
                "--vocab-file",
                VOCAB,
            ])
            .args(["--data-cache-path", "cache"])
            .args(model_args),
    )
}

fn golden(name: &str) -> Value {
    let path = shared_dir().join("golden").join(name).join("samples.json");
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

/// Every golden sample of `split` equals the printed line with the same `idx` in every field.
fn compare(output: &Output, expected: &Value, fields: &[&str], split: &str) {
    let stdout = String::from_utf8(output.stdout.clone()).unwrap();
    let lines: Vec<Value> = stdout
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let golden = expected["first_samples"].as_array().unwrap();
    assert_eq!(
        lines.len(),
        golden.len(),
        "{split}: number of printed samples"
    );
    for (ours, theirs) in lines.iter().zip(golden) {
        assert_eq!(ours["idx"], theirs["idx"]);
        for field in fields {
            assert_eq!(
                ours[field], theirs[field],
                "{split} sample {} {field}",
                theirs["idx"]
            );
        }
    }
}

#[test]
fn bert_samples_and_cache_files_equal_megatron() {
    let dir = workdir();
    let golden = golden("bert_dataset");
    for split in ["train", "valid", "test"] {
        let expected = &golden["splits"][split];
        let out = samples(
            dir.path(),
            &["--model", "bert", "--seq-length", "128"],
            split,
        );
        compare(
            &out,
            expected,
            &[
                "text",
                "types",
                "labels",
                "is_random",
                "padding_mask",
                "loss_mask",
                "truncated",
            ],
            split,
        );
        let hash = expected["unique_description_hash"].as_str().unwrap();
        for affix in ["description.txt", "sample_index.npy"] {
            let name = format!("{hash}-BERTMaskedWordPieceDataset-{affix}");
            let ours = std::fs::read(dir.path().join("cache").join(&name)).unwrap();
            let theirs =
                std::fs::read(shared_dir().join("golden/bert_dataset/cache").join(&name)).unwrap();
            assert!(ours == theirs, "{name} differs from Megatron's");
        }
        let summary = String::from_utf8(out.stderr).unwrap();
        assert!(
            summary.contains(&format!("of {} samples", expected["len"])),
            "{summary}"
        );
    }
}

#[test]
fn t5_samples_equal_megatron() {
    let dir = workdir();
    let golden = golden("t5_dataset");
    let t5 = [
        "--model",
        "t5",
        "--encoder-seq-length",
        "128",
        "--decoder-seq-length",
        "32",
        "--vocab-extra-ids",
        "100",
    ];
    for split in ["train", "valid", "test"] {
        let expected = &golden["splits"][split];
        let out = samples(dir.path(), &t5, split);
        compare(
            &out,
            expected,
            &[
                "text_enc",
                "text_dec",
                "labels",
                "loss_mask",
                "truncated",
                "enc_mask",
                "dec_mask",
            ],
            split,
        );
        let summary = String::from_utf8(out.stderr).unwrap();
        assert!(
            summary.contains(&format!("of {} samples", expected["len"])),
            "{summary}"
        );
    }
}

#[test]
fn document_level_data_is_refused_with_the_binary_head() {
    let dir = workdir();
    let out = bin("inspect_dataset")
        .current_dir(dir.path())
        .args(["samples", "--model", "bert", "--seq-length", "128"])
        .args([
            "--data-path",
            "small_bertdoc_text_document",
            "--split",
            "969,30,1",
        ])
        .args(["--num-samples", "200,20,5"])
        .args([
            "--tokenizer-type",
            "BertWordPieceLowerCase",
            "--vocab-file",
            VOCAB,
        ])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8(out.stderr).unwrap();
    assert!(stderr.contains("--split-sentences"), "{stderr}");
}
