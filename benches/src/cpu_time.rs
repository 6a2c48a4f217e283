//! CPU time used, by this thread, this process or another process: what a measurement costs in
//! cores, beside how long it takes.

use std::time::Duration;

/// CPU time the calling thread has used.
pub fn this_thread() -> Duration {
    clock(libc::CLOCK_THREAD_CPUTIME_ID)
}

/// CPU time every thread of this process has used, those that ended included.
pub fn this_process() -> Duration {
    clock(libc::CLOCK_PROCESS_CPUTIME_ID)
}

fn clock(id: libc::clockid_t) -> Duration {
    let mut now = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: `now` is a valid timespec to write into; the clock id is a constant the kernel knows.
    unsafe { libc::clock_gettime(id, &mut now) };
    Duration::new(now.tv_sec as u64, now.tv_nsec as u32)
}

/// User and system CPU time process `pid` has used, its ended threads' included, counted in the
/// kernel's ticks (10 ms on most systems: measure over far longer than that).
pub fn of_process(pid: u32) -> Result<Duration, String> {
    let stat =
        std::fs::read_to_string(format!("/proc/{pid}/stat")).map_err(|e| format!("process {pid}: {e}"))?;
    // Fields after the command's closing parenthesis: state is the first, utime the 12th.
    let fields: Vec<&str> = stat.rsplit_once(')').ok_or("a malformed stat")?.1.split_whitespace().collect();
    let ticks = |i: usize| fields.get(i).and_then(|f| f.parse::<u64>().ok()).ok_or("a malformed stat");
    // SAFETY: sysconf reads a constant of the system.
    let per_second = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as u64;
    let ticks = ticks(11)? + ticks(12)?;
    Ok(Duration::from_nanos(ticks * 1_000_000_000 / per_second))
}
