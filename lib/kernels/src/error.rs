//! The error raised by libtorch calls made through the shim.

/// A C++ exception from libtorch (or from a Rust callback that libtorch called), with its message.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("libtorch: {0}")]
pub struct TorchError(pub String);

/// Turns a shim return value (null, or a malloc'd message) into a Result, freeing the message.
pub(crate) fn check(error: *mut std::os::raw::c_char) -> Result<(), TorchError> {
    if error.is_null() {
        return Ok(());
    }
    // SAFETY: the shim returns NUL-terminated strings from malloc, owned by us.
    let message = unsafe { std::ffi::CStr::from_ptr(error) }
        .to_string_lossy()
        .into_owned();
    unsafe { crate::autograd::ffi::mrs_free_string(error) };
    Err(TorchError(message))
}
