//! One writer per save directory: an exclusive `flock` on a lock file inside it, taken before
//! anything is written and held until the process exits. Being an OS lock it is released when
//! its holder dies, however it dies, so a staging directory found while holding the lock is
//! known to be abandoned. The file records the holder's pid and host so that a refused writer
//! can say who has the directory.

use std::collections::HashMap;
use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, Write};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use anyhow::{bail, Context, Result};

/// The lock file's name inside a save directory.
pub const LOCK_FILE: &str = ".megatron-rs-save.lock";

/// The lock files this process holds, by save directory: the lock lasts as long as the
/// open file, and a second `flock` on a new open file would conflict with our own.
static HELD: Mutex<Option<HashMap<PathBuf, File>>> = Mutex::new(None);

/// Makes this process the only writer of `root` (created if missing) until it exits; a no-op
/// when it already is. Fails, naming the directory and the holder, when another process is.
pub fn lock_save_directory(root: &Path) -> Result<()> {
    std::fs::create_dir_all(root)
        .with_context(|| format!("creating checkpoint directory {}", root.display()))?;
    let key = root
        .canonicalize()
        .with_context(|| format!("resolving {}", root.display()))?;
    let mut held = HELD.lock().expect("save lock registry");
    let held = held.get_or_insert_with(HashMap::new);
    if held.contains_key(&key) {
        return Ok(());
    }
    let path = root.join(LOCK_FILE);
    let mut file = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(&path)
        .with_context(|| format!("opening {}", path.display()))?;
    // SAFETY: flock on a descriptor this function owns; no memory is passed.
    if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
        let error = std::io::Error::last_os_error();
        match error.raw_os_error() {
            Some(libc::EWOULDBLOCK) => {
                let mut holder = String::new();
                let _ = file.read_to_string(&mut holder);
                let holder = holder.trim();
                bail!(
                    "{} is in use by another run saving checkpoints there{}; give each run \
                     its own save directory (the lock is {})",
                    root.display(),
                    if holder.is_empty() {
                        String::new()
                    } else {
                        format!(" ({holder})")
                    },
                    path.display()
                );
            }
            // Some network filesystems have no locks at all; refusing to save there would
            // leave no way to train.
            Some(libc::ENOLCK | libc::EOPNOTSUPP | libc::ENOSYS) => {
                eprintln!(
                    "warning: {}: the filesystem cannot lock files ({error}); nothing stops \
                     another run from saving into {} at the same time",
                    path.display(),
                    root.display()
                );
            }
            _ => return Err(error).with_context(|| format!("locking {}", path.display())),
        }
    }
    file.set_len(0)
        .and_then(|()| file.rewind())
        .and_then(|()| writeln!(file, "pid {} on {}", std::process::id(), host_name()))
        .with_context(|| format!("writing {}", path.display()))?;
    held.insert(key, file);
    Ok(())
}

/// This machine's name, or `an unknown host`.
fn host_name() -> String {
    let mut buffer = [0u8; 256];
    // SAFETY: gethostname writes at most `buffer.len()` bytes into the buffer.
    let status = unsafe { libc::gethostname(buffer.as_mut_ptr().cast(), buffer.len()) };
    let length = buffer.iter().position(|&b| b == 0).unwrap_or(buffer.len());
    if status != 0 || length == 0 {
        return "an unknown host".to_string();
    }
    String::from_utf8_lossy(&buffer[..length]).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_second_holder_is_refused_and_named() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("ckpt");
        lock_save_directory(&root).unwrap();
        // Taking it again from the same process is a no-op.
        lock_save_directory(&root).unwrap();
        let recorded = std::fs::read_to_string(root.join(LOCK_FILE)).unwrap();
        assert!(
            recorded.starts_with(&format!("pid {} on ", std::process::id())),
            "{recorded}"
        );
        // Another open file description (as another process would have) is refused.
        let other = File::open(root.join(LOCK_FILE)).unwrap();
        // SAFETY: flock on a descriptor the test owns.
        let status = unsafe { libc::flock(other.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
        assert_eq!(status, -1);
    }
}
