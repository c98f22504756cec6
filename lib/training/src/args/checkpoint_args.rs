//! `--use-checkpoint-args`: the architecture flags recorded in the checkpoint under `--load`
//! replace the command line's, as Megatron's `load_args_from_checkpoint` (core_v0.14.0) does.

use std::path::Path;

use anyhow::{Context, Result};
use serde::de::DeserializeOwned;
use serde::Serialize;
use serde_json::Value;

use super::ModelArgs;
use megatron_data::cache::python_str_of_json;

/// Replaces `model`'s architecture flags by those the checkpoint under `load` recorded; returns
/// Megatron's line for each flag changed. Nothing changes when `load` holds no checkpoint
/// (training then starts from scratch, as Megatron does).
pub fn apply_checkpoint_args(model: &mut ModelArgs, load: &Path) -> Result<Vec<String>> {
    let Some(found) = megatron_store::find_checkpoint(load)? else {
        return Ok(Vec::new());
    };
    let saved = &found.metadata.args["model"];
    let mut changed = Vec::new();
    let mut set = |name: &str, only_where_unset: bool, field: &mut dyn FieldSlot| {
        field
            .take(saved.get(name), only_where_unset)
            .map(|taken| {
                if let Some(value) = taken {
                    changed.push(format!("Setting {name} to {value} from checkpoint"));
                }
            })
            .with_context(|| {
                format!(
                    "--use-checkpoint-args: {} records an unreadable {name}",
                    found.directory.display()
                )
            })
    };
    // Megatron's `force=True` flags: the checkpoint's value whatever the command line says.
    set("num_query_groups", false, &mut model.num_query_groups)?;
    set(
        "group_query_attention",
        false,
        &mut model.group_query_attention,
    )?;
    set(
        "position_embedding_type",
        false,
        &mut model.position_embedding_type,
    )?;
    set(
        "use_rotary_position_embeddings",
        false,
        &mut model.use_rotary_position_embeddings,
    )?;
    set("rotary_base", false, &mut model.rotary_base)?;
    set("rotary_percent", false, &mut model.rotary_percent)?;
    // Beyond Megatron's list (core_v0.14.0 leaves RoPE scaling to the command line): the
    // scaling is part of the architecture the weights were trained for.
    let rope = &mut model.rope;
    set("use_rope_scaling", false, &mut rope.use_rope_scaling)?;
    set("rope_scaling_factor", false, &mut rope.rope_scaling_factor)?;
    set(
        "rotary_seq_len_interpolation_factor",
        false,
        &mut rope.rotary_seq_len_interpolation_factor,
    )?;
    set("rope_type", false, &mut rope.rope_type)?;
    set(
        "rotary_scaling_factor",
        false,
        &mut rope.rotary_scaling_factor,
    )?;
    set("mscale", false, &mut rope.mscale)?;
    set("mscale_all_dim", false, &mut rope.mscale_all_dim)?;
    set(
        "yarn_original_max_position_embeddings",
        false,
        &mut rope.yarn_original_max_position_embeddings,
    )?;
    set("yarn_beta_fast", false, &mut rope.yarn_beta_fast)?;
    set("yarn_beta_slow", false, &mut rope.yarn_beta_slow)?;
    set(
        "no_yarn_correction_range_round_to_int",
        false,
        &mut rope.no_yarn_correction_range_round_to_int,
    )?;
    set("disable_bias_linear", false, &mut model.disable_bias_linear)?;
    set("add_qkv_bias", false, &mut model.add_qkv_bias)?;
    set("squared_relu", false, &mut model.squared_relu)?;
    set("swiglu", false, &mut model.swiglu)?;
    set(
        "untie_embeddings_and_output_weights",
        false,
        &mut model.untie_embeddings_and_output_weights,
    )?;
    set("apply_layernorm_1p", false, &mut model.apply_layernorm_1p)?;
    set("normalization", false, &mut model.normalization)?;
    set(
        "apply_query_key_layer_scaling",
        false,
        &mut model.apply_query_key_layer_scaling,
    )?;
    set("attention_dropout", false, &mut model.attention_dropout)?;
    set("hidden_dropout", false, &mut model.hidden_dropout)?;
    // The others: only where the command line left the flag unset.
    set("ffn_hidden_size", true, &mut model.ffn_hidden_size)?;
    set("kv_channels", true, &mut model.kv_channels)?;
    set(
        "max_position_embeddings",
        true,
        &mut model.max_position_embeddings,
    )?;
    Ok(changed)
}

/// A flag's value that a checkpoint's recorded one may replace.
trait FieldSlot {
    /// Takes `saved` (unless absent or null, or `only_where_unset` and the flag is set) and
    /// returns it, as Python prints it, when it changed the value.
    fn take(&mut self, saved: Option<&Value>, only_where_unset: bool) -> Result<Option<String>>;
}

impl<T: Serialize + DeserializeOwned + PartialEq> FieldSlot for T {
    fn take(&mut self, saved: Option<&Value>, only_where_unset: bool) -> Result<Option<String>> {
        let Some(saved) = saved.filter(|value| !value.is_null()) else {
            return Ok(None);
        };
        if only_where_unset && !serde_json::to_value(&*self)?.is_null() {
            return Ok(None);
        }
        let value: T = serde_json::from_value(saved.clone())?;
        if value == *self {
            return Ok(None);
        }
        *self = value;
        // Megatron prints Python's `str()` of the value.
        Ok(Some(python_str_of_json(saved)))
    }
}
