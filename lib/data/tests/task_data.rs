//! RACE, MNLI and QQP samples from fixture files in each task's official format (spec
//! §7.4–7.5): cleaning, `_` substitution, the 128-token question cap, truncation, types,
//! padding, and QQP's skipped rows.

use std::path::Path;

use megatron_data::tasks::{
    read_glue_tsv, read_race_dir, ClassificationSample, GlueTask, PairSpecials,
};
use megatron_data::tokenizer::BertWordPiece;

const VOCAB: [&str; 25] = [
    "[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "the", "cat", "sat", "on", "mat", ".", "what",
    "did", "do", "?", "it", "a", "b", "c", "d", "ran", "dog", ",", "is", "word",
];

fn tokenizer() -> (BertWordPiece, PairSpecials) {
    let text: String = VOCAB.iter().map(|t| format!("{t}\n")).collect();
    let t = BertWordPiece::from_vocab_text(&text, true, false).unwrap();
    let specials = PairSpecials::from_bert(&t).unwrap();
    (t, specials)
}

fn write(path: &Path, text: &str) {
    std::fs::write(path, text).unwrap();
}

#[test]
fn race_questions_become_four_capped_pairs() {
    let (tokenizer, specials) = tokenizer();
    let dir = tempfile::tempdir().unwrap();
    // Official RACE: one JSON document per .txt file, in directories like RACE/train/middle.
    let first = serde_json::json!({
        "article": "The cat sat\non the  mat . The dog ran .",
        "questions": ["The cat sat on the _ .", "What did the dog do?"],
        "options": [["mat", "dog", "cat", "a"], ["ran", "sat", "is", "a"]],
        "answers": ["A", "C"],
        "id": "middle1.txt"
    });
    let long_question = vec!["word"; 130].join(" ");
    let second = serde_json::json!({
        "article": "The dog ran .",
        "questions": [long_question],
        "options": [["a", "b", "c", "d"]],
        "answers": ["D"],
        "id": "middle2.txt"
    });
    write(&dir.path().join("2.txt"), &format!("{second}\n"));
    write(&dir.path().join("1.txt"), &format!("{first}\n"));
    write(&dir.path().join("notes.md"), "not a RACE file");

    let samples = read_race_dir(dir.path(), &tokenizer, specials, 16).unwrap();
    assert_eq!(samples.len(), 3);
    assert_eq!(
        samples.iter().map(|s| (s.uid, s.label)).collect::<Vec<_>>(),
        [(0, 0), (1, 2), (2, 3)]
    );
    // "_" is replaced by the option; the article is cleaned ("mat . The" → "mat. The"); the
    // pair reaches 16 positions, so it is cut to 15 and ends with [SEP].
    let mat = &samples[0].choices[0];
    assert_eq!(mat.text, [2, 5, 6, 7, 8, 5, 9, 10, 3, 5, 6, 7, 8, 5, 9, 3]);
    assert_eq!(mat.types, [[0; 9].as_slice(), &[1; 7]].concat());
    assert_eq!(mat.padding_mask, [1; 16]);
    let dog = &samples[0].choices[1];
    assert_eq!(dog.text[..9], [2, 5, 6, 7, 8, 5, 21, 10, 3]);
    // Without "_" the option is appended after a space.
    assert_eq!(
        samples[1].choices[2].text[..9],
        [2, 11, 12, 5, 21, 13, 14, 23, 3]
    );
    assert_eq!(samples[1].choices.len(), 4);

    // The question+option (131 tokens) is capped at 128 before pairing.
    let samples = read_race_dir(dir.path(), &tokenizer, specials, 256).unwrap();
    let capped = &samples[2].choices[0];
    assert_eq!(capped.text[1..129], [24; 128]);
    assert_eq!(capped.text[129..135], [3, 5, 21, 20, 10, 3]);
    assert_eq!(capped.text[135..], [0; 121]);
    assert_eq!(capped.types[130..135], [1; 5]);
    assert_eq!(capped.types[135..], [0; 121]);
    assert_eq!(capped.padding_mask.iter().sum::<i64>(), 135);

    write(&dir.path().join("3.txt"), "{\"article\": \"x\", \"questions\": [\"q\"], \"options\": [[\"a\",\"b\",\"c\",\"d\"]], \"answers\": [\"E\"]}\n");
    let error = read_race_dir(dir.path(), &tokenizer, specials, 16).unwrap_err();
    assert!(format!("{error:#}").contains("3.txt:1"), "{error:#}");
}

const MNLI_TRAIN_HEADER: &str = "index\tpromptID\tpairID\tgenre\tsentence1_binary_parse\t\
    sentence2_binary_parse\tsentence1_parse\tsentence2_parse\tsentence1\tsentence2\tlabel1\tgold_label";

