//! GPT sampler acceptance: `inspect_dataset samples` must reproduce Megatron's cached
//! document/sample/shuffle indices (byte for byte, including the description text and so its
//! MD5 file prefix) and the first samples of every split (`../shared/golden/gpt_dataset`).

use std::path::{Path, PathBuf};
use std::process::Output;

use megatron_e2e::{bin, run_ok, shared_dir};

const SPLITS: [(&str, &str); 3] = [
    ("train", "5818e8e5ab0453d2220fcb57f1080055"),
    ("valid", "7b00e170edd2187aa89523bdf0943874"),
    ("test", "03bb1c219d4f5b7d4afd7740d0915c75"),
];
const AFFIXES: [&str; 4] = [
    "description.txt",
    "document_index.npy",
    "sample_index.npy",
    "shuffle_index.npy",
];

fn golden_dir() -> PathBuf {
    shared_dir().join("golden/gpt_dataset")
}

/// Runs `samples` the way the golden was produced: working directory = the preprocess golden,
/// bare prefix, GPT-2 tokenizer flags as given to Megatron.
fn samples(split: &str, cache: &Path, first: usize) -> Output {
    run_ok(
        bin("inspect_dataset")
            .current_dir(shared_dir().join("golden/preprocess/gpt2"))
            .args(["samples", "--data-path", "small_gpt2_text_document"])
            .args([
                "--split",
                "969,30,1",
                "--seq-length",
                "128",
                "--seed",
                "1234",
            ])
            .args(["--num-samples", "1000,50,10", "--split-name", split])
            .args(["--first", &first.to_string()])
            .args(["--tokenizer-type", "GPT2BPETokenizer"])
            .args([
                "--vocab-file",
                "gpt2-vocab.json",
                "--merge-file",
                "gpt2-merges.txt",
            ])
            .arg("--data-cache-path")
            .arg(cache),
    )
}

/// A flat `"key": [ints]` or `"key": int` field of one JSON line (the format is ours and fixed).
fn field<'a>(line: &'a str, key: &str) -> &'a str {
    let start = line
        .find(&format!("\"{key}\": "))
        .unwrap_or_else(|| panic!("no {key} in {line}"))
        + key.len()
        + 4;
    let rest = &line[start..];
    let end = if rest.starts_with('[') {
        rest.find(']').unwrap() + 1
    } else {
        rest.find([',', '}']).unwrap()
    };
    &rest[..end]
}

/// The golden `first_samples` of a split as `(idx, text, document_ids)` strings without spaces.
fn golden_samples(split: &str) -> Vec<(String, String, String)> {
    let text = std::fs::read_to_string(golden_dir().join("samples.json")).unwrap();
    let compact: String = text.chars().filter(|c| !c.is_whitespace()).collect();
    let splits = &compact[compact.find("\"splits\":").unwrap()..];
    let this = &splits[splits.find(&format!("\"{split}\":{{")).unwrap()..];
    let list = &this[this.find("\"first_samples\":[").unwrap() + 17..];
    let mut out = Vec::new();
    let mut rest = list;
    while let Some(at) = rest.find("{\"idx\":") {
        let end = rest[at..].find('}').unwrap() + at + 1;
        let entry = rest[at..end].replace(':', ": ");
        out.push((
            field(&entry, "idx").to_string(),
            field(&entry, "text").to_string(),
            field(&entry, "document_ids").to_string(),
        ));
        rest = &rest[end..];
        if rest.starts_with("]") {
            break;
        }
    }
    out
}

#[test]
fn indices_descriptions_and_first_samples_equal_megatron_for_every_split() {
    let cache = tempfile::tempdir().unwrap();
    for (split, hash) in SPLITS {
        let golden = golden_samples(split);
        assert!(!golden.is_empty(), "golden has samples for {split}");
        let out = samples(split, cache.path(), 20);
        let stdout = String::from_utf8(out.stdout).unwrap();
        let lines: Vec<&str> = stdout.lines().collect();
        assert_eq!(
            lines.len(),
            golden.len(),
            "{split}: number of printed samples"
        );
        for (line, (idx, text, document_ids)) in lines.iter().zip(&golden) {
            let compact = line.replace(", ", ",").replace(": ", ": ");
            assert_eq!(field(&compact, "idx"), idx, "{split}");
            assert_eq!(field(&compact, "text"), text, "{split} sample {idx}");
            assert_eq!(
                field(&compact, "document_ids"),
                document_ids,
                "{split} sample {idx}"
            );
        }
        for affix in AFFIXES {
            let name = format!("{hash}-GPTDataset-{split}-{affix}");
            let ours = std::fs::read(cache.path().join(&name))
                .unwrap_or_else(|e| panic!("our cache lacks {name}: {e}"));
            let theirs = std::fs::read(golden_dir().join("cache").join(&name)).unwrap();
            assert!(ours == theirs, "{name} differs from Megatron's");
        }
    }
}

