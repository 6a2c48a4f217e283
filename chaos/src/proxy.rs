//! A fault-injecting TCP proxy in user space (the kernel here has no `tc netem`): one listener per
//! (link, target), two pump threads per connection, and per link a set of faults that the pumps
//! apply to every chunk of bytes they forward: delay and jitter, a bandwidth limit, stalls in one
//! or both directions, connection resets, byte corruption and truncation. It works below the
//! framing layer: it knows nothing of frames.

use std::collections::HashMap;
use std::io::{ErrorKind, Read, Write};
use std::net::{IpAddr, Ipv4Addr, Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use dejavud::cluster::{Interpose, Link};
use parking_lot::Mutex;

use dejavu_proto::rng::SplitMix64;

/// Towards the link's target, or back.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Direction {
    /// From the connecting process to the target.
    Forward = 0,
    /// From the target back.
    Backward = 1,
}

/// A network fault on one link.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum NetFault {
    /// Every write waits `delay` plus up to `jitter` (drawn per write), for `lasting`.
    Delay {
        /// Fixed part.
        delay: Duration,
        /// Random part, at most.
        jitter: Duration,
        /// How long the fault lasts.
        lasting: Duration,
    },
    /// Every write waits as long as its bytes take at `bytes_per_s`, for `lasting`.
    Bandwidth {
        /// The limit.
        bytes_per_s: u64,
        /// How long the fault lasts.
        lasting: Duration,
    },
    /// Bytes are held (not dropped) in `directions` for `lasting`.
    Stall {
        /// Both directions (a partition), or only towards the target.
        both: bool,
        /// How long the fault lasts.
        lasting: Duration,
    },
    /// Every open connection is closed.
    Reset,
    /// One byte of the next write is flipped.
    Corrupt,
    /// Half of the next write is forwarded, then the connection is closed.
    Truncate,
    /// The target is gone for good (its machine died): every open connection is closed, and the
    /// proxy stops listening, so new ones are refused as they would be.
    Down,
}

/// Counters of one link.
#[derive(Debug, Default)]
pub struct LinkStats {
    /// Bytes forwarded, both directions.
    pub bytes: AtomicU64,
    /// Connections accepted.
    pub connections: AtomicU64,
    /// Writes corrupted.
    pub corrupted: AtomicU64,
    /// Connections truncated.
    pub truncated: AtomicU64,
    /// Connections closed by resets.
    pub reset: AtomicU64,
}

#[derive(Debug, Default)]
struct Faults {
    delay: Option<(Duration, Duration, Instant)>,
    bandwidth: Option<(u64, Instant)>,
    stalled_until: [Option<Instant>; 2],
    corrupt: u32,
    truncate: u32,
}

/// What a pump does with one chunk.
struct Treatment {
    wait: Duration,
    corrupt_at: Option<usize>,
    truncate: bool,
}

/// One link's faults, open connections and counters.
#[derive(Debug)]
pub struct LinkState {
    faults: Mutex<Faults>,
    rng: Mutex<SplitMix64>,
    /// Both ends of every open connection, by number, to close on a reset.
    connections: Mutex<HashMap<u64, [TcpStream; 2]>>,
    /// Whether its target is gone ([`NetFault::Down`]).
    down: AtomicBool,
    /// Counters.
    pub stats: LinkStats,
}

impl LinkState {
    fn new(seed: u64) -> Self {
        Self {
            faults: Mutex::default(),
            rng: Mutex::new(SplitMix64::new(seed)),
            connections: Mutex::default(),
            down: AtomicBool::new(false),
            stats: LinkStats::default(),
        }
    }

