//! Network namespaces for a cluster's workers: each worker (a stage and its sidecar) runs in a
//! namespace of its own with an address of its own, as on a machine of its own, and reaches the
//! others only through a bridge. The controller, the driver and any fault-injecting proxies stay
//! in the caller's namespace, on the bridge's address.
//!
//! A [`Fabric`] is one bridge, `djvb<N>` with `10.231.<N>.1/24`; [`Fabric::host`] adds a
//! namespace `djv<N>h<i>` joined to it by a veth pair, with `10.231.<N>.<i + 2>`. Taking the
//! bridge's name is how concurrent fabrics (tests, other runs) pick different `N`s: creating a
//! link whose name exists fails. Everything is made with `ip` (iproute2) and needs root; a process
//! joins a namespace between `fork` and `exec` ([`Host::enter`]). Dropping the fabric removes the
//! namespaces and the bridge.

use std::collections::HashMap;
use std::fs::File;
use std::net::{IpAddr, Ipv4Addr};
use std::os::fd::AsRawFd;
use std::os::unix::process::CommandExt;
use std::process::Command;
use std::sync::Arc;

use parking_lot::Mutex;
use thiserror::Error;

/// Why a fabric or a host could not be made.
#[derive(Debug, Error)]
pub enum NetnsError {
    /// Namespaces and links need root.
    #[error("network namespaces need root (running as uid {0})")]
    NotRoot(u32),
    /// This machine (its kernel, its container, or a missing `ip`) does not let a fabric be made.
    #[error("network namespaces are not available here: {0}")]
    Unavailable(String),
    /// `ip` failed.
    #[error("`ip {args}` failed: {why}")]
    Ip {
        /// Its arguments.
        args: String,
        /// Its standard error, or why it did not run.
        why: String,
    },
    /// Every bridge name is taken.
    #[error("no free bridge name djvb0..djvb255")]
    Exhausted,
    /// The bridge's subnet has no address left.
    #[error("a fabric holds at most {0} hosts")]
    Full(usize),
}

/// Hosts a fabric's subnet has room for (`.2` to `.254`).
const MAX_HOSTS: usize = 253;

/// What a fabric's bridge is labelled with (its `ip link` alias), then its owner's process id:
/// a fabric whose owner died without removing it is removed by the next one made.
const OWNER: &str = "dejavu fabric of pid";

/// A bridge and the namespaces joined to it.
pub struct Fabric {
    number: u8,
    hosts: Mutex<Hosts>,
}

#[derive(Default)]
struct Hosts {
    by_name: HashMap<String, Arc<Host>>,
    /// Every namespace and veth pair made (or being made), to remove with the fabric.
    made: Vec<(String, String)>,
}

/// A network namespace on a fabric, with its own address.
pub struct Host {
    name: String,
    ip: Ipv4Addr,
}

impl Fabric {
    /// Makes a bridge with a free name and brings it up with its address, after checking that
    /// namespaces can be made here (and removing the fabrics of owners that died).
    pub fn create() -> Result<Self, NetnsError> {
        // SAFETY: geteuid takes nothing and cannot fail.
        let uid = unsafe { libc::geteuid() };
        if uid != 0 {
            return Err(NetnsError::NotRoot(uid));
        }
        let unavailable = |e: NetnsError| NetnsError::Unavailable(e.to_string());
        reap_orphans();
        for number in 0..=u8::MAX {
            let bridge = format!("djvb{number}");
            // An address of its own: a bridge otherwise takes the lowest of its ports', which
            // changes as hosts join, and the hosts' cached address of the gateway goes stale
            // (their packets to it are lost until the cache expires). Bridged frames skip
            // iptables: a host firewall's FORWARD policy must not cut workers off from each other.
            let mac = format!("02:64:6a:76:00:{number:02x}");
            match ip(&["link", "add", &bridge, "address", &mac, "type", "bridge", "nf_call_iptables", "0"]) {
                Ok(()) => {}
                Err(NetnsError::Ip { why, .. }) if why.contains("File exists") => continue,
                Err(e) => return Err(unavailable(e)),
            }
            // Removed when dropped from here on, also if what follows fails.
            let fabric = Self { number, hosts: Mutex::default() };
            let owner = format!("{OWNER} {}", std::process::id());
            ip(&["link", "set", &bridge, "alias", &owner]).map_err(unavailable)?;
            let probe = format!("djv{number}probe");
            ip(&["netns", "add", &probe]).map_err(unavailable)?;
            ip(&["netns", "del", &probe]).map_err(unavailable)?;
            let gateway = format!("{}/24", fabric.gateway());
            ip(&["addr", "add", &gateway, "dev", &bridge])?;
            ip(&["link", "set", &bridge, "up"])?;
            return Ok(fabric);
        }
        Err(NetnsError::Exhausted)
    }

