//! A restricted Python unpickler: it builds a tree of plain values and never imports or runs
//! anything. It knows what PyTorch checkpoints hold — tensors and their storages (through the
//! persistent ids `torch.save` writes), `OrderedDict`, `argparse.Namespace`, numpy arrays and
//! scalars, bytes encoded through `_codecs.encode` — and turns every other global (Megatron's
//! enums, `torch.bfloat16`, dataclasses, ...) into an opaque [`Value::Object`] that records the
//! class name, its constructor arguments and its state.

use std::collections::HashMap;

use anyhow::{bail, ensure, Context, Result};

use crate::dtype::DType;

/// Where a tensor's bytes live: a storage record of the zip archive (`data/<key>`).
#[derive(Debug, Clone, PartialEq)]
pub struct StorageRef {
    pub key: String,
    pub dtype: DType,
    /// Elements in the storage (several tensors may view one storage).
    pub numel: usize,
}

/// A tensor as pickled: a strided view of a storage, in elements.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorRef {
    pub storage: StorageRef,
    pub offset: usize,
    pub shape: Vec<usize>,
    pub stride: Vec<usize>,
}

impl TensorRef {
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    pub fn is_contiguous(&self) -> bool {
        let mut expected = 1;
        for (&size, &stride) in self.shape.iter().zip(&self.stride).rev() {
            if size != 1 && stride != expected {
                return false;
            }
            expected *= size;
        }
        true
    }
}

/// A numpy `ndarray` (C order) or, with an empty shape, a numpy scalar.
#[derive(Debug, Clone, PartialEq)]
pub struct NumpyArray {
    /// numpy's type string, e.g. `<u4`, `<f8`, `|b1`.
    pub dtype: String,
    pub shape: Vec<usize>,
    pub data: Vec<u8>,
}

/// A Python value as the unpickler rebuilt it.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    None,
    Bool(bool),
    Int(i64),
    /// An integer too large for i64, as Python's little-endian two's complement bytes.
    BigInt(Vec<u8>),
    Float(f64),
    Str(String),
    Bytes(Vec<u8>),
    List(Vec<Value>),
    Tuple(Vec<Value>),
    Set(Vec<Value>),
    /// `dict` and `OrderedDict`, in insertion order.
    Dict(Vec<(Value, Value)>),
    /// A reference to a class or function that was not called (e.g. `torch.bfloat16`).
    Global {
        module: String,
        name: String,
    },
    /// An instance of a class this reader does not know, with what pickle said about it.
    Object {
        module: String,
        name: String,
        args: Vec<Value>,
        state: Option<Box<Value>>,
    },
    Storage(StorageRef),
    Tensor(TensorRef),
    Numpy(NumpyArray),
}

impl Value {
    /// The entry `key` of a dict (string keys), or of an object's state dict
    /// (`argparse.Namespace` attributes and dataclass fields).
    pub fn get(&self, key: &str) -> Option<&Value> {
        match self {
            Value::Dict(items) => items
                .iter()
                .find(|(k, _)| matches!(k, Value::Str(s) if s == key))
                .map(|(_, v)| v),
            Value::Object {
                state: Some(state), ..
            } => match state.as_ref() {
                // Slotted dataclasses pickle `(None, {slot: value})`.
                Value::Tuple(parts) if parts.len() == 2 => parts[1].get(key).or(parts[0].get(key)),
                other => other.get(key),
            },
            _ => None,
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::Str(s) => Some(s),
            _ => None,
        }
    }

    pub fn as_i64(&self) -> Option<i64> {
        match self {
            Value::Int(i) => Some(*i),
            Value::Bool(b) => Some(*b as i64),
            _ => None,
        }
    }

    pub fn as_f64(&self) -> Option<f64> {
        match self {
            Value::Float(f) => Some(*f),
            Value::Int(i) => Some(*i as f64),
            _ => None,
        }
    }

    pub fn as_bool(&self) -> Option<bool> {
        match self {
            Value::Bool(b) => Some(*b),
            Value::Int(i) => Some(*i != 0),
            _ => None,
        }
    }

    /// `(key, value)` pairs of a dict or of an object's attribute dict.
    pub fn entries(&self) -> Option<&[(Value, Value)]> {
        match self {
            Value::Dict(items) => Some(items),
            Value::Object {
                state: Some(state), ..
            } => state.entries(),
            _ => None,
        }
    }

    /// Items of a list, tuple or set.
    pub fn items(&self) -> Option<&[Value]> {
        match self {
            Value::List(v) | Value::Tuple(v) | Value::Set(v) => Some(v),
            _ => None,
        }
    }

