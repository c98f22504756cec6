//! The tokenizer of BERT and T5 data as `pretrain_bert`, `pretrain_t5` and the tools beside
//! them build it from the tokenizer flags, with what the masked-LM datasets need of it.

use anyhow::{bail, Context, Result};

use crate::gpt::TokenizerIdentity;
use crate::tokenizer::{
    BertWordPiece, SentencePiece, SentencePieceFlavor, Tokenizer, TokenizerArgs, TokenizerType,
};

use super::vocab::MaskedLmVocab;

pub struct MaskedTokenizer {
    pub tokenizer: Box<dyn Tokenizer>,
    pub vocab: MaskedLmVocab,
}

impl MaskedTokenizer {
    /// Megatron's legacy WordPiece (`[BOS]`/`[EOS]` added, texts not wrapped in
    /// `[CLS]`/`[SEP]`) or its `SentencePieceTokenizer`, each with `vocab_extra_ids`
    /// sentinels (`--vocab-extra-ids`). Megatron's other tokenizers have no `[CLS]`, `[SEP]`
    /// or `[MASK]`, which masked-LM samples are made of.
    pub fn from_flags(flags: &TokenizerArgs, vocab_extra_ids: usize) -> Result<MaskedTokenizer> {
        let kind: TokenizerType = flags.tokenizer_type.parse().map_err(anyhow::Error::msg)?;
        match kind {
            TokenizerType::BertWordPieceLowerCase | TokenizerType::BertWordPieceCase => {
                let vocab_file = flags.vocab_file.as_ref().with_context(|| {
                    format!("--tokenizer-type {kind} needs --vocab-file (the WordPiece vocab.txt)")
                })?;
                let lower_case = kind == TokenizerType::BertWordPieceLowerCase;
                MaskedTokenizer::from_wordpiece(
                    BertWordPiece::from_file(vocab_file, lower_case, false)?
                        .with_extra_ids(vocab_extra_ids),
                )
            }
            TokenizerType::SentencePieceTokenizer => {
                let model = flags.tokenizer_model.as_ref().with_context(|| {
                    format!("--tokenizer-type {kind} needs --tokenizer-model (the SentencePiece .model)")
                })?;
                let sentencepiece = SentencePiece::from_file(
                    model,
                    SentencePieceFlavor::Megatron,
                    vocab_extra_ids,
                )?;
                let vocab = MaskedLmVocab::from_sentencepiece(&sentencepiece)?;
                Ok(MaskedTokenizer {
                    tokenizer: Box::new(sentencepiece),
                    vocab,
                })
            }
            other => bail!(
                "BERT and T5 data need a tokenizer with [CLS], [SEP] and [MASK] tokens, which \
                 Megatron's {other} does not have: use --tokenizer-type BertWordPieceLowerCase or \
                 BertWordPieceCase (with --vocab-file) or SentencePieceTokenizer (with \
                 --tokenizer-model)"
            ),
        }
    }

    /// Whether the tokenizer `flags` name has the tokens masked-LM samples are made of.
    pub fn supports(flags: &TokenizerArgs) -> Result<bool> {
        let kind: TokenizerType = flags.tokenizer_type.parse().map_err(anyhow::Error::msg)?;
        Ok(kind.is_bert() || kind == TokenizerType::SentencePieceTokenizer)
    }

    /// A legacy WordPiece tokenizer (built without `[CLS]`/`[SEP]` wrapping).
    pub fn from_wordpiece(wordpiece: BertWordPiece) -> Result<MaskedTokenizer> {
        let vocab = MaskedLmVocab::from_bert(&wordpiece)?;
        Ok(MaskedTokenizer {
            tokenizer: Box::new(wordpiece),
            vocab,
        })
    }

    /// The tokenizer's entry in cache descriptions. The BERT and T5 datasets of Megatron's
    /// releases (core_v0.14) are built with its legacy tokenizer classes, so that is the
    /// identity whatever `--legacy-tokenizer` says.
    pub fn identity(flags: &TokenizerArgs, vocab_extra_ids: usize) -> Result<TokenizerIdentity> {
        let legacy = TokenizerArgs {
            legacy_tokenizer: true,
            ..flags.clone()
        };
        TokenizerIdentity::from_flags(&legacy, vocab_extra_ids)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn flags(flags: &[&str]) -> TokenizerArgs {
        TokenizerArgs::from_flags(flags).unwrap()
    }

    #[test]
    fn wordpiece_gets_bos_eos_and_sentinels_after_its_vocabulary() {
        let dir = tempfile::tempdir().unwrap();
        let vocab = dir.path().join("vocab.txt");
        std::fs::write(&vocab, "[PAD]\n[UNK]\n[CLS]\n[SEP]\n[MASK]\nhello\n").unwrap();
        let vocab = vocab.to_str().unwrap();
        let kind = [
            "--tokenizer-type",
            "BertWordPieceLowerCase",
            "--vocab-file",
            vocab,
        ];
        let t = MaskedTokenizer::from_flags(&flags(&kind), 2).unwrap();
        // 6 entries, [BOS] 6, [EOS] 7, <extra_id_0> 8, <extra_id_1> 9.
        assert_eq!(t.tokenizer.vocab_size(), 10);
        let v = &t.vocab;
        assert_eq!((v.cls, v.sep, v.mask, v.pad), (2, 3, 4, 0));
        assert_eq!((v.bos, v.eos), (Some(6), Some(7)));
        assert_eq!(v.sentinels, [8, 9]);
        assert_eq!(t.tokenizer.tokenize("hello <extra_id_1>").unwrap()[0], 5);
        assert_eq!(
            t.tokenizer.detokenize(&[8, 9]).unwrap(),
            "<extra_id_0> <extra_id_1>"
        );
    }

    #[test]
    fn tokenizers_without_cls_sep_and_mask_are_refused_by_name() {
        for kind in [
            "GPT2BPETokenizer",
            "HuggingFaceTokenizer",
            "NullTokenizer",
            "GPTSentencePieceTokenizer",
            "Llama2Tokenizer",
            "TikTokenizer",
        ] {
            // Each with what clap requires of it; nothing is read before the refusal.
            let given = [
                "--tokenizer-type",
                kind,
                "--tokenizer-model",
                "m",
                "--vocab-size",
                "8",
            ];
            let error = MaskedTokenizer::from_flags(&flags(&given), 0)
                .err()
                .unwrap()
                .to_string();
            assert!(
                error.contains(&format!("Megatron's {kind} does not have"))
                    && error.contains("[MASK]"),
                "{error}"
            );
        }
    }

    #[test]
    fn a_missing_vocabulary_flag_is_named() {
        let wordpiece = flags(&["--tokenizer-type", "BertWordPieceCase"]);
        let error = MaskedTokenizer::from_flags(&wordpiece, 0).err().unwrap();
        assert!(error.to_string().contains("--vocab-file"), "{error}");
    }
}
