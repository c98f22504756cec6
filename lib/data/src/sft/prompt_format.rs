//! `--sft-tokenizer-prompt-format`: how a conversation's turns become text (Megatron's
//! `SFTTokenizer` prompt configurations, each a chat template of its own).

use anyhow::{bail, Result};

use super::conversation::{Message, Role};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PromptFormat {
    /// `nemotron-h-aligned` (Megatron's default): `<SPECIAL_10>System\n…\n`,
    /// `<SPECIAL_11>User\n…\n<SPECIAL_11>Assistant\n`, then the assistant's text and `\n`;
    /// contents stripped of surrounding whitespace; no BOS; `<SPECIAL_233>` pads.
    NemotronHAligned,
}

impl PromptFormat {
    pub const NAMES: [&'static str; 1] = ["nemotron-h-aligned"];

    pub fn parse(name: &str) -> Result<PromptFormat> {
        match name {
            "nemotron-h-aligned" => Ok(PromptFormat::NemotronHAligned),
            other => bail!(
                "unknown --sft-tokenizer-prompt-format {other:?} (choose from {})",
                Self::NAMES.join(", ")
            ),
        }
    }

    /// The text of one turn; a conversation's text is its turns' texts end to end.
    pub fn render(self, message: &Message) -> String {
        let content = message.content.trim();
        match (self, message.role) {
            (PromptFormat::NemotronHAligned, Role::System) => {
                format!("<SPECIAL_10>System\n{content}\n")
            }
            (PromptFormat::NemotronHAligned, Role::User) => {
                format!("<SPECIAL_11>User\n{content}\n<SPECIAL_11>Assistant\n")
            }
            (PromptFormat::NemotronHAligned, Role::Assistant) => format!("{content}\n"),
        }
    }

    /// The token that pads sequences (and whose labels carry no loss).
    pub fn pad_token(self) -> &'static str {
        match self {
            PromptFormat::NemotronHAligned => "<SPECIAL_233>",
        }
    }
}
