//! End-to-end checks of `openwebtext_filter` on a small real corpus built at run time
//! from ../shared/data: WikiText articles and Shakespeare speeches (merged into documents
//! long enough to pass cleanup), with injected near-duplicates, blacklisted URLs,
//! non-English and too-short documents, and LAMBADA passages.

use megatron_e2e::{bin, run_ok, shared_dir};
use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

fn read_texts(file: &str) -> Vec<String> {
    let data = std::fs::read_to_string(shared_dir().join("data").join(file)).unwrap();
    data.lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            v["text"].as_str().unwrap().to_string()
        })
        .collect()
}

fn doc(url: &str, text: &str) -> String {
    serde_json::json!({ "text": text, "url": url }).to_string()
}

/// Replaces every `every`-th word, keeping the rest: an edited copy.
fn edit(text: &str, every: usize) -> String {
    text.split(' ')
        .enumerate()
        .map(|(i, w)| if i % every == every - 1 { "changed" } else { w })
        .collect::<Vec<_>>()
        .join(" ")
}

struct Corpus {
    /// Expected reason per URL; `None` = kept.
    expected: BTreeMap<String, Option<&'static str>>,
    lambada_url: String,
}

fn build_corpus(dir: &Path) -> Corpus {
    let wiki = read_texts("wikitext103_valid.jsonl");
    let speeches = read_texts("tinyshakespeare.jsonl");
    let lambada = read_texts("lambada_test.jsonl");
    let mut expected = BTreeMap::new();
    let mut shard_a = Vec::new();
    let mut shard_b = Vec::new();

    // Clean documents: 20 WikiText articles (first 3000 chars) and 10 bundles of
    // 25 Shakespeare speeches.
    let mut originals = Vec::new();
    for (i, text) in wiki.iter().take(20).enumerate() {
        let text: String = text.chars().take(3000).collect();
        let url = format!("https://wiki.example.org/article/{i}");
        shard_a.push(doc(&url, &text));
        expected.insert(url.clone(), None);
        originals.push(text);
    }
    for (i, chunk) in speeches.chunks(25).take(10).enumerate() {
        let url = format!("http://plays.example.com/bundle{i}");
        shard_b.push(doc(&url, &chunk.join("\n\n")));
        expected.insert(url, None);
    }
    // Near-duplicates: edited copies of five articles (every 50th word changed, Jaccard
    // about 0.93, which 10 bands of 10 MinHashes catch with probability > 0.999).
    for (i, text) in originals.iter().take(5).enumerate() {
        let url = format!("https://mirror.example.net/copy/{i}");
        shard_b.push(doc(&url, &edit(text, 50)));
        expected.insert(url, Some("remove-duplicates: near-duplicate"));
    }
    // Blacklisted, malformed and repeated URLs on otherwise clean text.
    let clean = &originals[5];
    for (url, reason) in [
        (
            "https://en.wikipedia.org/wiki/Foo",
            "blacklist-urls: domain blacklisted",
        ),
        (
            "https://i.imgur.com/page",
            "blacklist-urls: domain blacklisted",
        ),
        (
            "http://files.example.com/paper.pdf?dl=1",
            "blacklist-urls: extension blacklisted",
        ),
        ("http://a", "blacklist-urls: short url (<=8)"),
        ("notaurl/at/all", "blacklist-urls: malformed url"),
    ] {
        shard_a.push(doc(url, clean));
        expected.insert(url.to_string(), Some(reason));
    }
    shard_b.push(doc("https://wiki.example.org/article/3", &originals[7]));
    // Non-English (French, German) and too-short English documents.
    let french = "Le petit prince habitait une planète à peine plus grande que lui, et il avait besoin d'un ami. Chaque jour il arrachait les pousses de baobabs et regardait le coucher du soleil. ".repeat(8);
    let german = "Die Stadt liegt am Ufer des Flusses, und im Sommer kommen viele Besucher, um die alten Häuser und die Brücken zu sehen. Am Abend sitzen die Menschen in den Gärten. ".repeat(8);
    shard_a.push(doc("https://fr.example.org/prince", &french));
    expected.insert(
        "https://fr.example.org/prince".into(),
        Some("cleanup: non-english"),
    );
    shard_a.push(doc("https://de.example.org/stadt", &german));
    expected.insert(
        "https://de.example.org/stadt".into(),
        Some("cleanup: non-english"),
    );
    shard_a.push(doc(
        "https://short.example.org/note",
        "The meeting was moved to Tuesday afternoon because the room was booked.",
    ));
    expected.insert(
        "https://short.example.org/note".into(),
        Some("cleanup: too short"),
    );
    // A document that is a LAMBADA passage wrapped in short filler: the passage and its
    // surroundings are cut, nothing of 200+ characters remains.
    let lambada_url = "https://stories.example.com/lambada".to_string();
    let passage = format!("{} {}", lambada[0], lambada[1]);
    shard_b.push(doc(&lambada_url, &passage));
    expected.insert(
        lambada_url.clone(),
        Some("filter-ngrams: task n-gram (nothing left)"),
    );

    std::fs::write(dir.join("shard_a.json"), shard_a.join("\n") + "\n").unwrap();
    std::fs::write(dir.join("shard_b.jsonl"), shard_b.join("\n") + "\n").unwrap();
    Corpus {
        expected,
        lambada_url,
    }
}

