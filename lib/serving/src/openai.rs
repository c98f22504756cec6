//! `POST /v1/completions` in OpenAI's format (beyond Megatron): `prompt` (a string or a list),
//! `max_tokens`, `temperature`, `top_p`, `top_k`, `stop`, `echo`, `logprobs`, `seed`, `n`,
//! `best_of`, `presence_penalty`, `frequency_penalty`, `logit_bias`,
//! and `stream` for server-sent events, over the same generation loop as `/api`.

use serde_json::{json, Map, Value};

use super::api::{ApiError, MAX_PROMPTS};

/// The most alternatives `logprobs: N` may ask for (OpenAI allows 5; lm-eval asks for 1).
pub const MAX_TOP_LOGPROBS: usize = 20;

#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct CompletionRequest {
    pub model: String,
    /// The prompts as text (empty strings when they came as token ids).
    pub prompts: Vec<String>,
    /// The prompts as token ids, when `prompt` was a list of ids or of id lists (as
    /// lm-evaluation-harness sends them).
    #[serde(default)]
    pub prompt_token_ids: Option<Vec<Vec<u32>>>,
    pub max_tokens: usize,
    pub temperature: f64,
    pub top_p: f64,
    pub top_k: i64,
    /// Text that ends a completion where it first appears (not included).
    pub stop: Vec<String>,
    /// The prompt is repeated at the start of the completion text.
    pub echo: bool,
    /// Include the log-probability of every returned token.
    pub logprobs: bool,
    /// `logprobs: N`: also the N most likely tokens at every returned position.
    #[serde(default)]
    pub top_logprobs: usize,
    pub seed: Option<u64>,
    pub stream: bool,
    /// Choices per prompt.
    #[serde(default = "one")]
    pub n: usize,
    /// Samples drawn per prompt (at least `n`), of which the `n` of highest cumulative
    /// log-probability are answered; they share the prompt's prefill and KV-cache blocks.
    #[serde(default = "one")]
    pub best_of: usize,
    /// Taken from the logit of every token generated so far, once.
    #[serde(default)]
    pub presence_penalty: f64,
    /// Taken from the logit of every token generated so far, once per time it was.
    #[serde(default)]
    pub frequency_penalty: f64,
    /// `(token id, amount)` added to the logits, as `logit_bias` gives them.
    #[serde(default)]
    pub logit_bias: Vec<(u32, f64)>,
}

/// The most samples a prompt may ask for (`n`, `best_of`).
pub const MAX_SAMPLES: usize = 128;

fn one() -> usize {
    1
}

/// The largest `logit_bias` amount either way (OpenAI's).
pub const MAX_LOGIT_BIAS: f64 = 100.0;

/// `logit_bias`: an object of token ids (as strings) to amounts within ±[`MAX_LOGIT_BIAS`].
fn logit_bias(body: &Map<String, Value>) -> Result<Vec<(u32, f64)>, ApiError> {
    let object = match body.get("logit_bias") {
        None | Some(Value::Null) => return Ok(Vec::new()),
        Some(Value::Object(object)) => object,
        Some(_) => return invalid("logit_bias must be an object of token ids to numbers".into()),
    };
    let mut bias = object
        .iter()
        .map(|(key, amount)| {
            let id = key
                .parse::<u32>()
                .map_err(|_| ApiError(format!("logit_bias key {key:?} is not a token id")))?;
            match amount.as_f64() {
                Some(amount) if (-MAX_LOGIT_BIAS..=MAX_LOGIT_BIAS).contains(&amount) => {
                    Ok((id, amount))
                }
                _ => invalid(format!(
                    "logit_bias[{key:?}] must be a number between -{MAX_LOGIT_BIAS} and \
                     {MAX_LOGIT_BIAS}"
                )),
            }
        })
        .collect::<Result<Vec<_>, _>>()?;
    bias.sort_by_key(|&(id, _)| id);
    Ok(bias)
}

/// A penalty: a number between -2 and 2 (OpenAI's range), 0 by default.
fn penalty(body: &Map<String, Value>, key: &str) -> Result<f64, ApiError> {
    let value = number(body, key, 0.0)?;
    if !(-2.0..=2.0).contains(&value) {
        return invalid(format!("{key} must be between -2 and 2"));
    }
    Ok(value)
}

fn invalid<T>(message: String) -> Result<T, ApiError> {
    Err(ApiError(message))
}

