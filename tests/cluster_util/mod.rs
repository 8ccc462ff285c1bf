//! A real etcd server for the cluster tests: Debian's `etcd` binary (`scripts/install-etcd.sh`)
//! started on reserved loopback ports ([`port_util`]) or inside a network namespace, with its data
//! in a temp dir, killed and removed on drop. Tests skip, with a message, when no etcd binary is
//! installed.
#![allow(dead_code)]

#[path = "../port_util/mod.rs"]
pub mod port_util;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

static N: AtomicU32 = AtomicU32::new(0);

/// The etcd binary: `$ETCD_BIN`, else `etcd` on PATH, else `/usr/bin/etcd`.
pub fn etcd_bin() -> Option<PathBuf> {
    if let Ok(p) = std::env::var("ETCD_BIN") {
        return Some(PathBuf::from(p));
    }
    if let Ok(path) = std::env::var("PATH") {
        for d in path.split(':') {
            let p = PathBuf::from(d).join("etcd");
            if p.is_file() {
                return Some(p);
            }
        }
    }
    let p = PathBuf::from("/usr/bin/etcd");
    p.is_file().then_some(p)
}

/// One etcd member.
pub struct Etcd {
    bin: PathBuf,
    child: Option<Child>,
    /// Data and log directory.
    pub dir: PathBuf,
    /// Address the client URL listens on.
    pub ip: String,
    /// Client port.
    pub port: u16,
    peer_port: u16,
    netns: Option<String>,
    extra: Vec<String>,
    /// The reservations of `port` and `peer_port` (held across restarts).
    _ports: Vec<port_util::Port>,
}

impl Etcd {
    /// Starts etcd on 127.0.0.1, or prints why the test is skipped and returns `None`.
    pub fn start(test: &str) -> Option<Etcd> {
        Self::start_with(test, "127.0.0.1", None, &[])
    }

    /// Starts etcd listening on `ip` (inside network namespace `netns`, if given), with extra
    /// command-line flags.
    pub fn start_with(test: &str, ip: &str, netns: Option<&str>, extra: &[&str]) -> Option<Etcd> {
        let Some(bin) = etcd_bin() else {
            eprintln!("SKIP {test}: no etcd binary (run scripts/install-etcd.sh)");
            return None;
        };
        let dir = std::env::temp_dir().join(format!(
            "tsync-etcd-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&dir).expect("etcd temp dir");
        let (port, peer_port, ports) = if netns.is_some() {
            (2379, 2380, vec![])
        } else {
            let (c, p) = (port_util::reserve(), port_util::reserve());
            (c.port, p.port, vec![c, p])
        };
        let mut e = Etcd {
            bin,
            child: None,
            dir,
            ip: ip.to_string(),
            port,
            peer_port,
            netns: netns.map(str::to_string),
            extra: extra.iter().map(|s| s.to_string()).collect(),
            _ports: ports,
        };
        e.spawn();
        Some(e)
    }

    /// `http://ip:port`.
    pub fn endpoint(&self) -> String {
        format!("http://{}:{}", self.ip, self.port)
    }

    fn spawn(&mut self) {
        let data = self.dir.join("data");
        let log = std::fs::File::create(self.dir.join("etcd.log")).expect("etcd log");
        let curl = self.endpoint();
        let purl = format!("http://{}:{}", self.ip, self.peer_port);
        let mut cmd = match &self.netns {
            Some(n) => {
                let mut c = Command::new("ip");
                c.args(["netns", "exec", n]).arg(&self.bin);
                c
            }
            None => Command::new(&self.bin),
        };
        cmd.arg("--name")
            .arg("t")
            .arg("--data-dir")
            .arg(&data)
            .arg("--listen-client-urls")
            .arg(&curl)
            .arg("--advertise-client-urls")
            .arg(&curl)
            .arg("--listen-peer-urls")
            .arg(&purl)
            .arg("--initial-advertise-peer-urls")
            .arg(&purl)
            .arg("--initial-cluster")
            .arg(format!("t={purl}"))
            .args(["--logger", "zap", "--log-level", "warn"])
            .args(&self.extra)
            .env("ETCD_UNSUPPORTED_ARCH", std::env::consts::ARCH)
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("log"))
            .stderr(log);
        self.child = Some(cmd.spawn().expect("spawn etcd"));
        self.wait_ready();
    }

    /// Waits (up to 30 s) until etcd answers `/health` with `"health":"true"`; panics with
    /// etcd's log when it exits first or the time runs out.
    pub fn wait_ready(&mut self) {
        let t0 = Instant::now();
        loop {
            if self.healthy() {
                return;
            }
            let exited = self
                .child
                .as_mut()
                .and_then(|c| c.try_wait().ok().flatten());
            if exited.is_some() || t0.elapsed() > Duration::from_secs(30) {
                let log = std::fs::read_to_string(self.dir.join("etcd.log")).unwrap_or_default();
                match exited {
                    Some(st) => {
                        panic!("etcd exited ({st}) before it became healthy; its log:\n{log}")
                    }
                    None => panic!("etcd did not become healthy in 30 s; its log:\n{log}"),
                }
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn healthy(&self) -> bool {
        if self.netns.is_some() {
            // Not reachable from this namespace: ask from inside.
            let out = Command::new("ip")
                .args(["netns", "exec", self.netns.as_deref().unwrap_or("")])
                .args(["bash", "-c"])
                .arg(format!(
                    "exec 3<>/dev/tcp/{}/{} && printf 'GET /health HTTP/1.0\\r\\n\\r\\n' >&3 && cat <&3",
                    self.ip, self.port
                ))
                .output();
            return out
                .map(|o| String::from_utf8_lossy(&o.stdout).contains("\"true\""))
                .unwrap_or(false);
        }
        let Ok(mut s) = TcpStream::connect_timeout(
            &format!("{}:{}", self.ip, self.port).parse().expect("addr"),
            Duration::from_millis(200),
        ) else {
            return false;
        };
        let _ = s.set_read_timeout(Some(Duration::from_secs(1)));
        if s.write_all(b"GET /health HTTP/1.0\r\n\r\n").is_err() {
            return false;
        }
        let mut body = String::new();
        let _ = s.read_to_string(&mut body);
        body.contains("\"true\"")
    }

    /// SIGKILLs etcd and waits for it.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Kills etcd and starts it again on the same ports; `wipe` deletes its data first (a
    /// replacement member that lost everything, leases included).
    pub fn restart(&mut self, wipe: bool) {
        self.kill();
        if wipe {
            let _ = std::fs::remove_dir_all(self.dir.join("data"));
        }
        self.spawn();
    }
}

impl Drop for Etcd {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
