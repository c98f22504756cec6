//! Sizes a config or args state, checked against the tensors actually present before anything
//! is allocated or written from them: a corrupt or crafted input fails here, naming the field,
//! instead of padding, allocating or writing whatever it claims.

use anyhow::{ensure, Context, Result};
use megatron_checkpoint::Value;

use super::megatron_args::true_vocab_size;

/// The number of layers the tensor `names` hold under any of `prefixes` (`decoder.layers.`,
/// `model.layers.`): one more than the highest layer index found, 0 when none is.
pub fn layers_found<'a>(names: impl IntoIterator<Item = &'a str>, prefixes: &[&str]) -> usize {
    names
        .into_iter()
        .filter_map(|name| {
            let rest = prefixes.iter().find_map(|p| name.strip_prefix(p))?;
            rest.split('.').next()?.parse::<usize>().ok()
        })
        .map(|index| index + 1)
        .max()
        .unwrap_or(0)
}

/// `declared` layers (the config's `field`) must be the layers the tensors hold.
pub fn check_layers(origin: &str, field: &str, declared: usize, found: usize) -> Result<()> {
    ensure!(
        declared == found,
        "{origin}: {field} {declared} disagrees with the tensors, which hold {found} layers"
    );
    Ok(())
}

/// The vocabulary of a Megatron checkpoint import and the multiple its rows are padded to,
/// from its args, the flags and `rows`, the rows of its word embeddings (`embedding`).
/// Megatron's converter pads to a larger size only from a true vocabulary size and the
/// padding multiple, so the args' `padded_vocab_size` must describe the rows present, and
/// padding beyond them needs `--make-vocab-size-divisible-by`.
pub fn megatron_vocabulary(
    origin: &str,
    args: &Value,
    embedding: &str,
    rows: i64,
    given_true_vocab_size: Option<i64>,
    given_multiple: Option<i64>,
) -> Result<(i64, i64)> {
    if let Some(padded) = args.get("padded_vocab_size").and_then(Value::as_i64) {
        ensure!(
            padded == rows,
            "{origin}: args padded_vocab_size {padded} disagrees with the {rows} rows of {embedding}"
        );
    }
    let vocab = true_vocab_size(args, rows, given_true_vocab_size);
    ensure!(
        0 < vocab && vocab <= rows,
        "{origin}: a vocabulary of {vocab} tokens does not fit the {rows} rows of {embedding} \
         (--true-vocab-size, --vocab-file or the args' tokenizer)"
    );
    let (multiple, source) = match given_multiple {
        Some(multiple) => (multiple, "--make-vocab-size-divisible-by"),
        None => (
            args.get("make_vocab_size_divisible_by")
                .and_then(Value::as_i64)
                .unwrap_or(128),
            "args make_vocab_size_divisible_by",
        ),
    };
    let padded = (multiple > 0)
        .then(|| vocab.checked_add(multiple - 1))
        .flatten()
        .map(|end| end / multiple * multiple)
        .with_context(|| {
            format!("{origin}: {source} {multiple} is not a usable padding multiple")
        })?;
    ensure!(
        padded <= rows || given_multiple.is_some(),
        "{origin}: {source} {multiple} pads the vocabulary of {vocab} tokens to {padded} rows, \
         more than the {rows} rows of {embedding}; pass --make-vocab-size-divisible-by to pad \
         beyond the rows present"
    );
    Ok((vocab, multiple))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layers_are_counted_by_their_highest_index() {
        let names = [
            "model.layers.0.mlp.down_proj.weight",
            "model.layers.11.input_layernorm.weight",
            "model.layers.x.odd",
            "model.embed_tokens.weight",
        ];
        assert_eq!(layers_found(names, &["model.layers."]), 12);
        assert_eq!(layers_found(names, &["transformer.h."]), 0);
    }
}
