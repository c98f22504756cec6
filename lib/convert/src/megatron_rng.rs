//! The generator states a Megatron `--ckpt-format torch` rank file carries (`rng_state`, as
//! core_v0.14.0's `get_rng_state` collects them), without which Megatron's `pretrain_gpt.py`
//! stops at load unless given `--no-load-rng`. Written as Megatron's own start leaves them for
//! the rank (`_set_random_seed`: `--seed` plus 100 per pipeline stage, then
//! `model_parallel_cuda_manual_seed`): Python's `random`, numpy's and torch's CPU generator
//! seeded, the CUDA generator and the tensor-parallel tracker's three states at their seeds.
//! Our own generators' states are not carried: our kernels draw dropout masks differently
//! from Megatron's, so a continuation draws fresh masks either way, as `--no-load-rng` would.

use megatron_checkpoint::torch_writer::{Saved, TensorSlot};
use megatron_checkpoint::{DType, Value};
use megatron_data::random::Mt19937;

/// A rank's place in the grids Megatron seeds by.
#[derive(Debug, Clone, Copy)]
pub(super) struct RankSeeds {
    /// `--seed` of the run.
    pub seed: i64,
    pub tensor_rank: usize,
    pub pipeline_rank: usize,
    pub expert_rank: usize,
}

/// A generator state tensor (`torch.uint8`) of the rank file: its slot and bytes.
pub(super) struct StateBytes {
    pub slot: TensorSlot,
    pub bytes: Vec<u8>,
}

/// The `rng_state` entry of a rank file (a list of one state: Megatron reads entry 0 unless
/// `--data-parallel-random-init`), its tensors appended to `tensors`; `first_slot` is the slot
/// index of the first of them in the file.
pub(super) fn rng_state_entry(
    seeds: RankSeeds,
    first_slot: usize,
    tensors: &mut Vec<StateBytes>,
) -> Saved {
    // `_set_random_seed`: each pipeline stage seeds apart.
    let seed = seeds.seed + 100 * seeds.pipeline_rank as i64;
    let mut tensor = |bytes: Vec<u8>| {
        tensors.push(StateBytes {
            slot: TensorSlot {
                dtype: DType::U8,
                shape: vec![bytes.len()],
            },
            bytes,
        });
        Saved::Tensor(first_slot + tensors.len() - 1)
    };
    let seeded = Mt19937::new(seed as u32);
    let (words, position) = seeded.words();
    let torch_rng_state = tensor(torch_cpu_state(seed as u64, words));
    // `model_parallel_cuda_manual_seed`: the CUDA generator at the data-parallel seed, and
    // the tracker's states at their seeds.
    let cuda_rng_state = tensor(cuda_state(seed as u64));
    let tracker = [
        ("data-parallel-rng", seed),
        ("model-parallel-rng", seed + 2718 + seeds.tensor_rank as i64),
        (
            "expert-parallel-rng",
            seed + 1024 + 100 * seeds.expert_rank as i64,
        ),
    ]
    .map(|(name, seed)| (name.to_string(), tensor(cuda_state(seed as u64))));
    let python_key: Vec<u32> = {
        // Python's `random.seed(int)` keys with the integer's 32-bit words.
        let mut magnitude = seed.unsigned_abs();
        let mut key = Vec::new();
        while magnitude > 0 {
            key.push(magnitude as u32);
            magnitude >>= 32;
        }
        key
    };
    let python = Mt19937::from_key(&python_key);
    let (python_words, python_position) = python.words();
    let mut python_state: Vec<Value> = python_words
        .iter()
        .map(|&w| Value::Int(i64::from(w)))
        .collect();
    python_state.push(Value::Int(python_position as i64));
    let numpy_key = words.iter().map(|&w| Value::Int(i64::from(w))).collect();
    let state = Saved::Dict(vec![
        (
            "random_rng_state".into(),
            Saved::Value(Value::Tuple(vec![
                Value::Int(3),
                Value::Tuple(python_state),
                Value::None,
            ])),
        ),
        (
            // numpy's legacy state tuple; `set_state` takes the key as any sequence.
            "np_rng_state".into(),
            Saved::Value(Value::Tuple(vec![
                Value::Str("MT19937".into()),
                Value::List(numpy_key),
                Value::Int(position as i64),
                Value::Int(0),
                Value::Float(0.0),
            ])),
        ),
        ("torch_rng_state".into(), torch_rng_state),
        ("cuda_rng_state".into(), cuda_rng_state),
        ("rng_tracker_states".into(), Saved::Dict(tracker.into())),
    ]);
    Saved::List(vec![state])
}

/// torch's CPU generator state after `torch.manual_seed(seed)` (`torch.get_rng_state()`: the
/// seed, `left` 1, `seeded` 1, `next` 0, the 624 Mersenne Twister words widened to 64 bits, no
/// cached normal samples).
fn torch_cpu_state(seed: u64, words: &[u32]) -> Vec<u8> {
    let mut bytes = Vec::with_capacity(5056);
    bytes.extend_from_slice(&seed.to_le_bytes());
    bytes.extend_from_slice(&1i32.to_le_bytes());
    bytes.extend_from_slice(&1i32.to_le_bytes());
    bytes.extend_from_slice(&0u64.to_le_bytes());
    for &word in words {
        bytes.extend_from_slice(&u64::from(word).to_le_bytes());
    }
    bytes.resize(5056, 0);
    bytes
}

/// A CUDA (Philox) generator's state after `torch.cuda.manual_seed(seed)`: the seed and an
/// offset of 0.
fn cuda_state(seed: u64) -> Vec<u8> {
    let mut bytes = seed.to_le_bytes().to_vec();
    bytes.extend_from_slice(&0u64.to_le_bytes());
    bytes
}