    /// Python's `repr`-like short description, for `inspect` and error messages.
    pub fn describe(&self) -> String {
        match self {
            Value::None => "None".into(),
            Value::Bool(b) => if *b { "True" } else { "False" }.into(),
            Value::Int(i) => i.to_string(),
            Value::BigInt(b) => format!("<int of {} bytes>", b.len()),
            Value::Float(f) => format!("{f:?}"),
            Value::Str(s) => format!("{s:?}"),
            Value::Bytes(b) => format!("<{} bytes>", b.len()),
            Value::List(v) => format!("[{}]", describe_all(v)),
            Value::Tuple(v) => format!("({})", describe_all(v)),
            Value::Set(v) => format!("{{{}}}", describe_all(v)),
            Value::Dict(v) => format!("<dict of {}>", v.len()),
            Value::Global { module, name } => format!("{module}.{name}"),
            Value::Object {
                module, name, args, ..
            } => {
                if args.is_empty() {
                    format!("{module}.{name}(...)")
                } else {
                    format!("{module}.{name}({})", describe_all(args))
                }
            }
            Value::Storage(s) => format!("<{} storage of {}>", s.dtype.torch_name(), s.numel),
            Value::Tensor(t) => format!("tensor {} {:?}", t.storage.dtype.torch_name(), t.shape),
            Value::Numpy(a) => format!("ndarray {} {:?}", a.dtype, a.shape),
        }
    }

    /// The value as JSON where it has a natural JSON form (flags, counters, scheduler state);
    /// opaque objects become their class name, tensors their description.
    pub fn to_json(&self) -> serde_json::Value {
        use serde_json::Value as J;
        match self {
            Value::None => J::Null,
            Value::Bool(b) => J::Bool(*b),
            Value::Int(i) => J::from(*i),
            Value::Float(f) => serde_json::Number::from_f64(*f).map_or(J::Null, J::Number),
            Value::Str(s) => J::String(s.clone()),
            Value::List(v) | Value::Tuple(v) | Value::Set(v) => {
                J::Array(v.iter().map(Value::to_json).collect())
            }
            Value::Dict(items) => J::Object(
                items
                    .iter()
                    .map(|(k, v)| (key_string(k), v.to_json()))
                    .collect(),
            ),
            Value::Object {
                module,
                name,
                state: Some(state),
                ..
            } if module == "argparse" && name == "Namespace" => state.to_json(),
            other => J::String(other.describe()),
        }
    }
}

fn key_string(key: &Value) -> String {
    match key {
        Value::Str(s) => s.clone(),
        other => other.describe(),
    }
}

fn describe_all(values: &[Value]) -> String {
    let shown: Vec<String> = values.iter().take(8).map(Value::describe).collect();
    let mut text = shown.join(", ");
    if values.len() > 8 {
        text.push_str(", ...");
    }
    text
}

/// Resolves a persistent id (`torch.save` writes `('storage', StorageClass, key, location, numel)`).
pub type PersistentLoad<'a> = dyn FnMut(Value) -> Result<Value> + 'a;

/// The default persistent-id resolver for `torch.save` archives.
pub fn torch_persistent_load(pid: Value) -> Result<Value> {
    let parts = match &pid {
        Value::Tuple(parts) => parts,
        other => bail!("unexpected persistent id {}", other.describe()),
    };
    ensure!(
        parts.len() >= 5 && parts[0].as_str() == Some("storage"),
        "unexpected persistent id {}",
        pid.describe()
    );
    let dtype = match &parts[1] {
        Value::Global { module, name } if module == "torch" => DType::from_storage_class(name)
            .with_context(|| format!("unsupported storage type torch.{name}"))?,
        other => bail!("unexpected storage type {}", other.describe()),
    };
    let key = match &parts[2] {
        Value::Str(s) => s.clone(),
        Value::Int(i) => i.to_string(),
        other => bail!("unexpected storage key {}", other.describe()),
    };
    let numel = parts[4]
        .as_i64()
        .and_then(|n| usize::try_from(n).ok())
        .filter(|n| n.checked_mul(dtype.size()).is_some())
        .with_context(|| format!("storage {key}: impossible size {}", parts[4].describe()))?;
    Ok(Value::Storage(StorageRef { key, dtype, numel }))
}

