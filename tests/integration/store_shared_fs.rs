//! The disk tier on a shared file system: writers in other processes (and in another mount
//! namespace, through a bind mount), a reader that checks every block byte for byte, a writer
//! SIGKILLed mid-write (20 times) while a reader reads, and two writers of the same key.
//!
//! Child processes are this test binary re-run with `TSYNC_SHARED_ROLE` set (the `child` test
//! does the work then and nothing otherwise).

use crate::store_util;

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use tpu_sync::store::shared::SharedReader;
use tpu_sync::store::{BlockKey, DiskOptions, KvStore, SharedFs};

const BLOCK: usize = 128 * 1024;
const PART: &str = "tp2_r1";

/// The bytes writer `variant` stores for `key` (variant 0: the common content).
fn content(key: BlockKey, variant: u64) -> Vec<u8> {
    store_util::bytes_of(BlockKey(key.0 ^ (variant as u128) << 64), BLOCK)
}

fn open_writer(dir: &Path, writer: &str, slots: u64) -> KvStore {
    let mut c = store_util::config(BLOCK as u64, slots);
    let mut d = DiskOptions::new(dir, 1 << 30);
    d.shared = Some(SharedFs {
        partition: PART.into(),
        writer: writer.into(),
    });
    c.disk = Some(d);
    KvStore::open(c).expect("open the shared writer")
}

fn put_chain(s: &KvStore, chain: &[BlockKey], variant: u64) {
    for (i, &k) in chain.iter().enumerate() {
        let data = content(k, variant);
        let parent = if i == 0 { None } else { Some(chain[i - 1]) };
        let r = s.put_from_host(parent, &[k], &[&data]).expect("put");
        assert!(r.complete(), "{r:?}");
    }
    s.flush_to_disk().expect("flush");
}

/// Child process body: see `spawn`.
#[test]
fn child() {
    let Ok(role) = std::env::var("TSYNC_SHARED_ROLE") else {
        return;
    };
    let dir = PathBuf::from(std::env::var("TSYNC_SHARED_DIR").unwrap());
    let writer = std::env::var("TSYNC_SHARED_WRITER").unwrap();
    let seed: u64 = std::env::var("TSYNC_SHARED_SEED").unwrap().parse().unwrap();
    let variant: u64 = std::env::var("TSYNC_SHARED_VARIANT")
        .map(|v| v.parse().unwrap())
        .unwrap_or(0);
    let s = open_writer(&dir, &writer, 8);
    match role.as_str() {
        "write" => {
            put_chain(&s, &store_util::chain(6, seed), variant);
            println!("DONE");
        }
        "loop" => {
            // Writes fresh chains until killed (at most 48, then idles).
            for i in 0..48 {
                put_chain(&s, &store_util::chain(4, seed * 1000 + i), variant);
                if i == 0 {
                    println!("STARTED");
                }
            }
            std::thread::sleep(Duration::from_secs(600));
        }
        r => panic!("unknown role {r}"),
    }
}

fn spawn(
    wrap: Option<&[&str]>,
    dir: &Path,
    role: &str,
    writer: &str,
    seed: u64,
    variant: u64,
) -> Child {
    let exe = std::env::current_exe().unwrap();
    let mut cmd = match wrap {
        Some(w) => {
            let mut c = Command::new(w[0]);
            c.args(&w[1..]).arg(&exe);
            c
        }
        None => Command::new(&exe),
    };
    cmd.args([
        "--exact",
        &crate::test_name(module_path!(), "child"),
        "--nocapture",
        "--test-threads=1",
    ])
    .env("TSYNC_SHARED_ROLE", role)
    .env("TSYNC_SHARED_DIR", dir)
    .env("TSYNC_SHARED_WRITER", writer)
    .env("TSYNC_SHARED_SEED", seed.to_string())
    .env("TSYNC_SHARED_VARIANT", variant.to_string())
    .stdout(Stdio::piped())
    .stderr(Stdio::inherit());
    cmd.spawn().expect("spawn the writer")
}

