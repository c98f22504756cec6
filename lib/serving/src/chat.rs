//! `POST /v1/chat/completions` in OpenAI's format: the messages become one prompt through the
//! checkpoint's chat template (`chat_template` of its `tokenizer_config.json`, a Jinja template
//! rendered like `transformers`' `apply_chat_template` with `add_generation_prompt`) or, for a
//! checkpoint without one, [`PLAIN_TEMPLATE`]; the completion runs like `/v1/completions`.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use serde_json::{json, Map, Value};

use super::api::ApiError;
use super::openai::CompletionRequest;

/// The template of checkpoints without one: each message as `Role: content` and a blank line,
/// then `Assistant:` for the answer, e.g. `"System: Be brief.\n\nUser: Hi\n\nAssistant:"`.
pub const PLAIN_TEMPLATE: &str = "{% for message in messages %}{{ message.role | capitalize }}: \
{{ message.content }}\n\n{% endfor %}{% if add_generation_prompt %}Assistant:{% endif %}";

/// The roles a message may have (no tools are called, so no `tool` messages).
const ROLES: [&str; 3] = ["system", "user", "assistant"];

#[derive(Debug, Clone, PartialEq)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
}

#[derive(Debug, Clone)]
pub struct ChatRequest {
    pub messages: Vec<ChatMessage>,
    /// The sampling fields; its prompt is set from the messages by [`ChatTemplate::render`].
    pub completion: CompletionRequest,
    /// No `max_tokens`: the answer may fill the model's context.
    pub unbounded: bool,
    /// `stream_options.include_usage`: a last streamed chunk carries the usage.
    pub include_usage: bool,
}

/// A message's `content`: a string, or a list of parts of which the text ones are joined.
fn content(message: &Map<String, Value>, index: usize) -> Result<String, ApiError> {
    match message.get("content") {
        None | Some(Value::Null) => Err(ApiError(format!(
            "messages[{index}].content is required: a string or a list of text parts"
        ))),
        Some(Value::String(text)) => Ok(text.clone()),
        Some(Value::Array(parts)) => parts
            .iter()
            .map(|part| match part.get("type").and_then(Value::as_str) {
                Some("text") => part
                    .get("text")
                    .and_then(Value::as_str)
                    .map(str::to_string)
                    .ok_or_else(|| ApiError(format!("messages[{index}]: a text part needs text"))),
                other => Err(ApiError(format!(
                    "messages[{index}]: content parts of type {} are not supported (text only)",
                    other.unwrap_or("null")
                ))),
            })
            .collect(),
        Some(_) => Err(ApiError(format!(
            "messages[{index}].content must be a string or a list of parts"
        ))),
    }
}

impl ChatRequest {
    pub fn parse(body: &Value) -> Result<Self, ApiError> {
        let Some(object) = body.as_object() else {
            return Err(ApiError("the request body must be a JSON object".into()));
        };
        let Some(Value::Array(list)) = object.get("messages") else {
            return Err(ApiError("messages is required: a list of messages".into()));
        };
        if list.is_empty() {
            return Err(ApiError("messages must not be empty".into()));
        }
        let messages = list
            .iter()
            .enumerate()
            .map(|(index, message)| {
                let message = message
                    .as_object()
                    .ok_or_else(|| ApiError(format!("messages[{index}] must be an object")))?;
                let role = message
                    .get("role")
                    .and_then(Value::as_str)
                    .ok_or_else(|| ApiError(format!("messages[{index}].role is required")))?;
                if !ROLES.contains(&role) {
                    return Err(ApiError(format!(
                        "messages[{index}].role {role:?} is not supported: {}",
                        ROLES.join(", ")
                    )));
                }
                Ok(ChatMessage {
                    role: role.to_string(),
                    content: content(message, index)?,
                })
            })
            .collect::<Result<Vec<_>, ApiError>>()?;
        let logprobs = match object.get("logprobs") {
            None | Some(Value::Null) => false,
            Some(Value::Bool(on)) => *on,
            Some(_) => return Err(ApiError("logprobs must be a boolean".into())),
        };
        let top_logprobs = match object.get("top_logprobs") {
            None | Some(Value::Null) => None,
            Some(value) => Some(
                value
                    .as_u64()
                    .ok_or_else(|| ApiError("top_logprobs must be an integer".into()))?,
            ),
        };
        if top_logprobs.is_some() && !logprobs {
            return Err(ApiError("top_logprobs needs logprobs: true".into()));
        }
        // The sampling fields mean what they mean for completions (`logprobs: N` there is
        // `logprobs: true, top_logprobs: N` here); `max_completion_tokens` is the newer name of
        // `max_tokens`.
        let mut fields = object.clone();
        for key in [
            "messages",
            "logprobs",
            "top_logprobs",
            "stream_options",
            "echo",
        ] {
            fields.remove(key);
        }
        if logprobs {
            fields.insert("logprobs".into(), json!(top_logprobs.unwrap_or(0)));
        }
        if let Some(limit) = object.get("max_completion_tokens") {
            fields.insert("max_tokens".into(), limit.clone());
        }
        let unbounded = fields.get("max_tokens").is_none_or(Value::is_null);
        fields.insert("prompt".into(), Value::String(String::new()));
        if object.contains_key("best_of") {
            return Err(ApiError("best_of is not a chat field".into()));
        }
        let completion = CompletionRequest::parse(&Value::Object(fields))?;
        let include_usage = object
            .get("stream_options")
            .and_then(|o| o.get("include_usage"))
            .and_then(Value::as_bool)
            .unwrap_or(false);
        Ok(ChatRequest {
            messages,
            completion,
            unbounded,
            include_usage,
        })
    }
}