/// Unpickles `data` (any protocol 0–5), resolving persistent ids through `persistent_load`.
pub fn unpickle(data: &[u8], persistent_load: &mut PersistentLoad<'_>) -> Result<Value> {
    Machine {
        input: data,
        position: 0,
        stack: Vec::new(),
        marks: Vec::new(),
        memo: HashMap::new(),
    }
    .run(persistent_load)
}

/// A stack slot: the value and, when it was memoized, its memo index, so that mutations
/// (`SETITEMS`, `APPENDS`, `BUILD`) reach later `GET`s of the same object.
struct Slot {
    value: Value,
    memo: Option<u32>,
}

struct Machine<'a> {
    input: &'a [u8],
    position: usize,
    stack: Vec<Slot>,
    marks: Vec<usize>,
    memo: HashMap<u32, Value>,
}

impl<'a> Machine<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        let end = self
            .position
            .checked_add(n)
            .filter(|&end| end <= self.input.len())
            .with_context(|| format!("pickle truncated at byte {}", self.position))?;
        let bytes = &self.input[self.position..end];
        self.position = end;
        Ok(bytes)
    }

    fn byte(&mut self) -> Result<u8> {
        Ok(self.take(1)?[0])
    }

    fn u16(&mut self) -> Result<usize> {
        Ok(u16::from_le_bytes(self.take(2)?.try_into().unwrap()) as usize)
    }

    fn u32(&mut self) -> Result<usize> {
        Ok(u32::from_le_bytes(self.take(4)?.try_into().unwrap()) as usize)
    }

    fn u64(&mut self) -> Result<usize> {
        let n = u64::from_le_bytes(self.take(8)?.try_into().unwrap());
        usize::try_from(n).context("pickle length does not fit in memory")
    }

    fn line(&mut self) -> Result<&'a str> {
        let rest = &self.input[self.position..];
        let end = rest
            .iter()
            .position(|&b| b == b'\n')
            .context("pickle truncated inside a text line")?;
        self.position += end + 1;
        std::str::from_utf8(&rest[..end]).context("pickle text line is not UTF-8")
    }

    fn push(&mut self, value: Value) {
        self.stack.push(Slot { value, memo: None });
    }

    fn pop(&mut self) -> Result<Value> {
        Ok(self.stack.pop().context("pickle stack underflow")?.value)
    }

    fn top(&mut self) -> Result<&mut Slot> {
        self.stack.last_mut().context("pickle stack underflow")
    }

    fn pop_mark(&mut self) -> Result<Vec<Value>> {
        let mark = self.marks.pop().context("pickle MARK missing")?;
        ensure!(mark <= self.stack.len(), "pickle MARK beyond the stack");
        Ok(self.stack.drain(mark..).map(|s| s.value).collect())
    }

    fn memoize(&mut self, index: u32) -> Result<()> {
        let slot = self.top()?;
        slot.memo = Some(index);
        let value = slot.value.clone();
        self.memo.insert(index, value);
        Ok(())
    }

    fn get(&mut self, index: u32) -> Result<()> {
        let value = self
            .memo
            .get(&index)
            .with_context(|| format!("pickle memo {index} is unset"))?
            .clone();
        self.stack.push(Slot {
            value,
            memo: Some(index),
        });
        Ok(())
    }

    /// Applies `change` to the value on top of the stack and keeps its memo copy in step.
    fn mutate_top(&mut self, change: impl FnOnce(&mut Value) -> Result<()>) -> Result<()> {
        let slot = self.stack.last_mut().context("pickle stack underflow")?;
        change(&mut slot.value)?;
        if let Some(index) = slot.memo {
            let value = slot.value.clone();
            self.memo.insert(index, value);
        }
        Ok(())
    }

    fn run(mut self, persistent_load: &mut PersistentLoad<'_>) -> Result<Value> {
        loop {
            let at = self.position;
            let op = self.byte()?;
            self.step(op, persistent_load)
                .with_context(|| format!("pickle opcode 0x{op:02x} at byte {at}"))?;
            if op == b'.' {
                return self.pop();
            }
        }
    }

    fn step(&mut self, op: u8, persistent_load: &mut PersistentLoad<'_>) -> Result<()> {
        match op {
            0x80 => {
                self.byte()?; // PROTO
            }
            0x95 => {
                self.take(8)?; // FRAME: framing is only a read-ahead hint
            }
            b'.' => {}
            b'(' => self.marks.push(self.stack.len()),
            b'0' => {
                self.pop()?;
            }
            b'1' => {
                self.pop_mark()?;
            }
            b'2' => {
                let value = self.top()?.value.clone();
                self.push(value);
            }
            b'N' => self.push(Value::None),
            0x88 => self.push(Value::Bool(true)),
            0x89 => self.push(Value::Bool(false)),
            b'I' => {
                let line = self.line()?;
                let value = match line {
                    "00" => Value::Bool(false),
                    "01" => Value::Bool(true),
                    _ => Value::Int(line.parse().context("bad INT")?),
                };
                self.push(value);
            }
            b'J' => {
                let v = i32::from_le_bytes(self.take(4)?.try_into().unwrap());
                self.push(Value::Int(v as i64));
            }
            b'K' => {
                let v = self.byte()?;
                self.push(Value::Int(v as i64));
            }
            b'M' => {
                let v = self.u16()?;
                self.push(Value::Int(v as i64));
            }
            b'L' => {
                let line = self.line()?.trim_end_matches('L');
                let value = line
                    .parse::<i64>()
                    .map(Value::Int)
                    .unwrap_or_else(|_| Value::BigInt(line.as_bytes().to_vec()));
                self.push(value);
            }
            0x8a | 0x8b => {
                let n = if op == 0x8a {
                    self.byte()? as usize
                } else {
                    self.u32()?
                };
                let bytes = self.take(n)?;
                self.push(long_from_bytes(bytes));
            }
            b'F' => {
                let v: f64 = self.line()?.parse().context("bad FLOAT")?;
                self.push(Value::Float(v));
            }
            b'G' => {
                let v = f64::from_be_bytes(self.take(8)?.try_into().unwrap());
                self.push(Value::Float(v));
            }
            b'S' => {
                let line = self.line()?;
                let text = line
                    .strip_prefix(['\'', '"'])
                    .and_then(|l| l.strip_suffix(['\'', '"']))
                    .unwrap_or(line);
                self.push(Value::Str(text.to_string()));
            }
            b'T' | b'U' | b'B' | b'C' | 0x8e | 0x96 => {
                let n = match op {
                    b'U' | b'C' => self.byte()? as usize,
                    b'T' | b'B' => self.u32()?,
                    _ => self.u64()?,
                };
                let bytes = self.take(n)?.to_vec();
                // Python 2 strings (BINSTRING) decode as text where they can.
                let value = if matches!(op, b'T' | b'U') {
                    String::from_utf8(bytes)
                        .map_or_else(|e| Value::Bytes(e.into_bytes()), Value::Str)
                } else {
                    Value::Bytes(bytes)
                };
                self.push(value);
            }
            b'V' => {
                let line = self.line()?;
                self.push(Value::Str(unescape_raw_unicode(line)));
            }
            b'X' | 0x8c | 0x8d => {
                let n = match op {
                    0x8c => self.byte()? as usize,
                    b'X' => self.u32()?,
                    _ => self.u64()?,
                };
                let text = std::str::from_utf8(self.take(n)?).context("string is not UTF-8")?;
                self.push(Value::Str(text.to_string()));
            }
            b']' => self.push(Value::List(Vec::new())),
            b')' => self.push(Value::Tuple(Vec::new())),
            b'}' => self.push(Value::Dict(Vec::new())),
            0x8f => self.push(Value::Set(Vec::new())),
            b'l' => {
                let items = self.pop_mark()?;
                self.push(Value::List(items));
            }
            b't' => {
                let items = self.pop_mark()?;
                self.push(Value::Tuple(items));
            }
            0x91 => {
                let items = self.pop_mark()?;
                self.push(Value::Set(items));
            }
            0x85..=0x87 => {
                let n = (op - 0x84) as usize;
                ensure!(self.stack.len() >= n, "pickle stack underflow");
                let items = self
                    .stack
                    .drain(self.stack.len() - n..)
                    .map(|s| s.value)
                    .collect();
                self.push(Value::Tuple(items));
            }
            b'd' => {
                let items = self.pop_mark()?;
                self.push(Value::Dict(pairs(items)?));
            }
            b'a' => {
                let item = self.pop()?;
                self.mutate_top(|list| append(list, vec![item]))?;
            }
            b'e' => {
                let items = self.pop_mark()?;
                self.mutate_top(|list| append(list, items))?;
            }
            0x90 => {
                let items = self.pop_mark()?;
                self.mutate_top(|set| append(set, items))?;
            }
            b's' => {
                let value = self.pop()?;
                let key = self.pop()?;
                self.mutate_top(|dict| set_items(dict, vec![(key, value)]))?;
            }
            b'u' => {
                let items = pairs(self.pop_mark()?)?;
                self.mutate_top(|dict| set_items(dict, items))?;
            }
            b'p' => {
                let index: u32 = self.line()?.parse().context("bad PUT")?;
                self.memoize(index)?;
            }
            b'q' => {
                let index = self.byte()? as u32;
                self.memoize(index)?;
            }
            b'r' => {
                let index = self.u32()? as u32;
                self.memoize(index)?;
            }
            0x94 => {
                let index = self.memo.len() as u32;
                self.memoize(index)?;
            }
            b'g' => {
                let index: u32 = self.line()?.parse().context("bad GET")?;
                self.get(index)?;
            }
            b'h' => {
                let index = self.byte()? as u32;
                self.get(index)?;
            }
            b'j' => {
                let index = self.u32()? as u32;
                self.get(index)?;
            }
            b'c' => {
                let module = self.line()?.to_string();
                let name = self.line()?.to_string();
                self.push(Value::Global { module, name });
            }
            0x93 => {
                let name = self.pop()?;
                let module = self.pop()?;
                match (module, name) {
                    (Value::Str(module), Value::Str(name)) => {
                        self.push(Value::Global { module, name })
                    }
                    _ => bail!("STACK_GLOBAL needs two strings"),
                }
            }
            b'R' => {
                let args = self.pop()?;
                let callable = self.pop()?;
                let args = match args {
                    Value::Tuple(items) => items,
                    other => bail!("REDUCE arguments are {}, not a tuple", other.describe()),
                };
                self.push(call(callable, args)?);
            }
            0x81 => {
                let args = self.pop()?;
                let class = self.pop()?;
                let args = match args {
                    Value::Tuple(items) => items,
                    other => bail!("NEWOBJ arguments are {}, not a tuple", other.describe()),
                };
                self.push(call(class, args)?);
            }
            0x92 => {
                let _kwargs = self.pop()?;
                let args = self.pop()?;
                let class = self.pop()?;
                let args = args.items().map(<[Value]>::to_vec).unwrap_or_default();
                self.push(call(class, args)?);
            }
            b'o' => {
                let mut items = self.pop_mark()?;
                ensure!(!items.is_empty(), "OBJ without a class");
                let class = items.remove(0);
                self.push(call(class, items)?);
            }
            b'i' => {
                let module = self.line()?.to_string();
                let name = self.line()?.to_string();
                let items = self.pop_mark()?;
                self.push(call(Value::Global { module, name }, items)?);
            }
            b'b' => {
                let state = self.pop()?;
                self.mutate_top(|object| build(object, state))?;
            }
            b'Q' => {
                let pid = self.pop()?;
                let value = persistent_load(pid)?;
                self.push(value);
            }
            b'P' => {
                let pid = Value::Str(self.line()?.to_string());
                let value = persistent_load(pid)?;
                self.push(value);
            }
            0x97 | 0x98 => bail!("out-of-band pickle buffers are not supported"),
            0x82..=0x84 => bail!("pickle extension registry codes are not supported"),
            other => bail!("unknown pickle opcode 0x{other:02x}"),
        }
        Ok(())
    }
}

