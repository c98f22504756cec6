//! NCCL collectives on CUDA tensors: the multi-GPU backend, with the semantics of the host
//! backends (threads.rs) that the CPU tests pin down.
//!
//! NCCL is reached through cudarc's raw bindings, which dlopen it at the first call, so
//! building needs no CUDA. Every operation is enqueued on libtorch's current stream of the
//! communicator's device: it is ordered with the kernels that produce and consume its tensors
//! without the host waiting, and the temporary buffers made here are only used on that stream,
//! so libtorch's caching allocator may recycle them as soon as they are dropped.
//!
//! A process must hold one NCCL: libtorch_cuda links the NVIDIA wheel's `libnccl.so.2`, while
//! cudarc opens `libnccl.so`. scripts/torch-env.sh puts a `libnccl.so` symlink to libtorch's
//! file on LD_LIBRARY_PATH; the dynamic loader recognises the file as already loaded (same
//! inode) and returns that copy. [`load_nccl`] checks that this is what happened.

use std::ffi::CStr;
use std::os::raw::{c_char, c_int};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock, PoisonError};

use anyhow::{anyhow, bail, ensure, Context, Result};
use cudarc::nccl::result::{self as nccl, NcclError, NcclStatus};
use cudarc::nccl::sys::{self, cudaStream_t, ncclComm_t, ncclDataType_t, ncclRedOp_t};
use tch::{Device, Kind, Tensor};

use super::communicator::{Communicator, P2pOp, ReduceOp};
use megatron_kernels::runtime;

const CPU_HINT: &str = "use --distributed-backend gloo for CPU";

/// One rank's handle on an NCCL communicator bound to one GPU.
pub struct NcclCommunicator {
    rank: usize,
    size: usize,
    device_index: usize,
    /// An NCCL communicator must not be used by two threads at once.
    comm: Mutex<Comm>,
}

struct Comm {
    handle: ncclComm_t,
    /// Set when an NCCL call failed: peers may be gone, so teardown aborts instead of waiting.
    failed: bool,
}

// SAFETY: the handle is only used under the mutex, and NCCL allows any thread to use it.
unsafe impl Send for Comm {}

impl NcclCommunicator {
    /// A fresh communicator id (ncclGetUniqueId). One rank makes it and sends the bytes to the
    /// others, which all pass them to [`NcclCommunicator::new`].
    pub fn unique_id() -> Result<[u8; 128]> {
        load_nccl()?;
        let id = nccl::get_uniqueid().map_err(|e| nccl_error(e, "ncclGetUniqueId"))?;
        Ok(id.internal.map(|byte| byte as u8))
    }

    /// Joins the group of `size` ranks named by `id` as `rank`, on `device`
    /// (ncclCommInitRank); returns once every rank has joined.
    pub fn new(id: [u8; 128], size: usize, rank: usize, device: Device) -> Result<Self> {
        let Device::Cuda(device_index) = device else {
            bail!("NCCL needs a CUDA device, not {device:?}; {CPU_HINT}");
        };
        ensure!(rank < size, "rank {rank} in an NCCL group of {size}");
        let ranks = c_int::try_from(size).context("NCCL group size")?;
        load_nccl()?;
        // ncclCommInitRank binds the communicator to the calling thread's current device.
        runtime::set_cuda_device(device_index)?;
        let id = sys::ncclUniqueId {
            internal: id.map(|byte| byte as c_char),
        };
        let mut handle = std::ptr::null_mut();
        // SAFETY: `handle` is a valid out-pointer; NCCL copies the id.
        unsafe { nccl::comm_init_rank(&mut handle, ranks, id, rank as c_int) }
            .map_err(|e| nccl_error(e, "ncclCommInitRank"))
            .with_context(|| {
                format!("joining an NCCL group of {size} as rank {rank} on cuda:{device_index}")
            })?;
        Ok(NcclCommunicator {
            rank,
            size,
            device_index,
            comm: Mutex::new(Comm {
                handle,
                failed: false,
            }),
        })
    }

    /// Enqueues NCCL work on libtorch's current stream of this communicator's device. Nothing
    /// is enqueued when `count` (elements moved) is zero: every rank knows the shapes, so all
    /// skip alike, and NCCL need not see empty buffers.
    fn run(
        &self,
        operation: &str,
        count: usize,
        enqueue: impl FnOnce(ncclComm_t, cudaStream_t) -> Result<NcclStatus, NcclError>,
    ) -> Result<()> {
        if count == 0 {
            return Ok(());
        }
        runtime::set_cuda_device(self.device_index)?;
        let stream = runtime::current_cuda_stream(self.device_index)? as cudaStream_t;
        let mut comm = self.comm.lock().unwrap_or_else(PoisonError::into_inner);
        enqueue(comm.handle, stream).map_err(|e| {
            comm.failed = true;
            nccl_error(e, operation)
        })?;
        Ok(())
    }