    /// The bridge's name.
    pub fn bridge(&self) -> String {
        format!("djvb{}", self.number)
    }

    /// The bridge's address: where the caller's namespace is reached from the hosts.
    pub fn gateway(&self) -> IpAddr {
        IpAddr::V4(Ipv4Addr::new(10, 231, self.number, 1))
    }

    /// The host called `name`, made (with the next free address) the first time it is asked for.
    /// Made outside the fabric's lock: asking for a host that exists never waits for another
    /// being made.
    pub fn host(&self, name: &str) -> Result<Arc<Host>, NetnsError> {
        let (n, i) = {
            let mut hosts = self.hosts.lock();
            if let Some(host) = hosts.by_name.get(name) {
                return Ok(host.clone());
            }
            let i = hosts.made.len();
            if i == MAX_HOSTS {
                return Err(NetnsError::Full(MAX_HOSTS));
            }
            hosts.made.push((format!("djv{}h{i}", self.number), format!("djv{}v{i}", self.number)));
            (self.number, i)
        };
        let (namespace, outside, inside) =
            (format!("djv{n}h{i}"), format!("djv{n}v{i}"), format!("djv{n}p{i}"));
        let addr = Ipv4Addr::new(10, 231, n, i as u8 + 2);
        let made = (|| {
            ip(&["netns", "add", &namespace])?;
            ip(&["link", "add", &outside, "type", "veth", "peer", "name", &inside, "netns", &namespace])?;
            ip(&["link", "set", &outside, "master", &self.bridge(), "up"])?;
            ip(&["-n", &namespace, "addr", "add", &format!("{addr}/24"), "dev", &inside])?;
            ip(&["-n", &namespace, "link", "set", &inside, "up"])?;
            ip(&["-n", &namespace, "link", "set", "lo", "up"])
        })();
        made.inspect_err(|_| remove(&namespace, &outside))?;
        let host = Arc::new(Host { name: namespace, ip: addr });
        // Two callers may have made one each for the same name: the first kept is everyone's.
        Ok(self.hosts.lock().by_name.entry(name.to_owned()).or_insert(host).clone())
    }
}

/// Removes the fabrics whose owner is no longer running (killed before it could), with their
/// namespaces and veth pairs.
fn reap_orphans() {
    let Ok(out) = Command::new("ip").args(["-o", "link", "show", "type", "bridge"]).output() else { return };
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let Some(number) = line
            .split_whitespace()
            .nth(1)
            .and_then(|name| name.trim_end_matches(':').strip_prefix("djvb"))
            .and_then(|n| n.parse::<u8>().ok())
        else {
            continue;
        };
        let Some(owner) = line.split(OWNER).nth(1).and_then(|rest| rest.split_whitespace().next()) else {
            continue;
        };
        if std::path::Path::new(&format!("/proc/{owner}")).exists() {
            continue;
        }
        let prefix = format!("djv{number}");
        let listed = Command::new("ip").args(["netns", "list"]).output();
        let listed = listed.map(|o| String::from_utf8_lossy(&o.stdout).into_owned()).unwrap_or_default();
        for name in listed.lines().filter_map(|line| line.split_whitespace().next()) {
            if let Some(i) = name.strip_prefix(&prefix).and_then(|rest| rest.strip_prefix('h')) {
                remove(name, &format!("{prefix}v{i}"));
            }
        }
        let _ = ip(&["link", "del", &format!("djvb{number}")]);
    }
}