fn long_from_bytes(bytes: &[u8]) -> Value {
    if bytes.is_empty() {
        return Value::Int(0);
    }
    if bytes.len() <= 8 {
        let negative = bytes[bytes.len() - 1] & 0x80 != 0;
        let mut full = if negative { [0xffu8; 8] } else { [0u8; 8] };
        full[..bytes.len()].copy_from_slice(bytes);
        return Value::Int(i64::from_le_bytes(full));
    }
    Value::BigInt(bytes.to_vec())
}

/// Python's raw-unicode-escape for protocol 0 `UNICODE` lines.
fn unescape_raw_unicode(line: &str) -> String {
    let mut out = String::new();
    let mut chars = line.chars().peekable();
    while let Some(c) = chars.next() {
        if c == '\\' && matches!(chars.peek(), Some('u') | Some('U')) {
            let width = if chars.next() == Some('u') { 4 } else { 8 };
            let hex: String = chars.by_ref().take(width).collect();
            if let Some(decoded) = u32::from_str_radix(&hex, 16).ok().and_then(char::from_u32) {
                out.push(decoded);
                continue;
            }
            out.push('\\');
            out.push_str(&hex);
        } else {
            out.push(c);
        }
    }
    out
}

fn pairs(items: Vec<Value>) -> Result<Vec<(Value, Value)>> {
    ensure!(items.len() % 2 == 0, "odd number of dict items");
    let mut out = Vec::with_capacity(items.len() / 2);
    let mut iter = items.into_iter();
    while let (Some(k), Some(v)) = (iter.next(), iter.next()) {
        out.push((k, v));
    }
    Ok(out)
}

