//! scripts/setup.sh and scripts/torch-env.sh as a user meets them: a wrong torch is refused at
//! set-up with a message naming it, and the library path comes out right for a given torch.

use megatron_e2e::workspace_root;
use std::fs;
use std::path::Path;
use std::process::{Command, Output};

fn script(name: &str) -> Command {
    let mut cmd = Command::new("bash");
    cmd.arg(workspace_root().join("scripts").join(name));
    cmd.env_remove("LIBTORCH").env_remove("TORCH_PYTHON");
    cmd
}

/// A directory shaped like a python torch package reporting `version`.
fn fake_torch(root: &Path, version: &str) -> std::path::PathBuf {
    let torch = root.join("site-packages/torch");
    fs::create_dir_all(torch.join("lib")).unwrap();
    fs::create_dir_all(torch.join("include")).unwrap();
    fs::write(
        torch.join("version.py"),
        format!("__version__ = '{version}'\ndebug = False\n"),
    )
    .unwrap();
    fs::create_dir_all(root.join("site-packages/nvidia/nccl/lib")).unwrap();
    torch
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

fn libtorch_link() -> Option<std::path::PathBuf> {
    fs::canonicalize(workspace_root().join(".libtorch")).ok()
}

#[test]
fn setup_refuses_another_torch_version_and_keeps_the_current_one() {
    let dir = tempfile::tempdir().unwrap();
    let before = libtorch_link();
    let out = script("setup.sh")
        .env("LIBTORCH", fake_torch(dir.path(), "2.10.1+cu128"))
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    let message = stderr(&out);
    assert!(message.contains("is torch 2.10.1+cu128"), "{message}");
    assert!(message.contains("needs torch 2.11.x"), "{message}");
    assert_eq!(
        libtorch_link(),
        before,
        "a refused torch must not replace .libtorch"
    );
}

#[test]
fn setup_refuses_a_directory_that_is_not_a_libtorch() {
    let dir = tempfile::tempdir().unwrap();
    let out = script("setup.sh")
        .env("LIBTORCH", dir.path())
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(
        stderr(&out).contains("it is not a libtorch"),
        "{}",
        stderr(&out)
    );
}

#[test]
fn setup_refuses_a_python_without_torch() {
    let out = script("setup.sh")
        .env("TORCH_PYTHON", "/nonexistent/python3")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(
        stderr(&out).contains("cannot import torch"),
        "{}",
        stderr(&out)
    );
}

#[test]
fn setup_accepts_the_libtorch_the_build_uses() {
    let current = fs::canonicalize(workspace_root().join(".libtorch")).expect("setup has run");
    let out = script("setup.sh")
        .env("LIBTORCH", &current)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("using libtorch 2.11."),
        "{}",
        stderr(&out)
    );
    assert_eq!(
        fs::canonicalize(workspace_root().join(".libtorch")).unwrap(),
        current
    );
}

#[test]
fn torch_env_puts_torch_and_its_nccl_on_the_library_path() {
    let dir = tempfile::tempdir().unwrap();
    let torch = fake_torch(dir.path(), "2.11.0");
    let nccl = fs::canonicalize(dir.path().join("site-packages/nvidia/nccl/lib")).unwrap();

    let printed = script("torch-env.sh")
        .env("LIBTORCH", &torch)
        .output()
        .unwrap();
    assert!(printed.status.success(), "{}", stderr(&printed));
    let line = String::from_utf8(printed.stdout).unwrap();
    assert!(
        line.starts_with(&format!(
            "export LD_LIBRARY_PATH={}/lib:{}",
            torch.display(),
            nccl.display()
        )),
        "{line}"
    );

    let sourced = Command::new("bash")
        .arg("-c")
        .arg(format!(
            "LD_LIBRARY_PATH=/opt/other; source {}; echo \"$LD_LIBRARY_PATH\"",
            workspace_root().join("scripts/torch-env.sh").display()
        ))
        .env("LIBTORCH", &torch)
        .output()
        .unwrap();
    let path = String::from_utf8(sourced.stdout).unwrap();
    assert_eq!(
        path.trim(),
        format!("{}/lib:{}:/opt/other", torch.display(), nccl.display())
    );
}
