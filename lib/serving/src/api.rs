//! Megatron's `PUT /api` request (spec §6.2): every field with its default, its validation in
//! the order of Megatron's handler (core_v0.13) and its exact message. JSON types follow Python's: a boolean passes where an
//! integer is expected, `top_p` must be written as a float.

use serde_json::{Map, Value};

/// Megatron's limit on prompts per request.
pub const MAX_PROMPTS: usize = 128;

/// A validated request.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct ApiRequest {
    pub prompts: Vec<String>,
    pub tokens_to_generate: usize,
    pub logprobs: bool,
    pub temperature: f64,
    pub top_k: i64,
    pub top_p: f64,
    pub top_p_decay: f64,
    pub top_p_bound: f64,
    pub add_bos: bool,
    pub stop_on_double_eol: bool,
    pub stop_on_eol: bool,
    pub prevent_newline_after_colon: bool,
    /// `None`: not given (-1 in Megatron).
    pub random_seed: Option<u64>,
    pub no_log: bool,
    pub beam_width: Option<usize>,
    pub stop_token: i64,
    pub length_penalty: f64,
}

/// A rejected request: Megatron's message, answered with HTTP 400.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiError(pub String);

fn error<T>(message: &str) -> Result<T, ApiError> {
    Err(ApiError(message.to_string()))
}

/// Python's `isinstance(x, int)`: integers and booleans.
fn python_int(value: &Value) -> Option<i64> {
    match value {
        Value::Bool(b) => Some(i64::from(*b)),
        Value::Number(n) => n.as_i64(),
        _ => None,
    }
}

/// A JSON float (written with a fraction or exponent), as Python's `type(x) == float`.
fn python_float(value: &Value) -> Option<f64> {
    match value {
        Value::Number(n) if !n.is_i64() && !n.is_u64() => n.as_f64(),
        _ => None,
    }
}

fn boolean(body: &Map<String, Value>, key: &str) -> Result<bool, ApiError> {
    match body.get(key) {
        None => Ok(false),
        Some(Value::Bool(b)) => Ok(*b),
        Some(_) => error(&format!("{key} must be a boolean value")),
    }
}