fn append(target: &mut Value, items: Vec<Value>) -> Result<()> {
    match target {
        Value::List(list) | Value::Set(list) => list.extend(items),
        // `collections.deque` and other list-like objects keep their items as arguments.
        Value::Object { args, .. } => args.extend(items),
        other => bail!("APPEND to {}", other.describe()),
    }
    Ok(())
}

fn set_items(target: &mut Value, items: Vec<(Value, Value)>) -> Result<()> {
    match target {
        Value::Dict(dict) => {
            // Pickled dicts never repeat a key, so items are appended without a lookup.
            dict.extend(items);
        }
        // A dict subclass this reader does not know: keep the items as its state.
        Value::Object { state, .. } => {
            let dict = state.get_or_insert_with(|| Box::new(Value::Dict(Vec::new())));
            set_items(dict, items)?;
        }
        other => bail!("SETITEM on {}", other.describe()),
    }
    Ok(())
}

/// `BUILD`: sets an object's state; numpy arrays and dtypes become [`Value::Numpy`] parts.
fn build(object: &mut Value, state: Value) -> Result<()> {
    match object {
        Value::Object {
            module,
            name,
            state: slot,
            args,
        } => {
            if name == "ndarray" && module.starts_with("numpy") {
                *object = numpy_array(args, &state)?;
            } else if name == "dtype" && module.starts_with("numpy") {
                // state: (version, byte order, ...); keep the order with the type code.
                if let (Some(Value::Str(code)), Some(Value::Str(order))) =
                    (args.first(), state.items().and_then(|s| s.get(1)))
                {
                    let order = if order == "|" || order == "=" {
                        "<"
                    } else {
                        order.as_str()
                    };
                    *object = Value::Str(format!("{order}{code}"));
                } else {
                    *slot = Some(Box::new(state));
                }
            } else {
                *slot = Some(Box::new(state));
            }
        }
        Value::Dict(items) => {
            if let Value::Dict(extra) = state {
                items.extend(extra);
            }
        }
        // Tensors' BUILD carries Python attributes (rare); the data is what matters.
        Value::Tensor(_) => {}
        other => bail!("BUILD on {}", other.describe()),
    }
    Ok(())
}