fn run_pipeline(corpus_dir: &Path, work: &Path, out: &Path) -> String {
    let data = shared_dir().join("data");
    let output = run_ok(
        bin("openwebtext_filter")
            .arg("run")
            .arg("--input-dir")
            .arg(corpus_dir)
            .arg("--work-dir")
            .arg(work)
            .arg("--output")
            .arg(out)
            .arg("--vocab-file")
            .arg(data.join("gpt2-vocab.json"))
            .arg("--merge-file")
            .arg(data.join("gpt2-merges.txt"))
            .args(["--tasks", "lambada", "--lambada-path"])
            .arg(data.join("lambada_test.jsonl")),
    );
    String::from_utf8(output.stderr).unwrap()
}

#[test]
fn pipeline_removes_each_bad_document_for_its_reason() {
    let tmp = tempfile::tempdir().unwrap();
    let corpus_dir = tmp.path().join("shards");
    std::fs::create_dir(&corpus_dir).unwrap();
    let corpus = build_corpus(&corpus_dir);
    let out = tmp.path().join("clean.json");
    let stderr = run_pipeline(&corpus_dir, &tmp.path().join("work"), &out);

    let kept: BTreeSet<String> = std::fs::read_to_string(&out)
        .unwrap()
        .lines()
        .map(|l| {
            serde_json::from_str::<serde_json::Value>(l).unwrap()["url"]
                .as_str()
                .unwrap()
                .to_string()
        })
        .collect();
    let want_kept: BTreeSet<String> = corpus
        .expected
        .iter()
        .filter(|(_, r)| r.is_none())
        .map(|(u, _)| u.clone())
        .collect();
    assert_eq!(kept, want_kept, "stderr:\n{stderr}");
    assert!(!kept.contains(&corpus.lambada_url));

    // Every drop reason appears in the summary with the expected count (+1 duplicate URL).
    let mut want: BTreeMap<&str, u64> = BTreeMap::new();
    for reason in corpus.expected.values().flatten() {
        *want.entry(reason).or_default() += 1;
    }
    *want.entry("blacklist-urls: duplicate url").or_default() += 1;
    for (reason, n) in want {
        assert!(
            stderr.contains(&format!("dropped ({reason}): {n}\n")),
            "missing `{reason}: {n}` in\n{stderr}"
        );
    }
    let total = corpus.expected.len() + 1;
    assert!(
        stderr.contains(&format!("documents in: {total}\n")),
        "{stderr}"
    );
}