    fn data_type(&self, tensor: &Tensor) -> Result<ncclDataType_t> {
        nccl_type(tensor, self.device_index)
    }
}

impl Communicator for NcclCommunicator {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.size
    }

    fn all_reduce(&self, tensor: &Tensor, op: ReduceOp) -> Result<()> {
        let dtype = self.data_type(tensor).context("all_reduce")?;
        let op = reduce_op(op, tensor.kind());
        let buffer = tensor.contiguous();
        let (data, count) = (buffer.data_ptr(), buffer.numel());
        // SAFETY: `buffer` is a contiguous tensor of `count` elements on the communicator's
        // device, alive until the stream has run the reduction.
        self.run("ncclAllReduce", count, |comm, stream| unsafe {
            nccl::all_reduce(data, data, count, dtype, op, comm, stream)
        })?;
        write_back(tensor, &buffer)
    }

    fn all_gather(&self, tensor: &Tensor, dim: i64) -> Result<Tensor> {
        let dtype = self.data_type(tensor).context("all_gather")?;
        let input = tensor.contiguous();
        let shape = input.size();
        let dim = dim_index(dim, &shape).context("all_gather")?;
        let group = self.size as i64;
        // NCCL stacks the ranks' buffers: [group, shape...]. Moving the rank axis next to `dim`
        // and merging the two concatenates along `dim` in rank order.
        let stacked: Vec<i64> = std::iter::once(group)
            .chain(shape.iter().copied())
            .collect();
        let output = Tensor::empty(stacked, (tensor.kind(), tensor.device()));
        let count = input.numel();
        // SAFETY: contiguous buffers on the communicator's device; `output` holds `group`
        // blocks of `count` elements.
        self.run("ncclAllGather", count, |comm, stream| unsafe {
            nccl::all_gather(
                input.data_ptr(),
                output.data_ptr(),
                count,
                dtype,
                comm,
                stream,
            )
        })?;
        let mut gathered = shape;
        gathered[dim] *= group;
        Ok(output.movedim(0, dim as i64).reshape(gathered))
    }

    fn reduce_scatter(&self, tensor: &Tensor, dim: i64) -> Result<Tensor> {
        let dtype = self.data_type(tensor).context("reduce_scatter")?;
        let shape = tensor.size();
        let dim_at = dim_index(dim, &shape).context("reduce_scatter")?;
        let group = self.size as i64;
        ensure!(
            shape[dim_at] % group == 0,
            "reduce_scatter: dimension {dim} of {shape:?} is not divisible by the group size {group}"
        );
        // NCCL gives rank r the r-th contiguous block: split `dim` into (group, width) and move
        // the group axis to the front, so block r is the r-th slice along `dim`.
        let mut slice = shape.clone();
        slice[dim_at] /= group;
        let mut split = slice.clone();
        split.insert(dim_at, group);
        let input = tensor.reshape(split).movedim(dim_at as i64, 0).contiguous();
        let output = Tensor::empty(slice, (tensor.kind(), tensor.device()));
        let op = reduce_op(ReduceOp::Sum, tensor.kind());
        let count = output.numel();
        // SAFETY: contiguous buffers on the communicator's device; `input` holds `group`
        // blocks of `count` elements.
        self.run("ncclReduceScatter", count, |comm, stream| unsafe {
            nccl::reduce_scatter(
                input.data_ptr(),
                output.data_ptr(),
                count,
                dtype,
                op,
                comm,
                stream,
            )
        })?;
        Ok(output)
    }

    fn broadcast(&self, tensor: &Tensor, root: usize) -> Result<()> {
        ensure!(
            root < self.size,
            "broadcast from rank {root} in a group of {}",
            self.size
        );
        let dtype = self.data_type(tensor).context("broadcast")?;
        let buffer = tensor.contiguous();
        let (data, count) = (buffer.data_ptr(), buffer.numel());
        // SAFETY: as for all_reduce.
        self.run("ncclBroadcast", count, |comm, stream| unsafe {
            nccl::broadcast(data, data, count, dtype, root as c_int, comm, stream)
        })?;
        write_back(tensor, &buffer)
    }

    /// NCCL has no barrier: all-reduce a token and wait for it on the host, which can only
    /// happen once every rank has joined the reduction.
    fn barrier(&self) -> Result<()> {
        let token = Tensor::zeros([1], (Kind::Float, Device::Cuda(self.device_index)));
        self.all_reduce(&token, ReduceOp::Sum).context("barrier")?;
        token.f_double_value(&[0]).context("barrier")?;
        Ok(())
    }

    fn exchange(&self, ops: &[P2pOp]) -> Result<()> {
        // Contiguous buffers, alive until the group is enqueued; receives into copies are
        // written back afterwards.
        let mut transfers = Vec::with_capacity(ops.len());
        for op in ops {
            let (tensor, peer) = match op {
                P2pOp::Send { tensor, peer } => (*tensor, *peer),
                P2pOp::Recv { buffer, peer } => (*buffer, *peer),
            };
            ensure!(
                peer < self.size,
                "point-to-point transfer with rank {peer} in a group of {}",
                self.size
            );
            let dtype = self.data_type(tensor).context("exchange")?;
            transfers.push((op, tensor.contiguous(), dtype));
        }
        transfers.retain(|(_, buffer, _)| buffer.numel() > 0);
        // SAFETY: each buffer is contiguous, on the communicator's device, and alive until
        // the stream has run the group.
        self.run(
            "ncclSend/ncclRecv group",
            transfers.len(),
            |comm, stream| {
                nccl::group_start()?;
                let enqueued = transfers.iter().try_for_each(|(op, buffer, dtype)| {
                    let (data, count) = (buffer.data_ptr(), buffer.numel());
                    match op {
                        P2pOp::Send { peer, .. } => unsafe {
                            nccl::send(data, count, *dtype, *peer as c_int, comm, stream)
                        },
                        P2pOp::Recv { peer, .. } => unsafe {
                            nccl::recv(data, count, *dtype, *peer as c_int, comm, stream)
                        },
                    }
                    .map(drop)
                });
                // The group must be closed even when enqueueing failed.
                let ended = nccl::group_end();
                enqueued.and(ended)
            },
        )?;
        for (op, buffer, _) in &transfers {
            if let P2pOp::Recv { buffer: target, .. } = op {
                write_back(target, buffer)?;
            }
        }
        Ok(())
    }
}

