//! The wire protocol between transfer endpoints: frame headers, control messages and data chunks.
//!
//! Pure code (no I/O). Every frame starts with a 24-byte [`FrameHeader`] (little endian):
//!
//! | bytes | field | meaning |
//! |---|---|---|
//! | 0..4 | magic | `b"TSYN"` |
//! | 4 | version | [`PROTOCOL_VERSION`] |
//! | 5 | kind | [`FrameKind`] |
//! | 6..8 | flags | reserved, 0 |
//! | 8..12 | body_len | bytes after the header |
//! | 12..16 | reserved | 0 |
//! | 16..24 | request_id | the request the frame belongs to (0 for none) |
//!
//! Control frames carry a JSON body ([`Control`]) of at most [`MAX_CONTROL_BODY`] bytes. Data
//! frames carry a 16-byte [`DataHeader`] (`stream_offset`, `checksum`) followed by the payload:
//! bytes `stream_offset..stream_offset+payload_len` of the pair's byte stream (the concatenation,
//! in plan order, of the bytes of every span between one source and one destination rank). The
//! checksum is xxh3-64 of the payload. A receiver derives where payload bytes go from its own
//! plan, never from the frame. A pair's stream may be split over several lanes ([`Stripe`]).
//!
//! The lane protocol built on these frames is described in [`crate::net`].

use serde::{Deserialize, Serialize};

use crate::error::{Error, ErrorKind, Result};
use crate::plan::Placement;

/// Frame magic.
pub const MAGIC: [u8; 4] = *b"TSYN";
/// Protocol version spoken by this build.
pub const PROTOCOL_VERSION: u8 = 2;
/// Size of [`FrameHeader`] on the wire.
pub const HEADER_LEN: usize = 24;
/// Size of [`DataHeader`] on the wire.
pub const DATA_HEADER_LEN: usize = 16;
/// Largest control body accepted (bytes).
pub const MAX_CONTROL_BODY: u32 = 16 << 20;
/// Largest data payload accepted per frame (bytes).
pub const MAX_DATA_PAYLOAD: u32 = 64 << 20;
/// Largest control body accepted as the first frame of a lane, before the peer has said
/// [`Control::Hello`] (bytes). A hello is a few hundred bytes; this keeps a peer that has not
/// identified itself from making the receiver buffer and parse megabytes.
pub const MAX_HELLO_BODY: u32 = 4 << 10;
/// Most stripes (parallel lanes) one pair's stream may be split over. A receiver allocates
/// per-stripe state, so the count a peer declares must be bounded.
pub const MAX_STRIPES: u32 = 1024;

/// What a frame carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum FrameKind {
    /// JSON [`Control`] message.
    Control = 1,
    /// [`DataHeader`] + payload.
    Data = 2,
    /// [`DataHeader`] + a table of where the payload lies in the sender's memory, for a
    /// receiver on the same host that copies it out itself (the `shm` transport,
    /// [`crate::net::shm`]): payload length `u64`, piece count `u32`, zero `u32`, then per piece
    /// address `u64` and length `u64`, little-endian. The body length counts these bytes, not
    /// the payload's.
    DataRef = 3,
}

/// Bytes of a [`FrameKind::DataRef`] table before its pieces (payload length, count, zero).
pub const DATA_REF_PREFIX_LEN: usize = 16;

/// Most pieces one [`FrameKind::DataRef`] frame may list.
pub const MAX_DATA_REF_PIECES: u32 = 1 << 16;

/// Bytes as space-separated hex plus their printable-ASCII rendering (`.` for the rest), for
/// messages: `48 54 54 50 ("HTTP")`.
fn magic_text(b: &[u8]) -> String {
    let hex = b
        .iter()
        .map(|x| format!("{x:02x}"))
        .collect::<Vec<_>>()
        .join(" ");
    let ascii: String = b
        .iter()
        .map(|&x| {
            if x.is_ascii_graphic() || x == b' ' {
                x as char
            } else {
                '.'
            }
        })
        .collect();
    format!("{hex} (\"{ascii}\")")
}

/// The fixed frame header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FrameHeader {
    /// Frame kind.
    pub kind: FrameKind,
    /// Bytes following the header.
    pub body_len: u32,
    /// Request id (0 when none).
    pub request_id: u64,
}

