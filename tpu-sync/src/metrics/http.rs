//! The opt-in HTTP endpoint: `GET /metrics` answers [`super::text`], on a thread of its own
//! (`tpu-sync-metrics`, a single-threaded tokio runtime, hyper's HTTP/1 server).
//!
//! Nothing listens unless asked: [`serve`] (a server owned by the caller), [`serve_global`]
//! (one per process, kept until exit), or [`super::ENV_ADDR`] read at the first use of the
//! library ([`serve_from_env`]).
//!
//! The server is the cargo feature `metrics-http` (on by default); without it [`parse_addr`]
//! stays, and [`serve_from_env`] refuses a configured address with an error that names the
//! feature.

#[cfg(feature = "metrics-http")]
use std::convert::Infallible;
use std::net::{SocketAddr, ToSocketAddrs};
#[cfg(feature = "metrics-http")]
use std::sync::{Mutex, OnceLock};

#[cfg(feature = "metrics-http")]
use http_body_util::Full;
#[cfg(feature = "metrics-http")]
use hyper::body::Bytes;
#[cfg(feature = "metrics-http")]
use hyper::{Method, Request, Response, StatusCode};
#[cfg(feature = "metrics-http")]
use hyper_util::rt::TokioIo;

use crate::error::{Error, Result};

/// Parses an endpoint address: `PORT`, `:PORT` (both bind `127.0.0.1`), `HOST:PORT` or
/// `IP:PORT` / `[IPv6]:PORT`, then adds `rank` to the port (port 0 stays 0: an ephemeral port).
/// `""`, `"0"` and `"off"` mean no endpoint (`Ok(None)`).
///
/// Errors: [`Error::InvalidArgument`] for an address that does not parse or resolve, or a port
/// that `rank` pushes past 65535.
pub fn parse_addr(s: &str, rank: u32) -> Result<Option<SocketAddr>> {
    let s = s.trim();
    if s.is_empty() || s == "0" || s.eq_ignore_ascii_case("off") {
        return Ok(None);
    }
    let bad = |why: &str| Error::InvalidArgument(format!("metrics address {s:?}: {why}"));
    let text = if let Some(p) = s.strip_prefix(':') {
        format!("127.0.0.1:{p}")
    } else if s.bytes().all(|b| b.is_ascii_digit()) {
        format!("127.0.0.1:{s}")
    } else {
        s.to_string()
    };
    let mut addr = match text.parse::<SocketAddr>() {
        Ok(a) => a,
        Err(_) => text
            .to_socket_addrs()
            .map_err(|e| bad(&e.to_string()))?
            .next()
            .ok_or_else(|| bad("resolves to no address"))?,
    };
    if addr.port() != 0 {
        let p = u32::from(addr.port()) + rank;
        let p = u16::try_from(p).map_err(|_| bad(&format!("port + rank {rank} exceeds 65535")))?;
        addr.set_port(p);
    }
    Ok(Some(addr))
}

#[cfg(feature = "metrics-http")]
/// A running metrics endpoint. Dropping it stops the server and joins its thread.
#[derive(Debug)]
pub struct MetricsServer {
    addr: SocketAddr,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

#[cfg(feature = "metrics-http")]
impl MetricsServer {
    /// The address bound (with the real port when 0 was asked for).
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }
}

