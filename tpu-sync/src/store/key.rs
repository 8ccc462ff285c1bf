//! Content keys of KV blocks and the namespace that keeps two models' keys apart.
//!
//! A block's key covers its own tokens **and every token before it** (a chained hash), exactly like
//! the serving engines' prefix-cache block hashes: vLLM's `BlockHash` (`hash(parent_hash,
//! token_ids, extra_keys)`, bytes; the offload key appends the KV-cache group index as 4
//! big-endian bytes, `docs/plugins-and-engines.md`, "vLLM: block hashes and offload keys") and
//! SGLang's HiCache page keys (a chain hash per page, passed as hex strings; "SGLang HiCache
//! storage interface" there). Two ways in:
//!
//! * [`Namespace::chain_key`] / [`Namespace::chain_keys`] build keys from token ids
//!   (xxh3-128 over `namespace id || parent key || token ids as u32 little endian`), for callers
//!   that have no engine hash (demos, tests, a C caller);
//! * [`Namespace::engine_key`] / [`Namespace::engine_key_str`] wrap an engine's own opaque hash
//!   (bytes, or a hex/decimal string) without re-deriving the chain: the engine already chained it.
//!
//! Either way the namespace id (a hash of the model, dtype and layout description) is mixed in, so
//! the same tokens under two models, dtypes, TP ranks or block layouts never share a key.

use xxhash_rust::xxh3::Xxh3;

/// A 128-bit content key of one KV block (a chained hash; see the module docs).
///
/// Keys are compared and hashed as plain 128-bit values; they are already uniformly distributed.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct BlockKey(pub u128);

impl BlockKey {
    /// The key as 16 little-endian bytes.
    pub fn to_bytes(self) -> [u8; 16] {
        self.0.to_le_bytes()
    }

    /// A key from 16 little-endian bytes (as written by [`BlockKey::to_bytes`]).
    pub fn from_bytes(b: [u8; 16]) -> BlockKey {
        BlockKey(u128::from_le_bytes(b))
    }

    /// 32 lowercase hex digits (most significant first), as used for disk file names.
    pub fn hex(self) -> String {
        format!("{:032x}", self.0)
    }

    /// Parses 32 hex digits written by [`BlockKey::hex`]; `None` for anything else.
    pub fn from_hex(s: &str) -> Option<BlockKey> {
        if s.len() != 32 || !s.bytes().all(|c| c.is_ascii_hexdigit()) {
            return None;
        }
        u128::from_str_radix(s, 16).ok().map(BlockKey)
    }
}

impl std::fmt::Debug for BlockKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "BlockKey({:032x})", self.0)
    }
}

impl std::fmt::Display for BlockKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The first 16 hex digits are enough to tell keys apart in log lines.
        write!(f, "{:016x}", (self.0 >> 64) as u64)
    }
}

/// What a store's blocks belong to: one model, dtype and block layout (and, for sharded caches,
/// one TP/PCP rank). Keys from different namespaces never collide in practice (128-bit hashes).
///
/// The description is free text chosen by the caller (e.g. `llama-3.1-8b bf16 tp=1 rank=0
/// block=16 NHD cpu-plugin-0.81`); what matters is that it changes whenever the raw bytes of a
/// block would mean something else. The id is xxh3-128 of the description. A warm-restarted
/// shared-memory segment and the disk tier both record the id and refuse (reformat) contents of
/// another namespace.
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct Namespace {
    id: u128,
    description: String,
}

impl std::fmt::Debug for Namespace {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Namespace({:032x} \"{}\")", self.id, self.description)
    }
}

/// Seed of the namespace hash, so that a namespace id never equals a key built from the same text.
const NS_SEED: u64 = 0x6b76_2d6e_616d_6573; // "kv-names"

impl Namespace {
    /// A namespace from a description of the model, dtype and layout (see the type docs).
    pub fn new(description: impl Into<String>) -> Namespace {
        let description = description.into();
        let id = xxhash_rust::xxh3::xxh3_128_with_seed(description.as_bytes(), NS_SEED);
        Namespace { id, description }
    }

    /// The 128-bit namespace id.
    pub fn id(&self) -> u128 {
        self.id
    }

    /// The description it was built from.
    pub fn description(&self) -> &str {
        &self.description
    }

