//! BERT and T5 datasets against Megatron core_v0.14.0's own output
//! (`../shared/golden/{bert,t5}_dataset`): sample index bytes, description text (so the MD5
//! cache file names), lengths and every field of the dumped samples, for every split.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use megatron_data::blend::{Blend, DataSources, SplitDataset};
use megatron_data::gpt::{Split, TokenizerIdentity};
use megatron_data::masked::{
    build_bert_datasets, build_t5_datasets, open_indexed, BertMaskedWordPieceDataset,
    MaskedDataFlags, MaskedWordPieceDataset, SentenceSourceOpener, T5MaskedWordPieceDataset,
};
use megatron_data::tokenizer::TokenizerArgs;
use serde_json::Value;

/// `../shared` beside the workspace (or `MEGATRON_RS_SHARED`).
fn shared_dir() -> PathBuf {
    std::env::var_os("MEGATRON_RS_SHARED")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../../../shared"))
}

const PREFIX: &str = "small_bert_text_sentence";

fn flags(vocab_extra_ids: usize, seq_length: usize, cache: &Path) -> MaskedDataFlags {
    MaskedDataFlags {
        seed: 1234,
        seq_length,
        mask_prob: 0.15,
        short_seq_prob: 0.1,
        split: Some("969,30,1".into()),
        data_cache_path: Some(cache.to_path_buf()),
        mid_level_dataset_surplus: 0.005,
        tokenizer: TokenizerArgs::from_flags([
            "--tokenizer-type",
            "BertWordPieceLowerCase",
            "--vocab-file",
            &shared_dir()
                .join("data/bert-large-uncased-vocab.txt")
                .to_string_lossy(),
        ])
        .unwrap(),
        vocab_extra_ids,
    }
}

/// The golden was made from the preprocess folder with the bare prefix; open that prefix
/// there while recording it bare.
fn open_golden_input(prefix: &str) -> anyhow::Result<Arc<dyn megatron_data::gpt::SentenceSource>> {
    open_indexed(
        shared_dir()
            .join("golden/preprocess/bert_legacy")
            .join(prefix)
            .to_str()
            .unwrap(),
    )
}

fn golden(name: &str) -> (PathBuf, Value) {
    let dir = shared_dir().join("golden").join(name);
    let text = std::fs::read_to_string(dir.join("samples.json")).unwrap();
    (dir, serde_json::from_str(&text).unwrap())
}

fn single<D: megatron_data::blend::BlendMember>(d: Option<SplitDataset<D>>) -> D {
    match d.expect("split present") {
        SplitDataset::Single(d) => d,
        SplitDataset::Blended(_) => panic!("one prefix gives a single dataset"),
    }
}

/// Index, description and cache files of one split equal the golden's.
fn check_base(
    base: &MaskedWordPieceDataset,
    class: &str,
    expected: &Value,
    golden_dir: &Path,
    cache: &Path,
) {
    let hash = expected["unique_description_hash"].as_str().unwrap();
    assert_eq!(base.description_hash(), hash);
    assert_eq!(base.len() as u64, expected["len"].as_u64().unwrap());
    for affix in ["description.txt", "sample_index.npy"] {
        let name = format!("{hash}-{class}-{affix}");
        let ours = std::fs::read(cache.join(&name)).unwrap();
        let theirs = std::fs::read(golden_dir.join("cache").join(&name)).unwrap();
        assert!(ours == theirs, "{name} differs from Megatron's");
    }
    let first = expected["sample_index_first"].as_array().unwrap();
    for (i, row) in first.iter().enumerate() {
        let row: Vec<u64> = row
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap())
            .collect();
        assert_eq!(base.mapping().row(i).to_vec(), row, "sample_index row {i}");
    }
}

fn ints(v: &Value) -> Vec<i64> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_i64().unwrap())
        .collect()
}