impl Drop for NcclCommunicator {
    fn drop(&mut self) {
        let comm = self.comm.get_mut().unwrap_or_else(PoisonError::into_inner);
        // SAFETY: the handle came from ncclCommInitRank and is not used again. Destroy waits
        // for peers, which after a failure may never come, so that case aborts. A failing
        // teardown has no one left to report to.
        let _ = unsafe {
            if comm.failed || std::thread::panicking() {
                nccl::comm_abort(comm.handle)
            } else {
                nccl::comm_destroy(comm.handle)
            }
        };
    }
}

/// The NCCL element type of `tensor`, which must live on CUDA device `device_index`.
fn nccl_type(tensor: &Tensor, device_index: usize) -> Result<ncclDataType_t> {
    match tensor.device() {
        Device::Cuda(index) if index == device_index => data_type(tensor.kind()),
        Device::Cuda(index) => {
            bail!("tensor on cuda:{index} but the NCCL communicator is on cuda:{device_index}")
        }
        _ => bail!("NCCL needs CUDA tensors; {CPU_HINT}"),
    }
}

fn reduce_op(op: ReduceOp, kind: Kind) -> ncclRedOp_t {
    match (op, kind) {
        // torch adds booleans as a logical or, which is the maximum of NCCL's 0/1 bytes.
        (ReduceOp::Max, _) | (ReduceOp::Sum, Kind::Bool) => ncclRedOp_t::ncclMax,
        (ReduceOp::Sum, _) => ncclRedOp_t::ncclSum,
    }
}

fn data_type(kind: Kind) -> Result<ncclDataType_t> {
    use ncclDataType_t::*;
    Ok(match kind {
        Kind::Float => ncclFloat32,
        Kind::BFloat16 => ncclBfloat16,
        Kind::Half => ncclFloat16,
        Kind::Double => ncclFloat64,
        Kind::Int64 => ncclInt64,
        Kind::Int => ncclInt32,
        Kind::Int8 => ncclInt8,
        // A torch bool is one byte holding 0 or 1.
        Kind::Uint8 | Kind::Bool => ncclUint8,
        other => bail!("NCCL cannot carry {other:?} tensors"),
    })
}