    fn inject(&self, fault: NetFault) {
        let now = Instant::now();
        let mut f = self.faults.lock();
        match fault {
            NetFault::Delay { delay, jitter, lasting } => f.delay = Some((delay, jitter, now + lasting)),
            NetFault::Bandwidth { bytes_per_s, lasting } => f.bandwidth = Some((bytes_per_s, now + lasting)),
            NetFault::Stall { both, lasting } => {
                f.stalled_until[Direction::Forward as usize] = Some(now + lasting);
                if both {
                    f.stalled_until[Direction::Backward as usize] = Some(now + lasting);
                }
            }
            NetFault::Reset | NetFault::Down => {
                drop(f);
                if fault == NetFault::Down {
                    self.down.store(true, Ordering::SeqCst);
                }
                let open = std::mem::take(&mut *self.connections.lock());
                self.stats.reset.fetch_add(open.len() as u64, Ordering::Relaxed);
                open.values().flatten().for_each(|stream| {
                    let _ = stream.shutdown(Shutdown::Both);
                });
            }
            NetFault::Corrupt => f.corrupt += 1,
            NetFault::Truncate => f.truncate += 1,
        }
    }

    /// Until when `direction` is stalled, if it is now.
    fn stalled(&self, direction: Direction) -> Option<Instant> {
        self.faults.lock().stalled_until[direction as usize].filter(|&until| until > Instant::now())
    }

    fn treat(&self, len: usize) -> Treatment {
        let now = Instant::now();
        let mut f = self.faults.lock();
        let mut wait = Duration::ZERO;
        if let Some((delay, jitter, until)) = f.delay {
            if until > now {
                let extra = self.rng.lock().below(jitter.as_micros() as u64 + 1);
                wait += delay + Duration::from_micros(extra);
            } else {
                f.delay = None;
            }
        }
        if let Some((rate, until)) = f.bandwidth {
            if until > now {
                wait += Duration::from_secs_f64(len as f64 / rate as f64);
            } else {
                f.bandwidth = None;
            }
        }
        let corrupt_at = (f.corrupt > 0).then(|| {
            f.corrupt -= 1;
            self.rng.lock().below(len as u64) as usize
        });
        let truncate = f.truncate > 0;
        if truncate {
            f.truncate -= 1;
        }
        Treatment { wait, corrupt_at, truncate }
    }
}

struct Shared {
    links: Mutex<HashMap<Link, Arc<LinkState>>>,
    stop: AtomicBool,
    seed: u64,
}

impl Shared {
    fn link(&self, link: Link) -> Arc<LinkState> {
        let mut links = self.links.lock();
        let next_seed = self.seed ^ (links.len() as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        links.entry(link).or_insert_with(|| Arc::new(LinkState::new(next_seed))).clone()
    }
}

/// The proxies of one cluster; dropping it closes them all.
pub struct Proxies {
    shared: Arc<Shared>,
    /// The address they listen on: loopback, or the gateway of the workers' namespaces.
    ip: IpAddr,
}

impl std::fmt::Debug for Proxies {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Proxies").field("links", &self.shared.links.lock().len()).finish()
    }
}

impl Proxies {
    /// No proxies yet, listening on loopback; jitter and corruption offsets are drawn from
    /// `seed`.
    pub fn new(seed: u64) -> Self {
        Self::on(IpAddr::V4(Ipv4Addr::LOCALHOST), seed)
    }

    /// No proxies yet, listening on `ip` (where every process can reach them).
    pub fn on(ip: IpAddr, seed: u64) -> Self {
        let shared = Arc::new(Shared { links: Mutex::default(), stop: AtomicBool::new(false), seed });
        Self { shared, ip }
    }

    /// Injects `fault` on `link` (it applies to the link's current and later connections).
    pub fn inject(&self, link: Link, fault: NetFault) {
        self.shared.link(link).inject(fault);
    }

    /// A link's state and counters.
    pub fn link(&self, link: Link) -> Arc<LinkState> {
        self.shared.link(link)
    }

    /// Starts a proxy for `link` in front of `target`; returns its address.
    pub fn start(&self, link: Link, target: SocketAddr) -> std::io::Result<SocketAddr> {
        let listener = TcpListener::bind((self.ip, 0))?;
        listener.set_nonblocking(true)?;
        let addr = listener.local_addr()?;
        let (shared, state) = (self.shared.clone(), self.shared.link(link));
        std::thread::Builder::new()
            .name(format!("proxy {link:?}"))
            .spawn(move || accept_loop(listener, target, &shared, &state))?;
        Ok(addr)
    }
}

