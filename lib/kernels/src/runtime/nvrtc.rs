//! Small CUDA kernels of our own, compiled at run time with NVRTC (which ships in the torch
//! wheel as `nvidia/cu13/lib/libnvrtc.so.13`) and launched through the CUDA driver API on
//! libtorch's current stream, so that they run in order with libtorch's kernels and are
//! captured in CUDA graphs like them. A kernel module is a [`KernelSource`]: its CUDA C++ text
//! (a `.cu` file of `lib/kernels/cuda/`), the headers it may include, handed to NVRTC in memory
//! (no system headers: the half-precision conversions are PTX instructions), and the
//! `extern "C"` functions it exports. Each source is compiled once per device and process; the
//! module and its functions are kept for the process's life.

use std::collections::HashMap;
use std::ffi::{c_char, c_int, c_void, CString};
use std::path::PathBuf;
use std::sync::{Mutex, OnceLock};

use anyhow::{anyhow, bail, Context, Result};
use cudarc::driver::{result as driver, sys as driver_sys};
use cudarc::nvrtc::{result as nvrtc, sys as nvrtc_sys};

/// A header kernel sources include (`#include "name"`), handed to NVRTC in memory.
pub struct CudaHeader {
    pub name: &'static str,
    pub text: &'static str,
}

/// A kernel module's CUDA C++ source and the functions launched from it.
pub struct KernelSource {
    /// Names the module in errors and NVRTC's logs (as `name.cu`).
    pub name: &'static str,
    pub source: &'static str,
    /// The headers the source may include (NVRTC is given no include path).
    pub headers: &'static [CudaHeader],
    pub functions: &'static [&'static str],
    /// Asks for all of each multiprocessor's unified L1/shared memory as shared memory. The
    /// decode kernels do: blocks of successive kernels stay resident side by side only where
    /// they ask for the same split, which the driver otherwise picks per kernel.
    pub prefer_shared_memory: bool,
}

/// The NVRTC library's file name in the torch wheel and on library paths.
const NVRTC: &str = "libnvrtc.so.13";

/// Loads NVRTC once: `$MEGATRON_RS_NVRTC` (a path), the library path (`scripts/torch-env.sh`
/// puts the wheel's `nvidia/cu13/lib` on it), or the wheel directory beside the libtorch this
/// process loaded. Later loads by name (cudarc's) find the loaded library.
fn load_nvrtc() -> Result<()> {
    static LOADED: OnceLock<Result<(), String>> = OnceLock::new();
    LOADED
        .get_or_init(|| {
            let mut candidates: Vec<PathBuf> = Vec::new();
            if let Some(path) = std::env::var_os("MEGATRON_RS_NVRTC") {
                candidates.push(path.into());
            }
            candidates.push(NVRTC.into());
            if let Some(torch_lib) = loaded_libtorch_dir() {
                candidates.push(torch_lib.join("../../nvidia/cu13/lib").join(NVRTC));
            }
            for candidate in &candidates {
                // NVRTC opens its builtins library by name: the one beside a library loaded by
                // path goes first.
                if let Some(dir) = candidate.parent().filter(|d| !d.as_os_str().is_empty()) {
                    for builtins in builtins_in(dir) {
                        dlopen_global(&builtins);
                    }
                }
                if dlopen_global(candidate) {
                    return Ok(());
                }
            }
            Err(format!(
                "cannot load NVRTC ({NVRTC}); looked for {}; set MEGATRON_RS_NVRTC to its path \
                 or source scripts/torch-env.sh",
                candidates
                    .iter()
                    .map(|c| c.display().to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            ))
        })
        .clone()
        .map_err(|e| anyhow!(e))
}

/// Loads a shared library with its symbols global (kept for the process's life); whether it
/// loaded.
fn dlopen_global(path: &std::path::Path) -> bool {
    let Ok(name) = CString::new(path.as_os_str().as_encoded_bytes()) else {
        return false;
    };
    // SAFETY: dlopen of a NUL-terminated name; the handle is never closed.
    !unsafe { libc::dlopen(name.as_ptr(), libc::RTLD_NOW | libc::RTLD_GLOBAL) }.is_null()
}

/// NVRTC's builtins libraries in `dir` (`libnvrtc-builtins.so.13.0`).
fn builtins_in(dir: &std::path::Path) -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("libnvrtc-builtins.so."))
        })
        .collect()
}

