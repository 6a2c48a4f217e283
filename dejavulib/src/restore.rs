//! What a restarted engine does first: asks its sidecar which of its sequences it keeps
//! ([`LocalSidecar::recovery`], planned by [`crate::resume`]) and fetches each one's KV back
//! into the cache of its microbatch, through shared memory. The C and Python bindings' restore
//! is this function.

use crate::cache::KvCache;
use crate::local::{LocalError, LocalSidecar};
use crate::placement::WorkerId;
use crate::reshard::{receive, StreamError, Transfer};
use crate::resume::ResumePoint;
use crate::store::ChunkStore;

/// A sequence of the engine's that its sidecar keeps, and whether its KV was fetched.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Restored {
    /// The sequence as held: the engine computes it on from `point.tokens`.
    pub point: ResumePoint,
    /// Whether its KV is back in a cache (false where its microbatch has none).
    pub fetched: bool,
}

/// Why a restore stopped.
#[derive(Debug, thiserror::Error)]
pub enum RestoreError {
    /// The sidecar could not say what it keeps.
    #[error("asking the sidecar what it keeps: {0}")]
    Sidecar(#[from] LocalError),
    /// A chunk could not be fetched or installed (missing, corrupt, of another layout).
    #[error("fetching microbatch {microbatch}'s KV: {error}")]
    Fetch {
        /// The sequences restored before it, as [`restore_from_sidecar`] returns them.
        restored: Vec<Restored>,
        /// The microbatch whose chunk failed.
        microbatch: u32,
        /// What failed.
        error: StreamError,
    },
}

/// Restores worker `me`'s sequences that `sidecar` keeps: each one's chunks are fetched into
/// `cache_of(microbatch)`, in the order the resume point lists them; a microbatch without a cache
/// is listed, not fetched. Returns every sequence of `me`, in the sidecar's order.
pub fn restore_from_sidecar<'c>(
    sidecar: &mut LocalSidecar,
    me: WorkerId,
    cache_of: impl FnMut(u32) -> Option<&'c KvCache>,
) -> Result<Vec<Restored>, RestoreError> {
    let mine = sidecar.recovery()?.resume_points().into_iter().filter(|p| p.destination == me).collect();
    fetch_points(sidecar, me, mine, cache_of)
}

/// The fetching half of [`restore_from_sidecar`], for a caller that asked the sidecar itself
/// (to size its output first): fetches each of `points` (worker `me`'s) from `store` into
/// `cache_of(microbatch)`.
pub fn fetch_points<'c>(
    store: &mut dyn ChunkStore,
    me: WorkerId,
    points: Vec<ResumePoint>,
    mut cache_of: impl FnMut(u32) -> Option<&'c KvCache>,
) -> Result<Vec<Restored>, RestoreError> {
    let mut payload = Vec::new();
    let mut restored = Vec::new();
    for point in points {
        let cache = cache_of(point.microbatch);
        if let Some(cache) = cache {
            for region in &point.chunks {
                let transfer = Transfer::in_place(me, me, point.microbatch, region);
                if let Err(error) = receive(cache, &transfer, region.tokens.clone(), store, &mut payload) {
                    return Err(RestoreError::Fetch { restored, microbatch: point.microbatch, error });
                }
            }
        }
        restored.push(Restored { fetched: cache.is_some(), point });
    }
    Ok(restored)
}