#[test]
fn a_second_run_loads_the_cache_and_prints_the_same_samples() {
    let cache = tempfile::tempdir().unwrap();
    let first = samples("valid", cache.path(), 51);
    let second = samples("valid", cache.path(), 51);
    assert_eq!(first.stdout, second.stdout);
    assert_eq!(String::from_utf8_lossy(&first.stdout).lines().count(), 51);
    assert!(String::from_utf8_lossy(&first.stderr).contains("built, cached in"));
    assert!(String::from_utf8_lossy(&second.stderr).contains("loaded from"));
}

#[test]
fn info_and_dump_describe_the_golden_dataset() {
    let prefix = shared_dir().join("golden/preprocess/gpt2/small_gpt2_text_document");
    let info =
        String::from_utf8(run_ok(bin("inspect_dataset").arg("info").arg(&prefix)).stdout).unwrap();
    assert!(info.contains("dtype: uint16"), "{info}");
    assert!(info.contains("sequences: 554"), "{info}");
    let dump = run_ok(
        bin("inspect_dataset")
            .args(["dump", "--sequence", "553", "--vocab-file"])
            .arg(shared_dir().join("data/gpt2-vocab.json"))
            .arg(&prefix),
    );
    let dump = String::from_utf8(dump.stdout).unwrap();
    let mut lines = dump.lines();
    let ids = lines.next().unwrap();
    // The test split is sequence 553 alone: 23 tokens ending in EOD (golden README).
    assert_eq!(ids.matches(',').count() + 1, 23, "{ids}");
    assert!(ids.ends_with("50256]"), "{ids}");
    assert!(
        dump.ends_with("your price o' the consulship?<|endoftext|>\n"),
        "{dump}"
    );
}

#[test]
fn bad_input_fails_with_a_clear_error() {
    let out = bin("inspect_dataset")
        .args([
            "samples",
            "--data-path",
            "/nonexistent/prefix",
            "--seq-length",
            "8",
        ])
        .args(["--vocab-file", "v", "--merge-file", "m"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("error:") && stderr.contains("/nonexistent/prefix"),
        "{stderr}"
    );
    let usage = bin("inspect_dataset").args(["samples"]).output().unwrap();
    assert_eq!(usage.status.code(), Some(2));
}

/// `inspect_dataset samples --sft` prints what `pretrain_gpt --sft` trains on: one conversation
/// per sample through a HuggingFace tokenizer, the loss mask on the assistant's turn (and the end
/// of document) only.
#[test]
fn sft_samples_show_the_loss_mask_of_the_assistant_turns() {
    let dir = tempfile::tempdir().unwrap();
    let specials = [
        "</s>",
        "<SPECIAL_10>",
        "<SPECIAL_11>",
        "<SPECIAL_233>",
        "<unk>",
    ];
    let words = ["User", "Assistant", "hi", "hello", "there"];
    let vocab: serde_json::Map<String, serde_json::Value> = specials
        .iter()
        .chain(&words)
        .enumerate()
        .map(|(id, token)| (token.to_string(), id.into()))
        .collect();
    let added: Vec<serde_json::Value> = specials
        .iter()
        .enumerate()
        .map(|(id, token)| {
            serde_json::json!({"id": id, "content": token, "single_word": false,
                "lstrip": false, "rstrip": false, "normalized": false, "special": true})
        })
        .collect();
    let tokenizer = serde_json::json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": added,
        "normalizer": null, "pre_tokenizer": {"type": "Whitespace"}, "post_processor": null,
        "decoder": null, "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "<unk>"},
    });
    std::fs::write(dir.path().join("tokenizer.json"), tokenizer.to_string()).unwrap();
    let data = dir.path().join("chat.jsonl");
    std::fs::write(
        &data,
        r#"{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello there"}]}"#,
    )
    .unwrap();
    let out = run_ok(
        bin("inspect_dataset")
            .args([
                "samples",
                "--sft",
                "--seq-length",
                "10",
                "--split",
                "100,0,0",
            ])
            .arg("--data-path")
            .arg(&data)
            .args(["--tokenizer-type", "SFTTokenizer", "--tokenizer-model"])
            .arg(dir.path()),
    );
    let line = String::from_utf8(out.stdout).unwrap();
    let sample: serde_json::Value = serde_json::from_str(line.trim()).unwrap();
    let ids = |key: &str| -> Vec<i64> {
        sample[key]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_i64().unwrap())
            .collect()
    };
    // <SPECIAL_11> User hi <SPECIAL_11> Assistant | hello there | </s> | pad pad
    assert_eq!(ids("tokens"), [2, 5, 7, 2, 6, 8, 9, 0, 3, 3]);
    assert_eq!(ids("labels"), [0, 0, 0, 0, 8, 9, 0, 3, 3, 3]);
    assert_eq!(ids("loss_mask"), [0, 0, 0, 0, 1, 1, 1, 0, 0, 0]);
}