/// numpy's `ndarray.__setstate__((version, shape, dtype, is_fortran, data))`.
fn numpy_array(_args: &[Value], state: &Value) -> Result<Value> {
    let parts = state.items().context("numpy array state is not a tuple")?;
    ensure!(
        parts.len() >= 5,
        "numpy array state has {} parts",
        parts.len()
    );
    let shape = parts[1]
        .items()
        .context("numpy array shape")?
        .iter()
        .map(|d| {
            d.as_i64()
                .map(|d| d as usize)
                .context("numpy array dimension")
        })
        .collect::<Result<Vec<_>>>()?;
    let dtype = match &parts[2] {
        Value::Str(s) => s.clone(),
        other => bail!("numpy array dtype {}", other.describe()),
    };
    ensure!(
        parts[3].as_bool() != Some(true) || shape.len() <= 1,
        "Fortran-ordered numpy arrays are not supported"
    );
    let data = match &parts[4] {
        Value::Bytes(b) => b.clone(),
        Value::Str(s) => latin1(s)?,
        other => bail!("numpy array data {}", other.describe()),
    };
    Ok(Value::Numpy(NumpyArray { dtype, shape, data }))
}

fn latin1(text: &str) -> Result<Vec<u8>> {
    text.chars()
        .map(|c| {
            u8::try_from(c as u32).map_err(|_| anyhow::anyhow!("non-latin-1 character in bytes"))
        })
        .collect()
}

