//! The integration tests that share nothing process-wide, in one test binary (`cargo test
//! --release --test integration`; one module per former test file, e.g. `-- store_restart::`).
//!
//! One binary instead of one per file: on the 2-core CI machine each test binary took 15-35 s of
//! compilation and linking (each one instantiates the library's generics and links every
//! dependency again), about 5 min of `make test`'s release build for 26 of them.
//!
//! What stays in a binary of its own (`tests/*.rs`) is what reads or changes state of the whole
//! process while its tests run, which the tests of another module, running beside it in this one,
//! would disturb: open file descriptors and sockets (`net_faults`, `net_scale`), threads, memory
//! and fds (`net_chaos`, `soak`, `cluster_remote`), the process-wide metrics (`metrics_net`,
//! `observability_cli`) and the global device-copy pacer (`net_stalled_copies` pauses it).
//!
//! The helper modules are declared once here, so their counters (unique names of shm segments,
//! temp dirs, PKIs) are shared by every module of the binary.

#[path = "../cluster_util/mod.rs"]
mod cluster_util;
#[path = "../common/mod.rs"]
mod common;
#[path = "../fault_util/mod.rs"]
mod fault_util;
#[path = "../net_util/mod.rs"]
mod net_util;
// The reserved loopback ports: the cluster helpers' own module (one instance of it).
use cluster_util::port_util;
#[path = "../store_util/mod.rs"]
mod store_util;

mod cluster_directory;
mod cluster_load;
mod cluster_netns;
mod device_pacing;
mod device_sources;
mod hybrid_demo;
mod net_auth;
mod net_hostile;
mod net_netns;
mod net_semantics;
mod net_transfer;
mod net_validation;
mod pjrt_abi;
mod pjrt_device;
mod store_basic;
mod store_device;
mod store_disk;
mod store_faults;
mod store_groups;
mod store_props;
mod store_race;
mod store_restart;
mod store_shared_fs;
mod transfer_groups;
mod transfer_pipeline;
mod two_process;

/// The full libtest name of test `name` in the module at `module` (pass `module_path!()`), as a
/// child process of this binary is started with it: `--exact store_restart::crash_child`.
pub fn test_name(module: &str, name: &str) -> String {
    match module.split_once("::") {
        Some((_, m)) => format!("{m}::{name}"),
        None => name.to_string(),
    }
}

/// A command that runs only test `name` of the module at `module` (pass `module_path!()`) in a
/// child process of this binary, one test thread, its output not captured: the child sides of
/// the tests that need a process of their own (to be killed, or where no other test forks).
pub fn child_test(module: &str, name: &str) -> std::process::Command {
    let mut c = std::process::Command::new(std::env::current_exe().expect("test binary path"));
    c.args([
        "--exact",
        &test_name(module, name),
        "--nocapture",
        "--test-threads=1",
    ]);
    c
}
