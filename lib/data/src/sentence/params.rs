use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};

use super::SentenceError;

/// A Punkt model: what NLTK stores in `punkt_tab/<lang>/`.
#[derive(Debug, Clone, Default)]
pub struct PunktParameters {
    pub abbrev_types: HashSet<String>,
    pub collocations: HashSet<(String, String)>,
    pub sent_starters: HashSet<String>,
    /// Orthographic context flags per word type (`_ORTHO_*` bits).
    pub ortho_context: HashMap<String, u32>,
}

fn read(dir: &Path, name: &str) -> Result<(PathBuf, String), SentenceError> {
    let path = dir.join(name);
    let text = std::fs::read_to_string(&path).map_err(|e| SentenceError::File {
        path: path.clone(),
        reason: e.to_string(),
    })?;
    Ok((path, text))
}

fn lines(text: &str) -> impl Iterator<Item = &str> {
    text.lines().map(str::trim).filter(|l| !l.is_empty())
}

impl PunktParameters {
    /// Loads `abbrev_types.txt`, `collocations.tab`, `sent_starters.txt` and `ortho_context.tab`.
    pub fn load(dir: &Path) -> Result<Self, SentenceError> {
        let (_, abbrev) = read(dir, "abbrev_types.txt")?;
        let (_, starters) = read(dir, "sent_starters.txt")?;
        let (colloc_path, colloc) = read(dir, "collocations.tab")?;
        let (ortho_path, ortho) = read(dir, "ortho_context.tab")?;
        let bad = |path: &Path, n: usize, line: &str| SentenceError::File {
            path: path.into(),
            reason: format!(
                "line {}: expected two tab-separated fields, found {line:?}",
                n + 1
            ),
        };
        let mut collocations = HashSet::new();
        for (n, line) in lines(&colloc).enumerate() {
            let (a, b) = line
                .split_once('\t')
                .ok_or_else(|| bad(&colloc_path, n, line))?;
            collocations.insert((a.to_string(), b.to_string()));
        }
        let mut ortho_context = HashMap::new();
        for (n, line) in lines(&ortho).enumerate() {
            let (word, flags) = line
                .split_once('\t')
                .ok_or_else(|| bad(&ortho_path, n, line))?;
            let flags: u32 = flags
                .trim()
                .parse()
                .map_err(|_| bad(&ortho_path, n, line))?;
            ortho_context.insert(word.to_string(), flags);
        }
        Ok(PunktParameters {
            abbrev_types: lines(&abbrev).map(str::to_string).collect(),
            collocations,
            sent_starters: lines(&starters).map(str::to_string).collect(),
            ortho_context,
        })
    }
}

/// Where NLTK would find `tokenizers/punkt_tab/<lang>`: `$NLTK_DATA` entries, then the
/// standard data directories. An explicit `dir` wins and must exist.
pub fn find_punkt_dir(dir: Option<&Path>, lang: &str) -> Result<PathBuf, SentenceError> {
    if let Some(dir) = dir {
        return if dir.join("ortho_context.tab").is_file() {
            Ok(dir.to_path_buf())
        } else {
            Err(SentenceError::NotFound(format!(
                "{} holds no Punkt parameters (abbrev_types.txt, collocations.tab, sent_starters.txt, ortho_context.tab)",
                dir.display()
            )))
        };
    }
    let mut roots: Vec<PathBuf> = std::env::var_os("NLTK_DATA")
        .map(|v| std::env::split_paths(&v).collect())
        .unwrap_or_default();
    if let Some(home) = std::env::var_os("HOME") {
        roots.push(Path::new(&home).join("nltk_data"));
    }
    for root in [
        "/usr/share",
        "/usr/local/share",
        "/usr/lib",
        "/usr/local/lib",
    ] {
        roots.push(Path::new(root).join("nltk_data"));
    }
    let candidates: Vec<PathBuf> = roots
        .iter()
        .map(|r| r.join("tokenizers").join("punkt_tab").join(lang))
        .collect();
    candidates
        .iter()
        .find(|c| c.join("ortho_context.tab").is_file())
        .cloned()
        .ok_or_else(|| {
            SentenceError::NotFound(format!(
                "NLTK's Punkt parameters for {lang:?} were not found (looked in {}); install them with \
                 `python -m nltk.downloader punkt_tab` or pass --punkt-dir",
                candidates.iter().map(|c| c.display().to_string()).collect::<Vec<_>>().join(", ")
            ))
        })
}