/// Calls a global the few ways PyTorch checkpoints need; every other call becomes an opaque
/// object.
fn call(callable: Value, mut args: Vec<Value>) -> Result<Value> {
    let (module, name) = match callable {
        Value::Global { module, name } => (module, name),
        other => bail!("cannot call {}", other.describe()),
    };
    Ok(match (module.as_str(), name.as_str()) {
        ("torch._utils", "_rebuild_tensor_v2") | ("torch._utils", "_rebuild_tensor") => {
            rebuild_tensor(&args)?
        }
        // `_rebuild_from_type_v2(func, new_type, args, state)`: a tensor subclass; its data is func(*args).
        ("torch._tensor", "_rebuild_from_type_v2") => {
            ensure!(
                args.len() >= 3,
                "_rebuild_from_type_v2 with {} arguments",
                args.len()
            );
            let inner = args[2]
                .items()
                .context("_rebuild_from_type_v2 arguments")?
                .to_vec();
            call(args.swap_remove(0), inner)?
        }
        ("torch._utils", "_rebuild_parameter")
        | ("torch._utils", "_rebuild_parameter_with_state") => {
            ensure!(!args.is_empty(), "_rebuild_parameter without a tensor");
            args.swap_remove(0)
        }
        ("collections", "OrderedDict") | ("builtins", "dict") | ("__builtin__", "dict") => {
            match args.pop() {
                Some(Value::List(items)) => Value::Dict(
                    items
                        .into_iter()
                        .filter_map(|pair| match pair {
                            Value::Tuple(mut kv) if kv.len() == 2 => {
                                let v = kv.pop().unwrap();
                                Some((kv.pop().unwrap(), v))
                            }
                            _ => None,
                        })
                        .collect(),
                ),
                _ => Value::Dict(Vec::new()),
            }
        }
        ("builtins", "set") | ("builtins", "frozenset") => Value::Set(
            args.pop()
                .and_then(|v| v.items().map(<[Value]>::to_vec))
                .unwrap_or_default(),
        ),
        ("_codecs", "encode") => match args.first() {
            Some(Value::Str(text)) => Value::Bytes(latin1(text)?),
            _ => bail!("_codecs.encode without a string"),
        },
        ("builtins", "bytearray") | ("__builtin__", "bytearray") => match args.first() {
            Some(Value::Bytes(b)) => Value::Bytes(b.clone()),
            Some(Value::Str(s)) => Value::Bytes(latin1(s)?),
            _ => Value::Bytes(Vec::new()),
        },
        (m, "scalar") if m.starts_with("numpy") => match (args.first(), args.get(1)) {
            (Some(Value::Str(dtype)), Some(Value::Bytes(data))) => Value::Numpy(NumpyArray {
                dtype: dtype.clone(),
                shape: Vec::new(),
                data: data.clone(),
            }),
            _ => Value::Object {
                module,
                name,
                args,
                state: None,
            },
        },
        (m, "_reconstruct") if m.starts_with("numpy") => Value::Object {
            module: "numpy".into(),
            name: "ndarray".into(),
            args: Vec::new(),
            state: None,
        },
        _ => Value::Object {
            module,
            name,
            args,
            state: None,
        },
    })
}

fn usize_list(value: &Value, what: &str) -> Result<Vec<usize>> {
    value
        .items()
        .with_context(|| format!("tensor {what} is {}", value.describe()))?
        .iter()
        .map(|v| {
            v.as_i64()
                .filter(|&v| v >= 0)
                .map(|v| v as usize)
                .with_context(|| format!("tensor {what} entry {}", v.describe()))
        })
        .collect()
}

