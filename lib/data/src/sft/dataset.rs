//! Conversations as training samples (Megatron's `SFTDataset.__getitem__`): the turns' tokens
//! end to end, targets hidden on system and user turns, truncated to `seq_length − 1`, then the
//! end-of-document token and padding; inputs and labels shifted by one.

use std::ops::Range;
use std::sync::Arc;

use anyhow::{bail, Context, Result};

use super::conversation::{Message, Role};
use super::prompt_format::PromptFormat;
use crate::gpt::GptSample;
use crate::tokenizer::Tokenizer;

/// The conversations of one JSONL file with the tokenizer and format that turn them into
/// sequences of `seq_length` tokens.
pub struct SftDataset {
    conversations: Vec<Vec<Message>>,
    tokenizer: Arc<dyn Tokenizer>,
    format: PromptFormat,
    seq_length: usize,
    pad: i64,
    eod: i64,
}

impl SftDataset {
    pub fn new(
        conversations: Vec<Vec<Message>>,
        tokenizer: Arc<dyn Tokenizer>,
        format: PromptFormat,
        seq_length: usize,
    ) -> Result<SftDataset> {
        let pad_token = format.pad_token();
        let pad = match tokenizer.tokenize(pad_token)?.as_slice() {
            [id] => i64::from(*id),
            other => bail!(
                "the prompt format pads with {pad_token}, which the tokenizer does not have as one \
                 token (it gives {other:?}); add it to the tokenizer's special tokens"
            ),
        };
        let eod = i64::from(
            tokenizer
                .eod()
                .context("the tokenizer has no end-of-document (eos) token, which SFT appends")?,
        );
        Ok(SftDataset {
            conversations,
            tokenizer,
            format,
            seq_length,
            pad,
            eod,
        })
    }

    pub fn len(&self) -> usize {
        self.conversations.len()
    }

    pub fn is_empty(&self) -> bool {
        self.conversations.is_empty()
    }

    /// The tokens of conversation `index` and their targets (`None` where a system or user
    /// turn puts no loss).
    pub fn tokenize(&self, index: usize) -> Result<(Vec<i64>, Vec<Option<i64>>)> {
        let mut tokens = Vec::new();
        let mut targets = Vec::new();
        for message in &self.conversations[index] {
            let ids = self
                .tokenizer
                .tokenize(&self.format.render(message))
                .with_context(|| format!("conversation {index}"))?;
            let learned = message.role == Role::Assistant;
            for id in ids {
                tokens.push(i64::from(id));
                targets.push(learned.then_some(i64::from(id)));
            }
        }
        Ok((tokens, targets))
    }

    /// The training sample of conversation `index`.
    pub fn sample(&self, index: usize) -> Result<GptSample> {
        let (mut tokens, mut targets) = self.tokenize(index)?;
        let s = self.seq_length;
        // One place stays for the end-of-document token.
        tokens.truncate(s - 1);
        targets.truncate(s - 1);
        tokens.push(self.eod);
        targets.push(Some(self.eod));
        tokens.resize(s + 1, self.pad);
        targets.resize(s + 1, Some(self.pad));
        let labels = &targets[1..];
        Ok(GptSample {
            tokens: tokens[..s].to_vec(),
            labels: labels.iter().map(|t| t.unwrap_or(0)).collect(),
            loss_mask: labels
                .iter()
                .map(|t| match t {
                    Some(id) if *id != self.pad => 1.0,
                    _ => 0.0,
                })
                .collect(),
            position_ids: (0..s as i64).collect(),
            attention_mask: None,
            document_lengths: None,
        })
    }
}

/// One split's share of the conversations (`--split`), read `samples` times round-robin in
/// file order, as Megatron's `SFTDataset` reads its split's indices.
pub struct SftSplit {
    pub dataset: Arc<SftDataset>,
    pub conversations: Range<usize>,
    pub samples: usize,
}

impl SftSplit {
    pub fn get(&self, index: usize) -> Result<GptSample> {
        let count = self.conversations.len();
        self.dataset
            .sample(self.conversations.start + index % count)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tokenizer::TokenizerError;

    /// One id per character; `<SPECIAL_…>` tags are one id each, like added special tokens.
    struct Characters;

    impl Tokenizer for Characters {
        fn tokenize_into(&self, text: &str, out: &mut Vec<u32>) -> Result<(), TokenizerError> {
            let mut rest = text;
            while let Some(c) = rest.chars().next() {
                if let Some(tag) = rest.strip_prefix("<SPECIAL_") {
                    let end = tag.find('>').unwrap();
                    out.push(1000 + tag[..end].parse::<u32>().unwrap());
                    rest = &tag[end + 1..];
                } else {
                    out.push(c as u32);
                    rest = &rest[c.len_utf8()..];
                }
            }
            Ok(())
        }
        fn vocab_size(&self) -> usize {
            2000
        }
        fn eod(&self) -> Option<u32> {
            Some(3)
        }
        fn detokenize(&self, _: &[u32]) -> Result<String, TokenizerError> {
            unreachable!()
        }
    }

    fn conversation() -> Vec<Message> {
        vec![
            Message {
                role: Role::User,
                content: " q ".into(),
            },
            Message {
                role: Role::Assistant,
                content: "ab".into(),
            },
        ]
    }

    fn dataset(seq_length: usize) -> SftDataset {
        SftDataset::new(
            vec![conversation()],
            Arc::new(Characters),
            PromptFormat::NemotronHAligned,
            seq_length,
        )
        .unwrap()
    }

    #[test]
    fn only_the_assistant_turn_and_the_end_carry_loss() {
        let text = "<SPECIAL_11>User\nq\n<SPECIAL_11>Assistant\n";
        let prompt = Characters.tokenize(text).unwrap();
        let answer = [i64::from(b'a'), i64::from(b'b'), i64::from(b'\n')];
        let s = prompt.len() + answer.len() + 3;
        let sample = dataset(s).sample(0).unwrap();
        let pad = 1233;
        let mut expected_tokens: Vec<i64> = prompt.iter().map(|&t| i64::from(t)).collect();
        expected_tokens.extend(answer);
        expected_tokens.extend([3, pad, pad]);
        assert_eq!(sample.tokens, expected_tokens);
        // Labels are the next tokens; the prompt's (but its last, whose next token is the
        // answer's first) and the padding's carry no loss.
        let learned: Vec<usize> = (0..s).filter(|&i| sample.loss_mask[i] == 1.0).collect();
        let first = prompt.len() - 1;
        assert_eq!(learned, (first..first + 4).collect::<Vec<_>>());
        assert_eq!(
            sample.labels[first..first + 4],
            [answer[0], answer[1], answer[2], 3]
        );
        assert_eq!(sample.labels[..first], vec![0; first]);
        assert_eq!(sample.position_ids, (0..s as i64).collect::<Vec<_>>());
    }

    #[test]
    fn long_conversations_are_truncated_and_still_end() {
        let sample = dataset(6).sample(0).unwrap();
        assert_eq!(sample.tokens.len(), 6);
        assert_eq!(
            sample.tokens[5], 3,
            "the end-of-document token closes the sequence"
        );
        // The kept tokens are all prompt: only the end-of-document label carries loss.
        assert_eq!(sample.loss_mask, [0.0, 0.0, 0.0, 0.0, 1.0, 0.0]);
    }
}
