//! [`PeerMap`]: which endpoint hosts each rank of the other side.

use std::collections::BTreeMap;

#[cfg(doc)]
use super::Endpoint;
use crate::error::{Error, Result};

/// Which endpoint hosts each rank of the other side: a default address plus per-rank overrides.
/// Addresses are `host:port` or a name given to [`Endpoint::add_peer`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PeerMap {
    /// Address for ranks without an override.
    pub default: Option<String>,
    /// Per-rank addresses.
    pub by_rank: BTreeMap<u32, String>,
}

impl PeerMap {
    /// Every rank at one endpoint.
    pub fn single(addr: impl Into<String>) -> PeerMap {
        PeerMap {
            default: Some(addr.into()),
            by_rank: BTreeMap::new(),
        }
    }

    /// Adds (or replaces) the endpoint of `rank`.
    pub fn with(mut self, rank: u32, addr: impl Into<String>) -> PeerMap {
        self.by_rank.insert(rank, addr.into());
        self
    }

    /// The distinct endpoints of `ranks`.
    pub fn addresses(&self, ranks: impl IntoIterator<Item = u32>) -> Result<Vec<String>> {
        let mut v: Vec<String> = Vec::new();
        for r in ranks {
            let a = self.get(r)?.to_string();
            if !v.contains(&a) {
                v.push(a);
            }
        }
        Ok(v)
    }

    /// Parses `ADDR` or `RANK=ADDR,RANK=ADDR,...` (a bare `ADDR` entry sets the default).
    pub fn parse(s: &str) -> Result<PeerMap> {
        let mut m = PeerMap::default();
        for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            match part.split_once('=') {
                Some((r, a)) => {
                    let r: u32 = r.trim().parse().map_err(|_| {
                        Error::InvalidArgument(format!("`{part}`: rank is not a number"))
                    })?;
                    m.by_rank.insert(r, a.trim().to_string());
                }
                None => m.default = Some(part.to_string()),
            }
        }
        if m.default.is_none() && m.by_rank.is_empty() {
            return Err(Error::InvalidArgument("empty peer map".into()));
        }
        Ok(m)
    }

    /// The endpoint of `rank`.
    ///
    /// Errors: [`Error::InvalidArgument`] when neither an override nor a default exists.
    pub fn get(&self, rank: u32) -> Result<&str> {
        self.by_rank
            .get(&rank)
            .or(self.default.as_ref())
            .map(String::as_str)
            .ok_or_else(|| Error::InvalidArgument(format!("no endpoint given for rank {rank}")))
    }
}
