//! Positional file I/O through io_uring, with a `pread`/`pwrite` fallback.

use std::collections::VecDeque;
use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::os::unix::io::AsRawFd;

use io_uring::{opcode, types, IoUring};
use parking_lot::Mutex;

/// Bytes per io_uring operation: large enough to stream, small enough to keep several in flight.
const OP_BYTES: usize = 1 << 20;
/// Operations in flight per call.
const QUEUE_DEPTH: u32 = 16;

/// Which file I/O backend to use.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum FileBackend {
    /// io_uring if the kernel allows it, else `pread`/`pwrite`.
    #[default]
    Auto,
    /// io_uring only (an error if unavailable).
    IoUring,
    /// `pread`/`pwrite`.
    Posix,
}

/// A positional file I/O engine. Its ring is private: every operation on it is one this module
/// submitted and reaps.
pub struct FileIo {
    backend: Backend,
}

enum Backend {
    /// A ring shared by callers (one call at a time; each call keeps many operations in flight).
    IoUring(Box<Mutex<Ring>>),
    /// Plain positional syscalls.
    Posix,
}

/// A ring and the generation counter that tags its operations: a completion is only ever matched
/// to the call that submitted it.
struct Ring {
    ring: IoUring,
    generation: u32,
}

impl std::fmt::Debug for FileIo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl FileIo {
    /// Opens the engine `backend` asks for.
    pub fn new(backend: FileBackend) -> io::Result<Self> {
        let ring = || -> io::Result<Backend> {
            Ok(Backend::IoUring(Box::new(Mutex::new(Ring {
                ring: IoUring::new(QUEUE_DEPTH)?,
                generation: 0,
            }))))
        };
        let backend = match backend {
            FileBackend::Posix => Backend::Posix,
            FileBackend::IoUring => ring()?,
            FileBackend::Auto => ring().unwrap_or(Backend::Posix),
        };
        Ok(Self { backend })
    }

    /// Backend name, for logs and reports.
    pub fn name(&self) -> &'static str {
        match self.backend {
            Backend::IoUring(_) => "io_uring",
            Backend::Posix => "pread/pwrite",
        }
    }

    /// Writes all of `buf` at `offset`.
    pub fn write_all_at(&self, file: &File, buf: &[u8], offset: u64) -> io::Result<()> {
        match &self.backend {
            Backend::Posix => file.write_all_at(buf, offset),
            Backend::IoUring(ring) => {
                // SAFETY: `buf` outlives the call, and `ring_io` reaps every operation it submits
                // before returning.
                unsafe { ring_io(&mut ring.lock(), file, buf.as_ptr() as *mut u8, buf.len(), offset, true) }
            }
        }
    }

    /// Fills all of `buf` from `offset`; a short file is `UnexpectedEof`.
    pub fn read_exact_at(&self, file: &File, buf: &mut [u8], offset: u64) -> io::Result<()> {
        match &self.backend {
            Backend::Posix => file.read_exact_at(buf, offset),
            Backend::IoUring(ring) => {
                // SAFETY: `buf` is exclusively borrowed for the call, and `ring_io` reaps every
                // operation it submits before returning.
                unsafe { ring_io(&mut ring.lock(), file, buf.as_mut_ptr(), buf.len(), offset, false) }
            }
        }
    }
}

