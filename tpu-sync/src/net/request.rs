//! What callers hand an [`Endpoint`]: source and push registrations, pull and
//! push requests, and the request-id rule.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use super::PeerMap;
#[cfg(doc)]
use super::{Endpoint, SourceHandle, Transfer};
use crate::error::{Error, Result};
use crate::plan::{Placement, Plan};
use crate::staging::Staging;

/// A request's staged blocks offered for pulling ([`Endpoint::register_source`]).
#[derive(Debug, Clone)]
pub struct SourceRegistration {
    /// Request id, `1..=2^53-1`.
    pub request_id: u64,
    /// Tokens of the request.
    pub num_tokens: u32,
    /// Where the request's blocks are on this side (every rank of the replica that this endpoint
    /// hosts must be staged).
    pub placement: Placement,
    /// The staged blocks. The caller must not write them while registered (except layers not yet
    /// published, see `layers_ready`).
    pub staging: Arc<Staging>,
    /// Layers already in the staging (`None`: all). Later layers are announced with
    /// [`SourceHandle::publish_layers`]; a puller receives layer `l` only after it is published.
    pub layers_ready: Option<u32>,
    /// Number of consumers that must [`Endpoint::release`] it before it is dropped (>= 1; one per
    /// decode process that pulls it).
    pub expected_releases: u32,
}

/// A destination registered for pushes ([`Endpoint::expect_push`]).
#[derive(Debug, Clone)]
pub struct SinkRegistration {
    /// Request id, `1..=2^53-1`.
    pub request_id: u64,
    /// Tokens of the request.
    pub num_tokens: u32,
    /// Where the request's blocks go on this side.
    pub placement: Placement,
    /// Destination staging: must stage [`Plan::dst_ranges`] of every destination rank hosted here.
    pub staging: Arc<Staging>,
    /// Destination ranks hosted by this endpoint (`None`: every rank of `placement`'s replica that
    /// `staging` holds).
    pub dst_ranks: Option<Vec<u32>>,
    /// The senders' placement, if known now (else taken from the first push and then enforced).
    pub src: Option<Placement>,
    /// `Plan::build(src, &placement, num_tokens)` if the caller already has it (only with `src`).
    pub plan: Option<Arc<Plan>>,
}

/// A pull ([`Endpoint::pull`]).
#[derive(Debug, Clone)]
pub struct PullRequest {
    /// Request id.
    pub request_id: u64,
    /// Tokens of the request.
    pub num_tokens: u32,
    /// The source (prefill) placement.
    pub src: Placement,
    /// Which endpoint hosts each source rank.
    pub sources: PeerMap,
    /// This side's placement.
    pub dst: Placement,
    /// Destination staging (stages [`Plan::dst_ranges`] of each destination rank pulled).
    pub staging: Arc<Staging>,
    /// Destination ranks this call pulls for (`None`: every rank of the replica that `staging`
    /// holds). A rank with no bytes completes at once.
    pub dst_ranks: Option<Vec<u32>>,
    /// `Plan::build(&src, &dst, num_tokens)` if the caller already has it (`None`: planned here).
    /// A plan that differs from the sender's fails with [`Error::Mismatch`] (digest check).
    pub plan: Option<Arc<Plan>>,
    /// How long to wait for the request to be registered at the sources (`None`: no wait, a
    /// source that does not know the request fails the pull with [`Error::UnknownRequest`]).
    /// With `Some(d)`, a stripe answered "unknown request" is asked again (backoff from 2 ms up
    /// to 100 ms) until `d` after [`Endpoint::pull`] was called; a decode request that reaches
    /// the producer before the producer registered it then waits and succeeds.
    pub wait_for_registration: Option<Duration>,
}

/// A push ([`Endpoint::push`]).
#[derive(Debug, Clone)]
pub struct PushRequest {
    /// Request id.
    pub request_id: u64,
    /// Tokens of the request.
    pub num_tokens: u32,
    /// This side's (prefill) placement.
    pub src: Placement,
    /// The staged source blocks.
    pub staging: Arc<Staging>,
    /// Source ranks hosted by this endpoint (`None`: every rank of the replica that `staging`
    /// holds). Every one is declared finished to every destination endpoint, also those that
    /// contribute no bytes.
    pub src_ranks: Option<Vec<u32>>,
    /// The destination (decode) placement.
    pub dst: Placement,
    /// Which endpoint hosts each destination rank.
    pub targets: PeerMap,
    /// Layers already staged (`None`: all); announce more with [`Transfer::publish_layers`].
    pub layers_ready: Option<u32>,
    /// `Plan::build(&src, &dst, num_tokens)` if the caller already has it (`None`: planned here).
    /// The receiver plans on its own and refuses a stripe whose digest differs.
    pub plan: Option<Arc<Plan>>,
}

/// Largest request id accepted: ids must survive a JSON round trip as an IEEE double (2^53 - 1).
pub const MAX_REQUEST_ID: u64 = (1 << 53) - 1;

/// Checks a request id: `1..=MAX_REQUEST_ID`.
pub fn check_request_id(request_id: u64) -> Result<()> {
    if request_id == 0 || request_id > MAX_REQUEST_ID {
        return Err(Error::InvalidArgument(format!(
            "request id {request_id} must be in 1..=2^53-1 (it must survive JSON)"
        )));
    }
    Ok(())
}

/// The device ranges a receiver must stage for `plan`: per destination rank of `dst`, the merged
/// bytes the plan writes ([`crate::plan::Plan::dst_ranges`]).
pub fn plan_staging(
    plan: &crate::plan::Plan,
    dst: &crate::plan::Placement,
) -> BTreeMap<u32, Vec<crate::plan::ByteRange>> {
    (0..dst.layout.spec.ranks_per_replica())
        .map(|l| {
            let r = dst.global_rank(l);
            (r, plan.dst_ranges(r))
        })
        .collect()
}