/// `_rebuild_tensor_v2(storage, storage_offset, size, stride, requires_grad, hooks, ...)`.
fn rebuild_tensor(args: &[Value]) -> Result<Value> {
    ensure!(
        args.len() >= 4,
        "_rebuild_tensor with {} arguments",
        args.len()
    );
    let storage = match &args[0] {
        Value::Storage(s) => s.clone(),
        other => bail!("tensor storage is {}", other.describe()),
    };
    let offset = args[1]
        .as_i64()
        .filter(|&o| o >= 0)
        .context("tensor offset")? as usize;
    let shape = usize_list(&args[2], "size")?;
    let stride = usize_list(&args[3], "stride")?;
    ensure!(
        shape.len() == stride.len(),
        "tensor size and stride differ in rank"
    );
    let tensor = TensorRef {
        storage,
        offset,
        shape,
        stride,
    };
    // Sizes come from the file: computed with overflow checks so that a crafted shape is an
    // error, not a wrapped product that passes the bounds check below.
    let numel = tensor
        .shape
        .iter()
        .try_fold(1usize, |n, &d| n.checked_mul(d))
        .filter(|n| n.checked_mul(tensor.storage.dtype.size()).is_some())
        .with_context(|| format!("tensor of shape {:?}: impossible size", tensor.shape))?;
    if numel > 0 {
        let last = tensor
            .shape
            .iter()
            .zip(&tensor.stride)
            .try_fold(tensor.offset, |at, (&n, &s)| {
                (n - 1).checked_mul(s).and_then(|step| at.checked_add(step))
            });
        ensure!(
            last.is_some_and(|last| last < tensor.storage.numel) && numel <= tensor.storage.numel,
            "tensor {:?} at offset {} reaches beyond its storage {} of {} elements",
            tensor.shape,
            tensor.offset,
            tensor.storage.key,
            tensor.storage.numel
        );
    }
    Ok(Value::Tensor(tensor))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn load(bytes: &[u8]) -> Value {
        unpickle(bytes, &mut |pid| Ok(pid)).unwrap()
    }

    /// Tensors whose sizes do not fit in memory, let alone the file, are refused before any
    /// product of them wraps around.
    #[test]
    fn impossible_tensor_sizes_are_refused() {
        // A float32 storage of 2^62 elements, viewed whole (its bytes overflow 64 bits):
        // pickle.dumps of torch._utils._rebuild_tensor_v2 over the persistent id
        // ('storage', torch.FloatStorage, '0', 'cpu', 2**62), protocol 2.
        let huge_storage = b"\x80\x02ctorch._utils\n_rebuild_tensor_v2\nq\x00((X\x07\x00\x00\x00storageq\x01ctorch\nFloatStorage\nq\x02X\x01\x00\x00\x000q\x03X\x03\x00\x00\x00cpuq\x04\x8a\x08\x00\x00\x00\x00\x00\x00\x00@tq\x05QK\x00\x8a\x08\x00\x00\x00\x00\x00\x00\x00@\x85q\x06K\x01\x85q\x07\x89ccollections\nOrderedDict\nq\x08)Rq\ttq\nRq\x0b.";
        let error = unpickle(huge_storage, &mut torch_persistent_load).unwrap_err();
        assert!(
            format!("{error:#}").contains("storage 0: impossible size"),
            "{error:#}"
        );
        // A [2^31, 2^31, 2^31] view with zero strides of a 4-element storage (2^93 elements).
        let huge_view = b"\x80\x02ctorch._utils\n_rebuild_tensor_v2\nq\x00((X\x07\x00\x00\x00storageq\x01ctorch\nFloatStorage\nq\x02X\x01\x00\x00\x000q\x03X\x03\x00\x00\x00cpuq\x04K\x04tq\x05QK\x00\x8a\x05\x00\x00\x00\x80\x00\x8a\x05\x00\x00\x00\x80\x00\x8a\x05\x00\x00\x00\x80\x00\x87q\x06K\x00K\x00K\x00\x87q\x07\x89ccollections\nOrderedDict\nq\x08)Rq\ttq\nRq\x0b.";
        let error = unpickle(huge_view, &mut torch_persistent_load).unwrap_err();
        assert!(
            format!("{error:#}").contains("impossible size"),
            "{error:#}"
        );
    }

    #[test]
    fn reads_protocol_two_containers() {
        // pickle.dumps({'a': [1, 2.5, None, True], 'b': (300, 'x')}, protocol=2)
        let bytes = b"\x80\x02}q\x00(X\x01\x00\x00\x00aq\x01]q\x02(K\x01G@\x04\x00\x00\x00\x00\x00\x00N\x88eX\x01\x00\x00\x00bq\x03M,\x01X\x01\x00\x00\x00xq\x04\x86q\x05u.";
        let value = load(bytes);
        assert_eq!(
            value.get("a"),
            Some(&Value::List(vec![
                Value::Int(1),
                Value::Float(2.5),
                Value::None,
                Value::Bool(true)
            ]))
        );
        assert_eq!(
            value.get("b"),
            Some(&Value::Tuple(vec![Value::Int(300), Value::Str("x".into())]))
        );
    }

    #[test]
    fn unknown_globals_become_opaque_objects_and_memo_sees_mutations() {
        // l = []; pickle.dumps([l, Foo(), l]) by hand: memoized list mutated after PUT.
        let bytes = b"\x80\x02](]q\x01K\x07acmegatron.core.enums\nModelType\nK\x01\x85Rh\x01e.";
        let value = load(bytes);
        let items = value.items().unwrap();
        assert_eq!(items[0], Value::List(vec![Value::Int(7)]));
        assert_eq!(items[2], items[0]);
        assert!(matches!(&items[1], Value::Object { module, name, .. }
            if module == "megatron.core.enums" && name == "ModelType"));
    }

    #[test]
    fn truncated_input_is_an_error() {
        let error = unpickle(b"\x80\x02]q\x00(K\x01", &mut |p| Ok(p)).unwrap_err();
        assert!(format!("{error:#}").contains("truncated"), "{error:#}");
    }
}