/// The directory of the `libtorch_cpu.so` this process mapped (`torch/lib` in a wheel).
fn loaded_libtorch_dir() -> Option<PathBuf> {
    super::loaded_library("libtorch_cpu.so")?
        .parent()
        .map(PathBuf::from)
}

/// PTX of `kernels` for `arch` (e.g. `compute_90`); NVRTC's log on a compile error. Needs no
/// GPU.
pub fn compile_ptx(kernels: &KernelSource, arch: &'static str) -> Result<String> {
    load_nvrtc()?;
    let program = Program::new(kernels)?;
    let options = [format!("--gpu-architecture={arch}"), "--std=c++17".into()];
    // SAFETY: a live program.
    if let Err(e) = unsafe { nvrtc::compile_program(program.handle, &options) } {
        bail!(
            "NVRTC cannot compile the {} kernels ({e:?}):\n{}",
            kernels.name,
            program.log()
        );
    }
    program.ptx()
}

/// An NVRTC program of one kernel source and its headers; destroyed on drop.
struct Program {
    handle: nvrtc_sys::nvrtcProgram,
    /// The texts and names NVRTC was given, kept until the program is destroyed in case it
    /// points into them.
    _strings: Vec<CString>,
}

impl Program {
    fn new(kernels: &KernelSource) -> Result<Self> {
        let text = |what: &str, s: &str| {
            CString::new(s)
                .with_context(|| format!("a NUL byte in {what} of the {} kernels", kernels.name))
        };
        let source = text("the source", kernels.source)?;
        let name = text("the name", &format!("{}.cu", kernels.name))?;
        let mut header_texts = Vec::new();
        let mut header_names = Vec::new();
        for header in kernels.headers {
            header_texts.push(text(header.name, header.text)?);
            header_names.push(text("a header name", header.name)?);
        }
        let texts: Vec<*const c_char> = header_texts.iter().map(|s| s.as_ptr()).collect();
        let names: Vec<*const c_char> = header_names.iter().map(|s| s.as_ptr()).collect();
        let mut handle = std::ptr::null_mut();
        // SAFETY: NUL-terminated source and name, and as many header texts as names, all
        // alive while the program is (moved into it below).
        unsafe {
            nvrtc_sys::nvrtcCreateProgram(
                &mut handle,
                source.as_ptr(),
                name.as_ptr(),
                texts.len() as c_int,
                texts.as_ptr(),
                names.as_ptr(),
            )
        }
        .result()
        .map_err(|e| anyhow!("NVRTC cannot take the {} kernels: {e:?}", kernels.name))?;
        let mut strings = vec![source, name];
        strings.extend(header_texts);
        strings.extend(header_names);
        Ok(Self {
            handle,
            _strings: strings,
        })
    }

    /// NVRTC's log of the compilation.
    fn log(&self) -> String {
        // SAFETY: a live program.
        match unsafe { nvrtc::get_program_log(self.handle) } {
            Ok(log) => c_text(&log),
            Err(e) => format!("(no log: {e:?})"),
        }
    }

    /// The compiled PTX.
    fn ptx(&self) -> Result<String> {
        // SAFETY: a live, compiled program.
        let ptx =
            unsafe { nvrtc::get_ptx(self.handle) }.map_err(|e| anyhow!("NVRTC's PTX: {e:?}"))?;
        Ok(c_text(&ptx))
    }
}

impl Drop for Program {
    fn drop(&mut self) {
        // SAFETY: a live program, destroyed once; nothing can be done about a failure here.
        let _ = unsafe { nvrtc::destroy_program(self.handle) };
    }
}

