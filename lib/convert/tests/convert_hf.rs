//! HuggingFace round trips against `transformers` itself (scripts/hf_reference.py): tiny
//! random models made by `save_pretrained` are imported (our logits equal HF's within 1e-4 in
//! float32), taken through our checkpoint format in another layout, and exported again
//! (`from_pretrained` reports no missing or unexpected keys, and its logits equal ours).

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::sync::{Mutex, PoisonError};

use megatron_convert::{
    load_hf, load_megatron_rs, save_hf, save_megatron_rs, verify, ModelState, TargetLayout,
    TokenizerExport,
};
use megatron_store::find_checkpoint;
use tch::Tensor;

fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// `scripts/hf_reference.py serve`: one python process answers every test of this file, as
/// importing torch and transformers takes seconds and a request about these tiny models
/// milliseconds.
struct Reference {
    _child: Child,
    requests: ChildStdin,
    replies: BufReader<ChildStdout>,
}

impl Reference {
    fn start() -> Reference {
        let python = std::env::var_os("MEGATRON_RS_TEST_PYTHON")
            .map(PathBuf::from)
            .unwrap_or_else(|| workspace_root().join(".venv/bin/python"));
        let mut child = Command::new(python)
            .arg(workspace_root().join("scripts/hf_reference.py"))
            .arg("serve")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("running scripts/hf_reference.py (MEGATRON_RS_TEST_PYTHON with transformers)");
        Reference {
            requests: child.stdin.take().unwrap(),
            replies: BufReader::new(child.stdout.take().unwrap()),
            _child: child,
        }
    }

    fn ask(&mut self, args: &[&str]) -> std::io::Result<serde_json::Value> {
        writeln!(self.requests, "{}", serde_json::json!(args))?;
        let mut line = String::new();
        if self.replies.read_line(&mut line)? == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        Ok(serde_json::from_str(&line)?)
    }
}

static REFERENCE: Mutex<Option<Reference>> = Mutex::new(None);

/// What `hf_reference.py args` prints, asked of the shared reference process (started again
/// if an earlier request took it down).
fn python(args: &[&str]) -> String {
    let reply = {
        let mut reference = REFERENCE.lock().unwrap_or_else(PoisonError::into_inner);
        let reply = reference.get_or_insert_with(Reference::start).ask(args);
        if reply.is_err() {
            *reference = None;
        }
        reply.unwrap_or_else(|e| panic!("hf_reference.py serve, asked {args:?}: {e}"))
    };
    match (reply["out"].as_str(), reply["error"].as_str()) {
        (Some(out), _) => out.to_string(),
        (_, Some(error)) => panic!("hf_reference.py {args:?}:\n{error}"),
        _ => panic!("hf_reference.py {args:?}: the reply {reply} has no out or error"),
    }
}

/// Two rows of 40 tokens: past the 16 positions the scaled-RoPE models were "trained" on.
fn id_rows() -> Vec<Vec<i64>> {
    (0..2)
        .map(|row| (0..40).map(|i| (i * 37 + row * 11 + 1) % 1000).collect())
        .collect()
}

fn ids_text() -> String {
    id_rows()
        .iter()
        .map(|row| row.iter().map(i64::to_string).collect::<Vec<_>>().join(","))
        .collect::<Vec<_>>()
        .join(";")
}

fn ids() -> Tensor {
    let rows = id_rows();
    Tensor::from_slice(&rows.concat()).view([rows.len() as i64, -1])
}

/// HF's logits for [`IDS`] from `dir`, after checking that every key loaded.
fn hf_logits(dir: &Path) -> (Tensor, Option<String>) {
    let reply: serde_json::Value =
        serde_json::from_str(&python(&["logits", dir.to_str().unwrap(), &ids_text()])).unwrap();
    assert_eq!(reply["missing"], serde_json::json!([]), "missing keys");
    assert_eq!(
        reply["unexpected"],
        serde_json::json!([]),
        "unexpected keys"
    );
    let values: Vec<f32> = reply["logits"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|b| b.as_array().unwrap().iter())
        .flat_map(|s| {
            s.as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_f64().unwrap() as f32)
        })
        .collect();
    let tokens = ids();
    let (b, s) = tokens.size2().unwrap();
    (
        Tensor::from_slice(&values).view([b, s, -1]),
        reply["tokenizer"].as_str().map(str::to_string),
    )
}

fn max_difference(a: &Tensor, b: &Tensor) -> f64 {
    (a - b).abs().max().double_value(&[])
}

fn round_trip(kind: &str, as_bin: bool) {
    round_trip_checking(kind, as_bin, false);
}

