//! The recovery feed from C: whoever feeds a pipeline learns of the controller's recoveries and
//! where each sequence resumes ([`dejavulib::net::controller::RecoveryFeed`]).

use std::ffi::{c_char, CStr};
use std::time::Duration;

use dejavulib::net::auth::DEFAULT_SECRET;
use dejavulib::net::controller::{parse_controllers, QueryError, RecoveryFeed};

use super::{call, give, DjvStatus, Failure};

/// A controller's recovery feed.
pub struct DjvRecoveryFeed(RecoveryFeed);

/// Where a sequence is fed again from after a recovery.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct DjvResume {
    /// The sequence's microbatch.
    pub microbatch: u32,
    /// Its slots, `slots_start..slots_end`.
    pub slots_start: u32,
    /// End of its slots (exclusive).
    pub slots_end: u32,
    /// The first token to feed again: some failed stage does not hold its KV.
    pub tokens: u32,
}

impl From<QueryError> for Failure {
    fn from(e: QueryError) -> Self {
        let status = match e {
            QueryError::Refused { .. } => DjvStatus::InvalidArgument,
            _ => DjvStatus::Io,
        };
        Failure(status, e.to_string())
    }
}

/// Opens the recovery feed of the controller at `controller` ("host:port", its `--listen`; or
/// several, comma-separated, for controllers on etcd: the feed follows whichever leads),
/// proving the cluster secret `secret` (`secret_len` bytes; NULL: the secret of a cluster started
/// without one). Nothing is sent until the first watch.
///
/// # Safety
///
/// `controller` is a NUL-terminated string; `secret` is NULL or valid for `secret_len` reads;
/// `out` is valid for a write of a pointer.
#[no_mangle]
pub unsafe extern "C" fn djv_recovery_feed_open(
    controller: *const c_char,
    secret: *const u8,
    secret_len: usize,
    out: *mut *mut DjvRecoveryFeed,
) -> DjvStatus {
    call(|| {
        if controller.is_null() {
            return Err(Failure::invalid("controller is NULL"));
        }
        // SAFETY: a NUL-terminated string per the contract (not NULL: checked).
        let text = unsafe { CStr::from_ptr(controller) }.to_string_lossy();
        let controllers = parse_controllers(&text).map_err(Failure::invalid)?;
        let secret = match secret.is_null() {
            true => DEFAULT_SECRET.as_bytes().to_vec(),
            // SAFETY: `secret` is valid for `secret_len` reads per the contract.
            false => unsafe { std::slice::from_raw_parts(secret, secret_len) }.to_vec(),
        };
        let feed = RecoveryFeed::following(&controllers, secret).expect("parsed at least one controller");
        // SAFETY: the caller passes a writable `out`.
        unsafe { give(out, DjvRecoveryFeed(feed)) }
    })
}

/// Waits up to `wait_ms` milliseconds (10 s at most) for the recovery of the first epoch after
/// `after` whose replacements are in place. If there is one, `*epoch` is its epoch and `resume`
/// gets, per sequence, where it is fed again from (`*count` of them; a sequence not listed starts
/// again from its first token); if not, `*epoch` and `*count` are 0. With less room than the
/// recovery's sequences, nothing is written but `*epoch` and `*count` (the room needed), and the
/// status is `DJV_STATUS_INVALID_ARGUMENT`: watching again with the same `after` answers the same
/// recovery. An unreachable controller is `DJV_STATUS_IO`; one that carries out no recoveries
/// (started without `--stages`) refuses, `DJV_STATUS_INVALID_ARGUMENT`.
///
/// # Safety
///
/// `feed` is a live handle; `epoch` and `count` are valid for a write; `resume` is valid for
/// `capacity` writes (NULL if 0).
#[no_mangle]
pub unsafe extern "C" fn djv_recovery_feed_watch(
    feed: *mut DjvRecoveryFeed,
    after: u64,
    wait_ms: u32,
    epoch: *mut u64,
    resume: *mut DjvResume,
    capacity: usize,
    count: *mut usize,
) -> DjvStatus {
    call(|| {
        // SAFETY: per the contract.
        let feed = unsafe { feed.as_mut() }.ok_or_else(|| Failure::invalid("feed is NULL"))?;
        // SAFETY: per the contract.
        let (epoch, count) = unsafe { (epoch.as_mut(), count.as_mut()) };
        let (epoch, count) = epoch.zip(count).ok_or_else(|| Failure::invalid("epoch or count is NULL"))?;
        (*epoch, *count) = (0, 0);
        let Some(orders) = feed.0.watch(after, Duration::from_millis(wait_ms.into()))? else {
            return Ok(());
        };
        let marks = orders.resume_from();
        *epoch = orders.epoch;
        *count = marks.len();
        if marks.len() > capacity {
            return Err(Failure::invalid(format!("room for {capacity} sequences, {} needed", marks.len())));
        }
        if resume.is_null() && !marks.is_empty() {
            return Err(Failure::invalid("resume is NULL"));
        }
        for (i, mark) in marks.into_iter().enumerate() {
            let entry = DjvResume {
                microbatch: mark.microbatch,
                slots_start: mark.slots.start,
                slots_end: mark.slots.end,
                tokens: mark.tokens,
            };
            // SAFETY: `i < count <= capacity` (checked above) and `resume` (not NULL: checked)
            // is valid for `capacity` writes.
            unsafe { resume.add(i).write(entry) };
        }
        Ok(())
    })
}

/// Tells the controller that every sequence of the recovery of `epoch` was fed again.
///
/// # Safety
///
/// `feed` is a live handle.
#[no_mangle]
pub unsafe extern "C" fn djv_recovery_feed_acknowledge(feed: *mut DjvRecoveryFeed, epoch: u64) -> DjvStatus {
    call(|| {
        // SAFETY: per the contract.
        let feed = unsafe { feed.as_mut() }.ok_or_else(|| Failure::invalid("feed is NULL"))?;
        Ok(feed.0.acknowledge(epoch)?)
    })
}

/// Closes a recovery feed (NULL is ignored).
///
/// # Safety
///
/// `feed` is NULL or a live handle, not used afterwards.
#[no_mangle]
pub unsafe extern "C" fn djv_recovery_feed_free(feed: *mut DjvRecoveryFeed) {
    if !feed.is_null() {
        // SAFETY: made by `djv_recovery_feed_open` and not freed yet, per the contract.
        drop(unsafe { Box::from_raw(feed) });
    }
}
