//! CPU affinity: which CPUs a thread may run on.
//!
//! On a host where the engine computes on the CPUs the copies run on (the CPU reference engine, or
//! an engine's own CPU threads), replication's wakeups preempt the compute and lengthen every step;
//! giving the streamer thread and the sidecar CPUs of their own keeps them off the critical path,
//! as on a GPU server where the engine computes on the GPU and the host's cores stream.

use std::fmt;
use std::io;
use std::str::FromStr;

use thiserror::Error;

/// CPUs a [`CpuList`] can name: those of the kernel's fixed-size affinity mask.
pub const MAX_CPUS: usize = libc::CPU_SETSIZE as usize;

/// Errors of CPU lists.
#[derive(Debug, Error)]
pub enum AffinityError {
    /// The text is not a CPU list.
    #[error("{text:?} is not a CPU list (such as 0-3,8): {why}")]
    Parse {
        /// The text.
        text: String,
        /// What is wrong with it.
        why: String,
    },
    /// The OS refused the affinity (no CPU of the list is online or allowed to this process).
    #[error("cannot run on CPUs {cpus}: {source}")]
    Os {
        /// The CPUs asked for.
        cpus: CpuList,
        /// The OS error.
        source: io::Error,
    },
    /// Some CPUs of the list are not online or not allowed to this process: the OS would have
    /// run the thread on the others only.
    #[error("cannot run on all of CPUs {cpus}: only {usable} of them are online and allowed here")]
    Partly {
        /// The CPUs asked for.
        cpus: CpuList,
        /// Those the OS would use.
        usable: CpuList,
    },
}

/// A non-empty set of CPU numbers, sorted, written as the kernel writes them (`0-3,8`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CpuList(Vec<usize>);

impl CpuList {
    /// The CPUs in `cpus` (deduplicated); `None` if empty or one is `MAX_CPUS` or more.
    pub fn new(cpus: impl IntoIterator<Item = usize>) -> Option<Self> {
        let mut cpus: Vec<usize> = cpus.into_iter().collect();
        cpus.sort_unstable();
        cpus.dedup();
        (!cpus.is_empty() && cpus.iter().all(|&c| c < MAX_CPUS)).then_some(Self(cpus))
    }

    /// The CPUs the calling thread may run on now.
    pub fn of_current_thread() -> io::Result<Self> {
        // SAFETY: `cpu_set_t` is plain data; all zeroes is the empty set.
        let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
        // SAFETY: `set` is a valid, writable `cpu_set_t` of the size passed; pid 0 is this thread.
        let rc = unsafe { libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) };
        if rc != 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `set` is initialised and every index is below CPU_SETSIZE.
        let cpus = (0..MAX_CPUS).filter(|&cpu| unsafe { libc::CPU_ISSET(cpu, &set) });
        Self::new(cpus).ok_or_else(|| io::Error::other("the thread may run on no CPU"))
    }

    /// The CPUs, in increasing order.
    pub fn cpus(&self) -> &[usize] {
        &self.0
    }

    /// Splits the list in two halves by number (the first the larger); `None` for a single CPU.
    /// Where the OS numbers the two hardware threads of a core far apart (`i` and `i + n/2`, as
    /// many x86 servers do), each half gets one thread of every core: set lists by core for those.
    pub fn halves(&self) -> Option<(Self, Self)> {
        let middle = self.0.len().div_ceil(2);
        (self.0.len() >= 2).then(|| (Self(self.0[..middle].to_vec()), Self(self.0[middle..].to_vec())))
    }

    /// Restricts the calling thread to these CPUs; threads it starts afterwards inherit that. An
    /// error, with the thread's CPUs as they were, unless every CPU of the list is usable.
    pub fn pin_current_thread(&self) -> Result<(), AffinityError> {
        let os = |source| AffinityError::Os { cpus: self.clone(), source };
        let before = Self::of_current_thread().map_err(os)?;
        self.set_current_thread()?;
        // The OS keeps those of the CPUs it can use, silently: a partial list is refused here.
        match Self::of_current_thread() {
            Ok(usable) if usable == *self => Ok(()),
            other => {
                let _ = before.set_current_thread();
                Err(match other {
                    Ok(usable) => AffinityError::Partly { cpus: self.clone(), usable },
                    Err(source) => os(source),
                })
            }
        }
    }

    /// `sched_setaffinity` of the calling thread to these CPUs.
    fn set_current_thread(&self) -> Result<(), AffinityError> {
        // SAFETY: `cpu_set_t` is plain data; all zeroes is the empty set.
        let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
        for &cpu in &self.0 {
            // SAFETY: `cpu < MAX_CPUS` (checked when the list was made), inside the set.
            unsafe { libc::CPU_SET(cpu, &mut set) };
        }
        // SAFETY: `set` is a valid `cpu_set_t` of the size passed; pid 0 is the calling thread.
        let rc = unsafe { libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) };
        if rc != 0 {
            let mut source = io::Error::last_os_error();
            if source.raw_os_error() == Some(libc::EINVAL) {
                let now = Self::of_current_thread().map_or_else(|e| e.to_string(), |c| c.to_string());
                source = io::Error::new(
                    io::ErrorKind::InvalidInput,
                    format!("none of them is online and allowed to this process (this thread runs on {now})"),
                );
            }
            return Err(AffinityError::Os { cpus: self.clone(), source });
        }
        Ok(())
    }
}