/// The text of a buffer NVRTC filled, up to its terminating NUL.
fn c_text(buffer: &[c_char]) -> String {
    let bytes: Vec<u8> = buffer.iter().map(|&c| c as u8).collect();
    let end = bytes.iter().position(|&b| b == 0).unwrap_or(bytes.len());
    String::from_utf8_lossy(&bytes[..end]).into_owned()
}

/// Compiles `kernels` for `arch` (e.g. `compute_80`) and checks that the PTX targets it and
/// exports every listed function: what the kernels' CPU tests assert, so that a source that
/// would not load on some GPU fails without one.
pub fn check_compiles(kernels: &KernelSource, arch: &'static str) -> Result<()> {
    let ptx = compile_ptx(kernels, arch)?;
    let target = format!(".target {}", arch.replace("compute_", "sm_"));
    if !ptx.contains(&target) {
        bail!(
            "the {} PTX for {arch} lacks `{target}`: {}",
            kernels.name,
            &ptx[..400.min(ptx.len())]
        );
    }
    for function in kernels.functions {
        if !ptx.contains(&format!(".entry {function}(")) {
            bail!(
                "{function} is missing from the {} PTX for {arch}",
                kernels.name
            );
        }
    }
    Ok(())
}

/// A kernel module loaded on one device.
pub struct Kernels {
    device: usize,
    context: usize,
    functions: HashMap<&'static str, usize>,
    /// Hopper or newer: kernels may be launched to overlap their predecessor's end
    /// ([`Kernels::launch_overlapping`]).
    dependent_launch: bool,
    /// The device's streaming multiprocessors.
    pub multiprocessors: u32,
    /// Shared memory of one multiprocessor, for the blocks resident on it together.
    pub shared_bytes_per_multiprocessor: u32,
    /// [`Kernels::resident_blocks`] answers so far, by function, block size and shared memory.
    occupancy: Mutex<HashMap<(&'static str, u32, u32), u32>>,
}

/// Modules loaded so far, by source name and device; kept for the process's life.
fn loaded() -> &'static Mutex<HashMap<(&'static str, usize), &'static Kernels>> {
    static LOADED: OnceLock<Mutex<HashMap<(&'static str, usize), &'static Kernels>>> =
        OnceLock::new();
    LOADED.get_or_init(Default::default)
}

