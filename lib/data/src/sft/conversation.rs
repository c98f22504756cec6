//! The conversations of a JSONL file: one per line, `{"messages": [{"role": ..., "content":
//! ...}, ...]}` (Megatron's `SFTLowLevelDataset`).

use std::path::Path;

use anyhow::{bail, Context, Result};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    System,
    User,
    Assistant,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Message {
    pub role: Role,
    pub content: String,
}

/// Every conversation of `path`, in file order; blank lines are skipped. A line that is not a
/// conversation the prompt format can render is an error naming the file, the line and what
/// is wrong.
pub fn read_conversations(path: &Path) -> Result<Vec<Vec<Message>>> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("cannot read the SFT data {}", path.display()))?;
    let mut conversations = Vec::new();
    for (index, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let conversation =
            parse_line(line).with_context(|| format!("{}, line {}", path.display(), index + 1))?;
        conversations.push(conversation);
    }
    if conversations.is_empty() {
        bail!("the SFT data {} holds no conversation", path.display());
    }
    Ok(conversations)
}

fn parse_line(line: &str) -> Result<Vec<Message>> {
    let value: serde_json::Value = serde_json::from_str(line).context("not JSON")?;
    let messages = value
        .get("messages")
        .context("no \"messages\" field (a list of {\"role\", \"content\"} objects)")?
        .as_array()
        .context("\"messages\" is not a list")?;
    if messages.is_empty() {
        bail!("\"messages\" is empty");
    }
    let mut conversation: Vec<Message> = Vec::with_capacity(messages.len());
    for (turn, message) in messages.iter().enumerate() {
        let role = match string_field(message, "role", turn)?.to_lowercase().as_str() {
            "system" => Role::System,
            "user" => Role::User,
            "assistant" => Role::Assistant,
            other => {
                bail!("message {turn} has role {other:?}; the roles are system, user and assistant")
            }
        };
        let content = string_field(message, "content", turn)?.to_string();
        if role == Role::Assistant {
            if content.is_empty() {
                bail!("message {turn} is an empty assistant turn");
            }
            if turn == 0 || conversation[turn - 1].role != Role::User {
                bail!("assistant message {turn} does not follow a user message");
            }
        }
        conversation.push(Message { role, content });
    }
    Ok(conversation)
}

/// The string `name` of message `turn`.
fn string_field<'a>(message: &'a serde_json::Value, name: &str, turn: usize) -> Result<&'a str> {
    message
        .get(name)
        .with_context(|| format!("message {turn} has no \"{name}\" field"))?
        .as_str()
        .with_context(|| format!("the \"{name}\" of message {turn} is not a string"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read(text: &str) -> Result<Vec<Vec<Message>>> {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("chat.jsonl");
        std::fs::write(&path, text).unwrap();
        read_conversations(&path)
    }

    #[test]
    fn reads_conversations_line_by_line() {
        let conversations = read(concat!(
            r#"{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}"#,
            "\n\n",
            r#"{"messages": [{"role": "System", "content": "be brief"}, {"role": "user", "content": "a"}]}"#,
            "\n",
        ))
        .unwrap();
        assert_eq!(conversations.len(), 2);
        assert_eq!(conversations[0][1].role, Role::Assistant);
        assert_eq!(conversations[0][1].content, "hello");
        assert_eq!(conversations[1][0].role, Role::System);
    }

    #[test]
    fn a_line_without_the_fields_names_the_file_line_and_field() {
        let error = read(concat!(
            r#"{"messages": [{"role": "user", "content": "hi"}]}"#,
            "\n",
            r#"{"messages": [{"role": "user", "text": "hi"}]}"#,
            "\n",
        ))
        .unwrap_err();
        let message = format!("{error:#}");
        assert!(message.contains("chat.jsonl, line 2"), "{message}");
        assert!(message.contains("\"content\""), "{message}");

        let message = format!("{:#}", read("{\"conversation\": []}\n").unwrap_err());
        assert!(
            message.contains("line 1") && message.contains("\"messages\""),
            "{message}"
        );

        let message = format!(
            "{:#}",
            read(r#"{"messages": [{"role": "assistant", "content": "x"}]}"#).unwrap_err()
        );
        assert!(
            message.contains("does not follow a user message"),
            "{message}"
        );
    }
}