/// [`round_trip`], and with `identical_tensors` the export's tensors are the source's, bit
/// for bit, under the same names.
fn round_trip_checking(kind: &str, as_bin: bool, identical_tensors: bool) {
    let dir = tempfile::tempdir().unwrap();
    let source = dir.path().join("hf");
    let mut make = vec!["make", kind, source.to_str().unwrap()];
    if as_bin {
        make.push("--bin");
    }
    python(&make);
    let (reference, _) = hf_logits(&source);
    // Import: our model on the imported weights gives HF's logits.
    let state = load_hf(&source, 128, None).unwrap();
    assert_eq!(state.config.vocab_size, 1000);
    assert_eq!(
        state.config.padded_vocab_size(1),
        1024,
        "padded as Megatron pads"
    );
    let ours = verify::logits(&verify::model_of(&state).unwrap(), &ids()).unwrap();
    let difference = max_difference(&ours, &reference);
    assert!(
        difference < 1e-4,
        "{kind}: import max |Δ logits| = {difference:e}"
    );
    if let Some(scaling) = state.config.rope_scaling {
        // The scaling shows in the logits: without it they are far from HF's.
        let mut unscaled = state.config.clone();
        unscaled.rope_scaling = None;
        let plain = ModelState {
            config: unscaled,
            weights: state.weights.clone(),
            expert_biases: state.expert_biases.clone(),
            params_dtype: state.params_dtype.clone(),
            optimizer: None,
            run: Default::default(),
            source_parallel: (1, 1),
            source: "unscaled".into(),
        };
        let without = verify::logits(&verify::model_of(&plain).unwrap(), &ids()).unwrap();
        let difference = max_difference(&without, &reference);
        assert!(
            difference > 1e-2,
            "{kind}: {scaling:?} changes the logits by only {difference:e}"
        );
    }
    // Through our format at TP=2 (vocabulary re-padded for two ranks) and back; MoE layers
    // run without tensor parallelism for now, so at TP=1.
    let ours_dir = dir.path().join("ours");
    save_megatron_rs(
        &state,
        &ours_dir,
        TargetLayout {
            tensor: if state.config.moe.is_some() { 1 } else { 2 },
            pipeline: 1,
            virtual_stages: 1,
        },
    )
    .unwrap();
    let checkpoint = find_checkpoint(&ours_dir).unwrap().unwrap();
    assert_eq!(
        checkpoint.metadata.model["vocab_size"], 1000,
        "the architecture is in our metadata"
    );
    let reloaded = load_megatron_rs(&checkpoint, false).unwrap();
    // Export: transformers loads it with no missing or unexpected keys and the same logits.
    let export = dir.path().join("export");
    let vocab = dir.path().join("vocab.json");
    let merges = dir.path().join("merges.txt");
    // A byte-level BPE vocabulary of 1000 entries with one merge (t + 0 → t0).
    let vocab_entries: serde_json::Map<String, serde_json::Value> = ["t", "0", "t0"]
        .into_iter()
        .map(str::to_string)
        .chain((3..1000).map(|i| format!("x{i}")))
        .enumerate()
        .map(|(i, token)| (token, serde_json::json!(i)))
        .collect();
    std::fs::write(&vocab, serde_json::to_string(&vocab_entries).unwrap()).unwrap();
    std::fs::write(&merges, "#version: 0.2\nt 0\n").unwrap();
    let tokenizer = TokenizerExport {
        files: vec![(vocab, "vocab.json"), (merges, "merges.txt")],
        tokenizer_config: Some(serde_json::json!({
            "tokenizer_class": "GPT2Tokenizer",
            "bos_token": "<|endoftext|>",
            "eos_token": "<|endoftext|>",
            "unk_token": "<|endoftext|>",
        })),
        ..Default::default()
    };
    save_hf(&reloaded, &export, &tokenizer).unwrap();
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(export.join("config.json")).unwrap())
            .unwrap();
    assert_eq!(config["vocab_size"], 1000, "padding rows dropped");
    // The RoPE parameters come back as transformers wrote them (rope_theta and scaling).
    let source_config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(source.join("config.json")).unwrap())
            .unwrap();
    if let Some(source_rope) = source_config["rope_parameters"].as_object() {
        let rope = &config["rope_parameters"];
        for (key, value) in source_rope {
            let same = match (value.as_f64(), rope[key].as_f64()) {
                (Some(a), Some(b)) => a == b,
                _ => *value == rope[key],
            };
            assert!(
                same,
                "{kind}: rope_parameters.{key} {value} exported as {}",
                rope[key]
            );
        }
        assert_eq!(rope.as_object().unwrap().len(), source_rope.len(), "{rope}");
    }
    let (exported, tokenizer) = hf_logits(&export);
    // transformers 5 loads a Mixtral's tokenizer through sentencepiece, which this test's
    // GPT-2 vocabulary is not; the tokenizer files are the same as the others'.
    assert!(
        tokenizer.is_some() || kind == "mixtral",
        "AutoTokenizer loads the export"
    );
    let ours = verify::logits(&verify::model_of(&reloaded).unwrap(), &ids()).unwrap();
    let difference = max_difference(&ours, &exported);
    assert!(
        difference < 1e-4,
        "{kind}: export max |Δ logits| = {difference:e}"
    );
    assert!(max_difference(&exported, &reference) < 1e-4);
    if identical_tensors {
        // HF → ours → HF in float32 moves tensors without arithmetic: the same bits come back.
        let reply: serde_json::Value = serde_json::from_str(&python(&[
            "differences",
            source.to_str().unwrap(),
            export.to_str().unwrap(),
        ]))
        .unwrap();
        assert_eq!(reply["differences"], serde_json::json!([]), "{kind}");
        assert!(reply["tensors"].as_i64().unwrap() > 0, "{reply}");
    }
}