/// `kernels` compiled for CUDA device `device` (its compute capability) and loaded there; the
/// first call per device compiles, later calls return the same module.
pub fn kernels(kernels: &'static KernelSource, device: usize) -> Result<&'static Kernels> {
    let mut loaded = loaded().lock().unwrap_or_else(|p| p.into_inner());
    if let Some(module) = loaded.get(&(kernels.name, device)) {
        return Ok(module);
    }
    let module = load(kernels, device)
        .with_context(|| format!("loading the {} kernels on cuda:{device}", kernels.name))?;
    let module: &'static Kernels = Box::leak(Box::new(module));
    loaded.insert((kernels.name, device), module);
    Ok(module)
}

fn load(source: &KernelSource, device: usize) -> Result<Kernels> {
    fn fail(what: &str) -> impl Fn(driver::DriverError) -> anyhow::Error + '_ {
        move |e| anyhow!("{what}: {e:?}")
    }
    driver::init().map_err(fail("the CUDA driver"))?;
    let ordinal = driver::device::get(device as i32).map_err(fail("the device"))?;
    let attribute = |which| {
        // SAFETY: a device handle from cuDeviceGet and a valid attribute.
        unsafe { driver::device::get_attribute(ordinal, which) }.map_err(fail("its attributes"))
    };
    let major =
        attribute(driver_sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?;
    let minor =
        attribute(driver_sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?;
    let arch: &'static str = Box::leak(format!("compute_{major}{minor}").into_boxed_str());
    let ptx = compile_ptx(source, arch)?;
    // SAFETY: retains the primary context libtorch's runtime uses; never released.
    let context = unsafe { driver::primary_ctx::retain(ordinal) }.map_err(fail("its context"))?;
    make_current(context)?;
    let image = CString::new(ptx).context("PTX with a NUL byte")?;
    // SAFETY: a NUL-terminated PTX text; the module is never unloaded.
    let module = unsafe { driver::module::load_data(image.as_ptr().cast()) }
        .map_err(fail("loading the PTX"))?;
    let shared_per_block = attribute(
        driver_sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
    )?;
    let mut functions = HashMap::new();
    for &name in source.functions {
        // SAFETY: a loaded module and a NUL-terminated name.
        let function = unsafe { driver::module::get_function(module, CString::new(name)?) }
            .map_err(fail(&format!("function {name}")))?;
        // Launches may ask for more than the default 48 KiB of dynamic shared memory: all the
        // block may have beside the function's static shared memory.
        // SAFETY: a function handle of the loaded module and valid attributes.
        unsafe {
            use driver_sys::CUfunction_attribute as function_attribute;
            let fixed = driver::function::get_function_attribute(
                function,
                function_attribute::CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES,
            )
            .map_err(fail(&format!("function {name}'s shared memory")))?;
            driver::function::set_function_attribute(
                function,
                function_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                shared_per_block - fixed,
            )
            .map_err(fail(&format!("function {name}'s shared memory")))?;
            if source.prefer_shared_memory {
                driver::function::set_function_attribute(
                    function,
                    function_attribute::CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT,
                    driver_sys::CUshared_carveout::CU_SHAREDMEM_CARVEOUT_MAX_SHARED as i32,
                )
                .map_err(fail(&format!("function {name}'s carveout")))?;
            }
        }
        functions.insert(name, function as usize);
    }
    Ok(Kernels {
        device,
        context: context as usize,
        functions,
        dependent_launch: major >= 9,
        multiprocessors: attribute(
            driver_sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
        )? as u32,
        shared_bytes_per_multiprocessor: attribute(
            driver_sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR,
        )? as u32,
        occupancy: Mutex::default(),
    })
}

/// Makes `context` current on the calling thread unless it is already.
fn make_current(context: driver_sys::CUcontext) -> Result<()> {
    let current = driver::ctx::get_current().map_err(|e| anyhow!("the CUDA context: {e:?}"))?;
    if current != Some(context) {
        // SAFETY: a retained, live context.
        unsafe { driver::ctx::set_current(context) }
            .map_err(|e| anyhow!("the CUDA context: {e:?}"))?;
    }
    Ok(())
}

impl Kernels {
    /// Launches `function` on libtorch's current stream of the module's device with `grid`
    /// blocks of `block` threads.
    ///
    /// # Safety
    /// `args` must point at values of the kernel's parameter types, in order, and every device
    /// pointer among them must stay valid until the kernel has run.
    pub unsafe fn launch(
        &self,
        function: &str,
        grid: (u32, u32, u32),
        block: (u32, u32, u32),
        args: &mut [*mut c_void],
    ) -> Result<()> {
        self.launch_with(function, grid, block, 0, args, false)
    }

    /// [`Kernels::launch`] with `shared_bytes` of dynamic shared memory per block, as a
    /// programmatic dependent launch on Hopper and newer GPUs: the kernel may
    /// start while the previous kernel on the stream is still running, once that one executes
    /// `griddepcontrol.launch_dependents`, and must execute `griddepcontrol.wait` (see
    /// `lib/kernels/cuda/dependent_launch.cuh`) before it touches anything an earlier
    /// kernel writes or reads. Work before the wait (loading weights) overlaps the previous
    /// kernel; CUDA graphs capture the dependency. Older GPUs get a plain launch, where the
    /// two instructions do nothing.
    ///
    /// # Safety
    /// As for [`Kernels::launch`], and the kernel must wait as described.
    pub unsafe fn launch_overlapping(
        &self,
        function: &str,
        grid: (u32, u32, u32),
        block: (u32, u32, u32),
        shared_bytes: u32,
        args: &mut [*mut c_void],
    ) -> Result<()> {
        self.launch_with(
            function,
            grid,
            block,
            shared_bytes,
            args,
            self.dependent_launch,
        )
    }

    /// How many blocks of `threads` threads and `shared_bytes` of dynamic shared memory of
    /// `function` one multiprocessor holds at once (at least 1).
    pub fn resident_blocks(&self, function: &str, threads: u32, shared_bytes: u32) -> Result<u32> {
        let (&name, &handle) = self
            .functions
            .get_key_value(function)
            .ok_or_else(|| anyhow!("no kernel {function} in this module"))?;
        let mut known = self.occupancy.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(&blocks) = known.get(&(name, threads, shared_bytes)) {
            return Ok(blocks);
        }
        make_current(self.context as driver_sys::CUcontext)?;
        // SAFETY: a function of this loaded module.
        let blocks = unsafe {
            driver::occupancy::max_active_block_per_multiprocessor(
                handle as driver_sys::CUfunction,
                threads as i32,
                shared_bytes as usize,
            )
        }
        .map_err(|e| anyhow!("the occupancy of {function}: {e:?}"))?
        .max(1) as u32;
        known.insert((name, threads, shared_bytes), blocks);
        Ok(blocks)
    }

    /// Whether the device runs thread-block clusters (Hopper or newer): kernels declared with
    /// `__cluster_dims__` launch only there.
    pub fn has_clusters(&self) -> bool {
        self.dependent_launch
    }

    unsafe fn launch_with(
        &self,
        function: &str,
        grid: (u32, u32, u32),
        block: (u32, u32, u32),
        shared_bytes: u32,
        args: &mut [*mut c_void],
        dependent: bool,
    ) -> Result<()> {
        let handle = *self
            .functions
            .get(function)
            .ok_or_else(|| anyhow!("no kernel {function} in this module"))?;
        make_current(self.context as driver_sys::CUcontext)?;
        let stream = super::current_cuda_stream(self.device)?;
        let mut attribute: driver_sys::CUlaunchAttribute = std::mem::zeroed();
        attribute.id =
            driver_sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
        attribute.value.programmaticStreamSerializationAllowed = 1;
        let config = driver_sys::CUlaunchConfig {
            gridDimX: grid.0,
            gridDimY: grid.1,
            gridDimZ: grid.2,
            blockDimX: block.0,
            blockDimY: block.1,
            blockDimZ: block.2,
            sharedMemBytes: shared_bytes,
            hStream: stream as driver_sys::CUstream,
            attrs: &mut attribute,
            numAttrs: u32::from(dependent),
        };
        driver_sys::cuLaunchKernelEx(
            &config,
            handle as driver_sys::CUfunction,
            args.as_mut_ptr(),
            std::ptr::null_mut(),
        )
        .result()
        .map_err(|e| anyhow!("launching {function}: {e:?}"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SEVEN: CudaHeader = CudaHeader {
        name: "seven.cuh",
        text: "#ifndef SEVEN_CUH\n#define SEVEN_CUH\nconstexpr int SEVEN = 7;\n#endif\n",
    };
    const SQUARE: CudaHeader = CudaHeader {
        name: "square.cuh",
        text: "#include \"seven.cuh\"\n__device__ int seven_squared() { return SEVEN * SEVEN; }\n",
    };

    /// A source including a header directly and through another header.
    fn source(headers: &'static [CudaHeader]) -> KernelSource {
        KernelSource {
            name: "header_test",
            source: "#include \"seven.cuh\"\n#include \"square.cuh\"\n\
                     extern \"C\" __global__ void write_343(int* out) {\n\
                         *out = seven_squared() * SEVEN;\n\
                     }\n",
            headers,
            functions: &["write_343"],
            prefer_shared_memory: false,
        }
    }

    #[test]
    fn nvrtc_compiles_a_source_with_the_headers_it_includes() {
        let source = source(&[SEVEN, SQUARE]);
        check_compiles(&source, "compute_80").unwrap();
        let ptx = compile_ptx(&source, "compute_80").unwrap();
        assert!(ptx.contains("343;"), "{ptx}");
    }

    #[test]
    fn a_header_not_handed_to_nvrtc_is_named_in_the_error() {
        let error = compile_ptx(&source(&[SEVEN]), "compute_80").unwrap_err();
        let message = format!("{error:#}");
        assert!(
            message.contains("header_test") && message.contains("square.cuh"),
            "{message}"
        );
    }
}