/// Removes a host's namespace and its veth pair, if they exist. The pair is removed by its end
/// outside: the namespace itself may outlive its name for a while (the kernel frees it once
/// nothing refers to it), and the pair with it.
fn remove(namespace: &str, outside: &str) {
    let _ = ip(&["link", "del", outside]);
    let _ = ip(&["netns", "del", namespace]);
}

impl std::fmt::Debug for Fabric {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Fabric").field("bridge", &self.bridge()).finish()
    }
}

impl Drop for Fabric {
    fn drop(&mut self) {
        for (namespace, outside) in &self.hosts.lock().made {
            remove(namespace, outside);
        }
        let _ = ip(&["link", "del", &self.bridge()]);
    }
}

impl Host {
    /// Its address.
    pub fn ip(&self) -> IpAddr {
        IpAddr::V4(self.ip)
    }

    /// Its namespace's name (as `ip netns` lists it).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Makes `command`'s process join this namespace before it runs. The namespace's file stays
    /// open as long as `command` (not longer: a cluster's runs must leave no descriptor behind).
    pub fn enter(&self, command: &mut Command) -> std::io::Result<()> {
        let namespace = File::open(format!("/run/netns/{}", self.name))?;
        // SAFETY: the closure runs in the child between fork and exec, where only
        // async-signal-safe calls are allowed: it makes one setns(2) system call on a descriptor
        // the child inherited (`namespace`, moved into the closure, is open in the parent until
        // the command is dropped) and builds an io::Error from errno, allocating nothing.
        unsafe {
            command.pre_exec(move || {
                if libc::setns(namespace.as_raw_fd(), libc::CLONE_NEWNET) == 0 {
                    Ok(())
                } else {
                    Err(std::io::Error::last_os_error())
                }
            });
        }
        Ok(())
    }
}

