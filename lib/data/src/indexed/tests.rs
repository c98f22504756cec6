//! Writer/reader round trips, Megatron's worked example, Megatron's own files, and corrupt input.

use std::path::{Path, PathBuf};

use proptest::prelude::*;

use super::*;

fn shared() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../../shared")
}

/// The example of the format spec: doc0 = [10,20,30]; doc1 = [1,2],[3].
fn write_example(prefix: &Path) {
    let mut b = IndexedDatasetBuilder::new(prefix, DType::U16).unwrap();
    b.add_item(&[10u16, 20, 30]).unwrap();
    b.end_document();
    b.add_document(&[1u32, 2, 3], &[2, 1]).unwrap();
    b.finalize().unwrap();
}

#[test]
fn writes_the_documented_byte_layout() {
    let dir = tempfile::tempdir().unwrap();
    let prefix = dir.path().join("ex");
    write_example(&prefix);
    let idx = std::fs::read(idx_path(&prefix)).unwrap();
    let mut expected = b"MMIDIDX\0\0".to_vec();
    expected.extend(1u64.to_le_bytes());
    expected.push(8);
    expected.extend(3u64.to_le_bytes());
    expected.extend(3u64.to_le_bytes());
    for len in [3i32, 2, 1] {
        expected.extend(len.to_le_bytes());
    }
    for v in [0i64, 6, 10, 0, 1, 3] {
        expected.extend(v.to_le_bytes());
    }
    assert_eq!(idx, expected);
    assert_eq!(
        std::fs::read(bin_path(&prefix)).unwrap(),
        [10, 0, 20, 0, 30, 0, 1, 0, 2, 0, 3, 0]
    );
    let ds = IndexedDataset::open(&prefix).unwrap();
    assert_eq!((ds.len(), ds.document_count()), (3, 2));
    assert_eq!(ds.get(0, 1, Some(2)), [20, 30]);
    assert_eq!(ds.get(2, 0, None), [3]);
    assert_eq!(ds.sequence_pointer(2), 10);
    assert!(!ds.is_multimodal());
    assert!(!dir.path().join("ex.bin.tmp").exists() && !dir.path().join("ex.idx.tmp").exists());
}

#[test]
fn reads_megatrons_gpt2_golden() {
    let ds = IndexedDataset::open(shared().join("golden/preprocess/gpt2/small_gpt2_text_document"))
        .unwrap();
    assert_eq!(ds.dtype(), DType::U16);
    assert_eq!((ds.len(), ds.document_count()), (554, 554));
    assert_eq!(ds.token_count(), 48066);
    let lengths: i64 = ds.sequence_lengths().iter().map(|&l| l as i64).sum();
    assert_eq!(lengths, 48066);
    assert_eq!(ds.document_indices(), (0..=554).collect::<Vec<i64>>());
    // Every document ends with GPT-2's end-of-text token (--append-eod).
    assert!((0..ds.len()).all(|i| *ds.sequence(i).last().unwrap() == 50256));
    let bert = IndexedDataset::open(
        shared().join("golden/preprocess/bert_legacy/small_bert_text_sentence"),
    )
    .unwrap();
    assert_eq!((bert.len(), bert.document_count()), (2099, 554));
}

#[test]
fn merge_equals_writing_everything_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let a = dir.path().join("a");
    write_example(&a);
    let mut b = IndexedDatasetBuilder::new(dir.path().join("b"), DType::U16).unwrap();
    b.add_document(&[7u16], &[1]).unwrap();
    b.end_document();
    b.finalize().unwrap();
    merge_datasets(
        &[a.clone(), dir.path().join("b")],
        &dir.path().join("m"),
        false,
    )
    .unwrap();
    let m = IndexedDataset::open(dir.path().join("m")).unwrap();
    assert_eq!(m.document_indices(), [0, 1, 3, 4, 4]);
    assert_eq!(m.sequence(3), [7]);

    let mut other = IndexedDatasetBuilder::new(dir.path().join("wide"), DType::I32).unwrap();
    let err = other.add_index(&a).unwrap_err();
    assert!(
        err.to_string().contains("dtype uint16 differs from int32"),
        "{err}"
    );
}