fn wait_line(c: &mut Child, want: &str) {
    let out = c.stdout.take().unwrap();
    let mut r = BufReader::new(out);
    let mut line = String::new();
    loop {
        line.clear();
        if r.read_line(&mut line).unwrap() == 0 {
            panic!("writer exited before printing {want}");
        }
        if line.trim().ends_with(want) {
            break;
        }
    }
    // Keep draining so the child never blocks on a full pipe.
    std::thread::spawn(move || {
        let mut sink = String::new();
        while r.read_line(&mut sink).map(|n| n > 0).unwrap_or(false) {
            sink.clear();
        }
    });
}

fn tmpdir(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(store_util::unique(tag));
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Reads `chain` through a reader and checks every delivered block against `variants`.
fn read_and_check(r: &SharedReader, chain: &[BlockKey], variants: &[u64]) -> usize {
    let mut bufs: Vec<Vec<u8>> = chain.iter().map(|_| vec![0u8; BLOCK]).collect();
    let mut dst: Vec<&mut [u8]> = bufs.iter_mut().map(|b| b.as_mut_slice()).collect();
    let g = r.get_to_host(chain, &mut dst).unwrap();
    for (i, b) in bufs.iter().enumerate().take(g.delivered) {
        assert!(
            variants.iter().any(|&v| *b == content(chain[i], v)),
            "block {i} of the chain is not any writer's whole block"
        );
    }
    g.delivered
}

/// Every `*.kvb` under the partition, as keys.
fn files(dir: &Path) -> Vec<BlockKey> {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    rd.flatten()
        .filter_map(|e| {
            let n = e.file_name().to_string_lossy().into_owned();
            n.strip_suffix(".kvb").and_then(BlockKey::from_hex)
        })
        .collect()
}

#[test]
fn another_process_writes_this_one_reads() {
    let dir = tmpdir("shfs-a");
    let mut c = spawn(None, &dir, "write", "hostA", 1, 0);
    assert!(c.wait().unwrap().success());
    let r = SharedReader::open(&dir, &store_util::ns(), PART, true).unwrap();
    let chain = store_util::chain(6, 1);
    assert_eq!(r.lookup(&chain), 6);
    assert_eq!(read_and_check(&r, &chain, &[0]), 6);
    // Files are partitioned by namespace and rank.
    assert!(r.dir().ends_with(PART));
    assert_eq!(files(r.dir()).len(), 6);
    // Another partition or namespace sees nothing.
    let other = SharedReader::open(&dir, &store_util::ns(), "tp2_r0", true).unwrap();
    assert_eq!(other.lookup(&chain), 0);
    let other_ns =
        SharedReader::open(&dir, &tpu_sync::store::Namespace::new("x"), PART, true).unwrap();
    assert_eq!(other_ns.lookup(&chain), 0);
    eprintln!(
        "O_DIRECT kept: {}, fallbacks: {}",
        r.direct(),
        r.direct_fallbacks()
    );
    // A second writer process of another id on the same partition: both sets readable, and
    // the first writer's files survive the second writer's open (not its to clean up).
    let mut c = spawn(None, &dir, "write", "hostB", 2, 0);
    assert!(c.wait().unwrap().success());
    assert_eq!(read_and_check(&r, &chain, &[0]), 6);
    assert_eq!(read_and_check(&r, &store_util::chain(6, 2), &[0]), 6);
    // A corrupted file is a miss for the reader, never bytes.
    let p = r.dir().join(format!("{}.kvb", chain[3].hex()));
    let mut b = std::fs::read(&p).unwrap();
    b[4096 + 100] ^= 0x55;
    let tmp = r.dir().join("corrupt.tmpfile");
    std::fs::write(&tmp, &b).unwrap();
    std::fs::rename(&tmp, &p).unwrap();
    assert_eq!(read_and_check(&r, &chain, &[0]), 3);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn writer_in_another_mount_namespace_via_bind_mount() {
    // Root and unshare(1) needed; skipped otherwise.
    let ok = Command::new("unshare")
        .args(["-m", "true"])
        .stderr(Stdio::null())
        .status()
        .map(|s| s.success())
        .unwrap_or(false);
    if !ok {
        eprintln!("SKIP writer_in_another_mount_namespace_via_bind_mount: unshare -m unavailable");
        return;
    }
    let shared = tmpdir("shfs-src");
    let mnt = tmpdir("shfs-mnt");
    // The writer sees the shared directory only at `mnt`, inside its own mount namespace.
    let script = format!(
        "mount --bind {} {} && exec \"$0\" \"$@\"",
        shared.display(),
        mnt.display()
    );
    let wrap = [
        "unshare",
        "-m",
        "--propagation",
        "private",
        "sh",
        "-c",
        &script,
    ];
    let mut c = spawn(Some(&wrap), &mnt, "write", "hostC", 3, 0);
    assert!(c.wait().unwrap().success());
    // Nothing appeared under `mnt` in this namespace; everything under `shared`.
    assert!(std::fs::read_dir(&mnt).unwrap().next().is_none());
    let r = SharedReader::open(&shared, &store_util::ns(), PART, true).unwrap();
    let chain = store_util::chain(6, 3);
    assert_eq!(read_and_check(&r, &chain, &[0]), 6);
    let _ = std::fs::remove_dir_all(&shared);
    let _ = std::fs::remove_dir_all(&mnt);
}

#[test]
fn writer_killed_mid_write_never_shows_a_partial_block() {
    let dir = tmpdir("shfs-kill");
    let r = SharedReader::open(&dir, &store_util::ns(), PART, true).unwrap();
    let mut leftovers = 0;
    let mut checked = 0;
    for round in 0..20u64 {
        let mut c = spawn(None, &dir, "loop", "killed", 100 + round, 0);
        wait_line(&mut c, "STARTED");
        // Read while it writes, then kill it at a different point each round.
        for k in files(r.dir()).into_iter().take(8) {
            checked += read_and_check(&r, &[k], &[0]);
        }
        std::thread::sleep(Duration::from_millis(round * 3 % 17));
        // SAFETY: kill(2) on our own child's pid.
        unsafe { libc::kill(c.id() as i32, libc::SIGKILL) };
        let _ = c.wait();
        // Every block file under its final name is whole and correct.
        for k in files(r.dir()) {
            assert_eq!(read_and_check(&r, &[k], &[0]), 1, "file {k} is not whole");
            checked += 1;
        }
        leftovers += std::fs::read_dir(r.dir())
            .unwrap()
            .flatten()
            .filter(|e| e.file_name().to_string_lossy().ends_with(".tmp"))
            .count();
        // Checked: start the next round on an empty partition (temporary files stay).
        for k in files(r.dir()) {
            let _ = std::fs::remove_file(r.dir().join(format!("{}.kvb", k.hex())));
        }
    }
    eprintln!("checked {checked} blocks; temporary files left by the kills: {leftovers}");
    assert!(checked > 20);
    // A restarted writer of the same id removes its own leftovers at open.
    let s = open_writer(&dir, "killed", 8);
    let tmp_after = std::fs::read_dir(r.dir())
        .unwrap()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().ends_with(".tmp"))
        .count();
    assert_eq!(tmp_after, 0);
    drop(s);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn two_writers_of_the_same_key() {
    let dir = tmpdir("shfs-same");
    // The same chain, different contents (variants 1 and 2), written concurrently.
    let mut a = spawn(None, &dir, "write", "w1", 7, 1);
    let mut b = spawn(None, &dir, "write", "w2", 7, 2);
    assert!(a.wait().unwrap().success());
    assert!(b.wait().unwrap().success());
    let chain = store_util::chain(6, 7);
    // Two readers: each block is one writer's whole block (one won), never a mix.
    let r1 = SharedReader::open(&dir, &store_util::ns(), PART, true).unwrap();
    let r2 = SharedReader::open(&dir, &store_util::ns(), PART, false).unwrap();
    assert_eq!(read_and_check(&r1, &chain, &[1, 2]), 6);
    assert_eq!(read_and_check(&r2, &chain, &[1, 2]), 6);
    assert_eq!(files(r1.dir()).len(), 6);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn bad_names_are_refused() {
    let dir = tmpdir("shfs-bad");
    assert!(SharedReader::open(&dir, &store_util::ns(), "../x", true).is_err());
    let mut c = store_util::config(4096, 4);
    let mut d = DiskOptions::new(&dir, 1 << 20);
    d.shared = Some(SharedFs::tp_rank(1, 0, "a/b"));
    c.disk = Some(d);
    assert_eq!(
        KvStore::open(c).unwrap_err().kind(),
        tpu_sync::ErrorKind::InvalidArgument
    );
    assert_eq!(SharedFs::tp_rank(4, 3, "w").partition, "tp4_r3");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Issue 24: the namespace directory of a shared disk tier may be writable by co-tenants, so
/// the names the writer opens there are symlink-proof: a `NAMESPACE` planted as a symlink is
/// not written through (the store still opens: the file is informational), a lock file planted
/// as a symlink refuses the open, and a namespace directory replaced by a symlink is refused.
/// The files the symlinks point at keep their bytes, and nothing is created where they point.
#[test]
fn symlinks_planted_in_the_namespace_directory_are_never_followed() {
    use std::os::unix::fs::symlink;

    let dir = tmpdir("shfs-symlink");
    let victim = dir.join("victim");
    let precious = b"precious bytes of another tenant\n".to_vec();
    let root = dir.join("root");
    drop(open_writer(&root, "w0", 4));
    let ns_dir = std::fs::read_dir(&root)
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .find(|p| p.is_dir())
        .expect("the namespace directory");
    let reset_victim = || std::fs::write(&victim, &precious).unwrap();

    // NAMESPACE as a symlink: the store opens and stores, the victim is untouched.
    reset_victim();
    std::fs::remove_file(ns_dir.join("NAMESPACE")).unwrap();
    symlink(&victim, ns_dir.join("NAMESPACE")).unwrap();
    let s = open_writer(&root, "w0", 4);
    let chain = store_util::chain(2, 71);
    put_chain(&s, &chain, 0);
    drop(s);
    assert_eq!(
        std::fs::read(&victim).unwrap(),
        precious,
        "NAMESPACE was written through"
    );
    assert!(std::fs::symlink_metadata(ns_dir.join("NAMESPACE"))
        .unwrap()
        .file_type()
        .is_symlink());

    // The writer's lock file as a symlink: refused, the victim untouched.
    reset_victim();
    let lock = ns_dir.join(PART).join(".lock.w1");
    let _ = std::fs::remove_file(&lock);
    symlink(&victim, &lock).unwrap();
    let mut c = store_util::config(BLOCK as u64, 4);
    let mut d = DiskOptions::new(&root, 1 << 30);
    d.shared = Some(SharedFs {
        partition: PART.into(),
        writer: "w1".into(),
    });
    c.disk = Some(d);
    let e = KvStore::open(c).unwrap_err();
    assert_eq!(e.kind(), tpu_sync::ErrorKind::Io, "{e}");
    assert_eq!(
        std::fs::read(&victim).unwrap(),
        precious,
        "the lock file was followed"
    );

    // The namespace directory as a symlink to another directory: refused, nothing created there.
    let elsewhere = dir.join("elsewhere");
    std::fs::create_dir(&elsewhere).unwrap();
    std::fs::rename(&ns_dir, dir.join("moved-away")).unwrap();
    symlink(&elsewhere, &ns_dir).unwrap();
    let mut c = store_util::config(BLOCK as u64, 4);
    c.disk = Some(DiskOptions::new(&root, 1 << 30));
    let e = KvStore::open(c).unwrap_err();
    assert_eq!(e.kind(), tpu_sync::ErrorKind::Io, "{e}");
    assert_eq!(
        std::fs::read_dir(&elsewhere).unwrap().count(),
        0,
        "written through the symlink"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// Issue 24, item 8: block names are opened through directory descriptors with `O_NOFOLLOW` and
/// never wait on what a co-tenant planted. A FIFO under a block's name (it would block an
/// `open(O_RDONLY)` forever) and a symlink to another file under another block's name are
/// misses for the reader and are skipped, never followed, by a writer's scan at open; the files
/// the symlinks name keep their bytes. The partition directory renamed away and replaced by a
/// symlink while a writer is open: the writer's later puts still land in the real directory.
#[test]
fn fifos_and_symlinks_under_block_names_are_refused_without_waiting() {
    use std::os::unix::ffi::OsStrExt;
    use std::os::unix::fs::symlink;

    let dir = tmpdir("shfs-fifo");
    let root = dir.join("root");
    let chain = store_util::chain(4, 81);
    {
        let s = open_writer(&root, "w0", 8);
        put_chain(&s, &chain[..2], 0);
    }
    let r = SharedReader::open(&root, &store_util::ns(), PART, false).unwrap();
    let part = r.dir().to_path_buf();
    let victim = dir.join("victim");
    let precious = content(chain[3], 0);
    std::fs::write(&victim, &precious).unwrap();
    let fifo = std::ffi::CString::new(
        part.join(format!("{}.kvb", chain[2].hex()))
            .as_os_str()
            .as_bytes(),
    )
    .unwrap();
    // SAFETY: NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(fifo.as_ptr(), 0o600) }, 0);
    symlink(&victim, part.join(format!("{}.kvb", chain[3].hex()))).unwrap();

    // Each step runs on a thread with a deadline: an open that waits on the FIFO is a failure.
    fn within<T: Send + 'static>(what: &str, f: impl FnOnce() -> T + Send + 'static) -> T {
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let _ = tx.send(f());
        });
        rx.recv_timeout(Duration::from_secs(60))
            .unwrap_or_else(|_| panic!("{what} waited on a FIFO planted under a block name"))
    }
    let r = std::sync::Arc::new(r);
    let (r2, c2) = (r.clone(), chain.clone());
    assert_eq!(within("lookup", move || r2.lookup(&c2)), 2);
    let (r2, c2) = (r.clone(), chain.clone());
    let (got, bufs) = within("get_to_host", move || {
        let mut bufs = vec![vec![0u8; BLOCK]; c2.len()];
        let mut dst: Vec<&mut [u8]> = bufs.iter_mut().map(|b| b.as_mut_slice()).collect();
        let got = r2.get_to_host(&c2, &mut dst).unwrap();
        (got, bufs)
    });
    assert_eq!(got.delivered, 2, "{got:?}");
    assert!(
        got.stop.is_some() && got.stop != Some(tpu_sync::store::disk::Miss::Missing),
        "{got:?}"
    );
    for (k, b) in chain[..2].iter().zip(&bufs) {
        assert!(b == &content(*k, 0), "block {k} differs");
    }
    // A writer's open scans the partition: it neither hangs on the FIFO nor follows the symlink.
    let root2 = root.clone();
    let s = within("a writer's open", move || open_writer(&root2, "w0", 8));
    assert_eq!(std::fs::read(&victim).unwrap(), precious);
    // Renamed away and replaced by a symlink to another directory while the writer is open:
    // its next put lands in the directory it checked, nothing in the other one.
    let elsewhere = dir.join("elsewhere");
    std::fs::create_dir(&elsewhere).unwrap();
    let moved = dir.join("moved-partition");
    std::fs::rename(&part, &moved).unwrap();
    symlink(&elsewhere, &part).unwrap();
    let more = store_util::chain(2, 82);
    put_chain(&s, &more, 0);
    drop(s);
    assert_eq!(
        std::fs::read_dir(&elsewhere).unwrap().count(),
        0,
        "written through the symlink"
    );
    for k in &more {
        let b = std::fs::read(moved.join(format!("{}.kvb", k.hex()))).unwrap();
        assert_eq!(b.len(), 4096 + BLOCK, "block {k}");
        assert!(b[4096..] == content(*k, 0)[..], "block {k} differs");
    }
    let _ = std::fs::remove_dir_all(&dir);
}
