//! The machine a report was measured on, in one line: two reports are comparable only with it.
//! Read from `/proc` and `/sys` (Linux), with one measurement: the memory bandwidth of a single
//! thread copying 256 MiB.

/// What the report says of its machine.
#[derive(Clone, Debug, PartialEq)]
pub struct Machine {
    /// The processor's model name, as `/proc/cpuinfo` gives it.
    pub cpu: String,
    /// CPUs this process may run on.
    pub cores: usize,
    /// Bytes of the level-2 cache of CPU 0.
    pub l2: Option<u64>,
    /// Bytes of the level-3 cache CPU 0 shares.
    pub l3: Option<u64>,
    /// The transparent huge page mode (`always`, `madvise` or `never`).
    pub huge_pages: String,
    /// GB/s of one thread copying 256 MiB to another 256 MiB (median of five, after one).
    pub memcpy_gbps: f64,
}

/// Bytes each side of the bandwidth copy: far beyond any last-level cache here.
const COPY_BYTES: usize = 256 << 20;

impl Machine {
    /// Reads the machine and measures its copy bandwidth (about a second).
    pub fn read() -> Self {
        let cpu = std::fs::read_to_string("/proc/cpuinfo")
            .ok()
            .and_then(|info| {
                info.lines()
                    .find(|line| line.starts_with("model name"))
                    .and_then(|line| line.split_once(':'))
                    .map(|(_, name)| name.trim().to_owned())
            })
            .unwrap_or_else(|| "unknown processor".into());
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        let huge_pages = std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled")
            .ok()
            .and_then(|modes| {
                let start = modes.find('[')?;
                let end = modes[start..].find(']')?;
                Some(modes[start + 1..start + end].to_owned())
            })
            .unwrap_or_else(|| "unknown".into());
        Self { cpu, cores, l2: cache_bytes(2), l3: cache_bytes(3), huge_pages, memcpy_gbps: memcpy_gbps() }
    }

    /// The report's machine line.
    pub fn line(&self) -> String {
        let size = |bytes: Option<u64>| {
            bytes.map_or("unknown".into(), |b| format!("{} MiB", b as f64 / (1 << 20) as f64))
        };
        format!(
            "machine: {}, {} CPUs, L2 {} (CPU 0), L3 {}, transparent huge pages {}, memcpy of 256 MiB on one thread {:.1} GB/s",
            self.cpu,
            self.cores,
            size(self.l2),
            size(self.l3),
            self.huge_pages,
            self.memcpy_gbps
        )
    }
}

/// Bytes of CPU 0's unified or data cache of `level`, from `/sys`.
fn cache_bytes(level: u32) -> Option<u64> {
    let dir = std::fs::read_dir("/sys/devices/system/cpu/cpu0/cache").ok()?;
    dir.filter_map(Result::ok).find_map(|index| {
        let read = |name: &str| std::fs::read_to_string(index.path().join(name)).ok();
        let kind = read("type")?;
        if read("level")?.trim() != level.to_string() || kind.trim() == "Instruction" {
            return None;
        }
        parse_size(read("size")?.trim())
    })
}

/// `32768K`, `1M`, `512`: bytes.
fn parse_size(size: &str) -> Option<u64> {
    let (digits, unit) = size.split_at(size.find(|c: char| !c.is_ascii_digit()).unwrap_or(size.len()));
    let n: u64 = digits.parse().ok()?;
    Some(match unit {
        "" => n,
        "K" => n << 10,
        "M" => n << 20,
        "G" => n << 30,
        _ => return None,
    })
}

/// GB/s of one thread copying `COPY_BYTES` (every page written first, so none is a zero page).
fn memcpy_gbps() -> f64 {
    let src: Vec<u8> = (0..COPY_BYTES).map(|i| i as u8).collect();
    let mut dst = vec![1u8; COPY_BYTES];
    let t = crate::median_of(5, || {
        crate::memcpy(&mut dst, &src);
        std::hint::black_box(&dst);
    });
    COPY_BYTES as f64 / t.as_secs_f64() / 1e9
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cache_sizes_are_read_as_sysfs_writes_them() {
        assert_eq!(parse_size("32768K"), Some(32 << 20));
        assert_eq!(parse_size("1M"), Some(1 << 20));
        assert_eq!(parse_size("512"), Some(512));
        assert_eq!(parse_size("12X"), None);
    }
}