impl FromStr for CpuList {
    type Err = AffinityError;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let bad = |why: String| AffinityError::Parse { text: text.to_string(), why };
        let number = |s: &str| s.trim().parse::<usize>().map_err(|e| bad(format!("{s:?}: {e}")));
        let mut cpus = Vec::new();
        for part in text.split(',') {
            let (first, last) = match part.split_once('-') {
                Some((a, b)) => (number(a)?, number(b)?),
                None => (number(part)?, number(part)?),
            };
            if first > last {
                return Err(bad(format!("the range {first}-{last} is empty")));
            }
            if last >= MAX_CPUS {
                return Err(bad(format!("CPU {last} is beyond the last possible, {}", MAX_CPUS - 1)));
            }
            cpus.extend(first..=last);
        }
        Self::new(cpus).ok_or_else(|| bad("no CPU".into()))
    }
}

impl fmt::Display for CpuList {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut ranges: Vec<(usize, usize)> = Vec::new();
        for &cpu in &self.0 {
            match ranges.last_mut() {
                Some((_, last)) if *last + 1 == cpu => *last = cpu,
                _ => ranges.push((cpu, cpu)),
            }
        }
        let parts: Vec<String> = ranges
            .into_iter()
            .map(|(a, b)| if a == b { a.to_string() } else { format!("{a}-{b}") })
            .collect();
        f.write_str(&parts.join(","))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lists_parse_and_print_as_the_kernel_writes_them() {
        let list: CpuList = "8,0-3, 2,5-5".parse().unwrap();
        assert_eq!(list.cpus(), [0, 1, 2, 3, 5, 8]);
        assert_eq!(list.to_string(), "0-3,5,8");
        assert_eq!("7".parse::<CpuList>().unwrap().to_string(), "7");
        for bad in ["", "a", "3-1", "1,", "-2", "0-99999"] {
            assert!(matches!(bad.parse::<CpuList>(), Err(AffinityError::Parse { .. })), "{bad:?}");
        }
    }

    #[test]
    fn halves_split_the_list_the_first_the_larger() {
        let (a, b) = CpuList::new(0..5).unwrap().halves().unwrap();
        assert_eq!((a.cpus(), b.cpus()), (&[0, 1, 2][..], &[3, 4][..]));
        assert!(CpuList::new([4]).unwrap().halves().is_none());
        assert!(CpuList::new([]).is_none());
    }

    #[test]
    fn a_thread_runs_where_it_is_pinned_and_its_children_inherit_it() {
        let available = CpuList::of_current_thread().unwrap();
        let first = CpuList::new([available.cpus()[0]]).unwrap();
        let (own, child) = std::thread::spawn(move || {
            first.pin_current_thread().unwrap();
            let child = std::thread::spawn(|| CpuList::of_current_thread().unwrap()).join().unwrap();
            (CpuList::of_current_thread().unwrap(), child)
        })
        .join()
        .unwrap();
        assert_eq!(own.cpus(), [available.cpus()[0]]);
        assert_eq!(child, own);
        // A CPU that does not exist is refused by the OS; one among usable ones, by the check.
        let missing = beyond_the_last_cpu();
        let refused =
            std::thread::spawn(move || CpuList::new([missing]).unwrap().pin_current_thread()).join().unwrap();
        assert!(matches!(refused, Err(AffinityError::Os { .. })), "{refused:?}");
        let mixed = CpuList::new([available.cpus()[0], missing]).unwrap();
        let (partly, after) =
            std::thread::spawn(move || (mixed.pin_current_thread(), CpuList::of_current_thread()))
                .join()
                .unwrap();
        assert!(matches!(partly, Err(AffinityError::Partly { .. })), "{partly:?}");
        assert_eq!(after.unwrap(), available, "a refused list leaves the thread's CPUs as they were");
    }

    /// A CPU number no machine this runs on has (the last a list can name: fewer than 1024 CPUs).
    fn beyond_the_last_cpu() -> usize {
        MAX_CPUS - 1
    }
}
