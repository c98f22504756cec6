//! libtorch's c10d `TCPStore` client: the key-value store torchrun's agent serves on
//! `MASTER_ADDR:MASTER_PORT` for the workers it launches (`TORCHELASTIC_USE_AGENT_STORE`).

use std::ffi::CString;
use std::time::Duration;

use crate::autograd::ffi;
use crate::error::check;
use crate::TorchError;

pub struct TorchStore {
    handle: *mut ffi::StoreHandle,
}

// SAFETY: c10d's TCPStore client serialises its own socket use; the handle is only freed in
// drop.
unsafe impl Send for TorchStore {}
unsafe impl Sync for TorchStore {}

fn c_string(text: &str) -> Result<CString, TorchError> {
    CString::new(text).map_err(|_| TorchError(format!("{text:?} holds a NUL byte")))
}

impl TorchStore {
    /// Connects to the store at `host:port`, retrying until `timeout`, which also bounds
    /// every later wait for a key.
    pub fn connect(host: &str, port: u16, timeout: Duration) -> Result<TorchStore, TorchError> {
        let host = c_string(host)?;
        let mut handle = std::ptr::null_mut();
        let millis = i64::try_from(timeout.as_millis()).unwrap_or(i64::MAX);
        // SAFETY: `host` outlives the call; on success the shim writes a handle we own.
        check(unsafe { ffi::mrs_tcp_store_connect(host.as_ptr(), port, millis, &mut handle) })?;
        Ok(TorchStore { handle })
    }

    pub fn set(&self, key: &str, value: &[u8]) -> Result<(), TorchError> {
        let key = c_string(key)?;
        // SAFETY: the handle is live; key and value outlive the call.
        check(unsafe {
            ffi::mrs_tcp_store_set(self.handle, key.as_ptr(), value.as_ptr(), value.len())
        })
    }

    /// The value of `key`, waiting for it to be set (up to the connection's timeout).
    pub fn get(&self, key: &str) -> Result<Vec<u8>, TorchError> {
        let key = c_string(key)?;
        let (mut bytes, mut length) = (std::ptr::null_mut(), 0usize);
        // SAFETY: the handle is live; on success the shim writes a malloc'd buffer we free.
        check(unsafe {
            ffi::mrs_tcp_store_get(self.handle, key.as_ptr(), &mut bytes, &mut length)
        })?;
        // SAFETY: `bytes` holds `length` initialised bytes.
        let value = unsafe { std::slice::from_raw_parts(bytes, length) }.to_vec();
        unsafe { ffi::mrs_free_array(bytes.cast()) };
        Ok(value)
    }
}

impl Drop for TorchStore {
    fn drop(&mut self) {
        // SAFETY: the handle came from mrs_tcp_store_connect and is freed once.
        unsafe { ffi::mrs_tcp_store_free(self.handle) };
    }
}