fn number(body: &Map<String, Value>, key: &str, default: f64) -> Result<f64, ApiError> {
    match body.get(key) {
        None | Some(Value::Null) => Ok(default),
        Some(value) => value
            .as_f64()
            .ok_or_else(|| ApiError(format!("{key} must be a number"))),
    }
}

fn integer(body: &Map<String, Value>, key: &str) -> Result<Option<i64>, ApiError> {
    match body.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(value) => value
            .as_i64()
            .map(Some)
            .ok_or_else(|| ApiError(format!("{key} must be an integer"))),
    }
}

fn flag(body: &Map<String, Value>, key: &str) -> Result<bool, ApiError> {
    match body.get(key) {
        None | Some(Value::Null) => Ok(false),
        Some(Value::Bool(b)) => Ok(*b),
        Some(_) => invalid(format!("{key} must be a boolean")),
    }
}

fn strings(value: &Value, key: &str) -> Result<Vec<String>, ApiError> {
    match value {
        Value::String(s) => Ok(vec![s.clone()]),
        Value::Array(items) => items
            .iter()
            .map(|i| i.as_str().map(str::to_string))
            .collect::<Option<Vec<_>>>()
            .ok_or_else(|| ApiError(format!("{key} must be a string or a list of strings"))),
        _ => invalid(format!("{key} must be a string or a list of strings")),
    }
}

/// `prompt` as token ids: one list of ids, or a list of them; `None` for text prompts.
fn token_ids(prompt: &Value) -> Result<Option<Vec<Vec<u32>>>, ApiError> {
    let Value::Array(items) = prompt else {
        return Ok(None);
    };
    let id = |v: &Value| {
        v.as_u64()
            .and_then(|i| u32::try_from(i).ok())
            .ok_or_else(|| ApiError("prompt token ids must be non-negative integers".into()))
    };
    match items.first() {
        Some(Value::Number(_)) => Ok(Some(vec![items.iter().map(id).collect::<Result<_, _>>()?])),
        Some(Value::Array(_)) => items
            .iter()
            .map(|row| match row {
                Value::Array(ids) => ids.iter().map(id).collect::<Result<Vec<u32>, _>>(),
                _ => Err(ApiError("prompt must be a string, a list of strings, a list of token ids or a list of such lists".into())),
            })
            .collect::<Result<Vec<_>, _>>()
            .map(Some),
        _ => Ok(None),
    }
}

/// OpenAI's fields this server does not honour: a request naming one is refused rather than
/// answered as if it had not (`null` counts as absent, as do the values that ask for nothing:
/// no tools, `tool_choice: "none"`, a text `response_format`).
fn refuse_unhonoured(body: &Map<String, Value>) -> Result<(), ApiError> {
    for key in [
        "tools",
        "tool_choice",
        "functions",
        "function_call",
        "response_format",
        "suffix",
    ] {
        let asks_nothing = match body.get(key) {
            None | Some(Value::Null) => true,
            Some(Value::Array(items)) => items.is_empty() && key != "response_format",
            Some(Value::String(choice)) => {
                choice == "none" && matches!(key, "tool_choice" | "function_call")
            }
            Some(Value::Object(format)) => {
                key == "response_format"
                    && format.len() == 1
                    && format.get("type").and_then(Value::as_str) == Some("text")
            }
            Some(_) => false,
        };
        if !asks_nothing {
            let what = match key {
                "tools" | "tool_choice" | "functions" | "function_call" => {
                    "this server does not call tools or functions"
                }
                "response_format" => "only {\"type\": \"text\"} is served",
                _ => "this server does not insert text before a suffix",
            };
            return invalid(format!("{key} is not supported: {what}"));
        }
    }
    Ok(())
}