impl FrameHeader {
    /// Encodes to 24 bytes.
    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut b = [0u8; HEADER_LEN];
        b[0..4].copy_from_slice(&MAGIC);
        b[4] = PROTOCOL_VERSION;
        b[5] = self.kind as u8;
        b[8..12].copy_from_slice(&self.body_len.to_le_bytes());
        b[16..24].copy_from_slice(&self.request_id.to_le_bytes());
        b
    }

    /// Decodes and validates a header: magic, version, kind, reserved bytes and the body length
    /// limit of the kind. Errors with [`Error::Protocol`].
    pub fn decode(b: &[u8]) -> Result<FrameHeader> {
        if b.len() < HEADER_LEN {
            return Err(Error::Protocol(format!(
                "truncated frame header ({} bytes)",
                b.len()
            )));
        }
        if b[0..4] != MAGIC {
            return Err(Error::Protocol(format!(
                "bad frame magic {}: not a tpu-sync peer?",
                magic_text(&b[0..4])
            )));
        }
        if b[4] != PROTOCOL_VERSION {
            return Err(Error::Protocol(format!(
                "protocol version {} not supported (this side speaks {PROTOCOL_VERSION})",
                b[4]
            )));
        }
        if b[6..8] != [0, 0] || b[12..16] != [0, 0, 0, 0] {
            return Err(Error::Protocol("reserved header bytes are not zero".into()));
        }
        let body_len = u32::from_le_bytes([b[8], b[9], b[10], b[11]]);
        let request_id = u64::from_le_bytes(b[16..24].try_into().expect("8 bytes"));
        let kind = match b[5] {
            1 => FrameKind::Control,
            2 => FrameKind::Data,
            3 => FrameKind::DataRef,
            k => return Err(Error::Protocol(format!("unknown frame kind {k}"))),
        };
        let max = match kind {
            FrameKind::Control => MAX_CONTROL_BODY,
            FrameKind::Data => MAX_DATA_PAYLOAD + DATA_HEADER_LEN as u32,
            FrameKind::DataRef => {
                (DATA_HEADER_LEN + DATA_REF_PREFIX_LEN) as u32 + MAX_DATA_REF_PIECES * 16
            }
        };
        if body_len > max {
            return Err(Error::Protocol(format!(
                "{kind:?} frame body of {body_len} bytes exceeds the limit of {max}"
            )));
        }
        if kind == FrameKind::DataRef
            && ((body_len as usize) < DATA_HEADER_LEN + DATA_REF_PREFIX_LEN
                || (body_len as usize - DATA_HEADER_LEN - DATA_REF_PREFIX_LEN) % 16 != 0)
        {
            return Err(Error::Protocol(format!(
                "data-by-reference frame body of {body_len} bytes is not a piece table"
            )));
        }
        if kind == FrameKind::Data && (body_len as usize) < DATA_HEADER_LEN {
            return Err(Error::Protocol(format!(
                "data frame body of {body_len} bytes is too short"
            )));
        }
        Ok(FrameHeader {
            kind,
            body_len,
            request_id,
        })
    }
}

/// The sub-header of a data frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DataHeader {
    /// Offset of the payload in the pair's byte stream.
    pub stream_offset: u64,
    /// xxh3-64 of the payload.
    pub checksum: u64,
}

impl DataHeader {
    /// Encodes to 16 bytes.
    pub fn encode(&self) -> [u8; DATA_HEADER_LEN] {
        let mut b = [0u8; DATA_HEADER_LEN];
        b[0..8].copy_from_slice(&self.stream_offset.to_le_bytes());
        b[8..16].copy_from_slice(&self.checksum.to_le_bytes());
        b
    }

    /// Decodes 16 bytes.
    pub fn decode(b: &[u8]) -> Result<DataHeader> {
        if b.len() < DATA_HEADER_LEN {
            return Err(Error::Protocol("truncated data header".into()));
        }
        Ok(DataHeader {
            stream_offset: u64::from_le_bytes(b[0..8].try_into().expect("8 bytes")),
            checksum: u64::from_le_bytes(b[8..16].try_into().expect("8 bytes")),
        })
    }
}

