//! `collect_env` as a user runs it: the report names the libtorch actually loaded, and the
//! self-test passes on every device of this machine.

use megatron_e2e::{bin, run_ok};

#[test]
fn self_test_passes_and_reports_the_loaded_libtorch() {
    let out = run_ok(bin("collect_env").arg("--self-test"));
    let stdout = String::from_utf8(out.stdout).unwrap();
    let libtorch_line = stdout
        .lines()
        .find(|l| l.starts_with("libtorch: "))
        .expect("libtorch line");
    assert!(
        libtorch_line.starts_with("libtorch: 2.11."),
        "{libtorch_line}"
    );
    assert!(libtorch_line.contains("libtorch_cpu.so"), "{libtorch_line}");
    for check in [
        "bf16 matmul",
        "bf16 SDPA forward+backward",
        "autograd shim",
        "recompute with dropout",
    ] {
        let line = stdout
            .lines()
            .find(|l| l.trim_start().starts_with("cpu") && l.contains(check))
            .unwrap_or_else(|| panic!("no cpu line for {check} in\n{stdout}"));
        assert!(line.contains(" ok ("), "{line}");
    }
    assert!(stdout.contains(" 0 failed on "), "{stdout}");
}

#[test]
fn unknown_flag_is_a_usage_error() {
    let out = bin("collect_env").arg("--no-such-flag").output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--no-such-flag"));
}