/// A chat template and the special tokens it may refer to.
pub struct ChatTemplate {
    environment: minijinja::Environment<'static>,
    bos_token: String,
    eos_token: String,
    /// Where it came from, for the startup message.
    pub origin: String,
}

/// A special token of `tokenizer_config.json`: a string or `{"content": ...}`.
fn special_token(config: &Value, key: &str) -> String {
    match config.get(key) {
        Some(Value::String(text)) => text.clone(),
        Some(value) => value
            .get("content")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_string(),
        None => String::new(),
    }
}

impl ChatTemplate {
    fn new(source: String, bos_token: String, eos_token: String, origin: String) -> Result<Self> {
        let mut environment = minijinja::Environment::new();
        // As `transformers` renders chat templates.
        environment.set_syntax(
            minijinja::syntax::SyntaxConfig::builder()
                .trim_blocks(true)
                .lstrip_blocks(true)
                .build()
                .expect("the default delimiters are valid"),
        );
        environment
            .set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        environment.add_function(
            "raise_exception",
            |message: String| -> Result<String, minijinja::Error> {
                Err(minijinja::Error::new(
                    minijinja::ErrorKind::InvalidOperation,
                    message,
                ))
            },
        );
        environment
            .add_template_owned("chat", source)
            .with_context(|| format!("the chat template of {origin} is not valid Jinja"))?;
        Ok(ChatTemplate {
            environment,
            bos_token,
            eos_token,
            origin,
        })
    }

    pub fn plain() -> Self {
        Self::new(
            PLAIN_TEMPLATE.to_string(),
            String::new(),
            String::new(),
            "the plain template (Role: content)".into(),
        )
        .expect("the plain template is valid")
    }

    /// `explicit` (a `tokenizer_config.json`, or else a Jinja file) when given, else
    /// [`Self::find`] in `directories`.
    pub fn load(explicit: Option<&Path>, directories: &[PathBuf]) -> Result<Self> {
        match explicit {
            Some(path) if path.extension().is_some_and(|e| e == "json") => {
                Self::from_tokenizer_config(path)?
                    .with_context(|| format!("{} has no chat_template", path.display()))
            }
            Some(path) => Self::from_file(path),
            None => Self::find(directories),
        }
    }

    /// A Jinja file (special tokens empty).
    pub fn from_file(path: &Path) -> Result<Self> {
        let source = std::fs::read_to_string(path)
            .with_context(|| format!("cannot read the chat template {}", path.display()))?;
        Self::new(
            source,
            String::new(),
            String::new(),
            path.display().to_string(),
        )
    }

    /// The `chat_template` of the first `tokenizer_config.json` in `directories` that has one,
    /// else the plain template.
    pub fn find(directories: &[PathBuf]) -> Result<Self> {
        for directory in directories {
            let path = directory.join("tokenizer_config.json");
            if !path.is_file() {
                continue;
            }
            if let Some(template) = Self::from_tokenizer_config(&path)? {
                return Ok(template);
            }
        }
        Ok(Self::plain())
    }