impl Interpose for Proxies {
    fn route(&self, link: Link, target: SocketAddr) -> SocketAddr {
        self.start(link, target).unwrap_or_else(|e| {
            eprintln!("chaos: no proxy for {link:?} ({e}); connecting directly");
            target
        })
    }
}

impl Drop for Proxies {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Relaxed);
        for state in self.shared.links.lock().values() {
            for stream in state.connections.lock().drain().flat_map(|(_, ends)| ends) {
                let _ = stream.shutdown(Shutdown::Both);
            }
        }
    }
}

fn accept_loop(listener: TcpListener, target: SocketAddr, shared: &Shared, state: &Arc<LinkState>) {
    // Returning drops the listener: a link whose target is down refuses connections.
    while !shared.stop.load(Ordering::Relaxed) && !state.down.load(Ordering::SeqCst) {
        let client = match listener.accept() {
            Ok((client, _)) => client,
            Err(e) if e.kind() == ErrorKind::WouldBlock => {
                std::thread::sleep(Duration::from_millis(5));
                continue;
            }
            Err(_) => return,
        };
        // A target that does not answer: the client sees its connection closed, as it would.
        let Ok(server) = TcpStream::connect_timeout(&target, Duration::from_secs(2)) else { continue };
        if client.set_nonblocking(false).is_err() {
            continue;
        }
        let _ = (client.set_nodelay(true), server.set_nodelay(true));
        // One handle per pump, and one per end kept for resets.
        let clones = || -> std::io::Result<_> {
            Ok((client.try_clone()?, server.try_clone()?, [client.try_clone()?, server.try_clone()?]))
        };
        let Ok((client_out, server_in, kept)) = clones() else { continue };
        let id = state.stats.connections.fetch_add(1, Ordering::Relaxed);
        state.connections.lock().insert(id, kept);
        for (from, to, direction) in
            [(client, server_in, Direction::Forward), (server, client_out, Direction::Backward)]
        {
            let state = state.clone();
            let _ = std::thread::Builder::new().name("proxy pump".into()).spawn(move || {
                pump(from, to, direction, &state);
                // The first pump to finish closes the connection; either may forget it.
                state.connections.lock().remove(&id);
            });
        }
    }
}

