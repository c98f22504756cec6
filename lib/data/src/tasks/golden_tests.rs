//! The task data against the goldens Megatron's own `tasks/zeroshot_gpt` code made
//! (`shared/golden/eval_tasks`, see its README).

use std::path::{Path, PathBuf};

use serde_json::Value;
use sha2::{Digest, Sha256};

use super::*;
use crate::tokenizer::Gpt2Bpe;

fn shared() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../../shared")
}

fn golden() -> Value {
    let path = shared().join("golden/eval_tasks/samples.json");
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn gpt2() -> Gpt2Bpe {
    let data = shared().join("data");
    Gpt2Bpe::from_files(&data.join("gpt2-vocab.json"), &data.join("gpt2-merges.txt")).unwrap()
}

/// sha256 over the samples' values as little-endian int64, as the golden driver hashes them.
fn sha256_int64<'a, T: Copy + Into<i64> + 'a>(rows: impl Iterator<Item = &'a [T]>) -> String {
    let mut hash = Sha256::new();
    for row in rows {
        for &value in row {
            hash.update(value.into().to_le_bytes());
        }
    }
    format!("{:x}", hash.finalize())
}

fn ids(value: &Value) -> Vec<u32> {
    value
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap() as u32)
        .collect()
}

fn check_lambada(strict: bool) {
    let golden = golden();
    let golden = &golden[if strict { "lambada_strict" } else { "lambada" }];
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("lambada_input.jsonl");
    let text = std::fs::read_to_string(shared().join("data/lambada_test.jsonl")).unwrap();
    let head: String = text.split_inclusive('\n').take(1000).collect();
    std::fs::write(&input, head).unwrap();
    let dataset = LambadaDataset::load(&input, &gpt2(), 1024, strict).unwrap();
    assert_eq!(
        dataset.len() as u64,
        golden["num_samples"].as_u64().unwrap()
    );
    let targets: Vec<u64> = dataset
        .passages
        .iter()
        .map(|p| p.target.len() as u64)
        .collect();
    let expected: Vec<u64> = golden["targets_per_sample"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap())
        .collect();
    assert_eq!(targets, expected);
    for (index, sample) in golden["samples"].as_object().unwrap() {
        let ours = dataset.sample(index.parse().unwrap());
        let prefix = ids(&sample["tokens_prefix"]);
        assert_eq!(ours.text.len(), 1025);
        assert_eq!(ours.text[..prefix.len()], prefix[..], "sample {index}");
        assert!(ours.text[prefix.len()..].iter().all(|&t| t == 50256));
        let scored: Vec<u32> = ours.scored_positions().map(|p| p as u32).collect();
        assert_eq!(scored, ids(&sample["pad_mask_nonzero"]), "sample {index}");
    }
    let samples: Vec<TaskSample> = (0..dataset.len()).map(|i| dataset.sample(i)).collect();
    assert_eq!(
        sha256_int64(samples.iter().map(|s| &s.text[..])),
        golden["sha256_text"].as_str().unwrap()
    );
    assert_eq!(
        sha256_int64(samples.iter().map(|s| &s.pad_mask[..])),
        golden["sha256_pad_mask"].as_str().unwrap()
    );
}

#[test]
fn lambada_samples_equal_megatrons() {
    check_lambada(false);
}

#[test]
fn strict_lambada_samples_equal_megatrons() {
    check_lambada(true);
}

