//! Helpers shared by the integration tests.
#![allow(dead_code)]

use std::path::PathBuf;
use std::process::{Command, Output};
use std::sync::Arc;
use std::time::Duration;

use tpu_sync::pjrt::{Client, ClientOptions, Plugin};

/// The PJRT plugin under test (installed by `make plugin`); panics with instructions if missing.
pub fn plugin_path() -> PathBuf {
    tpu_sync::pjrt::default_plugin_path()
        .expect("PJRT plugin not found: run `make plugin` (or set TPU_SYNC_PJRT_PLUGIN)")
}

/// The directory with `pjrt_c_api.h` shipped next to the plugin.
pub fn pjrt_include() -> PathBuf {
    if let Some(p) = std::env::var_os("TPU_SYNC_PJRT_INCLUDE") {
        if PathBuf::from(&p).join("pjrt_c_api.h").is_file() {
            return p.into();
        }
    }
    plugin_path().parent().expect("plugin dir").join("include")
}

pub fn plugin() -> Arc<Plugin> {
    Plugin::load(&plugin_path()).expect("load plugin")
}

pub fn client(devices: i64) -> Client {
    Client::create(
        &plugin(),
        &ClientOptions {
            cpu_device_count: Some(devices),
        },
    )
    .expect("client")
}

/// Runs the `tpu-sync` binary with `args`, killing it after `limit`.
pub fn tpu_sync(args: &[&str], limit: Duration) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_tpu-sync"));
    cmd.args(args).env("TPU_SYNC_PJRT_PLUGIN", plugin_path());
    run_with_limit(cmd, limit)
}

pub fn run_with_limit(mut cmd: Command, limit: Duration) -> Output {
    use std::io::Read;
    cmd.stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
    let mut child = cmd.spawn().expect("spawn");
    let mut out = child.stdout.take().unwrap();
    let mut err = child.stderr.take().unwrap();
    let t_out = std::thread::spawn(move || {
        let mut v = Vec::new();
        out.read_to_end(&mut v).ok();
        v
    });
    let t_err = std::thread::spawn(move || {
        let mut v = Vec::new();
        err.read_to_end(&mut v).ok();
        v
    });
    let deadline = std::time::Instant::now() + limit;
    let status = loop {
        if let Some(s) = child.try_wait().expect("wait") {
            break s;
        }
        if std::time::Instant::now() > deadline {
            child.kill().ok();
            let _ = child.wait();
            panic!("command {cmd:?} did not finish within {limit:?} (hang)");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    Output {
        status,
        stdout: t_out.join().unwrap(),
        stderr: t_err.join().unwrap(),
    }
}

pub fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}
