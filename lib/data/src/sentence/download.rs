//! Fetches NLTK's published `punkt_tab` archive when no Punkt parameters are installed, as
//! Megatron's `nltk.download("punkt_tab")` does: into `$NLTK_DATA` (its first directory) or
//! `~/nltk_data`, SHA-256 verified before anything is unpacked, unpacked under a temporary name
//! and renamed into place, so an interrupted download never leaves a half-written model.

use std::fs::File;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::time::Duration;

use sha2::{Digest, Sha256};

use super::SentenceError;

/// NLTK's archive, as `nltk.download` fetches it.
pub const PUNKT_TAB_URL: &str =
    "https://raw.githubusercontent.com/nltk/nltk_data/gh-pages/packages/tokenizers/punkt_tab.zip";
/// SHA-256 of that archive (nltk_data revision of 17 February 2025).
pub const PUNKT_TAB_SHA256: &str =
    "e57f64187974277726a3417ca6f181ec5403676c717672eef6a748a7b20e0106";
/// Environment variables that point the download at a mirror (and its archive's checksum).
pub const URL_VARIABLE: &str = "MEGATRON_RS_PUNKT_TAB_URL";
pub const SHA256_VARIABLE: &str = "MEGATRON_RS_PUNKT_TAB_SHA256";

/// Where NLTK's downloader puts its data: the first `$NLTK_DATA` directory, else `~/nltk_data`.
pub fn nltk_download_root() -> Option<PathBuf> {
    std::env::var_os("NLTK_DATA")
        .and_then(|v| std::env::split_paths(&v).next())
        .filter(|p| !p.as_os_str().is_empty())
        .or_else(|| std::env::var_os("HOME").map(|h| Path::new(&h).join("nltk_data")))
}

fn failed(reason: impl Into<String>) -> SentenceError {
    SentenceError::NotFound(reason.into())
}

/// Downloads and unpacks `punkt_tab` under `root/tokenizers/`; returns its `lang` directory.
/// `progress(received, total)` follows the download.
pub fn download_punkt_tab(
    root: &Path,
    lang: &str,
    progress: &mut dyn FnMut(u64, Option<u64>),
) -> Result<PathBuf, SentenceError> {
    let url = std::env::var(URL_VARIABLE).unwrap_or_else(|_| PUNKT_TAB_URL.to_string());
    let expected = std::env::var(SHA256_VARIABLE).unwrap_or_else(|_| PUNKT_TAB_SHA256.to_string());
    let tokenizers = root.join("tokenizers");
    std::fs::create_dir_all(&tokenizers)
        .map_err(|e| failed(format!("creating {}: {e}", tokenizers.display())))?;
    let archive = tokenizers.join("punkt_tab.zip.part");
    let fetched = fetch(&url, &archive, progress).and_then(|digest| {
        if digest == expected {
            Ok(())
        } else {
            Err(format!(
                "the archive's SHA-256 is {digest}, not the published {expected}"
            ))
        }
    });
    if let Err(reason) = fetched {
        let _ = std::fs::remove_file(&archive);
        return Err(failed(format!("{url}: {reason}")));
    }
    let unpacked = unpack(&archive, &tokenizers);
    let _ = std::fs::remove_file(&archive);
    unpacked.map_err(|reason| failed(format!("{url}: unpacking: {reason}")))?;
    let dir = tokenizers.join("punkt_tab").join(lang);
    if !dir.join("ortho_context.tab").is_file() {
        return Err(failed(format!(
            "{url} holds no Punkt parameters for {lang:?}"
        )));
    }
    Ok(dir)
}

/// Streams `url` into `path`; returns the SHA-256 of what was received.
fn fetch(
    url: &str,
    path: &Path,
    progress: &mut dyn FnMut(u64, Option<u64>),
) -> Result<String, String> {
    let agent = ureq::AgentBuilder::new()
        .timeout_connect(Duration::from_secs(15))
        .timeout_read(Duration::from_secs(60))
        .build();
    let response = agent.get(url).call().map_err(|e| match e {
        ureq::Error::Status(code, _) => format!("the server answered {code}"),
        // The transport error's own text repeats the URL, which the caller already names.
        ureq::Error::Transport(t) => match t.message() {
            Some(message) => format!("{}: {message}", t.kind()),
            None => t.kind().to_string(),
        },
    })?;
    let total = response
        .header("Content-Length")
        .and_then(|n| n.parse::<u64>().ok());
    let mut body = response.into_reader();
    let mut file = File::create(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let mut hasher = Sha256::new();
    let mut block = vec![0u8; 64 << 10];
    let mut received = 0u64;
    loop {
        let n = body.read(&mut block).map_err(|e| e.to_string())?;
        if n == 0 {
            break;
        }
        hasher.update(&block[..n]);
        file.write_all(&block[..n])
            .map_err(|e| format!("{}: {e}", path.display()))?;
        received += n as u64;
        progress(received, total);
    }
    if total.is_some_and(|t| t != received) {
        return Err(format!(
            "the connection closed after {received} of {} bytes",
            total.unwrap_or_default()
        ));
    }
    file.sync_all()
        .map_err(|e| format!("{}: {e}", path.display()))?;
    Ok(format!("{:x}", hasher.finalize()))
}

/// Unpacks the archive's `punkt_tab/` into `tokenizers/punkt_tab`, through a temporary
/// directory renamed into place; entries outside `punkt_tab/` are refused.
fn unpack(archive: &Path, tokenizers: &Path) -> Result<(), String> {
    let file = File::open(archive).map_err(|e| e.to_string())?;
    let mut zip = zip::ZipArchive::new(file).map_err(|e| e.to_string())?;
    let staging = tokenizers.join(".punkt_tab.tmp");
    let _ = std::fs::remove_dir_all(&staging);
    for i in 0..zip.len() {
        let mut entry = zip.by_index(i).map_err(|e| e.to_string())?;
        let name = entry
            .enclosed_name()
            .map(Path::to_path_buf)
            .ok_or_else(|| format!("unsafe entry {:?}", entry.name()))?;
        let Ok(inside) = name.strip_prefix("punkt_tab") else {
            return Err(format!("entry {} is not under punkt_tab/", name.display()));
        };
        let target = staging.join(inside);
        if entry.is_dir() {
            std::fs::create_dir_all(&target).map_err(|e| e.to_string())?;
            continue;
        }
        if let Some(parent) = target.parent() {
            std::fs::create_dir_all(parent).map_err(|e| e.to_string())?;
        }
        let mut out = File::create(&target).map_err(|e| format!("{}: {e}", target.display()))?;
        std::io::copy(&mut entry, &mut out).map_err(|e| format!("{}: {e}", target.display()))?;
    }
    let destination = tokenizers.join("punkt_tab");
    if destination.exists() {
        // Another language was installed before: add ours beside it.
        for entry in std::fs::read_dir(&staging)
            .map_err(|e| e.to_string())?
            .flatten()
        {
            let target = destination.join(entry.file_name());
            if !target.exists() {
                std::fs::rename(entry.path(), &target).map_err(|e| e.to_string())?;
            }
        }
        let _ = std::fs::remove_dir_all(&staging);
        return Ok(());
    }
    std::fs::rename(&staging, &destination).map_err(|e| e.to_string())
}