/// What a lane (one stream of a connection) is used for, declared in its [`Control::Hello`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LaneRole {
    /// The per-peer control lane: heartbeats ([`Control::Ping`]/[`Control::Pong`]) and
    /// [`Control::Cancel`]. Its loss (EOF, reset or missed heartbeats) means the peer is gone.
    Control,
    /// A data lane: one request/response exchange at a time (describe, pull, push, release).
    Data,
}

/// How a pair's byte stream is split over parallel lanes ("stripes"): the stream is cut into
/// chunks of at most `chunk_bytes` that never cross a layer boundary ([`Stripe::chunks_in`]);
/// chunk `c` travels on stripe `c % count`, one data frame per chunk, in increasing order. All stripes of a pair must declare the same
/// `count` and `chunk_bytes`; a receiver refuses a stripe that disagrees.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Stripe {
    /// This stripe (`0..count`).
    pub index: u32,
    /// Number of stripes of the pair (>= 1).
    pub count: u32,
    /// Chunk size in bytes (one data frame per chunk), `1..=MAX_DATA_PAYLOAD`.
    pub chunk_bytes: u64,
}

impl Stripe {
    /// Checks `index < count`, `1 <= count <= MAX_STRIPES` and the chunk size limit.
    pub fn validate(&self) -> Result<()> {
        if self.count == 0 || self.index >= self.count {
            return Err(Error::Protocol(format!(
                "stripe {} of {} is not a valid stripe",
                self.index, self.count
            )));
        }
        if self.count > MAX_STRIPES {
            return Err(Error::Protocol(format!(
                "{} stripes declared, at most {MAX_STRIPES} are accepted",
                self.count
            )));
        }
        if self.chunk_bytes == 0 || self.chunk_bytes > MAX_DATA_PAYLOAD as u64 {
            return Err(Error::Protocol(format!(
                "chunk size {} outside 1..={MAX_DATA_PAYLOAD}",
                self.chunk_bytes
            )));
        }
        Ok(())
    }

    /// [`Stripe::validate`], plus what a receiver checks against its own plan of a `total`-byte
    /// stream: a sender splits a stream over at most as many stripes as it has chunks
    /// (`ceil(total / chunk_bytes)`, at least 1), so a larger count is refused.
    pub fn validate_for(&self, total: u64) -> Result<()> {
        self.validate()?;
        let chunks = total.div_ceil(self.chunk_bytes).max(1);
        if self.count as u64 > chunks {
            return Err(Error::Protocol(format!(
                "{} stripes declared for a stream of {total} bytes in chunks of {} ({chunks} \
                 chunks)",
                self.count, self.chunk_bytes
            )));
        }
        Ok(())
    }

    /// The chunks (`[start, end)` stream offsets) of this stripe for a stream of `total` bytes.
    pub fn chunks(&self, total: u64) -> impl Iterator<Item = (u64, u64)> + '_ {
        self.chunks_in(std::slice::from_ref(&total).to_vec())
    }

    /// The chunks of this stripe for a stream cut into segments (layers) that end at `bounds`
    /// (non-decreasing; the last is the stream length): each segment is cut into chunks of at
    /// most `chunk_bytes`, so no chunk spans two layers; chunks are numbered across segments and
    /// chunk `c` belongs to stripe `c % count`.
    ///
    /// Lazy: memory is O(1) and time O(chunks of this stripe + segments), whatever `chunk_bytes`
    /// and `count` a peer declared.
    pub fn chunks_in(&self, bounds: Vec<u64>) -> impl Iterator<Item = (u64, u64)> + '_ {
        Chunks {
            chunk: self.chunk_bytes.max(1),
            count: self.count.max(1) as u64,
            index: self.index as u64,
            bounds: bounds.into_iter(),
            seg_start: 0,
            seg_end: 0,
            first_n: 0,
            a: 0,
        }
    }

    /// Bytes this stripe carries of a `total`-byte stream.
    pub fn bytes(&self, total: u64) -> u64 {
        self.chunks(total).map(|(a, b)| b - a).sum()
    }
}

/// The lazy iterator of [`Stripe::chunks_in`].
struct Chunks {
    chunk: u64,
    count: u64,
    index: u64,
    bounds: std::vec::IntoIter<u64>,
    /// Current segment `[seg_start, seg_end)`.
    seg_start: u64,
    seg_end: u64,
    /// Global number of the current segment's first chunk.
    first_n: u64,
    /// Start of the next chunk of this stripe in the current segment (>= seg_end: none left).
    a: u64,
}