    /// `None` when the file names no template.
    pub fn from_tokenizer_config(path: &Path) -> Result<Option<Self>> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("cannot read {}", path.display()))?;
        let config: Value = serde_json::from_str(&text)
            .with_context(|| format!("{} is not valid JSON", path.display()))?;
        let source = match config.get("chat_template") {
            None | Some(Value::Null) => return Ok(None),
            Some(Value::String(source)) => source.clone(),
            // Several named templates: the default one.
            Some(Value::Array(named)) => named
                .iter()
                .find(|t| t.get("name").and_then(Value::as_str) == Some("default"))
                .and_then(|t| t.get("template"))
                .and_then(Value::as_str)
                .with_context(|| {
                    format!(
                        "{}: chat_template has no template named default",
                        path.display()
                    )
                })?
                .to_string(),
            Some(_) => anyhow::bail!(
                "{}: chat_template must be a string or a list of named templates",
                path.display()
            ),
        };
        Self::new(
            source,
            special_token(&config, "bos_token"),
            special_token(&config, "eos_token"),
            path.display().to_string(),
        )
        .map(Some)
    }

    /// The prompt for `messages`, ending where the assistant's answer starts.
    pub fn render(&self, messages: &[ChatMessage]) -> Result<String, ApiError> {
        let template = self
            .environment
            .get_template("chat")
            .map_err(|e| ApiError(format!("the chat template: {e}")))?;
        let messages: Vec<minijinja::Value> = messages
            .iter()
            .map(|m| {
                minijinja::Value::from(std::collections::BTreeMap::from([
                    ("role", m.role.clone()),
                    ("content", m.content.clone()),
                ]))
            })
            .collect();
        template
            .render(minijinja::context! {
                messages,
                add_generation_prompt => true,
                bos_token => self.bos_token.clone(),
                eos_token => self.eos_token.clone(),
            })
            .map_err(|e| ApiError(format!("the chat template refused the messages: {e}")))
    }
}

/// A chat completion's body from the completion's: the text becomes the assistant's message,
/// its log-probabilities [`chat_logprobs`].
pub fn chat_body(completion: &Value, id: &str) -> Value {
    let choices: Vec<Value> = completion["choices"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|choice| {
            json!({"index": choice["index"], "logprobs": chat_logprobs(&choice["logprobs"]),
                   "finish_reason": choice["finish_reason"],
                   "message": {"role": "assistant", "content": choice["text"]}})
        })
        .collect();
    json!({"id": id, "object": "chat.completion", "created": completion["created"],
           "model": completion["model"], "choices": choices, "usage": completion["usage"]})
}

/// One token of a chat's `logprobs.content`: its text, log-probability and UTF-8 bytes.
fn chat_token(token: &str, logprob: &Value) -> Map<String, Value> {
    let mut entry = Map::new();
    entry.insert("token".into(), json!(token));
    entry.insert("logprob".into(), logprob.clone());
    entry.insert("bytes".into(), json!(token.as_bytes()));
    entry
}

/// A completion choice's log-probabilities (`tokens`, `token_logprobs`, `top_logprobs`) in the
/// chat format: `{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}`, the
/// alternatives most likely first; null when none were asked.
pub fn chat_logprobs(completion: &Value) -> Value {
    let Some(tokens) = completion["tokens"].as_array() else {
        return Value::Null;
    };
    let content: Vec<Value> = tokens
        .iter()
        .enumerate()
        .map(|(i, token)| {
            let mut entry = chat_token(
                token.as_str().unwrap_or(""),
                &completion["token_logprobs"][i],
            );
            let mut top: Vec<(&String, &Value)> = completion["top_logprobs"][i]
                .as_object()
                .map(|alternatives| alternatives.iter().collect())
                .unwrap_or_default();
            top.sort_by(|a, b| {
                let value = |v: &Value| v.as_f64().unwrap_or(f64::NEG_INFINITY);
                value(b.1).total_cmp(&value(a.1))
            });
            let top: Vec<Value> = top
                .into_iter()
                .map(|(text, logprob)| Value::Object(chat_token(text, logprob)))
                .collect();
            entry.insert("top_logprobs".into(), Value::Array(top));
            Value::Object(entry)
        })
        .collect();
    json!({"content": content})
}

/// A streamed chat chunk: `delta` of choice `index` with the tokens it carries, and why it
/// finished in its last one.
pub fn chat_chunk(
    id: &str,
    created: u64,
    model: &str,
    index: usize,
    delta: Value,
    logprobs: Value,
    finish: Value,
) -> Value {
    json!({"id": id, "object": "chat.completion.chunk", "created": created, "model": model,
           "choices": [{"index": index, "delta": delta, "logprobs": logprobs,
                        "finish_reason": finish}]})
}

#[cfg(test)]
mod tests {
    use super::*;

    fn messages() -> Vec<ChatMessage> {
        vec![
            ChatMessage {
                role: "system".into(),
                content: "Be brief.".into(),
            },
            ChatMessage {
                role: "user".into(),
                content: "Hi".into(),
            },
        ]
    }

    #[test]
    fn plain_template_is_role_colon_content() {
        assert_eq!(
            ChatTemplate::plain().render(&messages()).unwrap(),
            "System: Be brief.\n\nUser: Hi\n\nAssistant:"
        );
    }