#[test]
fn bert_samples_equal_megatron_on_every_split() {
    let (golden_dir, golden) = golden("bert_dataset");
    let cache = tempfile::tempdir().unwrap();
    let mut config = flags(0, 128, cache.path()).bert(true).unwrap();
    config.masked.tokenizer =
        TokenizerIdentity::bert_wordpiece("bert-large-uncased-vocab.txt", true, 0);
    let sources = DataSources::Blend(Blend::parse(&[PREFIX.to_string()]).unwrap());
    let open: &SentenceSourceOpener = &open_golden_input;
    let built = build_bert_datasets(
        &sources,
        [Some(200), Some(20), Some(5)],
        Arc::new(config),
        open,
    )
    .unwrap();
    for (split, dataset) in Split::ALL.into_iter().zip(built) {
        let dataset: BertMaskedWordPieceDataset = single(dataset);
        let expected = &golden["splits"][split.name()];
        check_base(
            dataset.base(),
            "BERTMaskedWordPieceDataset",
            expected,
            &golden_dir,
            cache.path(),
        );
        for sample in expected["first_samples"].as_array().unwrap() {
            let idx = sample["idx"].as_u64().unwrap() as usize;
            let ours = dataset.get(idx);
            let at = format!("{} sample {idx}", split.name());
            assert_eq!(ours.text, ints(&sample["text"]), "{at} text");
            assert_eq!(ours.types, ints(&sample["types"]), "{at} types");
            assert_eq!(ours.labels, ints(&sample["labels"]), "{at} labels");
            assert_eq!(
                ours.padding_mask,
                ints(&sample["padding_mask"]),
                "{at} padding_mask"
            );
            assert_eq!(ours.loss_mask, ints(&sample["loss_mask"]), "{at} loss_mask");
            assert_eq!(
                i64::from(ours.is_random),
                sample["is_random"].as_i64().unwrap(),
                "{at}"
            );
            assert_eq!(
                i64::from(ours.truncated),
                sample["truncated"].as_i64().unwrap(),
                "{at}"
            );
        }
    }
    // A second build loads the cached indices and gives the same samples.
    let mut config = flags(0, 128, cache.path()).bert(true).unwrap();
    config.masked.tokenizer =
        TokenizerIdentity::bert_wordpiece("bert-large-uncased-vocab.txt", true, 0);
    let again = build_bert_datasets(
        &sources,
        [Some(200), Some(20), Some(5)],
        Arc::new(config),
        open,
    )
    .unwrap();
    let train = single(again.into_iter().next().unwrap());
    assert!(matches!(
        train.base().origin(),
        megatron_data::gpt::IndexOrigin::Loaded(_)
    ));
    let first = &golden["splits"]["train"]["first_samples"][0];
    assert_eq!(train.get(0).text, ints(&first["text"]));
}

#[test]
fn t5_samples_equal_megatron_on_every_split() {
    let (golden_dir, golden) = golden("t5_dataset");
    let tokenizer = &golden["tokenizer"];
    let cache = tempfile::tempdir().unwrap();
    let mut config = flags(100, 128, cache.path()).t5(32).unwrap();
    let vocab = &config.masked.vocab;
    assert_eq!(vocab.bos, tokenizer["bos"].as_i64());
    assert_eq!(vocab.eos, tokenizer["eos"].as_i64());
    assert_eq!(
        [vocab.sentinels[0], *vocab.sentinels.last().unwrap()].to_vec(),
        ints(&tokenizer["sentinels_first_last"])
    );
    config.masked.tokenizer = TokenizerIdentity::bert_wordpiece(
        "/work/steering/shared/data/bert-large-uncased-vocab.txt",
        true,
        100,
    );
    let sources = DataSources::Blend(Blend::parse(&[PREFIX.to_string()]).unwrap());
    let open: &SentenceSourceOpener = &open_golden_input;
    let built = build_t5_datasets(
        &sources,
        [Some(200), Some(20), Some(5)],
        Arc::new(config),
        open,
    )
    .unwrap();
    for (split, dataset) in Split::ALL.into_iter().zip(built) {
        let dataset: T5MaskedWordPieceDataset = single(dataset);
        let expected = &golden["splits"][split.name()];
        check_base(
            dataset.base(),
            "T5MaskedWordPieceDataset",
            expected,
            &golden_dir,
            cache.path(),
        );
        for sample in expected["first_samples"].as_array().unwrap() {
            let idx = sample["idx"].as_u64().unwrap() as usize;
            let ours = dataset.get(idx).unwrap();
            let at = format!("{} sample {idx}", split.name());
            assert_eq!(ours.text_enc, ints(&sample["text_enc"]), "{at} text_enc");
            assert_eq!(ours.text_dec, ints(&sample["text_dec"]), "{at} text_dec");
            assert_eq!(ours.labels, ints(&sample["labels"]), "{at} labels");
            assert_eq!(ours.loss_mask, ints(&sample["loss_mask"]), "{at} loss_mask");
            assert_eq!(ours.enc_mask, ints(&sample["enc_mask"]), "{at} enc_mask");
            assert_eq!(ours.dec_mask, ints(&sample["dec_mask"]), "{at} dec_mask");
            assert_eq!(
                i64::from(ours.truncated),
                sample["truncated"].as_i64().unwrap(),
                "{at}"
            );
        }
    }
}