impl Chunks {
    /// Start offset of the first chunk at or after global chunk number `n0` that belongs to this
    /// stripe, in the current segment (may lie past its end).
    fn first_from(&self, n0: u64) -> u64 {
        let skip = (self.index + self.count - n0 % self.count) % self.count;
        let k = (n0 - self.first_n).saturating_add(skip);
        self.seg_start.saturating_add(k.saturating_mul(self.chunk))
    }
}

impl Iterator for Chunks {
    type Item = (u64, u64);

    fn next(&mut self) -> Option<(u64, u64)> {
        loop {
            if self.a < self.seg_end {
                let a = self.a;
                let b = a.saturating_add(self.chunk).min(self.seg_end);
                // The next chunk of this stripe is `count` chunks further on.
                self.a = a.saturating_add(self.chunk.saturating_mul(self.count));
                if self.a <= a {
                    self.a = u64::MAX;
                }
                return Some((a, b));
            }
            // Next segment: number its chunks after the previous segment's.
            let end = self.bounds.next()?;
            let prev_chunks = (self.seg_end - self.seg_start).div_ceil(self.chunk);
            self.first_n += prev_chunks;
            self.seg_start = self.seg_end.max(self.seg_start);
            self.seg_end = end.max(self.seg_start);
            self.a = self.first_from(self.first_n);
        }
    }
}