#[cfg(feature = "metrics-http")]
impl Drop for MetricsServer {
    fn drop(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

#[cfg(feature = "metrics-http")]
async fn answer(
    req: Request<hyper::body::Incoming>,
) -> std::result::Result<Response<Full<Bytes>>, Infallible> {
    let reply = |code: StatusCode, ctype: &str, body: String| {
        let mut r = Response::new(Full::new(Bytes::from(body)));
        *r.status_mut() = code;
        if let Ok(v) = hyper::header::HeaderValue::from_str(ctype) {
            r.headers_mut().insert(hyper::header::CONTENT_TYPE, v);
        }
        r
    };
    let plain = "text/plain; charset=utf-8";
    Ok(match (req.method(), req.uri().path()) {
        (&Method::GET | &Method::HEAD, "/metrics") => {
            reply(StatusCode::OK, super::CONTENT_TYPE, super::text())
        }
        (&Method::GET | &Method::HEAD, "/") => reply(
            StatusCode::OK,
            plain,
            "tpu-sync metrics: GET /metrics (Prometheus text format 0.0.4)\n".into(),
        ),
        (&Method::GET | &Method::HEAD, _) => reply(
            StatusCode::NOT_FOUND,
            plain,
            "not found: try /metrics\n".into(),
        ),
        _ => reply(
            StatusCode::METHOD_NOT_ALLOWED,
            plain,
            "only GET and HEAD\n".into(),
        ),
    })
}

#[cfg(feature = "metrics-http")]
/// Serves `GET /metrics` on `addr` until the returned server is dropped. The socket is bound
/// before this returns (so a port in use is reported here); connections are answered on the
/// `tpu-sync-metrics` thread, each with a 30 s limit.
///
/// Errors: [`Error::Io`] when the address cannot be bound or the thread not started.
pub fn serve(addr: SocketAddr) -> Result<MetricsServer> {
    super::init();
    let std_listener = std::net::TcpListener::bind(addr)
        .map_err(|e| Error::io(format!("bind the metrics endpoint on {addr}"), e))?;
    std_listener
        .set_nonblocking(true)
        .map_err(|e| Error::io("metrics endpoint: set_nonblocking", e))?;
    let bound = std_listener
        .local_addr()
        .map_err(|e| Error::io("metrics endpoint: local_addr", e))?;
    let (tx, mut rx) = tokio::sync::oneshot::channel::<()>();
    let thread = std::thread::Builder::new()
        .name("tpu-sync-metrics".into())
        .spawn(move || {
            let rt = match tokio::runtime::Builder::new_current_thread()
                .enable_io()
                .enable_time()
                .build()
            {
                Ok(rt) => rt,
                Err(e) => {
                    log::error!("metrics endpoint: no tokio runtime: {e}");
                    return;
                }
            };
            rt.block_on(async move {
                let listener = match tokio::net::TcpListener::from_std(std_listener) {
                    Ok(l) => l,
                    Err(e) => {
                        log::error!("metrics endpoint: {e}");
                        return;
                    }
                };
                loop {
                    tokio::select! {
                        _ = &mut rx => break,
                        acc = listener.accept() => {
                            let Ok((stream, _)) = acc else { continue };
                            tokio::spawn(async move {
                                let conn = hyper::server::conn::http1::Builder::new()
                                    .keep_alive(true)
                                    .serve_connection(
                                        TokioIo::new(stream),
                                        hyper::service::service_fn(answer),
                                    );
                                let _ = tokio::time::timeout(
                                    std::time::Duration::from_secs(30),
                                    conn,
                                )
                                .await;
                            });
                        }
                    }
                }
            });
        })
        .map_err(|e| Error::io("spawn the tpu-sync-metrics thread", e))?;
    log::info!("tpu-sync metrics on http://{bound}/metrics");
    Ok(MetricsServer {
        addr: bound,
        stop: Some(tx),
        thread: Some(thread),
    })
}

#[cfg(feature = "metrics-http")]
fn global() -> &'static Mutex<Option<MetricsServer>> {
    static G: OnceLock<Mutex<Option<MetricsServer>>> = OnceLock::new();
    G.get_or_init(|| Mutex::new(None))
}

#[cfg(feature = "metrics-http")]
/// Starts the process's metrics endpoint on `addr` (kept until the process exits), or returns
/// the address of the one already running (whatever `addr` says).
///
/// Errors: as [`serve`].
pub fn serve_global(addr: SocketAddr) -> Result<SocketAddr> {
    // Read the environment first: it may start the global endpoint itself (under the lock).
    super::init();
    let mut g = global().lock().unwrap_or_else(|p| p.into_inner());
    if let Some(s) = g.as_ref() {
        return Ok(s.addr());
    }
    let s = serve(addr)?;
    let a = s.addr();
    *g = Some(s);
    Ok(a)
}

#[cfg(feature = "metrics-http")]
/// The address of the process's endpoint ([`serve_global`] or the environment), if running.
pub fn served_addr() -> Option<SocketAddr> {
    global()
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .as_ref()
        .map(MetricsServer::addr)
}

/// Starts the process's endpoint from [`super::ENV_ADDR`] and [`super::ENV_RANK`], if set.
/// Returns the address served (`None` when the variable is unset or off). The library calls this
/// once, at its first use.
///
/// Errors: a malformed address or rank ([`Error::InvalidArgument`]); as [`serve`].
pub fn serve_from_env() -> Result<Option<SocketAddr>> {
    let Ok(v) = std::env::var(super::ENV_ADDR) else {
        return Ok(None);
    };
    serve_from_env_value(&v, std::env::var(super::ENV_RANK).ok().as_deref())
}

/// [`serve_from_env`] with the two variables' values given: `addr` of [`super::ENV_ADDR`],
/// `rank` of [`super::ENV_RANK`] (`None` or blank: rank 0).
pub(crate) fn serve_from_env_value(addr: &str, rank: Option<&str>) -> Result<Option<SocketAddr>> {
    let rank = match rank {
        Some(r) if !r.trim().is_empty() => r.trim().parse::<u32>().map_err(|_| {
            Error::InvalidArgument(format!("{}={r:?} is not a rank", super::ENV_RANK))
        })?,
        _ => 0,
    };
    match parse_addr(addr, rank)? {
        None => Ok(None),
        #[cfg(feature = "metrics-http")]
        Some(a) => serve_global(a).map(Some),
        #[cfg(not(feature = "metrics-http"))]
        Some(_) => Err(Error::feature_missing(
            &format!("{}={addr:?}", super::ENV_ADDR),
            "metrics-http",
        )),
    }
}