impl CompletionRequest {
    pub fn parse(body: &Value) -> Result<Self, ApiError> {
        let Some(body) = body.as_object() else {
            return invalid("the request body must be a JSON object".into());
        };
        refuse_unhonoured(body)?;
        let prompt = body
            .get("prompt")
            .ok_or_else(|| ApiError("prompt is required".into()))?;
        let prompt_token_ids = token_ids(prompt)?;
        let prompts = match &prompt_token_ids {
            Some(ids) => vec![String::new(); ids.len()],
            None => strings(prompt, "prompt")?,
        };
        if prompts.is_empty() || prompts.len() > MAX_PROMPTS {
            return invalid(format!(
                "prompt must hold between 1 and {MAX_PROMPTS} prompts"
            ));
        }
        let max_tokens = integer(body, "max_tokens")?.unwrap_or(16);
        if max_tokens < 0 {
            return invalid("max_tokens must not be negative".into());
        }
        let temperature = number(body, "temperature", 1.0)?;
        if !(0.0..=100.0).contains(&temperature) {
            return invalid("temperature must be between 0 and 100".into());
        }
        let top_p = number(body, "top_p", 1.0)?;
        if !(0.0..=1.0).contains(&top_p) {
            return invalid("top_p must be between 0 and 1".into());
        }
        let top_k = integer(body, "top_k")?.unwrap_or(0);
        if !(0..=1000).contains(&top_k) {
            return invalid("top_k must be between 0 and 1000".into());
        }
        if top_k > 0 && top_p < 1.0 {
            return invalid("cannot set both top_k and top_p".into());
        }
        let n = integer(body, "n")?.unwrap_or(1);
        if !(1..=MAX_SAMPLES as i64).contains(&n) {
            return invalid(format!("n must be between 1 and {MAX_SAMPLES}"));
        }
        let best_of = integer(body, "best_of")?.unwrap_or(n);
        if !(n..=MAX_SAMPLES as i64).contains(&best_of) {
            return invalid(format!("best_of must be between n ({n}) and {MAX_SAMPLES}"));
        }
        if max_tokens == 0 && best_of > 1 {
            return invalid("n and best_of need max_tokens > 0".into());
        }
        let stop = match body.get("stop") {
            None | Some(Value::Null) => Vec::new(),
            Some(value) => strings(value, "stop")?,
        };
        let logprobs = match body.get("logprobs") {
            None | Some(Value::Null) => None,
            Some(value) => Some(
                value
                    .as_i64()
                    .ok_or_else(|| ApiError("logprobs must be an integer".into()))?,
            ),
        };
        if logprobs.is_some_and(|n| !(0..=MAX_TOP_LOGPROBS as i64).contains(&n)) {
            return invalid(format!("logprobs must be between 0 and {MAX_TOP_LOGPROBS}"));
        }
        let seed = integer(body, "seed")?.map(|s| s as u64);
        let echo = flag(body, "echo")?;
        let stream = flag(body, "stream")?;
        if stream && best_of > n {
            return invalid("best_of > n cannot be streamed: the best are known at the end".into());
        }
        Ok(CompletionRequest {
            prompt_token_ids,
            model: body
                .get("model")
                .and_then(Value::as_str)
                .unwrap_or("megatron-rs")
                .to_string(),
            prompts,
            max_tokens: max_tokens as usize,
            temperature,
            top_p,
            top_k,
            stop,
            echo,
            logprobs: logprobs.is_some(),
            top_logprobs: logprobs.unwrap_or(0) as usize,
            seed,
            stream,
            n: n as usize,
            best_of: best_of as usize,
            presence_penalty: penalty(body, "presence_penalty")?,
            frequency_penalty: penalty(body, "frequency_penalty")?,
            logit_bias: logit_bias(body)?,
        })
    }
}

/// One choice of a completion as it is built: text so far, its tokens' log-probabilities when
/// asked, and why it ended.
#[derive(Debug, Clone, Default)]
pub struct Choice {
    pub text: String,
    pub logprobs: TokenLogprobs,
    pub finish_reason: Option<&'static str>,
}

/// Log-probabilities of a run of a choice's tokens (all of them in an answer, those a streamed
/// chunk carries), in the legacy completions' format.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct TokenLogprobs {
    pub tokens: Vec<String>,
    /// Where each token starts in the prompt and completion together, in characters (see
    /// [`text_offsets`]).
    pub text_offset: Vec<usize>,
    /// `None` for the first token of an echoed prompt, which has no context (as OpenAI).
    pub token_logprobs: Vec<Option<f32>>,
    /// With `logprobs: N > 0`, the N most likely tokens (text → log-probability, likeliest
    /// first) at each position, `None` where `token_logprobs` is.
    pub top_logprobs: Option<Vec<Option<Vec<(String, f32)>>>>,
}

impl TokenLogprobs {
    /// `{"tokens", "token_logprobs", "text_offset", "top_logprobs"}`, each position's
    /// alternatives an object of texts (the likelier kept where two tokens read the same).
    pub fn to_json(&self) -> Value {
        let top = self.top_logprobs.as_ref().map(|positions| {
            positions
                .iter()
                .map(|alternatives| {
                    alternatives.as_ref().map(|alternatives| {
                        let mut map = Map::new();
                        for (text, logprob) in alternatives {
                            map.entry(text.clone()).or_insert(json!(logprob));
                        }
                        Value::Object(map)
                    })
                })
                .collect::<Vec<_>>()
        });
        json!({"tokens": self.tokens, "token_logprobs": self.token_logprobs,
               "text_offset": self.text_offset, "top_logprobs": top})
    }
}