/// Control messages (JSON bodies of control frames).
///
/// Every exchange on a data lane is one request followed by its answer; a lane carries one
/// exchange at a time. Pull: `Pull` -> data frames -> `StreamDone` (or `Failed`). Push: `Push` ->
/// `Ready` (or `Failed`) -> data frames -> `StreamDone` -> `StreamAck` (or `Failed`); then
/// `PushFinish` -> `Finished`. `Describe` -> `Description`, `Release` -> `Released`, `Reject` ->
/// `Rejected` (each or `Failed`). Fields added since protocol version 2 was first spoken
/// (`Release::delivered`, `Release::attempt`, `Pull::attempt`, `Failed::kind`) have defaults,
/// so older peers' messages still parse.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Control {
    /// First message on every lane, sent by the side that opened it.
    Hello {
        /// Endpoint name (unique per live process; a new incarnation under the same name
        /// replaces the old one).
        name: String,
        /// Protocol version (must equal the frame version).
        protocol: u8,
        /// Random id of this process's endpoint instance: lanes with the same `(name,
        /// incarnation)` belong to one peer session.
        incarnation: u64,
        /// What the lane is for.
        role: LaneRole,
        /// The sender of this hello does not verify the xxh3-64 of data frames it receives on
        /// this lane if the lane's transport authenticates every byte (TLS 1.3, QUIC), so data
        /// frames sent to it there may carry 0 in the checksum field and skip the hash
        /// (`EndpointOptions::hash_encrypted_frames` off). Absent (false) from peers older
        /// than this field, which verify every frame.
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        unhashed_aead: bool,
    },
    /// Answer to [`Control::Hello`].
    HelloAck {
        /// The accepting endpoint's name.
        name: String,
        /// Protocol version.
        protocol: u8,
        /// The accepting endpoint's incarnation.
        incarnation: u64,
        /// As [`Control::Hello`]'s `unhashed_aead`, for the accepting side.
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        unhashed_aead: bool,
    },
    /// Heartbeat on the control lane; answered with [`Control::Pong`].
    Ping {
        /// Sequence number.
        seq: u64,
    },
    /// Heartbeat answer.
    Pong {
        /// Sequence number of the ping.
        seq: u64,
    },
    /// Ask for the placement and token count of a registered request.
    Describe {
        /// The request.
        request_id: u64,
        /// `false`: a request registered as a pull source; `true`: a push destination.
        sink: bool,
    },
    /// Reply to [`Control::Describe`].
    Description {
        /// The request.
        request_id: u64,
        /// Tokens of the request.
        num_tokens: u32,
        /// Where the request's blocks are on the owner's side.
        placement: Placement,
    },
    /// Receiver asks a sender for one stripe of the spans from `src_rank` to `dst_rank` of the
    /// plan between the sender's registered placement and `dst`.
    Pull {
        /// The request.
        request_id: u64,
        /// Source rank (on the sender).
        src_rank: u32,
        /// Destination rank (on the receiver).
        dst_rank: u32,
        /// The receiver's placement of the request.
        dst: Placement,
        /// [`crate::plan::spans_digest`] of the pair's spans as the receiver computed them.
        digest: u64,
        /// Bytes of the pair's stream (all stripes).
        total_bytes: u64,
        /// The stripe asked for.
        stripe: Stripe,
        /// Which pull of the request this stripe belongs to: the receiver's transfer id, the
        /// same for every stripe of one pull, larger for a later pull from the same receiver
        /// endpoint (a retry). Absent (0) in older peers' messages.
        #[serde(default)]
        attempt: u64,
    },
    /// Sender offers one stripe of the pair `src_rank -> dst_rank` of the plan between `src`
    /// and the receiver's registered placement.
    Push {
        /// The request.
        request_id: u64,
        /// Source rank (on the sender).
        src_rank: u32,
        /// Destination rank (on the receiver).
        dst_rank: u32,
        /// The sender's placement of the request.
        src: Placement,
        /// Tokens of the request.
        num_tokens: u32,
        /// Digest of the pair's spans as the sender computed them.
        digest: u64,
        /// Bytes of the pair's stream (all stripes).
        total_bytes: u64,
        /// The stripe offered.
        stripe: Stripe,
    },
    /// The receiver of a [`Control::Push`] accepts it: data frames may follow.
    Ready {
        /// The request.
        request_id: u64,
    },
    /// A sender finished a stripe.
    StreamDone {
        /// The request.
        request_id: u64,
        /// Payload bytes sent on this stripe.
        bytes: u64,
    },
    /// A push receiver verified a whole stripe.
    StreamAck {
        /// The request.
        request_id: u64,
        /// Payload bytes received and verified.
        bytes: u64,
    },
    /// A push sender declares that its source ranks `src_ranks` have delivered everything they
    /// hold for the receiver (ranks without bytes for it included).
    PushFinish {
        /// The request.
        request_id: u64,
        /// Global source ranks hosted by the sender.
        src_ranks: Vec<u32>,
        /// The sender's placement (the receiver may not have seen a `Push` from it).
        src: Placement,
        /// Tokens of the request.
        num_tokens: u32,
    },
    /// Answer to [`Control::PushFinish`].
    Finished {
        /// The request.
        request_id: u64,
        /// Whether the receiver now has every declared sender's bytes.
        complete: bool,
    },
    /// The receiver is done with the request; the sender may release its blocks.
    Release {
        /// The request.
        request_id: u64,
        /// Whether the receiver got (and verified) everything it pulled from this sender. A
        /// release with `false` (sent after a failed pull) ends the consumer's lease but is not
        /// counted as a delivery: the registration stays pullable. Absent (true) in older peers'
        /// messages.
        #[serde(default = "yes")]
        delivered: bool,
        /// The pull this release speaks for ([`Control::Pull::attempt`]); the sender ignores
        /// it once a later pull of the request from the same receiver began (a release of a
        /// failed pull that arrives after its retry started must not end the retry's lease).
        /// 0 (absent in older peers' messages): whichever pull came last.
        #[serde(default)]
        attempt: u64,
    },
    /// Acknowledges a [`Control::Release`].
    Released {
        /// The request.
        request_id: u64,
    },
    /// The receiver will not pull the request (decode refused or aborted it before admission):
    /// the sender ends this consumer's part at once and frees the staging when no consumer
    /// remains. Answered with [`Control::Rejected`].
    Reject {
        /// The request.
        request_id: u64,
        /// Why (shown in the sender's registration outcome).
        reason: String,
    },
    /// Acknowledges a [`Control::Reject`].
    Rejected {
        /// The request.
        request_id: u64,
        /// Whether the request was registered when the reject arrived (false: the sender
        /// remembers the reject for a registration that comes later).
        known: bool,
    },
    /// Stop all work on a request (control lane); no answer.
    Cancel {
        /// The request.
        request_id: u64,
        /// Sent by a push sender whose push ended without finishing: the receiver fails its
        /// registration of the request even if none of this sender's stripes reached it yet.
        /// Absent (false) in older peers' messages.
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        push: bool,
    },
    /// An error for one request (or for the connection when `request_id` is 0).
    Failed {
        /// The request.
        request_id: u64,
        /// Description (the error's [`Error::detail`]).
        message: String,
        /// The error's kind, so that the receiver rebuilds the same kind ([`remote_error`]).
        /// Absent in older peers' messages (then the failure arrives as [`Error::Remote`]).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        kind: Option<ErrorKind>,
    },
}

