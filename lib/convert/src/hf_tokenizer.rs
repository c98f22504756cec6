//! The tokenizer a HuggingFace export carries: the files `AutoTokenizer` reads and the
//! `bos_token_id`/`eos_token_id` that `config.json` and `generation_config.json` record, so that
//! `generate` stops at the end of text. They come from the tokenizer the checkpoint was trained
//! with (its recorded `tokenizer_type`, `tokenizer_model`, `vocab_file`, `merge_file`), or from
//! the flags that point at the files when the recorded paths are gone.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use megatron_data::tokenizer::{build_tokenizer, TokenizerConfig, TokenizerType};
use serde_json::{json, Value as Json};

/// Tokenizer files given on the command line (`--vocab-file`, `--merge-file`,
/// `--tokenizer-model`); each overrides the path the checkpoint recorded.
#[derive(Debug, Clone, Default)]
pub struct TokenizerFiles {
    pub vocab_file: Option<PathBuf>,
    pub merge_file: Option<PathBuf>,
    pub tokenizer_model: Option<PathBuf>,
}

/// What an export writes of its tokenizer.
#[derive(Debug, Default)]
pub struct TokenizerExport {
    /// Source files and their names in the export.
    pub files: Vec<(PathBuf, &'static str)>,
    /// A `tokenizer_config.json` to write when none is copied.
    pub tokenizer_config: Option<Json>,
    pub bos_token_id: Option<u32>,
    pub eos_token_id: Option<u32>,
    /// Why files or ids are missing, for the user.
    pub warnings: Vec<String>,
}

/// The files a HuggingFace tokenizer directory may hold, the first required.
const HF_FILES: [&str; 3] = [
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
];

fn path_arg(args: &Json, key: &str) -> Option<PathBuf> {
    args.get(key).and_then(Json::as_str).map(PathBuf::from)
}

/// The tokenizer of a checkpoint whose run recorded `args` (Megatron's argument names).
pub fn tokenizer_export(args: &Json, given: &TokenizerFiles) -> Result<TokenizerExport> {
    let vocab_file = given
        .vocab_file
        .clone()
        .or_else(|| path_arg(args, "vocab_file"));
    let merge_file = given
        .merge_file
        .clone()
        .or_else(|| path_arg(args, "merge_file"));
    let tokenizer_model = given
        .tokenizer_model
        .clone()
        .or_else(|| path_arg(args, "tokenizer_model"));
    let recorded = args.get("tokenizer_type").and_then(Json::as_str);
    let kind = match recorded {
        Some(name) => name.parse::<TokenizerType>().ok(),
        None if vocab_file.is_some() && merge_file.is_some() => {
            Some(TokenizerType::Gpt2BpeTokenizer)
        }
        None if given.tokenizer_model.is_some() => Some(TokenizerType::HuggingFaceTokenizer),
        None => None,
    };
    let mut export = TokenizerExport::default();
    let Some(kind) = kind else {
        export.warnings.push(format!(
            "the checkpoint records {}; the export has no tokenizer files and no bos/eos ids \
             (give --tokenizer-model, or --vocab-file and --merge-file)",
            recorded.map_or("no tokenizer".to_string(), |name| format!(
                "tokenizer {name}, which has no HuggingFace form"
            ))
        ));
        return Ok(export);
    };
    // The files that must exist for the tokenizer to load, by their names in the export.
    let mut needed: Vec<(PathBuf, &'static str)> = Vec::new();
    let mut optional: Vec<(PathBuf, &'static str)> = Vec::new();
    match kind {
        TokenizerType::Gpt2BpeTokenizer => {
            needed.extend(vocab_file.clone().map(|p| (p, "vocab.json")));
            needed.extend(merge_file.clone().map(|p| (p, "merges.txt")));
            export.tokenizer_config = Some(json!({
                "tokenizer_class": "GPT2Tokenizer",
                "bos_token": "<|endoftext|>",
                "eos_token": "<|endoftext|>",
                "unk_token": "<|endoftext|>",
            }));
        }
        TokenizerType::HuggingFaceTokenizer => match &tokenizer_model {
            Some(model) if model.extension().is_some_and(|e| e == "json") => {
                needed.push((model.clone(), "tokenizer.json"));
            }
            Some(dir) => {
                needed.push((dir.join(HF_FILES[0]), HF_FILES[0]));
                for name in &HF_FILES[1..] {
                    optional.push((dir.join(name), name));
                }
            }
            None => {}
        },
        TokenizerType::SentencePieceTokenizer
        | TokenizerType::GptSentencePieceTokenizer
        | TokenizerType::Llama2Tokenizer => {
            needed.extend(tokenizer_model.clone().map(|p| (p, "tokenizer.model")));
            export.tokenizer_config = Some(json!({"tokenizer_class": "LlamaTokenizer"}));
        }
        TokenizerType::NullTokenizer => {}
        other => {
            export.warnings.push(format!(
                "the checkpoint's tokenizer {other} has no HuggingFace form; the export has no \
                 tokenizer files"
            ));
        }
    }
    if let Some((missing, _)) = needed.iter().find(|(path, _)| !path.is_file()) {
        export.warnings.push(format!(
            "tokenizer file {} not found: the export has no tokenizer files and no bos/eos ids \
             (point --tokenizer-model, or --vocab-file and --merge-file, at the files)",
            missing.display()
        ));
        export.tokenizer_config = None;
        return Ok(export);
    }
    let config = TokenizerConfig {
        kind,
        vocab_file,
        merge_file,
        tokenizer_model,
        vocab_size: args
            .get("vocab_size")
            .and_then(Json::as_u64)
            .and_then(|size| u32::try_from(size).ok()),
        tiktoken: Default::default(),
        include_special_tokens: false,
    };
    let tokenizer = build_tokenizer(&config)
        .with_context(|| format!("reading the checkpoint's {kind} tokenizer"))?;
    export.bos_token_id = tokenizer.bos();
    export.eos_token_id = tokenizer.eod();
    export.files = needed;
    export
        .files
        .extend(optional.into_iter().filter(|(path, _)| path.is_file()));
    if export
        .files
        .iter()
        .any(|(_, name)| *name == "tokenizer_config.json")
    {
        export.tokenizer_config = None;
    } else if kind == TokenizerType::HuggingFaceTokenizer {
        export.tokenizer_config = Some(json!({"tokenizer_class": "PreTrainedTokenizerFast"}));
    }
    Ok(export)
}

/// Copies `export`'s files into `directory` and writes its `tokenizer_config.json`, with the
/// model's context length.
pub fn write_tokenizer(export: &TokenizerExport, directory: &Path, max_length: i64) -> Result<()> {
    for (source, name) in &export.files {
        std::fs::copy(source, directory.join(name)).with_context(|| {
            format!("copying {} into {}", source.display(), directory.display())
        })?;
    }
    if let Some(config) = &export.tokenizer_config {
        let mut config = config.clone();
        config["model_max_length"] = json!(max_length);
        std::fs::write(
            directory.join("tokenizer_config.json"),
            serde_json::to_string_pretty(&config)?,
        )?;
    }
    Ok(())
}