/// OpenAI's `text_offset`: where each of `ids[from..]` starts in the text of `ids`, counted in
/// characters (Python string indices), not bytes. A byte-level token may hold part of a
/// character, so the offsets come from the decoded prefixes, not from the tokens' own (lossy)
/// texts.
pub fn text_offsets(ids: &[u32], from: usize, decode: impl Fn(&[u32]) -> String) -> Vec<usize> {
    (from..ids.len())
        .map(|i| decode(&ids[..i]).chars().count())
        .collect()
}

/// The response body (also the last streamed event, without `usage` there).
pub fn completion_body(
    id: &str,
    created: u64,
    model: &str,
    choices: &[Choice],
    usage: Option<(usize, usize)>,
) -> Value {
    let choices: Vec<Value> = choices
        .iter()
        .enumerate()
        .map(|(index, c)| {
            let logprobs = (!c.logprobs.tokens.is_empty()).then(|| c.logprobs.to_json());
            json!({"index": index, "text": c.text, "logprobs": logprobs, "finish_reason": c.finish_reason})
        })
        .collect();
    let mut body = json!({"id": id, "object": "text_completion", "created": created, "model": model, "choices": choices});
    if let Some((prompt, completion)) = usage {
        body["usage"] = json!({"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion});
    }
    body
}

/// A streamed event: new text of one choice, with the tokens it carries when asked.
pub fn delta_body(
    id: &str,
    created: u64,
    model: &str,
    index: usize,
    text: &str,
    logprobs: Option<&TokenLogprobs>,
) -> Value {
    let logprobs = logprobs.map_or(Value::Null, TokenLogprobs::to_json);
    json!({"id": id, "object": "text_completion", "created": created, "model": model,
           "choices": [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": null}]})
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn openai_fields_and_defaults() {
        let r = CompletionRequest::parse(&json!({"prompt": "Hi", "stop": "\n", "stream": true}))
            .unwrap();
        assert_eq!(
            (
                r.prompts,
                r.max_tokens,
                r.temperature,
                r.top_p,
                r.stop,
                r.stream
            ),
            (
                vec!["Hi".to_string()],
                16,
                1.0,
                1.0,
                vec!["\n".to_string()],
                true
            )
        );
        let errors = [
            (json!({}), "prompt is required"),
            (
                json!({"prompt": 3}),
                "prompt must be a string or a list of strings",
            ),
            (
                json!({"prompt": "a", "n": 0}),
                "n must be between 1 and 128",
            ),
            (
                json!({"prompt": "a", "n": 3, "best_of": 2}),
                "best_of must be between n (3) and 128",
            ),
            (
                json!({"prompt": "a", "best_of": 2, "stream": true}),
                "best_of > n cannot be streamed: the best are known at the end",
            ),
            (
                json!({"prompt": "a", "suffix": "b"}),
                "suffix is not supported: this server does not insert text before a suffix",
            ),
            (
                json!({"prompt": "a", "tools": [{"type": "function"}]}),
                "tools is not supported: this server does not call tools or functions",
            ),
            (
                json!({"prompt": "a", "response_format": {"type": "json_object"}}),
                "response_format is not supported: only {\"type\": \"text\"} is served",
            ),
            (
                json!({"prompt": "a", "top_k": 5, "top_p": 0.5}),
                "cannot set both top_k and top_p",
            ),
            (
                json!({"prompt": "a", "logprobs": 21}),
                "logprobs must be between 0 and 20",
            ),
            (
                json!({"prompt": "a", "temperature": "x"}),
                "temperature must be a number",
            ),
            (
                json!({"prompt": "a", "presence_penalty": 2.5}),
                "presence_penalty must be between -2 and 2",
            ),
            (
                json!({"prompt": "a", "logit_bias": {"12": 101}}),
                "logit_bias[\"12\"] must be a number between -100 and 100",
            ),
            (
                json!({"prompt": "a", "logit_bias": {"x7": 1}}),
                "logit_bias key \"x7\" is not a token id",
            ),
        ];
        for (body, message) in errors {
            assert_eq!(
                CompletionRequest::parse(&body).unwrap_err().0,
                message,
                "{body}"
            );
        }
    }

    #[test]
    fn streams_may_carry_alternatives_and_an_echoed_prompts_logprobs() {
        let r = CompletionRequest::parse(
            &json!({"prompt": "a", "stream": true, "echo": true, "logprobs": 3, "n": 2}),
        )
        .unwrap();
        assert_eq!(
            (r.stream, r.echo, r.logprobs, r.top_logprobs, r.n),
            (true, true, true, 3, 2)
        );
    }

    #[test]
    fn penalties_and_logit_bias() {
        let r = CompletionRequest::parse(&json!({"prompt": "a", "presence_penalty": 0.5,
            "frequency_penalty": -1, "logit_bias": {"7": -100, "12": 2.5}}))
        .unwrap();
        assert_eq!((r.presence_penalty, r.frequency_penalty), (0.5, -1.0));
        assert_eq!(r.logit_bias, vec![(7, -100.0), (12, 2.5)]);
    }

    #[test]
    fn fields_asking_for_nothing_are_accepted() {
        for body in [
            json!({"prompt": "a", "suffix": null}),
            json!({"prompt": "a", "tools": [], "tool_choice": "none"}),
            json!({"prompt": "a", "function_call": "none", "functions": null}),
            json!({"prompt": "a", "response_format": {"type": "text"}}),
        ] {
            assert!(CompletionRequest::parse(&body).is_ok(), "{body}");
        }
    }

    #[test]
    fn prompts_may_be_token_ids() {
        let one = CompletionRequest::parse(&json!({"prompt": [1, 2, 3], "echo": true})).unwrap();
        assert_eq!(one.prompt_token_ids, Some(vec![vec![1, 2, 3]]));
        assert_eq!(one.prompts.len(), 1);
        let two = CompletionRequest::parse(&json!({"prompt": [[1], [4, 5]]})).unwrap();
        assert_eq!(two.prompt_token_ids, Some(vec![vec![1], vec![4, 5]]));
        let text = CompletionRequest::parse(&json!({"prompt": ["a", "b"]})).unwrap();
        assert_eq!(text.prompt_token_ids, None);
        assert!(CompletionRequest::parse(&json!({"prompt": [1, -2]})).is_err());
    }

    #[test]
    fn text_offsets_follow_the_tokens() {
        let choice = Choice {
            text: "ab c".into(),
            logprobs: TokenLogprobs {
                tokens: vec!["hé".into(), "llo".into(), " wö".into(), "rld".into()],
                text_offset: vec![0, 2, 5, 8],
                token_logprobs: vec![None, Some(-1.0), Some(-2.0), Some(-0.5)],
                top_logprobs: Some(vec![
                    None,
                    Some(vec![("llo".into(), -1.0)]),
                    Some(vec![(" x".into(), -0.25)]),
                    Some(vec![("rld".into(), -0.5)]),
                ]),
            },
            finish_reason: Some("length"),
        };
        let body = completion_body("x", 0, "m", &[choice], Some((3, 2)));
        let logprobs = &body["choices"][0]["logprobs"];
        assert_eq!(logprobs["text_offset"], json!([0, 2, 5, 8]));
        assert_eq!(logprobs["token_logprobs"], json!([null, -1.0, -2.0, -0.5]));
        assert_eq!(
            logprobs["top_logprobs"],
            json!([null, {"llo": -1.0}, {" x": -0.25}, {"rld": -0.5}])
        );
        assert_eq!(body["usage"]["total_tokens"], json!(5));
    }

    #[test]
    fn offsets_count_characters_of_the_decoded_text() {
        // Byte-level pieces of "héllo wörld": "ö" is split over two tokens.
        let pieces: [&[u8]; 5] = [b"h\xc3\xa9", b"llo", b" w\xc3", b"\xb6", b"rld"];
        let decode = |ids: &[u32]| {
            let bytes: Vec<u8> = ids
                .iter()
                .flat_map(|&i| pieces[i as usize].to_vec())
                .collect();
            String::from_utf8_lossy(&bytes).into_owned()
        };
        // 'héllo wörld'.index('llo') == 2, .index('rld') == 8, as Python counts; the token
        // ending inside "ö" counts it as one (replacement) character.
        assert_eq!(text_offsets(&[0, 1, 2, 3, 4], 0, &decode), [0, 2, 5, 8, 8]);
        assert_eq!(text_offsets(&[0, 1, 2, 3, 4], 3, &decode), [8, 8]);
    }
}