fn yes() -> bool {
    true
}

/// Rebuilds an error a peer reported in a [`Control::Failed`]: the same [`ErrorKind`] with the
/// peer's message, marked as coming from the peer (`"unknown request: peer: request 5 is not
/// registered here"`). A message without a kind (an older peer) becomes [`Error::Remote`].
pub fn remote_error(kind: Option<ErrorKind>, message: &str) -> Error {
    match kind {
        None => Error::Remote(message.to_string()),
        Some(k) => Error::new(k, format!("peer: {message}")),
    }
}

impl Control {
    /// The [`Control::Failed`] reporting `e` for `request_id` (its kind and detail).
    pub fn failed(request_id: u64, e: &Error) -> Control {
        Control::Failed {
            request_id,
            message: e.detail(),
            kind: Some(e.kind()),
        }
    }

    /// Encodes as a full frame (header + JSON body).
    pub fn to_frame(&self, request_id: u64) -> Result<Vec<u8>> {
        let body = serde_json::to_vec(self)
            .map_err(|e| Error::Protocol(format!("cannot encode control message: {e}")))?;
        if body.len() as u64 > MAX_CONTROL_BODY as u64 {
            return Err(Error::Protocol(format!(
                "control message of {} bytes exceeds the limit",
                body.len()
            )));
        }
        let mut out = Vec::with_capacity(HEADER_LEN + body.len());
        out.extend_from_slice(
            &FrameHeader {
                kind: FrameKind::Control,
                body_len: body.len() as u32,
                request_id,
            }
            .encode(),
        );
        out.extend_from_slice(&body);
        Ok(out)
    }

    /// Decodes a control body.
    pub fn decode(body: &[u8]) -> Result<Control> {
        serde_json::from_slice(body)
            .map_err(|e| Error::Protocol(format!("bad control message: {e}")))
    }
}