    #[test]
    fn tokenizer_config_templates_see_special_tokens_and_python_methods() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tokenizer_config.json");
        let template = "{{ bos_token }}{% for m in messages %}\n  {% if m.role == 'system' %}\
                        [{{ m.content.strip().upper() }}]{% else %}<{{ m.role }}>{{ m.content }}{{ eos_token }}{% endif %}\n\
                        {% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}";
        std::fs::write(
            &path,
            json!({"chat_template": template, "bos_token": {"content": "<s>"}, "eos_token": "</s>"})
                .to_string(),
        )
        .unwrap();
        let found = ChatTemplate::find(&[dir.path().join("missing"), dir.path().into()]).unwrap();
        assert_eq!(
            found.render(&messages()).unwrap(),
            "<s>[BE BRIEF.]<user>Hi</s><assistant>"
        );
        std::fs::write(
            &path,
            json!({"chat_template": "{{ raise_exception('no system messages') }}"}).to_string(),
        )
        .unwrap();
        let refusing = ChatTemplate::find(&[dir.path().into()]).unwrap();
        assert!(refusing
            .render(&messages())
            .unwrap_err()
            .0
            .contains("no system messages"));
        std::fs::write(&path, "{}").unwrap();
        assert_eq!(
            ChatTemplate::find(&[dir.path().into()]).unwrap().origin,
            ChatTemplate::plain().origin
        );
        // Named explicitly: a tokenizer_config.json must have a template; another file is one.
        let error = ChatTemplate::load(Some(&path), &[]).err().unwrap();
        assert!(
            format!("{error:#}").contains("has no chat_template"),
            "{error:#}"
        );
        let jinja = dir.path().join("chat.jinja");
        std::fs::write(
            &jinja,
            "{% for m in messages %}{{ m.content }}|{% endfor %}",
        )
        .unwrap();
        let explicit = ChatTemplate::load(Some(&jinja), &[dir.path().into()]).unwrap();
        assert_eq!(explicit.render(&messages()).unwrap(), "Be brief.|Hi|");
        std::fs::write(&jinja, "{% for m in messages %}").unwrap();
        let error = ChatTemplate::load(Some(&jinja), &[]).err().unwrap();
        assert!(
            format!("{error:#}").contains("is not valid Jinja"),
            "{error:#}"
        );
    }

    #[test]
    fn chat_requests_take_completion_fields() {
        let request = ChatRequest::parse(&json!({
            "model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
            "max_completion_tokens": 5, "temperature": 0, "stream": true,
            "stream_options": {"include_usage": true}}))
        .unwrap();
        assert_eq!(request.messages[0].content, "ab");
        assert_eq!(request.completion.max_tokens, 5);
        assert!(request.completion.stream && request.include_usage && !request.unbounded);
        assert!(
            ChatRequest::parse(&json!({"messages": [{"role": "user", "content": "a"}]}))
                .unwrap()
                .unbounded
        );
        for (body, message) in [
            (json!({}), "messages is required"),
            (json!({"messages": []}), "messages must not be empty"),
            (
                json!({"messages": [{"content": "a"}]}),
                "messages[0].role is required",
            ),
            (
                json!({"messages": [{"role": "user", "content": "a"}], "best_of": 2}),
                "best_of is not a chat field",
            ),
            (
                json!({"messages": [{"role": "user", "content": "a"}, {"role": "wizard", "content": "b"}]}),
                "messages[1].role \"wizard\" is not supported",
            ),
            (
                json!({"messages": [{"role": "user"}]}),
                "messages[0].content is required",
            ),
            (
                json!({"messages": [{"role": "system", "content": "a"}, {"role": "user", "content": null}]}),
                "messages[1].content is required",
            ),
            (
                json!({"messages": [{"role": "user", "content": "a"}], "tools": [{"type": "function"}]}),
                "tools is not supported",
            ),
            (
                json!({"messages": [{"role": "user", "content": "a"}], "tool_choice": "auto"}),
                "tool_choice is not supported",
            ),
            (
                json!({"messages": [{"role": "user", "content": "a"}], "functions": [{"name": "f"}]}),
                "functions is not supported",
            ),
            (
                json!({"messages": [{"role": "user", "content": "a"}], "response_format": {"type": "json_object"}}),
                "response_format is not supported",
            ),
            (
                json!({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}),
                "content parts of type image_url are not supported",
            ),
        ] {
            let error = ChatRequest::parse(&body).unwrap_err().0;
            assert!(error.contains(message), "{body}: {error}");
        }
    }
}