impl ApiRequest {
    /// Validates a request body in Megatron's order.
    pub fn parse(body: &Value) -> Result<Self, ApiError> {
        let Some(body) = body.as_object() else {
            return error("the request body must be a JSON object");
        };
        let Some(prompts) = body.get("prompts") else {
            return error("prompts argument required");
        };
        if body.contains_key("max_len") {
            return error("max_len is no longer used.  Replace with tokens_to_generate");
        }
        if body.contains_key("sentences") {
            return error("sentences is no longer used.  Replace with prompts");
        }
        let prompts: Vec<String> = match prompts {
            Value::Array(items) => items
                .iter()
                .map(|p| p.as_str().map(str::to_string))
                .collect::<Option<_>>()
                .ok_or_else(|| ApiError("prompts is not a list of strings".into()))?,
            _ => return error("prompts is not a list of strings"),
        };
        if prompts.is_empty() {
            return error("prompts is empty");
        }
        if prompts.len() > MAX_PROMPTS {
            return error(&format!("Maximum number of prompts is {MAX_PROMPTS}"));
        }
        let tokens_to_generate = match body.get("tokens_to_generate") {
            None => 64,
            Some(value) => match python_int(value) {
                None => return error("tokens_to_generate must be an integer greater than 0"),
                Some(n) if n < 0 => {
                    return error(
                        "tokens_to_generate must be an integer greater than or equal to 0",
                    )
                }
                Some(n) => n as usize,
            },
        };
        let logprobs = boolean(body, "logprobs")?;
        if tokens_to_generate == 0 && !logprobs {
            return error("tokens_to_generate=0 implies logprobs should be True");
        }
        let temperature = match body.get("temperature") {
            None => 1.0,
            Some(value) => {
                let message = "temperature must be a positive number less than or equal to 100.0";
                let t = python_int(value)
                    .map(|i| i as f64)
                    .or_else(|| value.as_f64())
                    .ok_or_else(|| ApiError(message.into()))?;
                if !(t > 0.0 && t <= 100.0) {
                    return error(message);
                }
                t
            }
        };
        let top_k = match body.get("top_k") {
            None => 0,
            Some(value) => match python_int(value) {
                None => return error("top_k must be an integer equal to or greater than 0 and less than or equal to 1000"),
                Some(k) if !(0..=1000).contains(&k) => {
                    return error("top_k must be equal to or greater than 0 and less than or equal to 1000")
                }
                Some(k) => k,
            },
        };
        let top_p = match body.get("top_p") {
            None => 0.0,
            Some(value) => {
                let p = python_float(value).ok_or_else(|| {
                    ApiError("top_p must be a positive float less than or equal to 1.0".into())
                })?;
                if p > 0.0 && top_k > 0 {
                    return error("cannot set both top-k and top-p samplings.");
                }
                if !(0.0..=1.0).contains(&p) {
                    return error("top_p must be less than or equal to 1.0");
                }
                p
            }
        };
        let top_p_decay = match body.get("top_p_decay") {
            None => 0.0,
            Some(value) => {
                let d = python_float(value).ok_or_else(|| {
                    ApiError(
                        "top_p_decay must be a positive float less than or equal to 1.0".into(),
                    )
                })?;
                if top_p == 0.0 {
                    return error("top_p_decay cannot be set without top_p");
                }
                if !(0.0..=1.0).contains(&d) {
                    return error("top_p_decay must be less than or equal to 1.0");
                }
                d
            }
        };
        let top_p_bound = match body.get("top_p_bound") {
            None => 0.0,
            Some(value) => {
                let b = python_float(value).ok_or_else(|| {
                    ApiError(
                        "top_p_bound must be a positive float less than or equal to top_p".into(),
                    )
                })?;
                if top_p == 0.0 {
                    return error("top_p_bound cannot be set without top_p");
                }
                if !(b > 0.0 && b <= top_p) {
                    return error("top_p_bound must be greater than 0 and less than top_p");
                }
                b
            }
        };
        let add_bos = boolean(body, "add_BOS")?;
        if !add_bos && prompts.iter().any(String::is_empty) {
            return error("Empty prompts require add_BOS=true");
        }
        let stop_on_double_eol = boolean(body, "stop_on_double_eol")?;
        let stop_on_eol = boolean(body, "stop_on_eol")?;
        let prevent_newline_after_colon = boolean(body, "prevent_newline_after_colon")?;
        let random_seed = match body.get("random_seed") {
            None => None,
            Some(value) => match python_int(value) {
                None => return error("random_seed must be integer"),
                Some(s) if s < 0 => return error("random_seed must be a positive integer"),
                Some(s) => Some(s as u64),
            },
        };
        let no_log = boolean(body, "no_log")?;
        let beam_width = match body.get("beam_width") {
            None | Some(Value::Null) => None,
            Some(value) => match python_int(value) {
                None => return error("beam_width must be integer"),
                Some(w) if w < 1 => return error("beam_width must be an integer > 1"),
                Some(_) if prompts.len() > 1 => {
                    return error("When doing beam_search, batch size must be 1")
                }
                Some(w) => Some(w as usize),
            },
        };
        let stop_token = match body.get("stop_token") {
            None => 50256,
            Some(value) => {
                python_int(value).ok_or_else(|| ApiError("stop_token must be an integer".into()))?
            }
        };
        let length_penalty = match body.get("length_penalty") {
            None => 1.0,
            Some(value) => python_float(value)
                .ok_or_else(|| ApiError("length_penalty must be a float".into()))?,
        };
        Ok(ApiRequest {
            prompts,
            tokens_to_generate,
            logprobs,
            temperature,
            top_k,
            top_p,
            top_p_decay,
            top_p_bound,
            add_bos,
            stop_on_double_eol,
            stop_on_eol,
            prevent_newline_after_colon,
            random_seed,
            no_log,
            beam_width,
            stop_token,
            length_penalty,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn message(body: Value) -> String {
        ApiRequest::parse(&body)
            .err()
            .map(|e| e.0)
            .unwrap_or_else(|| "accepted".into())
    }

    #[test]
    fn defaults_are_megatrons() {
        let r = ApiRequest::parse(&json!({"prompts": ["Hello"]})).unwrap();
        assert_eq!(
            (
                r.tokens_to_generate,
                r.logprobs,
                r.temperature,
                r.top_k,
                r.top_p
            ),
            (64, false, 1.0, 0, 0.0)
        );
        assert_eq!(
            (r.random_seed, r.beam_width, r.stop_token, r.length_penalty),
            (None, None, 50256, 1.0)
        );
    }

    #[test]
    fn every_validation_message_in_order() {
        let p = json!(["a"]);
        let cases = [
            (json!({}), "prompts argument required"),
            (json!({"prompts": "a"}), "prompts is not a list of strings"),
            (json!({"prompts": [1]}), "prompts is not a list of strings"),
            (json!({"prompts": []}), "prompts is empty"),
            (json!({"prompts": vec!["a"; 129]}), "Maximum number of prompts is 128"),
            (json!({"prompts": 5, "max_len": 3}), "max_len is no longer used.  Replace with tokens_to_generate"),
            (json!({"prompts": 5, "sentences": 3}), "sentences is no longer used.  Replace with prompts"),
            (json!({"prompts": p, "tokens_to_generate": "3"}), "tokens_to_generate must be an integer greater than 0"),
            (json!({"prompts": p, "tokens_to_generate": -1}), "tokens_to_generate must be an integer greater than or equal to 0"),
            (json!({"prompts": p, "logprobs": 1}), "logprobs must be a boolean value"),
            (json!({"prompts": p, "tokens_to_generate": 0}), "tokens_to_generate=0 implies logprobs should be True"),
            (json!({"prompts": p, "temperature": "hot"}), "temperature must be a positive number less than or equal to 100.0"),
            (json!({"prompts": p, "temperature": 0}), "temperature must be a positive number less than or equal to 100.0"),
            (json!({"prompts": p, "top_k": 0.5}), "top_k must be an integer equal to or greater than 0 and less than or equal to 1000"),
            (json!({"prompts": p, "top_k": 1001}), "top_k must be equal to or greater than 0 and less than or equal to 1000"),
            (json!({"prompts": p, "top_p": 1}), "top_p must be a positive float less than or equal to 1.0"),
            (json!({"prompts": p, "top_p": 0.5, "top_k": 5}), "cannot set both top-k and top-p samplings."),
            (json!({"prompts": p, "top_p": 1.5}), "top_p must be less than or equal to 1.0"),
            (json!({"prompts": p, "top_p_decay": 1}), "top_p_decay must be a positive float less than or equal to 1.0"),
            (json!({"prompts": p, "top_p_decay": 0.5}), "top_p_decay cannot be set without top_p"),
            (json!({"prompts": p, "top_p": 0.5, "top_p_decay": 1.5}), "top_p_decay must be less than or equal to 1.0"),
            (json!({"prompts": p, "top_p_bound": "x"}), "top_p_bound must be a positive float less than or equal to top_p"),
            (json!({"prompts": p, "top_p_bound": 0.1}), "top_p_bound cannot be set without top_p"),
            (json!({"prompts": p, "top_p": 0.5, "top_p_bound": 0.7}), "top_p_bound must be greater than 0 and less than top_p"),
            (json!({"prompts": p, "add_BOS": "yes"}), "add_BOS must be a boolean value"),
            (json!({"prompts": [""]}), "Empty prompts require add_BOS=true"),
            (json!({"prompts": p, "stop_on_double_eol": 0}), "stop_on_double_eol must be a boolean value"),
            (json!({"prompts": p, "stop_on_eol": 0}), "stop_on_eol must be a boolean value"),
            (json!({"prompts": p, "prevent_newline_after_colon": 0}), "prevent_newline_after_colon must be a boolean value"),
            (json!({"prompts": p, "random_seed": 1.5}), "random_seed must be integer"),
            (json!({"prompts": p, "random_seed": -2}), "random_seed must be a positive integer"),
            (json!({"prompts": p, "no_log": 1}), "no_log must be a boolean value"),
            (json!({"prompts": p, "beam_width": "2"}), "beam_width must be integer"),
            (json!({"prompts": p, "beam_width": 0}), "beam_width must be an integer > 1"),
            (json!({"prompts": ["a", "b"], "beam_width": 2}), "When doing beam_search, batch size must be 1"),
            (json!({"prompts": p, "stop_token": "x"}), "stop_token must be an integer"),
            (json!({"prompts": p, "length_penalty": 1}), "length_penalty must be a float"),
        ];
        for (body, expected) in cases {
            assert_eq!(message(body.clone()), expected, "{body}");
        }
    }

    #[test]
    fn python_types_are_followed() {
        // A boolean is an integer to Python; an integer is not a float.
        assert_eq!(
            ApiRequest::parse(&json!({"prompts": ["a"], "tokens_to_generate": true}))
                .unwrap()
                .tokens_to_generate,
            1
        );
        assert_eq!(
            message(json!({"prompts": ["a"], "top_p": 0})),
            "top_p must be a positive float less than or equal to 1.0"
        );
        assert_eq!(
            ApiRequest::parse(&json!({"prompts": [""], "add_BOS": true}))
                .unwrap()
                .prompts,
            vec![String::new()]
        );
    }
}