/// Forwards `from` to `to` chunk by chunk, applying the link's faults, until either end closes.
fn pump(mut from: TcpStream, mut to: TcpStream, direction: Direction, state: &LinkState) {
    let mut buf = vec![0u8; 64 << 10];
    loop {
        let n = match from.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        while let Some(until) = state.stalled(direction) {
            std::thread::sleep(until.saturating_duration_since(Instant::now()).min(Duration::from_millis(5)));
        }
        let treatment = state.treat(n);
        if !treatment.wait.is_zero() {
            std::thread::sleep(treatment.wait);
        }
        if let Some(at) = treatment.corrupt_at {
            buf[at] ^= 0x5A;
            state.stats.corrupted.fetch_add(1, Ordering::Relaxed);
        }
        let len = if treatment.truncate { n / 2 } else { n };
        if to.write_all(&buf[..len]).is_err() {
            break;
        }
        state.stats.bytes.fetch_add(len as u64, Ordering::Relaxed);
        if treatment.truncate {
            state.stats.truncated.fetch_add(1, Ordering::Relaxed);
            break;
        }
    }
    let _ = from.shutdown(Shutdown::Both);
    let _ = to.shutdown(Shutdown::Both);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An echo server on loopback; returns its address.
    fn echo() -> SocketAddr {
        let listener = TcpListener::bind(("127.0.0.1", 0)).unwrap();
        let addr = listener.local_addr().unwrap();
        std::thread::spawn(move || {
            for stream in listener.incoming().flatten() {
                std::thread::spawn(move || {
                    let mut reader = stream.try_clone().unwrap();
                    let mut writer = stream;
                    let _ = std::io::copy(&mut reader, &mut writer);
                });
            }
        });
        addr
    }

    fn round_trip(stream: &mut TcpStream, bytes: &[u8]) -> std::io::Result<Vec<u8>> {
        stream.write_all(bytes)?;
        let mut back = vec![0u8; bytes.len()];
        stream.read_exact(&mut back)?;
        Ok(back)
    }

    const LINK: Link = Link::Activation { from: 0 };

    #[test]
    fn forwards_bytes_unchanged_without_faults() {
        let proxies = Proxies::new(1);
        let mut s = TcpStream::connect(proxies.start(LINK, echo()).unwrap()).unwrap();
        let data: Vec<u8> = (0..200_000u32).map(|i| (i * 31 % 251) as u8).collect();
        assert_eq!(round_trip(&mut s, &data).unwrap(), data);
        // The pumps count after each write, which may land after the echo is read back.
        let counted = || proxies.link(LINK).stats.bytes.load(Ordering::Relaxed);
        let deadline = Instant::now() + Duration::from_secs(5);
        while counted() < 2 * data.len() as u64 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(1));
        }
        assert_eq!(counted(), 2 * data.len() as u64);
    }

    #[test]
    fn corrupts_exactly_one_byte() {
        let proxies = Proxies::new(2);
        let mut s = TcpStream::connect(proxies.start(LINK, echo()).unwrap()).unwrap();
        assert_eq!(round_trip(&mut s, b"warm").unwrap(), b"warm");
        proxies.inject(LINK, NetFault::Corrupt);
        let data = vec![7u8; 1000];
        let back = round_trip(&mut s, &data).unwrap();
        assert_eq!(back.iter().zip(&data).filter(|(a, b)| a != b).count(), 1);
        assert_eq!(round_trip(&mut s, &data).unwrap(), data, "only the next write");
    }

    #[test]
    fn reset_and_truncate_close_the_connection() {
        let proxies = Proxies::new(3);
        let addr = proxies.start(LINK, echo()).unwrap();
        let mut s = TcpStream::connect(addr).unwrap();
        assert_eq!(round_trip(&mut s, b"hello").unwrap(), b"hello");
        proxies.inject(LINK, NetFault::Reset);
        assert!(round_trip(&mut s, b"again").is_err());
        // A new connection works, until a truncation cuts it after half a write.
        let mut s = TcpStream::connect(addr).unwrap();
        assert_eq!(round_trip(&mut s, b"hello").unwrap(), b"hello");
        proxies.inject(LINK, NetFault::Truncate);
        assert!(round_trip(&mut s, b"0123456789").is_err());
        let stats = &proxies.link(LINK).stats;
        assert_eq!(stats.truncated.load(Ordering::Relaxed), 1);
        assert!(stats.reset.load(Ordering::Relaxed) >= 1);
    }

    #[test]
    fn a_partition_holds_bytes_until_it_heals() {
        let proxies = Proxies::new(4);
        let mut s = TcpStream::connect(proxies.start(LINK, echo()).unwrap()).unwrap();
        assert_eq!(round_trip(&mut s, b"x").unwrap(), b"x");
        proxies.inject(LINK, NetFault::Stall { both: true, lasting: Duration::from_millis(300) });
        s.set_read_timeout(Some(Duration::from_millis(100))).unwrap();
        assert!(round_trip(&mut s, b"held").is_err(), "nothing passes during the partition");
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let mut back = [0u8; 4];
        s.read_exact(&mut back).unwrap();
        assert_eq!(&back, b"held", "the bytes were held, not dropped");
    }

    #[test]
    fn delay_slows_every_write_while_it_lasts() {
        let proxies = Proxies::new(5);
        let mut s = TcpStream::connect(proxies.start(LINK, echo()).unwrap()).unwrap();
        proxies.inject(
            LINK,
            NetFault::Delay {
                delay: Duration::from_millis(40),
                jitter: Duration::ZERO,
                lasting: Duration::from_secs(10),
            },
        );
        let start = Instant::now();
        assert_eq!(round_trip(&mut s, b"slow").unwrap(), b"slow");
        // Both directions wait: at least two delays.
        assert!(start.elapsed() >= Duration::from_millis(80), "{:?}", start.elapsed());
    }
}
