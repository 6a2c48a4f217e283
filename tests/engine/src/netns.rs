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
    /// `ip` failed or is missing.
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

/// A bridge and the namespaces joined to it.
pub struct Fabric {
    number: u8,
    hosts: Mutex<HashMap<String, Arc<Host>>>,
}

/// A network namespace on a fabric, with its own address.
pub struct Host {
    name: String,
    /// Its veth pair's end outside, on the bridge.
    outside: String,
    ip: Ipv4Addr,
}

impl Fabric {
    /// Makes a bridge with a free name and brings it up with its address.
    pub fn create() -> Result<Self, NetnsError> {
        // SAFETY: geteuid takes nothing and cannot fail.
        let uid = unsafe { libc::geteuid() };
        if uid != 0 {
            return Err(NetnsError::NotRoot(uid));
        }
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
                Err(e) => return Err(e),
            }
            let fabric = Self { number, hosts: Mutex::default() };
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
    pub fn host(&self, name: &str) -> Result<Arc<Host>, NetnsError> {
        let mut hosts = self.hosts.lock();
        if let Some(host) = hosts.get(name) {
            return Ok(host.clone());
        }
        if hosts.len() == MAX_HOSTS {
            return Err(NetnsError::Full(MAX_HOSTS));
        }
        let (n, i) = (self.number, hosts.len());
        let (namespace, outside) = (format!("djv{n}h{i}"), format!("djv{n}v{i}"));
        let addr = Ipv4Addr::new(10, 231, n, i as u8 + 2);
        // Names with this fabric's number are this fabric's: any found are left by a process
        // that died before removing them.
        remove(&namespace, &outside);
        let made = (|| {
            let inside = format!("djv{n}p{i}");
            ip(&["netns", "add", &namespace])?;
            ip(&["link", "add", &outside, "type", "veth", "peer", "name", &inside, "netns", &namespace])?;
            ip(&["link", "set", &outside, "master", &self.bridge(), "up"])?;
            ip(&["-n", &namespace, "addr", "add", &format!("{addr}/24"), "dev", &inside])?;
            ip(&["-n", &namespace, "link", "set", &inside, "up"])?;
            ip(&["-n", &namespace, "link", "set", "lo", "up"])
        })();
        made.inspect_err(|_| remove(&namespace, &outside))?;
        let host = Arc::new(Host { name: namespace, outside, ip: addr });
        hosts.insert(name.to_owned(), host.clone());
        Ok(host)
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
        f.debug_struct("Fabric").field("bridge", &format_args!("djvb{}", self.number)).finish()
    }
}

impl Drop for Fabric {
    fn drop(&mut self) {
        for host in self.hosts.lock().values() {
            remove(&host.name, &host.outside);
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
    use std::net::{TcpListener, TcpStream};

    /// Whether this machine lets the test make namespaces (root, `ip` and kernel support).
    fn fabric() -> Option<Fabric> {
        match Fabric::create() {
            Ok(fabric) => Some(fabric),
            Err(e) => {
                eprintln!("skipped: no network namespaces here ({e})");
                None
            }
        }
    }

    #[test]
    fn hosts_reach_each_other_and_the_gateway_only_at_their_own_addresses() {
        let Some(fabric) = fabric() else { return };
        let (a, b) = (fabric.host("a").unwrap(), fabric.host("b").unwrap());
        assert_ne!(a.ip(), b.ip());
        assert_eq!(fabric.host("a").unwrap().ip(), a.ip(), "a host is made once");
        // The bridge keeps its own hardware address as hosts join: the hosts' cached address of
        // the gateway stays right.
        let mac = std::fs::read_to_string(format!("/sys/class/net/{}/address", fabric.bridge())).unwrap();
        assert!(mac.starts_with("02:64:6a:76:00:"), "{mac}");
        let gateway = TcpListener::bind((fabric.gateway(), 0)).unwrap();
        let port = gateway.local_addr().unwrap().port();
        // A process in host a connects to the gateway; the connection comes from a's address.
        let script = format!(
            "exec 3<>/dev/tcp/{}/{port} && echo hello >&3 && ip -o -4 addr show scope global",
            fabric.gateway()
        );
        let mut command = Command::new("bash");
        command.args(["-c", &script]);
        a.enter(&mut command).unwrap();
        let child = std::thread::spawn(move || command.output().unwrap());
        let (mut stream, from) = gateway.accept().unwrap();
        assert_eq!(from.ip(), a.ip());
        let mut hello = String::new();
        stream.read_to_string(&mut hello).unwrap();
        assert_eq!(hello, "hello\n");
        let out = child.join().unwrap();
        let addrs = String::from_utf8_lossy(&out.stdout);
        assert!(addrs.contains(&a.ip().to_string()) && !addrs.contains(&b.ip().to_string()), "{addrs}");
        // Host b is not on this namespace's loopback: its address is reached over the bridge.
        let mut command = Command::new("bash");
        let listen = format!("exec python3 -c 'import socket; s=socket.socket(); s.bind((\"{}\", 9)); s.listen(); c, a = s.accept(); c.sendall(b\"from b\")'", b.ip());
        command.args(["-c", &listen]);
        b.enter(&mut command).unwrap();
        let mut server = command.spawn().unwrap();
        let mut reply = String::new();
        for _ in 0..100 {
            if let Ok(mut s) = TcpStream::connect((b.ip(), 9)) {
                s.read_to_string(&mut reply).unwrap();
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        server.wait().unwrap();
        assert_eq!(reply, "from b");
        let names: Vec<String> = [&a, &b].iter().map(|h| h.name().to_owned()).collect();
        drop(fabric);
        let listed = Command::new("ip").args(["netns", "list"]).output().unwrap();
        let listed = String::from_utf8_lossy(&listed.stdout);
        assert!(
            names.iter().all(|n| !listed.lines().any(|l| l.split_whitespace().next() == Some(n))),
            "{listed}"
        );
    }
}