/// xxh3-64 of a payload given as several slices (streaming, no copy).
pub fn checksum<'a>(parts: impl IntoIterator<Item = &'a [u8]>) -> u64 {
    let mut h = xxhash_rust::xxh3::Xxh3::new();
    for p in parts {
        h.update(p);
    }
    h.digest()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_round_trip_and_validation() {
        let h = FrameHeader {
            kind: FrameKind::Data,
            body_len: 1000,
            request_id: (1 << 53) - 1,
        };
        let b = h.encode();
        assert_eq!(FrameHeader::decode(&b).unwrap(), h);
        assert!(FrameHeader::decode(&b[..10]).is_err());
        let mut bad = b;
        bad[0] = b'X';
        assert!(FrameHeader::decode(&bad).is_err());
        let mut http = b;
        http[0..4].copy_from_slice(b"HTTP");
        assert_eq!(
            FrameHeader::decode(&http).unwrap_err().to_string(),
            "protocol error: bad frame magic 48 54 54 50 (\"HTTP\"): not a tpu-sync peer?"
        );
        let mut bin = b;
        bin[0..4].copy_from_slice(&[0x16, 0x03, 0x01, 0x41]);
        assert!(FrameHeader::decode(&bin)
            .unwrap_err()
            .to_string()
            .contains("16 03 01 41 (\"...A\")"));
        let mut bad = b;
        bad[4] = 9;
        assert!(FrameHeader::decode(&bad)
            .unwrap_err()
            .to_string()
            .contains("version"));
        let mut bad = b;
        bad[5] = 7;
        assert!(FrameHeader::decode(&bad).is_err());
        let mut bad = b;
        bad[8..12].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(FrameHeader::decode(&bad).is_err());
        let mut bad = b;
        bad[8..12].copy_from_slice(&3u32.to_le_bytes());
        assert!(
            FrameHeader::decode(&bad).is_err(),
            "data frame shorter than its sub-header"
        );
        let mut bad = b;
        bad[13] = 1;
        assert!(FrameHeader::decode(&bad).is_err());
    }

    #[test]
    fn control_round_trip() {
        let m = Control::Release {
            request_id: 42,
            delivered: false,
            attempt: 7,
        };
        let f = m.to_frame(42).unwrap();
        let h = FrameHeader::decode(&f).unwrap();
        assert_eq!(h.kind, FrameKind::Control);
        assert_eq!(Control::decode(&f[HEADER_LEN..]).unwrap(), m);
        assert!(Control::decode(b"{\"type\":\"nope\"}").is_err());
        assert!(Control::decode(&f[HEADER_LEN..f.len() - 1]).is_err());
    }

    #[test]
    fn older_peers_messages_still_parse() {
        // A release without `delivered` is a delivery (the old meaning).
        assert_eq!(
            Control::decode(br#"{"type":"release","request_id":3}"#).unwrap(),
            Control::Release {
                request_id: 3,
                delivered: true,
                attempt: 0,
            }
        );
        // A failure without a kind arrives as a remote error.
        let m = Control::decode(br#"{"type":"failed","request_id":3,"message":"x"}"#).unwrap();
        let Control::Failed { message, kind, .. } = m else {
            panic!("{m:?}")
        };
        assert_eq!(kind, None);
        assert_eq!(remote_error(kind, &message).kind(), ErrorKind::Remote);
        // A hello or its answer without `unhashed_aead` asks for checksums on every lane.
        let m = Control::decode(
            br#"{"type":"hello","name":"p","protocol":2,"incarnation":1,"role":"data"}"#,
        )
        .unwrap();
        assert!(
            matches!(
                m,
                Control::Hello {
                    unhashed_aead: false,
                    ..
                }
            ),
            "{m:?}"
        );
        let m = Control::decode(br#"{"type":"hello_ack","name":"p","protocol":2,"incarnation":1}"#)
            .unwrap();
        assert!(
            matches!(
                m,
                Control::HelloAck {
                    unhashed_aead: false,
                    ..
                }
            ),
            "{m:?}"
        );
    }

    #[test]
    fn a_hello_says_whether_its_sender_verifies_encrypted_lanes() {
        for unhashed_aead in [false, true] {
            let m = Control::Hello {
                name: "decode-0".into(),
                protocol: PROTOCOL_VERSION,
                incarnation: 9,
                role: LaneRole::Data,
                unhashed_aead,
            };
            let f = m.to_frame(0).unwrap();
            let body = &f[HEADER_LEN..];
            assert_eq!(Control::decode(body).unwrap(), m);
            // Only the new meaning is spelled out: a hello of the old form is what older
            // peers send and expect.
            let text = std::str::from_utf8(body).unwrap();
            assert_eq!(text.contains("unhashed_aead"), unhashed_aead, "{text}");
        }
    }

    #[test]
    fn failures_keep_their_kind() {
        for k in ErrorKind::ALL {
            let e = Error::new(k, "request 5 is not registered here");
            let f = Control::failed(5, &e).to_frame(5).unwrap();
            let Control::Failed {
                request_id,
                message,
                kind,
            } = Control::decode(&f[HEADER_LEN..]).unwrap()
            else {
                panic!("not a failure")
            };
            assert_eq!((request_id, kind), (5, Some(k)));
            let back = remote_error(kind, &message);
            assert_eq!(back.kind(), k);
            let text = back.to_string();
            assert!(text.contains("peer: "), "{text}");
            assert!(text.contains("request 5 is not registered here"), "{text}");
        }
    }

    #[test]
    fn stripes_partition_the_stream() {
        for total in [0u64, 1, 999, 1000, 1001, 12345] {
            for count in 1..5 {
                let mut covered = vec![0u8; total as usize];
                let mut sum = 0;
                for index in 0..count {
                    let s = Stripe {
                        index,
                        count,
                        chunk_bytes: 100,
                    };
                    s.validate().unwrap();
                    for (a, b) in s.chunks(total) {
                        assert!(b - a <= 100 && a < b);
                        covered[a as usize..b as usize]
                            .iter_mut()
                            .for_each(|x| *x += 1);
                    }
                    sum += s.bytes(total);
                }
                assert_eq!(sum, total);
                assert!(covered.iter().all(|&x| x == 1));
            }
        }
        // Layer-aligned chunks: no chunk crosses a segment end.
        let s = Stripe {
            index: 0,
            count: 1,
            chunk_bytes: 100,
        };
        let v: Vec<_> = s.chunks_in(vec![150, 150, 420]).collect();
        assert_eq!(
            v,
            vec![(0, 100), (100, 150), (150, 250), (250, 350), (350, 420)]
        );
        let s1 = Stripe {
            index: 1,
            count: 2,
            chunk_bytes: 100,
        };
        let v: Vec<_> = s1.chunks_in(vec![150, 420]).collect();
        assert_eq!(v, vec![(100, 150), (250, 350)]);
        let bad = Stripe {
            index: 2,
            count: 2,
            chunk_bytes: 1,
        };
        assert!(bad.validate().is_err());
        let bad = Stripe {
            index: 0,
            count: 1,
            chunk_bytes: 0,
        };
        assert!(bad.validate().is_err());
    }

    /// The eager definition of `chunks_in` the lazy iterator must match.
    fn chunks_reference(s: &Stripe, bounds: &[u64]) -> Vec<(u64, u64)> {
        let (c, count) = (s.chunk_bytes.max(1), s.count.max(1) as u64);
        let (mut start, mut n, mut out) = (0u64, 0u64, Vec::new());
        for &end in bounds {
            let mut a = start;
            while a < end {
                let b = (a + c).min(end);
                if n % count == s.index as u64 {
                    out.push((a, b));
                }
                n += 1;
                a = b;
            }
            start = start.max(end);
        }
        out
    }

    #[test]
    fn lazy_chunks_match_the_definition() {
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        let mut rnd = |m: u64| {
            x = crate::pattern::mix64(x);
            x % m
        };
        for _ in 0..3000 {
            let count = 1 + rnd(6) as u32;
            let s = Stripe {
                index: rnd(count as u64) as u32,
                count,
                chunk_bytes: 1 + rnd(40),
            };
            let mut bounds: Vec<u64> = (0..rnd(6)).map(|_| rnd(300)).collect();
            if rnd(3) > 0 {
                bounds.sort_unstable();
            }
            let got: Vec<_> = s.chunks_in(bounds.clone()).collect();
            assert_eq!(got, chunks_reference(&s, &bounds), "{s:?} {bounds:?}");
        }
        // Huge declared geometry costs nothing until iterated.
        let s = Stripe {
            index: 3,
            count: MAX_STRIPES,
            chunk_bytes: 1,
        };
        let mut it = s.chunks_in(vec![u64::MAX / 2, u64::MAX]);
        assert_eq!(it.next(), Some((3, 4)));
        assert_eq!(
            it.next(),
            Some((3 + MAX_STRIPES as u64, 4 + MAX_STRIPES as u64))
        );
    }

    #[test]
    fn stripe_counts_are_bounded() {
        let s = |index, count, chunk_bytes| Stripe {
            index,
            count,
            chunk_bytes,
        };
        assert!(s(0, MAX_STRIPES, 1).validate().is_ok());
        let e = s(0, MAX_STRIPES + 1, 1).validate().unwrap_err();
        assert!(e.to_string().contains("at most"), "{e}");
        assert!(s(u32::MAX - 1, u32::MAX, 1).validate().is_err());
        // A receiver refuses more stripes than the stream has chunks.
        assert!(s(0, 2, 100).validate_for(101).is_ok());
        assert!(s(0, 3, 100).validate_for(200).is_err());
        assert!(s(0, 1, 100).validate_for(0).is_ok());
        assert!(s(1, 2, 100).validate_for(0).is_err());
    }

    #[test]
    fn checksum_is_split_invariant() {
        let data: Vec<u8> = (0..1000u32).map(|i| (i * 7 + 3) as u8).collect();
        let whole = checksum([&data[..]]);
        assert_eq!(whole, checksum([&data[..10], &data[10..500], &data[500..]]));
        assert_ne!(whole, checksum([&data[1..]]));
    }
}