#[test]
fn multimodal_modes_round_trip() {
    let dir = tempfile::tempdir().unwrap();
    let prefix = dir.path().join("mm");
    let mut b = IndexedDatasetBuilder::new_multimodal(&prefix, DType::I32).unwrap();
    b.add_item_with_mode(&[1i32, 2], 0).unwrap();
    b.add_item_with_mode(&[-5i32], 1).unwrap();
    b.end_document();
    b.finalize().unwrap();
    let ds = IndexedDataset::open(&prefix).unwrap();
    assert!(ds.is_multimodal());
    assert_eq!(ds.sequence_modes(), Some(&[0i8, 1][..]));
    assert_eq!(ds.sequence(1), [-5]);
}

#[test]
fn rejects_tokens_the_dtype_cannot_hold_and_leaves_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let prefix = dir.path().join("x");
    let mut b = IndexedDatasetBuilder::new(&prefix, DType::U16).unwrap();
    let err = b.add_item(&[70000u32]).unwrap_err();
    assert!(
        err.to_string()
            .contains("70000 does not fit the dataset dtype uint16"),
        "{err}"
    );
    drop(b);
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
}

fn corrupt(edit: impl Fn(&mut Vec<u8>, &mut Vec<u8>)) -> String {
    let dir = tempfile::tempdir().unwrap();
    let prefix = dir.path().join("c");
    write_example(&prefix);
    let mut idx = std::fs::read(idx_path(&prefix)).unwrap();
    let mut bin = std::fs::read(bin_path(&prefix)).unwrap();
    edit(&mut idx, &mut bin);
    std::fs::write(idx_path(&prefix), idx).unwrap();
    std::fs::write(bin_path(&prefix), bin).unwrap();
    IndexedDataset::open(&prefix).unwrap_err().to_string()
}

#[test]
fn corrupt_files_get_clear_errors() {
    let e = corrupt(|idx, _| idx.truncate(60));
    assert!(
        e.contains("c.idx: size mismatch") && e.contains("truncated"),
        "{e}"
    );
    let e = corrupt(|idx, _| idx[0] = b'X');
    assert!(e.contains("not a Megatron index file: wrong magic"), "{e}");
    let e = corrupt(|idx, _| idx[9] = 2);
    assert!(e.contains("unsupported index version 2"), "{e}");
    let e = corrupt(|idx, _| idx[17] = 12);
    assert!(e.contains("unknown dtype code 12"), "{e}");
    let e = corrupt(|_, bin| bin.truncate(10));
    assert!(
        e.contains("c.bin: size mismatch") && e.contains("12 bytes"),
        "{e}"
    );
    let e = corrupt(|idx, _| idx[34 + 12 + 8] = 9);
    assert!(e.contains("sequence 1 points to byte 9, expected 6"), "{e}");
    let e = corrupt(|idx, _| idx[34 + 36 + 8] = 5);
    assert!(
        e.contains("document index decreases") || e.contains("ends at"),
        "{e}"
    );
    let e = corrupt(|idx, _| idx.splice(0..8, *b"TNTIDX\0\0").for_each(drop));
    assert!(e.contains("TNTIDX"), "{e}");
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    #[test]
    fn writer_reader_round_trip(
        docs in prop::collection::vec(prop::collection::vec(prop::collection::vec(0u32..65535, 0..20), 0..4), 0..12),
        dtype_index in 0usize..3,
    ) {
        let dtype = [DType::U16, DType::I32, DType::I64][dtype_index];
        let dir = tempfile::tempdir().unwrap();
        let prefix = dir.path().join("rt");
        let mut b = IndexedDatasetBuilder::new(&prefix, dtype).unwrap();
        for doc in &docs {
            for seq in doc {
                b.add_item(seq).unwrap();
            }
            b.end_document();
        }
        b.finalize().unwrap();
        let ds = IndexedDataset::open(&prefix).unwrap();
        let flat: Vec<&Vec<u32>> = docs.iter().flatten().collect();
        prop_assert_eq!(ds.len(), flat.len());
        prop_assert_eq!(ds.document_count(), docs.len());
        for (i, seq) in flat.iter().enumerate() {
            let want: Vec<i64> = seq.iter().map(|&t| t as i64).collect();
            prop_assert_eq!(ds.sequence(i), want);
        }
        let mut boundary = 0i64;
        let mut expected = vec![0i64];
        for doc in &docs {
            boundary += doc.len() as i64;
            expected.push(boundary);
        }
        prop_assert_eq!(ds.document_indices(), &expected[..]);
    }
}