#[test]
fn document_level_data_stops_at_once_with_the_binary_head() {
    let cache = tempfile::tempdir().unwrap();
    let sources =
        DataSources::Blend(Blend::parse(&["small_bertdoc_text_document".to_string()]).unwrap());
    let open: &SentenceSourceOpener = &open_golden_input;
    let config = Arc::new(flags(0, 128, cache.path()).bert(true).unwrap());
    let error = build_bert_datasets(&sources, [Some(200), Some(20), Some(5)], config, open)
        .err()
        .expect("document-level data is refused");
    let message = format!("{error:#}");
    assert!(message.contains("--split-sentences"), "{message}");
    assert!(message.contains("small_bertdoc_text_document"), "{message}");

    // Without the head every document is a sample: Megatron accepts this and so do we.
    let config = Arc::new(flags(0, 128, cache.path()).bert(false).unwrap());
    let built =
        build_bert_datasets(&sources, [Some(200), Some(20), Some(5)], config, open).unwrap();
    let train: BertMaskedWordPieceDataset = single(built.into_iter().next().unwrap());
    assert!(train.len() >= 200);
    let sample = train.get(0);
    assert!(!sample.is_random);
    assert!(sample.types.iter().all(|&t| t == 0));
    assert_eq!(sample.text[0], 101);
}

#[test]
fn t5_decoder_overflow_is_an_error_naming_the_flag() {
    let cache = tempfile::tempdir().unwrap();
    let config = Arc::new(flags(100, 128, cache.path()).t5(4).unwrap());
    let sources = DataSources::Blend(Blend::parse(&[PREFIX.to_string()]).unwrap());
    let open: &SentenceSourceOpener = &open_golden_input;
    let built = build_t5_datasets(&sources, [Some(20), None, None], config, open).unwrap();
    let train: T5MaskedWordPieceDataset = single(built.into_iter().next().unwrap());
    let errors: Vec<String> = (0..train.len())
        .filter_map(|i| train.get(i).err().map(|e| e.to_string()))
        .collect();
    assert!(!errors.is_empty());
    assert!(errors[0].contains("--decoder-seq-length"), "{}", errors[0]);
}

#[test]
fn weighted_bert_blends_draw_member_samples_by_weight() {
    let cache = tempfile::tempdir().unwrap();
    let config = Arc::new(flags(0, 128, cache.path()).bert(true).unwrap());
    let blend = Blend::parse(&["0.3".into(), PREFIX.into(), "0.7".into(), PREFIX.into()]).unwrap();
    let sources = DataSources::Blend(blend);
    let open: &SentenceSourceOpener = &open_golden_input;
    let built =
        build_bert_datasets(&sources, [Some(100), Some(10), Some(0)], config, open).unwrap();
    let Some(SplitDataset::Blended(train)) = &built[0] else {
        panic!("two weighted prefixes give a blend");
    };
    // ceil(100 · 0.3) + ceil(100 · 0.7) samples, members sized with the 0.5 % surplus.
    assert_eq!(train.len(), 100);
    let cached: Vec<_> = std::fs::read_dir(cache.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.contains("BlendedDataset-train"))
        .collect();
    assert_eq!(cached.len(), 3, "{cached:?}");
    for k in [0, 1, 2, 50, 99] {
        let (member, index) = train.locate(k);
        assert_eq!(train.get(k).1, train.datasets()[member].get(index));
    }
    let counts = train.indices().counts(2);
    assert_eq!(counts, [30, 70]);
}