#[test]
fn pipeline_output_is_deterministic() {
    let tmp = tempfile::tempdir().unwrap();
    let corpus_dir = tmp.path().join("shards");
    std::fs::create_dir(&corpus_dir).unwrap();
    build_corpus(&corpus_dir);
    let (a, b) = (tmp.path().join("a.json"), tmp.path().join("b.json"));
    run_pipeline(&corpus_dir, &tmp.path().join("wa"), &a);
    run_pipeline(&corpus_dir, &tmp.path().join("wb"), &b);
    assert_eq!(std::fs::read(&a).unwrap(), std::fs::read(&b).unwrap());
    assert_eq!(
        std::fs::read(tmp.path().join("wa/04_similar_pairs.json")).unwrap(),
        std::fs::read(tmp.path().join("wb/04_similar_pairs.json")).unwrap()
    );
}

/// Exact Jaccard of character 5-gram sets, computed independently of the library.
fn exact_jaccard(a: &str, b: &str) -> f64 {
    let grams = |t: &str| {
        let c: Vec<char> = t.chars().collect();
        c.windows(5)
            .map(|w| w.iter().collect::<String>())
            .collect::<BTreeSet<_>>()
    };
    let (x, y) = (grams(a), grams(b));
    x.intersection(&y).count() as f64 / x.union(&y).count() as f64
}

#[test]
fn find_duplicates_reports_exact_jaccard_of_edited_copies() {
    let tmp = tempfile::tempdir().unwrap();
    let wiki = read_texts("wikitext2_test.jsonl");
    let mut lines = Vec::new();
    let mut edited = BTreeMap::new();
    for (i, text) in wiki.iter().take(30).enumerate() {
        let text: String = text.chars().take(4000).collect();
        lines.push(doc(&format!("orig{i}"), &text));
        if i < 10 {
            let copy = edit(&text, 50 + i);
            edited.insert(
                format!("copy{i}"),
                (format!("orig{i}"), exact_jaccard(&text, &copy)),
            );
            lines.push(doc(&format!("copy{i}"), &copy));
        }
    }
    let input = tmp.path().join("docs.json");
    std::fs::write(&input, lines.join("\n") + "\n").unwrap();
    let pairs = tmp.path().join("pairs.json");
    run_ok(
        bin("openwebtext_filter")
            .args(["find-duplicates", "--inputs"])
            .arg(&input)
            .arg("url")
            .arg("--output")
            .arg(&pairs),
    );
    let mut found = BTreeMap::new();
    for line in std::fs::read_to_string(&pairs).unwrap().lines() {
        let v: serde_json::Value = serde_json::from_str(line).unwrap();
        for (main, others) in v.as_object().unwrap() {
            for o in others.as_array().unwrap() {
                for (other, sim) in o.as_object().unwrap() {
                    let mut key = [main.clone(), other.clone()];
                    key.sort();
                    found.insert(key, sim.as_f64().unwrap());
                }
            }
        }
    }
    for (copy, (orig, exact)) in &edited {
        assert!(
            *exact > 0.5,
            "{copy}: test copies must be similar ({exact})"
        );
        let mut key = [copy.clone(), orig.clone()];
        key.sort();
        let sim = found
            .get(&key)
            .unwrap_or_else(|| panic!("pair {key:?} not found in {found:?}"));
        assert!(
            (sim - exact).abs() < 1e-12,
            "{key:?}: reported {sim}, exact {exact}"
        );
    }
    assert_eq!(found.len(), edited.len(), "no unrelated pairs: {found:?}");
}