/// Moves `len` bytes between `ptr` and `file` at `offset`, several operations in flight, retrying
/// short transfers. Never returns while an operation it submitted is in flight: if the ring cannot
/// be waited on any more, the process aborts rather than let the kernel write freed memory.
///
/// # Safety
/// 1. `ptr` is valid for `len` bytes of reads (write) or writes (read) until the call returns.
/// 2. Nobody else touches those bytes during the call.
unsafe fn ring_io(
    ring: &mut Ring,
    file: &File,
    ptr: *mut u8,
    len: usize,
    offset: u64,
    write: bool,
) -> io::Result<()> {
    ring.generation = ring.generation.wrapping_add(1);
    let generation = ring.generation;
    let tag = |index: usize| (u64::from(generation) << 32) | index as u64;
    let fd = types::Fd(file.as_raw_fd());
    let mut pending: VecDeque<(usize, usize)> =
        (0..len).step_by(OP_BYTES).map(|at| (at, OP_BYTES.min(len - at))).collect();
    let mut ops: Vec<(usize, usize)> = Vec::new();
    let mut in_flight = 0usize;
    let mut failure: Option<io::Error> = None;
    while in_flight > 0 || (failure.is_none() && !pending.is_empty()) {
        while failure.is_none() && in_flight < QUEUE_DEPTH as usize {
            let Some((at, n)) = pending.pop_front() else { break };
            // SAFETY: at + n <= len, inside the caller's buffer (safety 1).
            let p = unsafe { ptr.add(at) };
            let entry = if write {
                opcode::Write::new(fd, p, n as u32).offset(offset + at as u64).build()
            } else {
                opcode::Read::new(fd, p, n as u32).offset(offset + at as u64).build()
            };
            ops.push((at, n));
            // SAFETY: the buffer stays valid until its completion is reaped below: this function
            // does not return while any operation is in flight.
            if unsafe { ring.ring.submission().push(&entry.user_data(tag(ops.len() - 1))) }.is_err() {
                // The queue is full of our own entries: submit them before pushing more.
                pending.push_front(ops.pop().expect("just pushed"));
                break;
            }
            in_flight += 1;
        }
        if in_flight == 0 {
            break;
        }
        loop {
            match ring.ring.submit_and_wait(1) {
                Ok(_) => break,
                Err(e) if matches!(e.raw_os_error(), Some(libc::EINTR | libc::EAGAIN | libc::EBUSY)) => {
                    continue
                }
                // Operations are in flight and we cannot wait for them: returning would let the
                // kernel write memory the caller may free. Nothing safe is left to do.
                Err(_) => std::process::abort(),
            }
        }
        for cqe in ring.ring.completion() {
            let data = cqe.user_data();
            if (data >> 32) as u32 != generation {
                continue; // not ours (cannot happen with a private ring, but never miscount)
            }
            let Some(&(at, n)) = ops.get((data & 0xffff_ffff) as usize) else { continue };
            in_flight -= 1;
            let res = cqe.result();
            if res == -libc::EINTR || res == -libc::EAGAIN {
                pending.push_back((at, n));
            } else if res < 0 {
                failure.get_or_insert(io::Error::from_raw_os_error(-res));
            } else if res == 0 {
                let kind = if write { io::ErrorKind::WriteZero } else { io::ErrorKind::UnexpectedEof };
                failure.get_or_insert(io::Error::new(kind, "file ended before the transfer completed"));
            } else if (res as usize) < n {
                pending.push_back((at + res as usize, n - res as usize));
            }
        }
    }
    match failure {
        Some(e) => Err(e),
        None if !pending.is_empty() => Err(io::Error::other("io_uring transfer left work unsubmitted")),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_backends_round_trip_multi_op_buffers() {
        let data: Vec<u8> = (0..3 * OP_BYTES + 123).map(|i| (i * 7 % 251) as u8).collect();
        for backend in [FileBackend::Auto, FileBackend::Posix] {
            let io = FileIo::new(backend).unwrap();
            let file = tempfile::tempfile().unwrap();
            io.write_all_at(&file, &data, 10).unwrap();
            let mut back = vec![0u8; data.len()];
            io.read_exact_at(&file, &mut back, 10).unwrap();
            assert!(back == data, "{} round trip", io.name());
            let mut past_end = vec![0u8; 100];
            let err = io.read_exact_at(&file, &mut past_end, data.len() as u64).unwrap_err();
            assert_eq!(err.kind(), io::ErrorKind::UnexpectedEof, "{}", io.name());
        }
    }
}
