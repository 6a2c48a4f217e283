//! The controller's heartbeat socket: datagrams taken in as they come (a thread blocks on the
//! socket) or as they wait (before a census, without blocking), and only beats signed with the
//! cluster secret counted.

use std::io::ErrorKind;
use std::net::{SocketAddr, UdpSocket};
use std::os::fd::AsRawFd;
use std::sync::atomic::Ordering;

use parking_lot::Mutex;
use tracing::{error, info};

use super::{role_name, Counters, Tables};
use crate::heartbeat::{Beat, DATAGRAM_LEN};

/// Room for a heartbeat datagram and a byte more, so that a longer datagram shows as one.
pub(super) const DATAGRAM_BUFFER: usize = DATAGRAM_LEN + 1;

/// The beat `datagram` is, if it is one signed with the cluster secret `secret`; anything else is
/// counted as refused.
pub(super) fn authentic_beat(datagram: &[u8], secret: &[u8], counters: &Counters) -> Option<Beat> {
    let beat = crate::heartbeat::decode(datagram, secret);
    if beat.is_none() {
        counters.refused_heartbeats.fetch_add(1, Ordering::Relaxed);
    }
    beat
}

/// Takes one datagram waiting on `socket` into `buf`, without waiting: its length and sender.
/// `None` when nothing waits (or the socket failed). The heartbeat thread blocks on the same
/// socket, so the socket itself stays blocking.
pub(super) fn recv_waiting(socket: &UdpSocket, buf: &mut [u8]) -> Option<(usize, SocketAddr)> {
    // SAFETY: an all-zero sockaddr_storage is a valid value of this plain C struct.
    let mut from: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    let mut from_len = std::mem::size_of::<libc::sockaddr_storage>() as libc::socklen_t;
    // SAFETY: recvfrom writes at most `buf.len()` bytes into `buf`, a live, writable buffer, and
    // at most `from_len` bytes of address into `from`, which is that large; the descriptor
    // belongs to `socket`, open for the whole call; MSG_DONTWAIT makes it return at once when
    // nothing is waiting.
    let n = unsafe {
        libc::recvfrom(
            socket.as_raw_fd(),
            buf.as_mut_ptr().cast(),
            buf.len(),
            libc::MSG_DONTWAIT,
            (&mut from as *mut libc::sockaddr_storage).cast(),
            &mut from_len,
        )
    };
    let n = usize::try_from(n).ok()?;
    Some((n, socket_addr_of(&from)?))
}

/// The address in `storage`, if it is an IPv4 or IPv6 one.
fn socket_addr_of(storage: &libc::sockaddr_storage) -> Option<SocketAddr> {
    match i32::from(storage.ss_family) {
        libc::AF_INET => {
            // SAFETY: the family says the storage holds a sockaddr_in, which it is large and
            // aligned enough for.
            let v4 = unsafe { &*(storage as *const libc::sockaddr_storage).cast::<libc::sockaddr_in>() };
            let ip = std::net::Ipv4Addr::from(u32::from_be(v4.sin_addr.s_addr));
            Some(SocketAddr::from((ip, u16::from_be(v4.sin_port))))
        }
        libc::AF_INET6 => {
            // SAFETY: as above, for a sockaddr_in6.
            let v6 = unsafe { &*(storage as *const libc::sockaddr_storage).cast::<libc::sockaddr_in6>() };
            let ip = std::net::Ipv6Addr::from(v6.sin6_addr.s6_addr);
            let port = u16::from_be(v6.sin6_port);
            Some(std::net::SocketAddrV6::new(ip, port, v6.sin6_flowinfo, v6.sin6_scope_id).into())
        }
        _ => None,
    }
}

/// Records every heartbeat that arrives on `socket`; a member heard for the first time (or a
/// replacement) is written to the state file.
pub(super) fn listen_heartbeats(
    socket: &UdpSocket,
    tables: &Mutex<Tables>,
    counters: &Counters,
    secret: &[u8],
) {
    let mut buf = [0u8; DATAGRAM_BUFFER];
    loop {
        let (n, from) = match socket.recv_from(&mut buf) {
            Ok(received) => received,
            Err(e) if e.kind() == ErrorKind::Interrupted => continue,
            Err(e) => {
                error!(error = %e, "the heartbeat socket failed");
                return;
            }
        };
        // Checked before the lock: a flood of forgeries costs the other threads nothing.
        let Some(beat) = authentic_beat(&buf[..n], secret, counters) else { continue };
        let mut tables = tables.lock();
        if tables.heard(beat, from, counters) {
            let Beat { member, pid, epoch, .. } = beat;
            info!(role = role_name(member.0), stage = member.1, pid, epoch, "a member joined");
            if let Err(e) = tables.save() {
                error!(error = %e, "cannot record a new member");
            }
        }
    }
}
