//! Peer sessions on the server side: one per `(name, incarnation)` of a connected endpoint,
//! alive while it is heard from within the heartbeat timeout (at most [`MAX_SESSIONS`]).

use std::collections::HashMap;
use std::time::Instant;

use super::{Config, SessionId};

/// Most peer sessions one endpoint keeps at once (a session is one `(name, incarnation)` of a
/// connected endpoint; it ends with its control lane or after the heartbeat timeout of
/// silence). A hello that would create one more is refused, so a peer that says hello under
/// ever new names or incarnations cannot grow the endpoint's state without bound.
pub const MAX_SESSIONS: usize = 4096;

pub(super) struct Session {
    pub(super) name: String,
    incarnation: u64,
    last_seen: Instant,
}

#[derive(Default)]
pub(super) struct Sessions {
    by_id: HashMap<SessionId, Session>,
    by_key: HashMap<(String, u64), SessionId>,
    /// Sessions declared dead while the endpoint was running.
    pub(super) lost: u64,
}

impl Sessions {
    /// The session of `(name, incarnation)`, created if new; `None` when it is new and
    /// [`MAX_SESSIONS`] sessions exist. Other incarnations of `name` are left alone: two live
    /// endpoints may share a name (containers with the same pid), and an old incarnation ends
    /// only when it is dead (its control lane closed, or it was silent for the heartbeat
    /// timeout), never because a newer one said hello. O(1).
    pub(super) fn hello(
        &mut self,
        now: Instant,
        name: &str,
        incarnation: u64,
        next_id: &mut u64,
    ) -> Option<SessionId> {
        let key = (name.to_string(), incarnation);
        let id = match self.by_key.get(&key) {
            Some(id) => *id,
            None => {
                if self.by_id.len() >= MAX_SESSIONS {
                    return None;
                }
                let id = SessionId(*next_id);
                *next_id += 1;
                self.by_key.insert(key, id);
                self.by_id.insert(
                    id,
                    Session {
                        name: name.to_string(),
                        incarnation,
                        last_seen: now,
                    },
                );
                id
            }
        };
        self.heard(now, id);
        Some(id)
    }

    pub(super) fn heard(&mut self, now: Instant, s: SessionId) {
        if let Some(x) = self.by_id.get_mut(&s) {
            x.last_seen = x.last_seen.max(now);
        }
    }

    #[cfg(test)]
    pub(super) fn alive(&self, s: SessionId) -> bool {
        self.by_id.contains_key(&s)
    }

    pub(super) fn name(&self, s: SessionId) -> String {
        self.by_id
            .get(&s)
            .map(|x| x.name.clone())
            .unwrap_or_else(|| format!("session {}", s.0))
    }

    pub(super) fn remove(&mut self, s: SessionId) -> Option<Session> {
        let x = self.by_id.remove(&s)?;
        self.by_key.remove(&(x.name.clone(), x.incarnation));
        Some(x)
    }

    pub(super) fn ids(&self) -> Vec<SessionId> {
        let mut v: Vec<SessionId> = self.by_id.keys().copied().collect();
        v.sort();
        v
    }

    pub(super) fn len(&self) -> usize {
        self.by_id.len()
    }

    pub(super) fn next_timeout(&self, cfg: &Config) -> Option<Instant> {
        self.by_id
            .values()
            .map(|s| s.last_seen + cfg.heartbeat_timeout)
            .min()
    }

    /// Sessions silent for longer than the heartbeat timeout at `now`.
    pub(super) fn silent(&self, now: Instant, cfg: &Config) -> Vec<(SessionId, String)> {
        let mut v: Vec<(SessionId, String)> = self
            .by_id
            .iter()
            .filter(|(_, s)| now.saturating_duration_since(s.last_seen) >= cfg.heartbeat_timeout)
            .map(|(id, s)| {
                (
                    *id,
                    format!(
                        "peer {} sent no heartbeat for {:?}",
                        s.name, cfg.heartbeat_timeout
                    ),
                )
            })
            .collect();
        v.sort_by_key(|x| x.0);
        v
    }
}
