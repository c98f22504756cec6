//! `preprocess_data --split-sentences` without installed Punkt parameters downloads NLTK's
//! `punkt_tab` archive (here from a loopback server serving a fixture archive made from the
//! shared English parameters), verifies its SHA-256 and unpacks it into `$NLTK_DATA`; without
//! network, or with a corrupted archive, it stops with a clear message and installs nothing.

use std::io::{Read, Write};
use std::net::TcpListener;
use std::path::Path;
use std::process::{Command, Output};

use megatron_e2e::{bin, run_ok, shared_dir, workspace_root};

fn python() -> std::path::PathBuf {
    std::env::var_os("MEGATRON_RS_TEST_PYTHON")
        .map(Into::into)
        .unwrap_or_else(|| workspace_root().join(".venv/bin/python"))
}

/// `punkt_tab.zip` holding `punkt_tab/english/*`, and its SHA-256.
fn fixture_archive(dir: &Path) -> (Vec<u8>, String) {
    let archive = dir.join("punkt_tab.zip");
    let script = "import hashlib, pathlib, sys, zipfile\n\
        src, out = pathlib.Path(sys.argv[1]), sys.argv[2]\n\
        with zipfile.ZipFile(out, 'w', zipfile.ZIP_DEFLATED) as z:\n\
        \x20   for f in sorted(src.iterdir()):\n\
        \x20       z.write(f, f'punkt_tab/english/{f.name}')\n\
        print(hashlib.sha256(open(out, 'rb').read()).hexdigest())\n";
    let out = run_ok(
        Command::new(python())
            .args(["-c", script])
            .arg(shared_dir().join("data/punkt_tab_english"))
            .arg(&archive),
    );
    (
        std::fs::read(&archive).unwrap(),
        String::from_utf8(out.stdout).unwrap().trim().to_string(),
    )
}

/// Serves `body` to every GET on a loopback port; returns the URL.
fn serve(body: Vec<u8>) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut stream) = stream else { continue };
            let mut request = Vec::new();
            let mut byte = [0u8; 1];
            while !request.ends_with(b"\r\n\r\n") && stream.read(&mut byte).unwrap_or(0) == 1 {
                request.push(byte[0]);
            }
            let head = format!(
                "HTTP/1.1 200 OK\r\nContent-Type: application/zip\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
                body.len()
            );
            let _ = stream.write_all(head.as_bytes());
            let _ = stream.write_all(&body);
        }
    });
    format!("http://127.0.0.1:{port}/packages/tokenizers/punkt_tab.zip")
}

fn split_sentences(dir: &Path, url: &str, sha256: &str, output: &str) -> Output {
    let input = dir.join("in.jsonl");
    std::fs::write(
        &input,
        "{\"text\": \"Mr. Smith went home. He slept. It rained.\"}\n{\"text\": \"One. Two.\"}\n",
    )
    .unwrap();
    let data = workspace_root().join("data");
    bin("preprocess_data")
        .arg("--input")
        .arg(&input)
        .arg("--output-prefix")
        .arg(dir.join(output))
        .args(["--split-sentences", "--tokenizer-type", "GPT2BPETokenizer"])
        .arg("--vocab-file")
        .arg(data.join("quickstart-vocab.json"))
        .arg("--merge-file")
        .arg(data.join("quickstart-merges.txt"))
        .env("NLTK_DATA", dir.join("nltk_data"))
        .env("HOME", dir.join("home"))
        .env("MEGATRON_RS_PUNKT_TAB_URL", url)
        .env("MEGATRON_RS_PUNKT_TAB_SHA256", sha256)
        .output()
        .unwrap()
}

#[test]
fn punkt_tab_is_downloaded_verified_and_installed_when_missing() {
    let dir = tempfile::tempdir().unwrap();
    let (archive, sha256) = fixture_archive(dir.path());
    let installed = dir.path().join("nltk_data/tokenizers/punkt_tab/english");

    // No network: today's message, with the reason the download failed.
    let closed = TcpListener::bind("127.0.0.1:0").unwrap();
    let dead = format!("http://{}/punkt_tab.zip", closed.local_addr().unwrap());
    drop(closed);
    let out = split_sentences(dir.path(), &dead, &sha256, "offline");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("NLTK's Punkt parameters for \"english\" were not found")
            && stderr.contains("downloading them failed: http://127.0.0.1:"),
        "{stderr}"
    );

    // A corrupted archive is refused before anything is unpacked.
    let url = serve(archive);
    let out = split_sentences(dir.path(), &url, &"0".repeat(64), "corrupt");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains(&format!("the archive's SHA-256 is {sha256}")),
        "{stderr}"
    );
    assert!(!installed.exists());

    // The published archive: installed, and the output equals the one from --punkt-dir.
    let out = split_sentences(dir.path(), &url, &sha256, "downloaded");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(installed.join("ortho_context.tab").is_file());
    let left: Vec<String> = std::fs::read_dir(dir.path().join("nltk_data/tokenizers"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(left, ["punkt_tab"]);
    let data = workspace_root().join("data");
    run_ok(
        bin("preprocess_data")
            .arg("--input")
            .arg(dir.path().join("in.jsonl"))
            .arg("--output-prefix")
            .arg(dir.path().join("reference"))
            .args(["--split-sentences", "--tokenizer-type", "GPT2BPETokenizer"])
            .arg("--vocab-file")
            .arg(data.join("quickstart-vocab.json"))
            .arg("--merge-file")
            .arg(data.join("quickstart-merges.txt"))
            .arg("--punkt-dir")
            .arg(shared_dir().join("data/punkt_tab_english")),
    );
    for ext in ["bin", "idx"] {
        let read = |name: &str| {
            std::fs::read(dir.path().join(format!("{name}_text_sentence.{ext}"))).unwrap()
        };
        assert!(read("downloaded") == read("reference"), "{ext} differs");
    }
}