/// Runs `ip args...`; its standard error is the error.
fn ip(args: &[&str]) -> Result<(), NetnsError> {
    let fail = |why: String| NetnsError::Ip { args: args.join(" "), why };
    let out = Command::new("ip").args(args).output().map_err(|e| fail(e.to_string()))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(fail(String::from_utf8_lossy(&out.stderr).trim().to_owned()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;
    use std::net::TcpListener;
    use std::time::{Duration, Instant};

    /// A fabric with a host "a", if this machine lets the test make them (root, `ip`, and a
    /// kernel and container that allow namespaces); says so when it does not.
    fn fabric() -> Option<(Fabric, Arc<Host>)> {
        match Fabric::create() {
            Ok(fabric) => {
                let a = fabric.host("a").unwrap();
                Some((fabric, a))
            }
            Err(e @ (NetnsError::NotRoot(_) | NetnsError::Unavailable(_))) => {
                eprintln!("skipped: {e}");
                None
            }
            Err(e) => panic!("{e}"),
        }
    }

    /// `script` run by bash in `host`'s namespace.
    fn bash_in(host: &Host, script: &str) -> Command {
        let mut command = Command::new("bash");
        command.args(["-c", script]);
        host.enter(&mut command).unwrap();
        command
    }

    #[test]
    fn hosts_reach_the_gateway_and_each_other_at_their_own_addresses() {
        let Some((fabric, a)) = fabric() else { return };
        let b = fabric.host("b").unwrap();
        assert_ne!(a.ip(), b.ip());
        assert_eq!(fabric.host("a").unwrap().ip(), a.ip(), "a host is made once");
        // The bridge keeps its own hardware address as hosts join: the hosts' cached address of
        // the gateway stays right.
        let mac = std::fs::read_to_string(format!("/sys/class/net/{}/address", fabric.bridge())).unwrap();
        assert!(mac.starts_with("02:64:6a:76:00:"), "{mac}");

        // Host a connects to the gateway, from its own address, and sees only that address.
        let gateway = TcpListener::bind((fabric.gateway(), 0)).unwrap();
        let port = gateway.local_addr().unwrap().port();
        let script = format!(
            "exec 3<>/dev/tcp/{}/{port} && echo hello >&3 && ip -o -4 addr show scope global",
            fabric.gateway()
        );
        let child = bash_in(&a, &script).stdout(std::process::Stdio::piped()).spawn().unwrap();
        gateway.set_nonblocking(true).unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        let (mut stream, from) = loop {
            match gateway.accept() {
                Ok(accepted) => break accepted,
                Err(_) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(10)),
                Err(e) => panic!("host a never connected: {e}"),
            }
        };
        assert_eq!(from.ip(), a.ip());
        stream.set_nonblocking(false).unwrap();
        let mut hello = String::new();
        stream.read_to_string(&mut hello).unwrap();
        assert_eq!(hello, "hello\n");
        let out = child.wait_with_output().unwrap();
        let addrs = String::from_utf8_lossy(&out.stdout);
        assert!(addrs.contains(&a.ip().to_string()) && !addrs.contains(&b.ip().to_string()), "{addrs}");

        // Host b serves; host a reaches it over the bridge.
        let serve = format!(
            "exec python3 -c 'import socket; s = socket.socket(); s.bind((\"{}\", 9)); s.listen(); \
             c, _ = s.accept(); c.sendall(b\"from b\")'",
            b.ip()
        );
        let mut server = bash_in(&b, &serve).spawn().unwrap();
        let fetch = format!(
            "for i in $(seq 100); do (exec 3<>/dev/tcp/{}/9 && cat <&3) 2>/dev/null && exit 0; sleep 0.05; done; exit 1",
            b.ip()
        );
        let reply = bash_in(&a, &fetch).output().unwrap();
        let _ = server.kill();
        let _ = server.wait();
        assert_eq!(String::from_utf8_lossy(&reply.stdout), "from b");

        let names: Vec<String> = [&a, &b].iter().map(|h| h.name().to_owned()).collect();
        drop(fabric);
        let listed = Command::new("ip").args(["netns", "list"]).output().unwrap();
        let listed = String::from_utf8_lossy(&listed.stdout);
        assert!(
            names.iter().all(|n| !listed.lines().any(|l| l.split_whitespace().next() == Some(n))),
            "{listed}"
        );
    }

    #[test]
    fn a_fabric_whose_owner_died_is_removed_by_the_next_one() {
        use std::os::unix::fs::MetadataExt;
        let Some((orphan, a)) = fabric() else { return };
        // Its owner "died": a process id that is not running.
        let dead = format!("{OWNER} {}", u32::MAX);
        ip(&["link", "set", &orphan.bridge(), "alias", &dead]).unwrap();
        // Other tests make fabrics meanwhile, and may reap the orphan first and reuse its names:
        // the orphan's namespace is known by its inode, its bridge by its alias.
        let namespace = std::path::Path::new("/run/netns").join(a.name());
        let inode = std::fs::metadata(&namespace).unwrap().ino();
        std::mem::forget(orphan);
        let _next = Fabric::create().unwrap();
        let links = Command::new("ip").args(["-o", "link", "show"]).output().unwrap();
        let links = String::from_utf8_lossy(&links.stdout);
        assert!(!links.contains(&dead), "{links}");
        assert!(std::fs::metadata(&namespace).map_or(true, |m| m.ino() != inode), "{namespace:?} is left");
    }
}