/// `dim` (negative counts from the end) as an index into `shape`.
fn dim_index(dim: i64, shape: &[i64]) -> Result<usize> {
    let rank = shape.len() as i64;
    ensure!(
        (-rank..rank).contains(&dim),
        "dimension {dim} out of range for shape {shape:?}"
    );
    Ok(dim.rem_euclid(rank) as usize)
}

/// Finishes an in-place operation run on `buffer`, a contiguous copy of `target` when
/// `target` itself is not contiguous.
fn write_back(target: &Tensor, buffer: &Tensor) -> Result<()> {
    if !target.is_contiguous() {
        target.shallow_clone().f_copy_(buffer)?;
    }
    Ok(())
}

fn nccl_error(error: NcclError, operation: &str) -> anyhow::Error {
    let text = |raw: *const c_char| {
        // SAFETY: NCCL returns NUL-terminated strings it owns, or null.
        (!raw.is_null()).then(|| {
            unsafe { CStr::from_ptr(raw) }
                .to_string_lossy()
                .into_owned()
        })
    };
    // SAFETY: both only read NCCL's own state; the last error is not tied to a communicator.
    let description = text(unsafe { sys::ncclGetErrorString(error.0) });
    let last = text(unsafe { sys::ncclGetLastError(std::ptr::null_mut()) });
    let mut message = format!("{operation} failed: {:?}", error.0);
    if let Some(description) = description {
        message += &format!(" ({description})");
    }
    if let Some(last) = last.filter(|l| !l.is_empty()) {
        message += &format!(": {last}");
    }
    anyhow!(message)
}

/// Loads NCCL on first use, checking that the process ends up with a single copy of it (see
/// the module documentation); later calls return the first outcome.
fn load_nccl() -> Result<()> {
    static LOADED: OnceLock<Result<(), String>> = OnceLock::new();
    LOADED
        .get_or_init(load_single_nccl)
        .clone()
        .map_err(anyhow::Error::msg)
}

fn load_single_nccl() -> Result<(), String> {
    // libtorch_cuda's libnccl.so.2, mapped at startup (binaries link libtorch_cuda with
    // --no-as-needed).
    let libtorch_nccl = nccl_files(&process_maps()).into_iter().next();
    let fix = match &libtorch_nccl {
        Some(file) => {
            let dir = link_dir(file)
                .map(|d| format!(" ({})", d.display()))
                .unwrap_or_default();
            format!(
                "a directory on LD_LIBRARY_PATH{dir} must hold a symlink libnccl.so -> {}; \
                 `source scripts/torch-env.sh` makes it and sets LD_LIBRARY_PATH",
                file.display()
            )
        }
        None => "libtorch has no NCCL loaded (a CPU-only libtorch?); put NCCL's libnccl.so \
                 on LD_LIBRARY_PATH"
            .to_string(),
    };
    // SAFETY: dlopen of NCCL (closed again if found), which runs no code of ours.
    if !unsafe { sys::is_culib_present() } {
        return Err(format!(
            "cannot load NCCL: cudarc opens it as `libnccl.so`, which is on no library search \
             path; {fix}"
        ));
    }
    // SAFETY: as above; this keeps the library that every NCCL call is resolved from.
    unsafe { sys::culib() };
    let loaded = nccl_files(&process_maps());
    if loaded.len() > 1 {
        let files: Vec<String> = loaded.iter().map(|f| f.display().to_string()).collect();
        return Err(format!(
            "two copies of NCCL are loaded ({}): the `libnccl.so` cudarc opened must be the \
             file libtorch uses; {fix}",
            files.join(" and ")
        ));
    }
    Ok(())
}

/// This process's memory map; empty where there is none to read, which skips the check.
fn process_maps() -> String {
    std::fs::read_to_string("/proc/self/maps").unwrap_or_default()
}

/// The distinct NCCL library files in the text of a /proc/<pid>/maps, in order of appearance.
fn nccl_files(maps: &str) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = Vec::new();
    for path in maps.lines().filter_map(mapped_path).map(Path::new) {
        let is_nccl = path
            .file_name()
            .and_then(|name| name.to_str())
            .is_some_and(|name| name.starts_with("libnccl.so"));
        if is_nccl && !files.iter().any(|file| file == path) {
            files.push(path.to_path_buf());
        }
    }
    files
}