#[test]
fn malformed_line_is_reported_with_file_and_line_or_skipped() {
    let tmp = tempfile::tempdir().unwrap();
    let input = tmp.path().join("in.json");
    std::fs::write(
        &input,
        "{\"text\": \"a\", \"url\": \"u\"}\n{broken\n{\"text\": \"b\"}\n",
    )
    .unwrap();
    let out = tmp.path().join("out.json");
    let failed = bin("openwebtext_filter")
        .args(["add-id", "--id-prefix", "owt", "--input-file"])
        .arg(&input)
        .arg("--output-file")
        .arg(&out)
        .output()
        .unwrap();
    assert_eq!(failed.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&failed.stderr);
    assert!(
        stderr.starts_with("error: ") && stderr.contains("in.json:2:"),
        "{stderr}"
    );
    assert!(!out.exists(), "a failed run must not leave an output");

    run_ok(
        bin("openwebtext_filter")
            .args([
                "add-id",
                "--skip-invalid",
                "--id-prefix",
                "owt",
                "--input-file",
            ])
            .arg(&input)
            .arg("--output-file")
            .arg(&out),
    );
    assert_eq!(
        std::fs::read_to_string(&out).unwrap(),
        "{\"text\": \"a\", \"url\": \"u\", \"adlr_id\": \"owt-0000000001\"}\n{\"text\": \"b\", \"adlr_id\": \"owt-0000000002\"}\n"
    );
    let usage = bin("openwebtext_filter")
        .args(["add-id", "--bogus"])
        .output()
        .unwrap();
    assert_eq!(usage.status.code(), Some(2));
}

#[test]
fn saved_fingerprints_continue_a_dedup_run() {
    let tmp = tempfile::tempdir().unwrap();
    let wiki = read_texts("wikitext2_test.jsonl");
    let (mut first, mut second) = (Vec::new(), Vec::new());
    for (i, text) in wiki.iter().take(20).enumerate() {
        let text: String = text.chars().take(3000).collect();
        first.push(doc(&format!("a{i}"), &text));
        // Half of the second file copies the first with edits.
        let copy = if i % 2 == 0 {
            edit(&text, 40 + i)
        } else {
            wiki[40 + i].chars().take(3000).collect()
        };
        second.push(doc(&format!("b{i}"), &copy));
    }
    std::fs::write(tmp.path().join("a.json"), first.join("\n") + "\n").unwrap();
    std::fs::write(tmp.path().join("b.json"), second.join("\n") + "\n").unwrap();
    let run = |args: &[&str]| {
        let mut command = bin("openwebtext_filter");
        command.arg("find-duplicates").args(args);
        command
    };
    let path = |name: &str| tmp.path().join(name).to_str().unwrap().to_string();
    let (a, b) = (path("a.json"), path("b.json"));
    let (once, resumed, saved, scratch) = (
        path("once.json"),
        path("resumed.json"),
        path("a.fp"),
        path("x.json"),
    );
    run_ok(&mut run(&[
        "--inputs", &a, "url", &b, "url", "--output", &once,
    ]));
    run_ok(&mut run(&[
        "--inputs",
        &a,
        "url",
        "--output",
        &scratch,
        "--save-fingerprints",
        &saved,
    ]));
    run_ok(&mut run(&[
        "--load-fingerprints",
        &saved,
        "--inputs",
        &b,
        "url",
        "--output",
        &resumed,
    ]));
    let pairs = std::fs::read_to_string(&once).unwrap();
    assert!(pairs.lines().count() >= 5, "{pairs}");
    assert_eq!(pairs, std::fs::read_to_string(&resumed).unwrap());

    let other_seed = run(&[
        "--load-fingerprints",
        &saved,
        "--seed",
        "7",
        "--output",
        &resumed,
    ])
    .output()
    .unwrap();
    let message = String::from_utf8_lossy(&other_seed.stderr);
    assert!(
        !other_seed.status.success() && message.contains("--seed 1234"),
        "{message}"
    );
    std::fs::write(&a, first.join("\n") + "\nmore\n").unwrap();
    let changed = run(&["--load-fingerprints", &saved, "--output", &resumed])
        .output()
        .unwrap();
    let message = String::from_utf8_lossy(&changed.stderr);
    assert!(
        !changed.status.success() && message.contains("changed since"),
        "{message}"
    );
}
