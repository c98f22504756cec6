//! `pretrain_gpt --sft` (Megatron's supervised fine-tuning data): a tiny GPT trained on a
//! JSONL file of conversations, through a HuggingFace tokenizer that knows the prompt format's
//! special tokens (`SFTTokenizer`), learns: its `lm loss`, which counts only the assistant's
//! turns, falls well below its start.

mod support;

use std::path::Path;

use megatron_training::GptPretrainArgs;

const COLORS: [(&str, &str); 6] = [
    ("sky", "blue"),
    ("grass", "green"),
    ("snow", "white"),
    ("coal", "black"),
    ("blood", "red"),
    ("sun", "yellow"),
];

/// A word-level tokenizer: the prompt format's special tokens, `</s>` (the end of document)
/// and the corpus's words.
fn write_tokenizer(dir: &Path) {
    let specials = [
        "</s>",
        "<SPECIAL_10>",
        "<SPECIAL_11>",
        "<SPECIAL_233>",
        "<unk>",
    ];
    let mut words: Vec<&str> = vec!["System", "User", "Assistant", "answer", "with", "a"];
    words.extend(["what", "color", "is", "the", "?", "it", "."]);
    for (thing, color) in COLORS {
        words.extend([thing, color]);
    }
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
        "decoder": null,
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "<unk>"},
    });
    std::fs::write(dir.join("tokenizer.json"), tokenizer.to_string()).unwrap();
}

fn write_conversations(path: &Path) {
    let mut lines = Vec::new();
    for round in 0..4 {
        for (i, (thing, color)) in COLORS.iter().enumerate() {
            let mut messages = Vec::new();
            if (round + i) % 2 == 0 {
                messages
                    .push(serde_json::json!({"role": "system", "content": "answer with a color"}));
            }
            messages.push(serde_json::json!({"role": "user", "content": format!("what color is the {thing} ?")}));
            messages.push(
                serde_json::json!({"role": "assistant", "content": format!("it is {color} .")}),
            );
            lines.push(serde_json::json!({ "messages": messages }).to_string());
        }
    }
    std::fs::write(path, lines.join("\n") + "\n").unwrap();
}

#[test]
fn sft_on_conversations_learns_the_assistant_turns() {
    let dir = tempfile::tempdir().unwrap();
    write_tokenizer(dir.path());
    let data = dir.path().join("chat.jsonl");
    write_conversations(&data);
    let (tokenizer, data) = (dir.path().display().to_string(), data.display().to_string());
    let flags: Vec<&str> = [
        &[
            "--num-layers",
            "2",
            "--hidden-size",
            "32",
            "--num-attention-heads",
            "4",
            "--seq-length",
            "24",
            "--max-position-embeddings",
            "24",
            "--micro-batch-size",
            "4",
            "--global-batch-size",
            "8",
            "--train-iters",
            "60",
            "--save-interval",
            "60",
            "--sft",
            "--tokenizer-type",
            "SFTTokenizer",
            "--tokenizer-model",
            &tokenizer,
            "--data-path",
            &data,
            "--split",
            "100,0,0",
        ],
        support::TINY_OPTIMIZATION,
        &["--lr", "1e-2"],
    ]
    .concat();
    let run = tempfile::tempdir().unwrap();
    let outcome = support::train_in::<GptPretrainArgs>(run.path(), &flags, 1, 1, 1, &[]).unwrap();
    let losses = outcome.lm_losses();
    assert_eq!(losses.len(), 60, "{losses:?}");
    let (first, last) = (losses[0], losses[59]);
    assert!(
        last < 0.5 * first,
        "the assistant turns' loss went from {first} to {last}: {losses:?}"
    );
}

/// A conversation without the fields the prompt format needs stops the run, naming the file
/// and the line.
#[test]
fn a_chat_line_without_content_is_an_error_naming_the_line() {
    let dir = tempfile::tempdir().unwrap();
    write_tokenizer(dir.path());
    let data = dir.path().join("chat.jsonl");
    write_conversations(&data);
    let mut text = std::fs::read_to_string(&data).unwrap();
    text.push_str(r#"{"messages": [{"role": "user"}, {"role": "assistant", "content": "x"}]}"#);
    std::fs::write(&data, text + "\n").unwrap();
    let (tokenizer, data) = (dir.path().display().to_string(), data.display().to_string());
    let flags: Vec<&str> = [
        &[
            "--num-layers",
            "1",
            "--hidden-size",
            "32",
            "--num-attention-heads",
            "4",
            "--seq-length",
            "24",
            "--max-position-embeddings",
            "24",
            "--micro-batch-size",
            "1",
            "--global-batch-size",
            "1",
            "--train-iters",
            "4",
            "--sft",
            "--tokenizer-type",
            "SFTTokenizer",
            "--tokenizer-model",
            &tokenizer,
            "--data-path",
            &data,
            "--split",
            "100,0,0",
        ],
        support::TINY_OPTIMIZATION,
    ]
    .concat();
    let run = tempfile::tempdir().unwrap();
    let error = support::train_in::<GptPretrainArgs>(run.path(), &flags, 1, 1, 1, &[])
        .err()
        .expect("the bad line stops the run");
    let message = format!("{error:#}");
    assert!(
        message.contains("chat.jsonl, line 25") && message.contains("\"content\""),
        "{message}"
    );
}