    /// Key of a block holding `tokens`, whose chain before it ends in `parent` (`None` for the
    /// first block of a sequence): xxh3-128 over `namespace id || parent key (or 16 zero bytes
    /// and a marker) || token ids (u32 little endian)`.
    pub fn chain_key(&self, parent: Option<BlockKey>, tokens: &[u32]) -> BlockKey {
        let mut h = Xxh3::new();
        h.update(&self.id.to_le_bytes());
        match parent {
            Some(p) => {
                h.update(&[1]);
                h.update(&p.to_bytes());
            }
            None => h.update(&[0; 17]),
        }
        // Hash the tokens in bulk: u32 little endian.
        let mut buf = [0u8; 256];
        for chunk in tokens.chunks(64) {
            for (i, t) in chunk.iter().enumerate() {
                buf[i * 4..i * 4 + 4].copy_from_slice(&t.to_le_bytes());
            }
            h.update(&buf[..chunk.len() * 4]);
        }
        BlockKey(h.digest128())
    }

    /// Keys of the blocks of a token sequence cut into blocks of `block_size` tokens, each chained
    /// on the one before it. Only full blocks get a key (as in vLLM and SGLang, which cache full
    /// blocks only), so the result has `tokens.len() / block_size` keys. A `block_size` of 0
    /// gives no keys.
    pub fn chain_keys(&self, tokens: &[u32], block_size: usize) -> Vec<BlockKey> {
        if block_size == 0 {
            return Vec::new();
        }
        let mut parent = None;
        tokens
            .chunks_exact(block_size)
            .map(|b| {
                let k = self.chain_key(parent, b);
                parent = Some(k);
                k
            })
            .collect()
    }

    /// Key of an engine-provided block hash (opaque bytes, already chained by the engine), e.g.
    /// vLLM's `BlockHash` bytes or its offload key `block_hash + group_idx.to_bytes(4, "big")`:
    /// xxh3-128 over `namespace id || 0x02 || bytes`.
    pub fn engine_key(&self, hash: &[u8]) -> BlockKey {
        let mut h = Xxh3::new();
        h.update(&self.id.to_le_bytes());
        h.update(&[2]);
        h.update(hash);
        BlockKey(h.digest128())
    }

    /// Key of an engine hash given as a string (SGLang's page hash strings, or a vLLM integer
    /// hash printed in decimal): the string's bytes as given, through [`Namespace::engine_key`].
    pub fn engine_key_str(&self, hash: &str) -> BlockKey {
        self.engine_key(hash.as_bytes())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chain_keys_cover_every_token_before() {
        let ns = Namespace::new("m");
        let toks: Vec<u32> = (0..64).collect();
        let k = ns.chain_keys(&toks, 16);
        assert_eq!(k.len(), 4);
        // Same last block tokens, different first block: different key for every later block.
        let mut other = toks.clone();
        other[0] = 999;
        let k2 = ns.chain_keys(&other, 16);
        for i in 0..4 {
            assert_ne!(k[i], k2[i]);
        }
        // Shared prefix: shared keys.
        let mut tail = toks.clone();
        tail[40] = 7;
        let k3 = ns.chain_keys(&tail, 16);
        assert_eq!(k[..2], k3[..2]);
        assert_ne!(k[2], k3[2]);
        assert_ne!(k[3], k3[3]);
        // Partial blocks get no key; block 0 gives none.
        assert_eq!(ns.chain_keys(&toks[..31], 16).len(), 1);
        assert!(ns.chain_keys(&toks, 0).is_empty());
        assert_eq!(k[1], ns.chain_key(Some(k[0]), &toks[16..32]));
    }

    #[test]
    fn namespaces_separate_keys() {
        let a = Namespace::new("llama bf16 tp=1");
        let b = Namespace::new("llama bf16 tp=2");
        assert_ne!(a.id(), b.id());
        assert_ne!(a.chain_key(None, &[1, 2, 3]), b.chain_key(None, &[1, 2, 3]));
        assert_ne!(a.engine_key(b"abc"), b.engine_key(b"abc"));
        assert_eq!(a.engine_key(b"abc"), a.engine_key_str("abc"));
        assert_ne!(a.engine_key(b"abc"), a.engine_key(b"abd"));
    }

    #[test]
    fn hex_round_trip() {
        let k = Namespace::new("x").chain_key(None, &[5]);
        assert_eq!(BlockKey::from_hex(&k.hex()), Some(k));
        assert_eq!(BlockKey::from_bytes(k.to_bytes()), k);
        assert_eq!(BlockKey::from_hex("zz"), None);
        assert_eq!(BlockKey::from_hex(&"g".repeat(32)), None);
    }
}
