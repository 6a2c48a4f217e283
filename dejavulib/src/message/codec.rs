//! The little-endian primitives messages are made of, and a reader that never trusts a length.

use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4, SocketAddrV6};

use super::MessageError;

/// Appends fields to an encoded message.
#[derive(Default)]
pub(super) struct Writer(pub(super) Vec<u8>);

impl Writer {
    pub(super) fn u8(&mut self, v: u8) {
        self.0.push(v);
    }

    pub(super) fn u16(&mut self, v: u16) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }

    pub(super) fn u32(&mut self, v: u32) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }

    pub(super) fn u64(&mut self, v: u64) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }

    /// A length as a `u32` (every list and text of a message is far below 4 GiB).
    pub(super) fn len(&mut self, len: usize) {
        self.u32(u32::try_from(len).expect("a message field under 4 GiB"));
    }

    pub(super) fn bytes(&mut self, v: &[u8]) {
        self.len(v.len());
        self.0.extend_from_slice(v);
    }

    pub(super) fn text(&mut self, v: &str) {
        self.bytes(v.as_bytes());
    }

    /// An address, in binary: one encoding per address (text would allow `:05` for `:5`).
    pub(super) fn addr(&mut self, v: SocketAddr) {
        match v {
            SocketAddr::V4(v4) => {
                self.u8(4);
                self.0.extend_from_slice(&v4.ip().octets());
                self.u16(v4.port());
            }
            SocketAddr::V6(v6) => {
                self.u8(6);
                self.0.extend_from_slice(&v6.ip().octets());
                self.u16(v6.port());
                self.u32(v6.flowinfo());
                self.u32(v6.scope_id());
            }
        }
    }

    pub(super) fn option_addr(&mut self, v: Option<SocketAddr>) {
        match v {
            None => self.u8(0),
            Some(addr) => {
                self.u8(1);
                self.addr(addr);
            }
        }
    }
}

/// Takes fields off the front of an encoded message. Every list's length is checked against the
/// bytes left before anything is allocated for it, so a decoder allocates in proportion to its
/// input, whatever the input claims.
pub(super) struct Reader<'a>(pub(super) &'a [u8]);

impl<'a> Reader<'a> {
    fn take<const N: usize>(&mut self, what: &'static str) -> Result<[u8; N], MessageError> {
        let (head, rest) = self.0.split_first_chunk::<N>().ok_or(MessageError::Truncated(what))?;
        self.0 = rest;
        Ok(*head)
    }

    pub(super) fn u8(&mut self, what: &'static str) -> Result<u8, MessageError> {
        Ok(self.take::<1>(what)?[0])
    }

    pub(super) fn u16(&mut self, what: &'static str) -> Result<u16, MessageError> {
        self.take(what).map(u16::from_le_bytes)
    }

    pub(super) fn u32(&mut self, what: &'static str) -> Result<u32, MessageError> {
        self.take(what).map(u32::from_le_bytes)
    }

    pub(super) fn u64(&mut self, what: &'static str) -> Result<u64, MessageError> {
        self.take(what).map(u64::from_le_bytes)
    }

    pub(super) fn bool(&mut self, what: &'static str) -> Result<bool, MessageError> {
        match self.u8(what)? {
            0 => Ok(false),
            1 => Ok(true),
            _ => Err(MessageError::Malformed(what)),
        }
    }

    /// A count of items each at least `min_len` bytes long: refused if the bytes left cannot hold
    /// them, so that no list is allocated beyond what the input could fill.
    pub(super) fn count(&mut self, min_len: usize, what: &'static str) -> Result<usize, MessageError> {
        let count = self.u32(what)? as usize;
        if count.saturating_mul(min_len.max(1)) > self.0.len() {
            return Err(MessageError::Truncated(what));
        }
        Ok(count)
    }

    pub(super) fn bytes(&mut self, what: &'static str) -> Result<&'a [u8], MessageError> {
        let len = self.count(1, what)?;
        let (head, rest) = self.0.split_at(len);
        self.0 = rest;
        Ok(head)
    }

    pub(super) fn text(&mut self, what: &'static str) -> Result<&'a str, MessageError> {
        std::str::from_utf8(self.bytes(what)?).map_err(|_| MessageError::Malformed(what))
    }

    pub(super) fn addr(&mut self, what: &'static str) -> Result<SocketAddr, MessageError> {
        match self.u8(what)? {
            4 => {
                let ip = Ipv4Addr::from(self.take::<4>(what)?);
                Ok(SocketAddrV4::new(ip, self.u16(what)?).into())
            }
            6 => {
                let ip = Ipv6Addr::from(self.take::<16>(what)?);
                let port = self.u16(what)?;
                Ok(SocketAddrV6::new(ip, port, self.u32(what)?, self.u32(what)?).into())
            }
            _ => Err(MessageError::Malformed(what)),
        }
    }

    pub(super) fn option_addr(&mut self, what: &'static str) -> Result<Option<SocketAddr>, MessageError> {
        Ok(if self.bool(what)? { Some(self.addr(what)?) } else { None })
    }

    /// A list of `count` items each at least `min_len` bytes long, each read by `item`.
    pub(super) fn list<T>(
        &mut self,
        min_len: usize,
        what: &'static str,
        mut item: impl FnMut(&mut Self) -> Result<T, MessageError>,
    ) -> Result<Vec<T>, MessageError> {
        let count = self.count(min_len, what)?;
        let mut out = Vec::with_capacity(count);
        for _ in 0..count {
            out.push(item(self)?);
        }
        Ok(out)
    }

    /// Refuses bytes left over: a message is exactly its fields.
    pub(super) fn finish(self) -> Result<(), MessageError> {
        if self.0.is_empty() {
            Ok(())
        } else {
            Err(MessageError::Trailing(self.0.len()))
        }
    }
}
