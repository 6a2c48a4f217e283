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

/// A positional file I/O engine.
pub enum FileIo {
    /// A ring shared by callers (one call at a time; each call keeps many operations in flight).
    IoUring(Box<Mutex<IoUring>>),
    /// Plain positional syscalls.
    Posix,
}

impl std::fmt::Debug for FileIo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl FileIo {
    /// Opens the engine `backend` asks for.
    pub fn new(backend: FileBackend) -> io::Result<Self> {
        match backend {
            FileBackend::Posix => Ok(FileIo::Posix),
            FileBackend::IoUring => Ok(FileIo::IoUring(Box::new(Mutex::new(IoUring::new(QUEUE_DEPTH)?)))),
            FileBackend::Auto => Ok(IoUring::new(QUEUE_DEPTH)
                .map(|r| FileIo::IoUring(Box::new(Mutex::new(r))))
                .unwrap_or(FileIo::Posix)),
        }
    }

    /// Backend name, for logs and reports.
    pub fn name(&self) -> &'static str {
        match self {
            FileIo::IoUring(_) => "io_uring",
            FileIo::Posix => "pread/pwrite",
        }
    }

    /// Writes all of `buf` at `offset`.
    pub fn write_all_at(&self, file: &File, buf: &[u8], offset: u64) -> io::Result<()> {
        match self {
            FileIo::Posix => file.write_all_at(buf, offset),
            FileIo::IoUring(ring) => {
                // SAFETY: `buf` outlives the call, and `ring_io` waits for every operation.
                unsafe { ring_io(&mut ring.lock(), file, buf.as_ptr() as *mut u8, buf.len(), offset, true) }
            }
        }
    }

    /// Fills all of `buf` from `offset`; a short file is `UnexpectedEof`.
    pub fn read_exact_at(&self, file: &File, buf: &mut [u8], offset: u64) -> io::Result<()> {
        match self {
            FileIo::Posix => file.read_exact_at(buf, offset),
            FileIo::IoUring(ring) => {
                // SAFETY: `buf` is exclusively borrowed for the call, and `ring_io` waits for every
                // operation before returning.
                unsafe { ring_io(&mut ring.lock(), file, buf.as_mut_ptr(), buf.len(), offset, false) }
            }
        }
    }
}

/// Moves `len` bytes between `ptr` and `file` at `offset`, several operations in flight, retrying
/// short transfers.
///
/// # Safety
/// 1. `ptr` is valid for `len` bytes of reads (write) or writes (read) until the call returns.
/// 2. Nobody else touches those bytes during the call.
unsafe fn ring_io(
    ring: &mut IoUring,
    file: &File,
    ptr: *mut u8,
    len: usize,
    offset: u64,
    write: bool,
) -> io::Result<()> {
    let fd = types::Fd(file.as_raw_fd());
    let mut pending: VecDeque<(usize, usize)> =
        (0..len).step_by(OP_BYTES).map(|at| (at, OP_BYTES.min(len - at))).collect();
    let mut ops: Vec<(usize, usize)> = Vec::new();
    let mut in_flight = 0usize;
    let mut failure: Option<io::Error> = None;
    while in_flight > 0 || (failure.is_none() && !pending.is_empty()) {
        while failure.is_none() && in_flight < QUEUE_DEPTH as usize {
            let Some((at, n)) = pending.pop_front() else {
                break;
            };
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
            if unsafe { ring.submission().push(&entry.user_data((ops.len() - 1) as u64)) }.is_err() {
                pending.push_front(ops.pop().expect("just pushed"));
                break;
            }
            in_flight += 1;
        }
        if in_flight == 0 {
            break;
        }
        ring.submit_and_wait(1)?;
        for cqe in ring.completion() {
            in_flight -= 1;
            let (at, n) = ops[cqe.user_data() as usize];
            let res = cqe.result();
            if res < 0 {
                failure.get_or_insert(io::Error::from_raw_os_error(-res));
            } else if res == 0 {
                let kind = if write { io::ErrorKind::WriteZero } else { io::ErrorKind::UnexpectedEof };
                failure.get_or_insert(io::Error::new(kind, "file ended before the transfer completed"));
            } else if (res as usize) < n {
                pending.push_back((at + res as usize, n - res as usize));
            }
        }
    }
    failure.map_or(Ok(()), Err)
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