fn check_wikitext(name: &str, raw: &str) {
    let golden = golden();
    let golden = &golden[name];
    let detokenizer = detokenizer_for_path(name).unwrap();
    assert_eq!(detokenizer, Detokenizer::Wikitext);
    let data = WikitextData::from_text(raw, &gpt2(), detokenizer).unwrap();
    let head: String = data.detokenized.chars().take(2000).collect();
    assert_eq!(head, golden["detokenized_head"].as_str().unwrap());
    assert_eq!(
        format!("{:x}", Sha256::digest(data.detokenized.as_bytes())),
        golden["detokenized_sha256"].as_str().unwrap()
    );
    assert_eq!(
        data.num_original_tokens as u64,
        golden["num_original_tokens"].as_u64().unwrap()
    );
    assert_eq!(
        data.tokens.len() as u64,
        golden["num_tokenized_tokens"].as_u64().unwrap()
    );
    for stride in [32, 1024] {
        let golden = &golden[format!("overlapping_eval_{stride}")];
        let dataset = LmDataset::new(
            data.tokens.clone(),
            1024,
            50256,
            data.num_original_tokens,
            Some(stride),
        );
        assert_eq!(
            dataset.len() as u64,
            golden["num_windows"].as_u64().unwrap()
        );
        for (index, window) in golden["windows"].as_object().unwrap() {
            let ours = dataset.sample(index.parse().unwrap());
            assert_eq!(ours.text, ids(&window["text"]), "window {index}");
            let mask: Vec<u8> = ids(&window["pad_mask"]).iter().map(|&m| m as u8).collect();
            assert_eq!(ours.pad_mask, mask, "window {index}");
        }
        let samples: Vec<TaskSample> = (0..dataset.len()).map(|i| dataset.sample(i)).collect();
        assert_eq!(
            sha256_int64(samples.iter().map(|s| &s.text[..])),
            golden["sha256_text"].as_str().unwrap(),
            "stride {stride}"
        );
        assert_eq!(
            sha256_int64(samples.iter().map(|s| &s.pad_mask[..])),
            golden["sha256_pad_mask"].as_str().unwrap(),
            "stride {stride}"
        );
    }
}

#[test]
fn wikitext2_test_windows_equal_megatrons() {
    let raw = std::fs::read_to_string(shared().join("data/wikitext2_test.tokens")).unwrap();
    check_wikitext("wiki2.test.tokens", &raw);
}

#[test]
fn wikitext103_valid_windows_equal_megatrons() {
    let raw = std::fs::read_to_string(shared().join("data/wikitext103_valid.tokens")).unwrap();
    let head: String = raw.split_inclusive('\n').take(2000).collect();
    check_wikitext("wiki.valid.head2000.tokens", &head);
}

#[test]
fn detokenizer_quirks() {
    assert_eq!(
        wikitext_detokenize("the dogs ' bones , 1 @,@ 000 ( a b ) \" c \" = = = = x"),
        "the dogs' bones, 1,000 (a b) \"c\" ==== x"
    );
    // The digit rule matches only its literal slashes (outputs checked with Megatron's code).
    assert_eq!(wikitext_detokenize("/' 5/ x"), "/'[0-9]/ x");
    assert_eq!(wikitext_detokenize("/' 5/ and ' 5"), "/'[0-9]/ and' 5");
    assert_eq!(
        detokenizer_for_path("data/ptb/wiki.txt"),
        Some(Detokenizer::Ptb)
    );
    assert_eq!(detokenizer_for_path("test.tokens"), None);
}

#[test]
fn windows_score_every_target_once() {
    let tokens: Vec<u32> = (0..100).collect();
    for stride in [1, 7, 16, 32, 40] {
        let dataset = LmDataset::new(tokens.clone(), 16, 999, 50, Some(stride));
        let mut scored = vec![0; 99];
        for i in 0..dataset.len() {
            let sample = dataset.sample(i);
            for p in sample.scored_positions() {
                let target = sample.text[p + 1];
                assert_ne!(target, 999);
                scored[target as usize - 1] += 1;
            }
        }
        if stride <= 16 {
            assert!(
                scored.iter().all(|&n| n == 1),
                "stride {stride}: {scored:?}"
            );
        }
    }
}

#[test]
fn bad_files_get_clear_errors() {
    let dir = tempfile::tempdir().unwrap();
    let tokenizer = gpt2();
    let missing = LambadaDataset::load(&dir.path().join("nope.jsonl"), &tokenizer, 1024, true);
    assert!(format!("{:#}", missing.unwrap_err()).contains("nope.jsonl: No such file"));
    let directory = LambadaDataset::load(dir.path(), &tokenizer, 1024, true).unwrap_err();
    assert!(format!("{directory:#}").contains("is a directory"));
    let empty = dir.path().join("empty.tokens");
    std::fs::write(&empty, "").unwrap();
    let error = WikitextData::load(&empty, &tokenizer, Detokenizer::Wikitext).unwrap_err();
    assert!(format!("{error:#}").contains("empty.tokens: the file is empty"));
    let bad = dir.path().join("bad.jsonl");
    std::fs::write(&bad, "{\"text\": \"a b\"}\n{\"txt\": 1}\n").unwrap();
    let error = LambadaDataset::load(&bad, &tokenizer, 1024, false).unwrap_err();
    assert!(
        format!("{error:#}").contains("bad.jsonl:2: no string field \"text\""),
        "{error:#}"
    );
}