#[test]
fn mnli_rows_are_cleaned_labelled_and_paired() {
    let (tokenizer, specials) = tokenizer();
    let dir = tempfile::tempdir().unwrap();
    let train = dir.path().join("train.tsv");
    write(
        &train,
        &format!(
            "{MNLI_TRAIN_HEADER}\n\
             0\t31193\t31193n\tgovernment\t( ( x ) )\t( y )\t(ROOT x)\t(ROOT y)\tThe  cat sat . the dog\tThe dog ran .\tneutral\tneutral\n\
             7\t1\t1e\tfiction\tp\tq\tr\ts\tthe cat\tthe mat\tentailment\tentailment\n\
             9\t1\t1c\tfiction\tp\tq\tr\ts\tthe cat\tthe mat\tcontradiction\tcontradiction\n"
        ),
    );
    let file = read_glue_tsv(GlueTask::Mnli, &train).unwrap();
    assert!(!file.is_test);
    assert_eq!(
        file.rows
            .iter()
            .map(|r| (r.uid, r.label))
            .collect::<Vec<_>>(),
        [(0, 2), (7, 1), (9, 0)]
    );
    assert_eq!(file.rows[0].text_a, "The cat sat. the dog");
    assert_eq!(file.rows[0].text_b, "The dog ran .");

    let sample = ClassificationSample::build(&file.rows[0], &tokenizer, specials, 10).unwrap();
    // [CLS] the cat sat . the dog [SEP] = 8, + "the dog ran ." reaches 10: cut to 9 + [SEP].
    assert_eq!(sample.input.text, [2, 5, 6, 7, 10, 5, 21, 3, 5, 3]);
    assert_eq!(sample.input.types, [0, 0, 0, 0, 0, 0, 0, 0, 1, 1]);
    let sample = ClassificationSample::build(&file.rows[1], &tokenizer, specials, 10).unwrap();
    assert_eq!(sample.input.text, [2, 5, 6, 3, 5, 9, 3, 0, 0, 0]);
    assert_eq!(sample.input.padding_mask, [1, 1, 1, 1, 1, 1, 1, 0, 0, 0]);
    assert_eq!((sample.label, sample.uid), (1, 7));

    // A 10-column header marks a test file: every label is contradiction (0).
    let test = dir.path().join("test_matched.tsv");
    let header10: Vec<&str> = MNLI_TRAIN_HEADER.split('\t').take(10).collect();
    write(
        &test,
        &format!(
            "{}\n3\t1\t1\tg\tp\tq\tr\ts\tthe cat\tthe dog\n",
            header10.join("\t")
        ),
    );
    let file = read_glue_tsv(GlueTask::Mnli, &test).unwrap();
    assert!(file.is_test);
    assert_eq!(file.rows[0].label, 0);

    let bad = dir.path().join("bad.tsv");
    write(
        &bad,
        &format!("{MNLI_TRAIN_HEADER}\n1\tp\tp\tg\tp\tq\tr\ts\ta\tb\tx\tmaybe\n"),
    );
    let error = read_glue_tsv(GlueTask::Mnli, &bad).unwrap_err();
    assert!(format!("{error:#}").contains("bad.tsv:2"), "{error:#}");
}

#[test]
fn qqp_skips_malformed_rows_like_megatron() {
    let dir = tempfile::tempdir().unwrap();
    let train = dir.path().join("train.tsv");
    write(
        &train,
        "id\tqid1\tqid2\tquestion1\tquestion2\tis_duplicate\n\
         0\t1\t2\tWhat  did the cat do ?\tDid the cat sit?\t1\n\
         1\t3\t4\tthe cat\tthe dog\n\
         2\t5\t6\t\tthe dog\t0\n\
         3\t7\t8\tthe cat\t \t0\n\
         4\t9\t10\tthe mat\tthe cat\t0\n",
    );
    let file = read_glue_tsv(GlueTask::Qqp, &train).unwrap();
    assert!(!file.is_test);
    assert_eq!(
        file.rows
            .iter()
            .map(|r| (r.uid, r.label))
            .collect::<Vec<_>>(),
        [(0, 1), (4, 0)]
    );
    assert_eq!(file.rows[0].text_a, "What did the cat do ?");
    assert_eq!(file.skipped.len(), 3);
    assert!(file.skipped[0].contains("train.tsv:3") && file.skipped[0].contains("index error"));
    assert!(file.skipped[1].contains("zero length a"));
    assert!(file.skipped[2].contains("zero length b"));

    let test = dir.path().join("test.tsv");
    write(&test, "id\tquestion1\tquestion2\n5\tthe cat\tthe dog\n");
    let file = read_glue_tsv(GlueTask::Qqp, &test).unwrap();
    assert!(file.is_test);
    assert_eq!((file.rows[0].uid, file.rows[0].label), (5, 0));
    assert_eq!(GlueTask::Qqp.num_classes(), 2);
}
