//! A decode step's embedding as one kernel: each row's word embedding plus, with learned
//! absolute positions, its position's embedding. libtorch runs it as two lookups and an add,
//! three launches in a step whose every kernel costs a few microseconds of latency; here one
//! block per row reads both rows of the tables and writes their sum, rounded once to the
//! tables' dtype as libtorch's add rounds it, so the result is the same bits.
//!
//! The kernel lets the step's next kernel start at once (a programmatic dependent launch on
//! Hopper): the first layer's kernel then loads its weights while the embedding runs, and waits
//! for it before reading the hidden states.
//!
//! Compiled at run time ([`crate::runtime::nvrtc`]) and launched on libtorch's current stream.

use anyhow::{bail, ensure, Result};
use tch::{Device, Kind, Tensor};

use super::{dtype_name, kernel_arg, passes_self_check, turned_off};
use crate::runtime::nvrtc::{kernels, KernelSource};

/// `MEGATRON_RS_DECODE_EMBEDDING=0` keeps libtorch's lookups and add (to compare the two).
pub const VARIABLE: &str = "MEGATRON_RS_DECODE_EMBEDDING";

/// Threads of a block (one row).
const THREADS: u32 = 128;

/// The kernel's CUDA source (`lib/kernels/cuda/decode_embedding.cu`).
pub const SOURCE: KernelSource = KernelSource {
    name: "decode_embedding",
    source: include_str!("../../cuda/decode_embedding.cu"),
    headers: super::HEADERS,
    functions: &["decode_embed_bf16", "decode_embed_f16", "decode_embed_f32"],
    prefer_shared_memory: false,
};

/// Whether the kernel serves `words` (`[vocabulary, hidden]`) and `places` (`[positions,
/// hidden]`, learned absolute positions, when the model has them) on their device: contiguous
/// tables of one dtype on a CUDA device, not turned off by [`VARIABLE`], and the self-check
/// passed there (once per device and dtype; a failure is reported once).
pub fn usable(words: &Tensor, places: Option<&Tensor>) -> bool {
    let device = words.device();
    let Device::Cuda(index) = device else {
        return false;
    };
    let kind = words.kind();
    let table = |t: &Tensor| t.dim() == 2 && t.is_contiguous() && t.size()[1] == words.size()[1];
    let applies = dtype_name(kind).is_ok()
        && table(words)
        && words.size()[1] < i64::from(i32::MAX)
        && places.is_none_or(|p| table(p) && p.kind() == kind && p.device() == device)
        && !turned_off(VARIABLE);
    applies
        && passes_self_check(
            "the decode embedding kernel",
            device,
            kind,
            0,
            "libtorch's lookups",
            || self_check(index, kind),
        )
}

/// `words[tokens] + places[positions]` (`places` when given) for `tokens` and `positions`
/// (int64 on the tables' device, `[rows, 1]`, one decode position per row), laid out `[1,
/// rows, hidden]` as the layers take it. The caller checks [`usable`] first.
pub fn embed(
    words: &Tensor,
    places: Option<&Tensor>,
    tokens: &Tensor,
    positions: &Tensor,
) -> Result<Tensor> {
    let Device::Cuda(device) = words.device() else {
        bail!("the decode embedding kernel runs on CUDA devices");
    };
    let (vocabulary, hidden) = words.size2()?;
    let rows = tokens.numel() as i64;
    ensure!(
        tokens.size() == [rows, 1] && positions.size() == [rows, 1],
        "decode embedding of tokens {:?} at positions {:?}: one position per row",
        tokens.size(),
        positions.size()
    );
    ensure!(
        tokens.kind() == Kind::Int64 && positions.kind() == Kind::Int64,
        "decode embedding of {:?} tokens at {:?} positions: int64 expected",
        tokens.kind(),
        positions.kind()
    );
    let out = Tensor::empty([1, rows, hidden], (words.kind(), words.device()));
    if rows == 0 {
        return Ok(out);
    }
    let (tokens, positions) = (tokens.contiguous(), positions.contiguous());
    let module = kernels(&SOURCE, device)?;
    let function = format!("decode_embed_{}", dtype_name(words.kind())?);
    let mut words_ptr = words.data_ptr() as u64;
    let mut places_ptr = places.map_or(0, |p| p.data_ptr() as u64);
    let mut places_rows = places.map_or(0, |p| p.size()[0]);
    let [mut tokens_ptr, mut positions_ptr, mut out_ptr] =
        [&tokens, &positions, &out].map(|t| t.data_ptr() as u64);
    let (mut vocabulary_arg, mut hidden_arg) = (vocabulary, hidden as i32);
    // SAFETY: the arguments match the kernel's parameters in order and type (pointers as u64,
    // table sizes as i64, the width as i32); the tables are contiguous `[*, hidden]` tensors of
    // the kernel's dtype (checked by `usable`), `tokens` and `positions` hold `rows` int64
    // values, `out` is a fresh `[rows, hidden]` tensor of that dtype, and the kernel reads
    // table rows only inside their sizes.
    unsafe {
        module.launch(
            &function,
            (rows as u32, 1, 1),
            (THREADS, 1, 1),
            &mut [
                kernel_arg(&mut words_ptr),
                kernel_arg(&mut vocabulary_arg),
                kernel_arg(&mut places_ptr),
                kernel_arg(&mut places_rows),
                kernel_arg(&mut tokens_ptr),
                kernel_arg(&mut positions_ptr),
                kernel_arg(&mut hidden_arg),
                kernel_arg(&mut out_ptr),
            ],
        )?;
    }
    Ok(out)
}

/// What [`embed`] computes, in libtorch's operations (as the model embeds without the kernel).
pub fn reference(
    words: &Tensor,
    places: Option<&Tensor>,
    tokens: &Tensor,
    positions: &Tensor,
) -> Tensor {
    let looked_up = Tensor::embedding(words, tokens, -1, false, false);
    let out = match places {
        Some(places) => looked_up + Tensor::embedding(places, positions, -1, false, false),
        None => looked_up,
    };
    out.transpose(0, 1)
}

/// Runs the kernel on made-up tables on CUDA device `device` in `kind` against
/// [`reference`]: the same bits, with and without position embeddings, on repeated tokens.
pub fn self_check(device: usize, kind: Kind) -> Result<()> {
    let cuda = Device::Cuda(device);
    let inputs = super::self_check_inputs(kind, cuda);
    let (words, places) = (inputs(&[97, 72], 0.37, 1.0), inputs(&[40, 72], 0.11, 1.0));
    let tokens = Tensor::from_slice(&[5i64, 96, 0, 5, 41])
        .to_device(cuda)
        .view([5, 1]);
    let positions = Tensor::from_slice(&[0i64, 39, 7, 7, 12])
        .to_device(cuda)
        .view([5, 1]);
    for places in [Some(&places), None] {
        let got = embed(&words, places, &tokens, &positions)?;
        let want = reference(&words, places, &tokens, &positions);
        ensure!(
            got.equal(&want),
            "differs from libtorch's lookups by {:e}",
            super::relative_error(&got, &want)
        );
    }
    Ok(())
}