/// The file of one maps line (`address perms offset dev inode path`; the path may contain
/// spaces), if it maps one.
fn mapped_path(line: &str) -> Option<&str> {
    let mut rest = line;
    for _ in 0..5 {
        rest = rest.trim_start();
        rest = &rest[rest.find(' ')?..];
    }
    let path = rest.trim();
    path.starts_with('/').then_some(path)
}

/// Where scripts/torch-env.sh puts the `libnccl.so` symlink to `file`: a directory named
/// after the file's device and inode, the identity the dynamic loader compares.
fn link_dir(file: &Path) -> Option<PathBuf> {
    let cache = std::env::var_os("XDG_CACHE_HOME")
        .filter(|dir| !dir.is_empty())
        .map(PathBuf::from)
        .or_else(|| Some(PathBuf::from(std::env::var_os("HOME")?).join(".cache")))?;
    let metadata = std::fs::metadata(file).ok()?;
    Some(cache.join(format!(
        "megatron-rs/nccl-{}-{}",
        metadata.dev(),
        metadata.ino()
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn torch_kinds_map_to_nccl_types() {
        use ncclDataType_t::*;
        let cases = [
            (Kind::Float, ncclFloat32),
            (Kind::BFloat16, ncclBfloat16),
            (Kind::Half, ncclFloat16),
            (Kind::Double, ncclFloat64),
            (Kind::Int64, ncclInt64),
            (Kind::Int, ncclInt32),
            (Kind::Int8, ncclInt8),
            (Kind::Uint8, ncclUint8),
            (Kind::Bool, ncclUint8),
        ];
        for (kind, expected) in cases {
            assert_eq!(data_type(kind).unwrap(), expected, "{kind:?}");
        }
        let error = data_type(Kind::ComplexFloat).unwrap_err().to_string();
        assert!(error.contains("ComplexFloat"), "{error}");
    }

    #[test]
    fn boolean_sums_are_logical_ors() {
        use ncclRedOp_t::*;
        assert_eq!(reduce_op(ReduceOp::Sum, Kind::Float), ncclSum);
        assert_eq!(reduce_op(ReduceOp::Max, Kind::Float), ncclMax);
        assert_eq!(reduce_op(ReduceOp::Sum, Kind::Bool), ncclMax);
    }

    #[test]
    fn cpu_tensors_and_devices_are_refused() {
        let tensor = Tensor::zeros([2], (Kind::Float, Device::Cpu));
        let error = nccl_type(&tensor, 0).unwrap_err().to_string();
        assert_eq!(
            error,
            "NCCL needs CUDA tensors; use --distributed-backend gloo for CPU"
        );
        let error = NcclCommunicator::new([0; 128], 2, 0, Device::Cpu)
            .err()
            .expect("no communicator on the CPU")
            .to_string();
        assert!(error.contains("--distributed-backend gloo"), "{error}");
    }

    #[test]
    fn dims_count_from_either_end() {
        assert_eq!(dim_index(0, &[4, 6]).unwrap(), 0);
        assert_eq!(dim_index(-1, &[4, 6]).unwrap(), 1);
        assert!(dim_index(2, &[4, 6]).is_err());
        assert!(dim_index(0, &[]).is_err());
    }

    #[test]
    fn maps_list_each_nccl_file_once() {
        let maps = "\
55d4c8a00000-55d4c8a21000 r--p 00000000 08:01 1234   /work/bin/pretrain_gpt
7f0000000000-7f0000200000 r--p 00000000 08:01 5678   /venv/site-packages/nvidia/nccl/lib/libnccl.so.2
7f0000200000-7f0004000000 r-xp 00200000 08:01 5678   /venv/site-packages/nvidia/nccl/lib/libnccl.so.2
7f0005000000-7f0005100000 r-xp 00000000 08:01 4321   /usr/lib/libnccl-net.so
7f0006000000-7f0006100000 rw-p 00000000 00:00 0 
7f0007000000-7f0007100000 r-xp 00000000 08:01 8765   /opt/my nccl/lib/libnccl.so.2.28.9
7ffd0000000-7ffd0021000 rw-p 00000000 00:00 0                          [stack]
";
        assert_eq!(
            nccl_files(maps),
            [
                PathBuf::from("/venv/site-packages/nvidia/nccl/lib/libnccl.so.2"),
                PathBuf::from("/opt/my nccl/lib/libnccl.so.2.28.9"),
            ]
        );
        let libtorch_only: String = maps.lines().take(3).map(|l| format!("{l}\n")).collect();
        assert_eq!(nccl_files(&libtorch_only).len(), 1);
        assert!(nccl_files("").is_empty());
    }
}