#[test]
fn gpt2_safetensors_round_trip() {
    round_trip("gpt2", false);
}

#[test]
fn gpt2_pytorch_model_bin_round_trip() {
    round_trip("gpt2", true);
}

#[test]
fn llama_gqa_untied_rope_theta_round_trip() {
    round_trip("llama", false);
}

#[test]
fn llama3_rope_scaling_round_trip() {
    round_trip("llama3", false);
}

#[test]
fn linear_rope_scaling_round_trip() {
    round_trip("linear", false);
}

#[test]
fn yarn_rope_scaling_round_trip() {
    round_trip("yarn", false);
}

#[test]
fn yarn_mscale_betas_untruncated_round_trip() {
    round_trip("yarn_mscale", false);
}

/// A Llama `config.json` of the tiny shape with `rope` as its `rope_parameters`.
fn load_error_with_rope(rope: serde_json::Value) -> String {
    let dir = tempfile::tempdir().unwrap();
    let config = serde_json::json!({
        "architectures": ["LlamaForCausalLM"], "vocab_size": 1000, "hidden_size": 64,
        "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
        "max_position_embeddings": 64, "rope_parameters": rope,
    });
    std::fs::write(dir.path().join("config.json"), config.to_string()).unwrap();
    format!("{:#}", load_hf(dir.path(), 128, None).unwrap_err())
}

#[test]
fn rope_scalings_we_cannot_represent_are_refused_by_field() {
    let error = load_error_with_rope(serde_json::json!({"rope_type": "dynamic", "factor": 2.0}));
    assert!(
        error.contains("rope_parameters.rope_type dynamic"),
        "{error}"
    );
    let error = load_error_with_rope(serde_json::json!(
        {"rope_type": "linear", "factor": 2.0, "low_freq_factor": 1.0}
    ));
    assert!(error.contains("rope_parameters.low_freq_factor"), "{error}");
    let error = load_error_with_rope(serde_json::json!(
        {"rope_type": "yarn", "factor": 4.0, "attention_factor": 2.0}
    ));
    assert!(
        error.contains("rope_parameters.attention_factor 2"),
        "{error}"
    );
    let error = load_error_with_rope(serde_json::json!(
        {"rope_type": "yarn", "factor": 4.0, "partial_rotary_factor": 0.5}
    ));
    assert!(
        error.contains("rope_parameters.partial_rotary_factor"),
        "{error}"
    );
    let error = load_error_with_rope(serde_json::json!({"rope_type": "linear"}));
    assert!(error.contains("no number factor"), "{error}");
}

#[test]
fn qwen2_qkv_bias_tied_round_trip() {
    round_trip("qwen2", false);
}

/// Mixtral's experts and router (`block_sparse_moe.*`) in and out: our MoE layer on the
/// imported weights gives transformers' logits, and so does transformers on the export.
#[test]
fn mixtral_experts_round_trip() {
    round_trip_checking("mixtral", false, true);
}

/// Qwen3's per-head query and key norms (`--qk-layernorm`) with a head width other than
/// hidden / heads, through our format at TP=2 (the norms replicated) and back.
#[test]
fn qwen3_qk_layernorm_round_trip() {
    round_trip_checking("qwen3", false, true);
}

/// Qwen2-MoE: the gated shared expert, experts of `moe_intermediate_size`, a dense layer
/// between sparse ones (`mlp_only_layers`), top-2 of the softmax over all experts without
/// renormalisation (`norm_topk_prob` false: `--moe-router-pre-softmax`), QKV biases.
#[test]
fn qwen2_moe_shared_expert_round_trip() {
    round_trip_checking("qwen2_moe", false, true);
}

/// Qwen3-MoE: per-head query and key norms, top-2 renormalised (`norm_topk_prob`).
#[test]
fn qwen3_moe_qk_layernorm_round_trip() {
    round_trip_checking("qwen3_moe", false, true);
}

#[test]
fn unknown_architectures_are_named() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("config.json"),
        r#"{"architectures": ["FalconForCausalLM"]}"#,
    )
    .unwrap();
    let error = format!("{:#}", load_hf(dir.path(), 128, None).unwrap_err());
    assert!(
        error.contains("FalconForCausalLM") && error.contains("config.json"),
        "{error}"
    );
}
