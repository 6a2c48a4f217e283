//! The engine protocol's messages (see [`super`]) and their framing: each message a
//! little-endian `u32` length, then its body, a kind byte and its fields.

use std::io::{Read, Write};
use std::net::SocketAddr;

use super::ExternalError;
use dejavu_engine::pipeline::Seat;

/// Longest message either side may send: a step's input or output of a long prompt fits easily.
pub const MAX_MESSAGE: u32 = 1 << 30;

/// What the host sends.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ToEngine {
    /// The stage to be, once.
    Start(Start),
    /// A step to run.
    Step {
        /// The sequence.
        seat: Seat,
        /// Its first token's position.
        position: u32,
        /// Its tokens.
        count: u32,
        /// Whether to hand the step's KV to the sidecar.
        replicate: bool,
        /// Token ids or hidden states, little-endian.
        input: Vec<u8>,
    },
    /// A sequence's KV to restore.
    Restore {
        /// The sequence.
        seat: Seat,
        /// Its prompt's length (its first chunk).
        prompt_len: u32,
        /// Tokens computed so far: no chunk beyond them is read.
        kv_tokens: u32,
        /// The sidecar to read from, or the engine's own.
        from: Option<SocketAddr>,
    },
    /// A sequence's KV to read out (packed).
    Read {
        /// The sequence.
        seat: Seat,
        /// Its tokens whose KV is read.
        tokens: std::ops::Range<u32>,
    },
    /// A sequence's KV to take in (packed), in place of computing it.
    Write {
        /// The sequence.
        seat: Seat,
        /// Its tokens whose KV is given.
        tokens: std::ops::Range<u32>,
        /// Whether to hand it to the sidecar, as a computed step's.
        replicate: bool,
        /// The KV, packed.
        kv: Vec<u8>,
    },
}

/// The stage an engine process is to be.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Start {
    /// Its position in the chain.
    pub index: u32,
    /// The epoch it joins its sidecar in.
    pub epoch: u64,
    /// Global layers it runs.
    pub layers: std::ops::Range<u32>,
    /// Sequences per microbatch.
    pub slots: u32,
    /// Microbatches.
    pub microbatches: u32,
    /// Microbatches whose KV stays in device memory (fewer than `microbatches`: swapping).
    pub resident: u32,
    /// Tokens per sequence at most.
    pub max_tokens: u32,
    /// Its sidecar's local socket, if it replicates.
    pub sidecar: String,
    /// Its successor's sidecar, or `none`.
    pub successor: String,
    /// CPUs for its copies, if set apart.
    pub copy_cpus: String,
    /// The cluster secret.
    pub secret: Vec<u8>,
}

/// What the engine answers.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum FromEngine {
    /// Built and joined, in this epoch.
    Ready(u64),
    /// A step's output.
    Output(Vec<u8>),
    /// Tokens restored.
    Restored(u32),
    /// A request refused, and why.
    Refused(String),
    /// Started, waiting to be told its stage.
    Standby,
    /// Its swaps so far, sent before an answer.
    Swapped(SwapTotals),
    /// KV read out, packed.
    Kv(Vec<u8>),
}

/// An engine's swaps between its device and host memory so far (what [`FromEngine::Swapped`]
/// carries).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SwapTotals {
    /// Microbatches swapped in.
    pub swap_ins: u64,
    /// Bytes swapped in.
    pub bytes_in: u64,
    /// Deltas (or whole microbatches) swapped out.
    pub swap_outs: u64,
    /// Bytes swapped out.
    pub bytes_out: u64,
    /// Bytes of KV in host memory now.
    pub host_bytes: u64,
}

/// Writes a little-endian message body's fields.
#[derive(Default)]
struct Body(Vec<u8>);

impl Body {
    fn u8(mut self, v: u8) -> Self {
        self.0.push(v);
        self
    }
    fn u32(mut self, v: u32) -> Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    fn u64(mut self, v: u64) -> Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    fn bytes(self, v: &[u8]) -> Self {
        let mut this = self.u32(v.len() as u32);
        this.0.extend_from_slice(v);
        this
    }
    fn rest(mut self, v: &[u8]) -> Self {
        self.0.extend_from_slice(v);
        self
    }
}

/// Reads a message body's fields.
struct Fields<'a>(&'a [u8]);

impl<'a> Fields<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], ExternalError> {
        if self.0.len() < n {
            return Err(ExternalError::Malformed(format!(
                "{} bytes where {n} more were expected",
                self.0.len()
            )));
        }
        let (taken, rest) = self.0.split_at(n);
        self.0 = rest;
        Ok(taken)
    }
    fn u8(&mut self) -> Result<u8, ExternalError> {
        Ok(self.take(1)?[0])
    }
    fn u32(&mut self) -> Result<u32, ExternalError> {
        Ok(u32::from_le_bytes(self.take(4)?.try_into().expect("4 bytes")))
    }
    fn u64(&mut self) -> Result<u64, ExternalError> {
        Ok(u64::from_le_bytes(self.take(8)?.try_into().expect("8 bytes")))
    }
    fn bytes(&mut self) -> Result<&'a [u8], ExternalError> {
        let n = self.u32()? as usize;
        self.take(n)
    }
    fn text(&mut self) -> Result<String, ExternalError> {
        String::from_utf8(self.bytes()?.to_vec())
            .map_err(|_| ExternalError::Malformed("text that is not UTF-8".into()))
    }
    fn rest(&mut self) -> &'a [u8] {
        std::mem::take(&mut self.0)
    }
    fn flag(&mut self) -> Result<bool, ExternalError> {
        match self.u8()? {
            0 => Ok(false),
            1 => Ok(true),
            v => Err(ExternalError::Malformed(format!("a flag of {v}"))),
        }
    }
    fn end(&self) -> Result<(), ExternalError> {
        match self.0.len() {
            0 => Ok(()),
            n => Err(ExternalError::Malformed(format!("{n} bytes after the last field"))),
        }
    }
}

impl ToEngine {
    /// The message's body (without its length).
    pub fn encode(&self) -> Vec<u8> {
        match self {
            ToEngine::Start(s) => Body::default()
                .u8(1)
                .u32(s.index)
                .u64(s.epoch)
                .u32(s.layers.start)
                .u32(s.layers.end)
                .u32(s.slots)
                .u32(s.microbatches)
                .u32(s.resident)
                .u32(s.max_tokens)
                .bytes(s.sidecar.as_bytes())
                .bytes(s.successor.as_bytes())
                .bytes(s.copy_cpus.as_bytes())
                .bytes(&s.secret),
            ToEngine::Step { seat, position, count, replicate, input } => Body::default()
                .u8(2)
                .u32(seat.microbatch)
                .u32(seat.slot)
                .u32(*position)
                .u32(*count)
                .u8(u8::from(*replicate))
                .rest(input),
            ToEngine::Restore { seat, prompt_len, kv_tokens, from } => Body::default()
                .u8(3)
                .u32(seat.microbatch)
                .u32(seat.slot)
                .u32(*prompt_len)
                .u32(*kv_tokens)
                .bytes(from.map(|a| a.to_string()).unwrap_or_default().as_bytes()),
            ToEngine::Read { seat, tokens } => {
                Body::default().u8(4).u32(seat.microbatch).u32(seat.slot).u32(tokens.start).u32(tokens.end)
            }
            ToEngine::Write { seat, tokens, replicate, kv } => Body::default()
                .u8(5)
                .u32(seat.microbatch)
                .u32(seat.slot)
                .u32(tokens.start)
                .u32(tokens.end)
                .u8(u8::from(*replicate))
                .rest(kv),
        }
        .0
    }

    /// The message in `body`.
    pub fn decode(body: &[u8]) -> Result<Self, ExternalError> {
        let mut f = Fields(body);
        let message = match f.u8()? {
            1 => ToEngine::Start(Start {
                index: f.u32()?,
                epoch: f.u64()?,
                layers: f.u32()?..f.u32()?,
                slots: f.u32()?,
                microbatches: f.u32()?,
                resident: f.u32()?,
                max_tokens: f.u32()?,
                sidecar: f.text()?,
                successor: f.text()?,
                copy_cpus: f.text()?,
                secret: f.bytes()?.to_vec(),
            }),
            2 => ToEngine::Step {
                seat: Seat { microbatch: f.u32()?, slot: f.u32()? },
                position: f.u32()?,
                count: f.u32()?,
                replicate: f.flag()?,
                input: f.rest().to_vec(),
            },
            3 => ToEngine::Restore {
                seat: Seat { microbatch: f.u32()?, slot: f.u32()? },
                prompt_len: f.u32()?,
                kv_tokens: f.u32()?,
                from: match f.text()?.as_str() {
                    "" => None,
                    addr => Some(
                        addr.parse().map_err(|_| ExternalError::Malformed(format!("address {addr:?}")))?,
                    ),
                },
            },
            4 => ToEngine::Read {
                seat: Seat { microbatch: f.u32()?, slot: f.u32()? },
                tokens: f.u32()?..f.u32()?,
            },
            5 => ToEngine::Write {
                seat: Seat { microbatch: f.u32()?, slot: f.u32()? },
                tokens: f.u32()?..f.u32()?,
                replicate: f.flag()?,
                kv: f.rest().to_vec(),
            },
            kind => return Err(ExternalError::Malformed(format!("message kind {kind} to an engine"))),
        };
        f.end()?;
        Ok(message)
    }
}

impl FromEngine {
    /// The message's body (without its length).
    pub fn encode(&self) -> Vec<u8> {
        match self {
            FromEngine::Ready(epoch) => Body::default().u8(1).u64(*epoch),
            FromEngine::Output(out) => Body::default().u8(2).rest(out),
            FromEngine::Restored(tokens) => Body::default().u8(3).u32(*tokens),
            FromEngine::Refused(why) => Body::default().u8(4).rest(why.as_bytes()),
            FromEngine::Standby => Body::default().u8(5),
            FromEngine::Swapped(t) => Body::default()
                .u8(6)
                .u64(t.swap_ins)
                .u64(t.bytes_in)
                .u64(t.swap_outs)
                .u64(t.bytes_out)
                .u64(t.host_bytes),
            FromEngine::Kv(kv) => Body::default().u8(7).rest(kv),
        }
        .0
    }

    /// The message in `body`.
    pub fn decode(body: &[u8]) -> Result<Self, ExternalError> {
        let mut f = Fields(body);
        let message = match f.u8()? {
            1 => FromEngine::Ready(f.u64()?),
            2 => FromEngine::Output(f.rest().to_vec()),
            3 => FromEngine::Restored(f.u32()?),
            4 => FromEngine::Refused(String::from_utf8_lossy(f.rest()).into_owned()),
            5 => FromEngine::Standby,
            6 => FromEngine::Swapped(SwapTotals {
                swap_ins: f.u64()?,
                bytes_in: f.u64()?,
                swap_outs: f.u64()?,
                bytes_out: f.u64()?,
                host_bytes: f.u64()?,
            }),
            7 => FromEngine::Kv(f.rest().to_vec()),
            kind => return Err(ExternalError::Malformed(format!("message kind {kind} from an engine"))),
        };
        f.end()?;
        Ok(message)
    }
}

/// Writes one message: its length, then `body`.
pub fn write_message(w: &mut impl Write, body: &[u8]) -> std::io::Result<()> {
    w.write_all(&(body.len() as u32).to_le_bytes())?;
    w.write_all(body)?;
    w.flush()
}

/// Reads one message's body; `None` at the end of the stream before a message began.
pub fn read_message(r: &mut impl Read) -> Result<Option<Vec<u8>>, ExternalError> {
    let mut length = [0u8; 4];
    match r.read_exact(&mut length) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(ExternalError::Gone(e.to_string())),
    }
    let length = u32::from_le_bytes(length);
    if length == 0 || length > MAX_MESSAGE {
        return Err(ExternalError::Malformed(format!("a message of {length} bytes")));
    }
    let mut body = vec![0u8; length as usize];
    r.read_exact(&mut body).map_err(|e| ExternalError::Gone(format!("in the middle of a message: {e}")))?;
    Ok(Some(body))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn start() -> Start {
        Start {
            index: 2,
            epoch: 7,
            layers: 4..6,
            slots: 4,
            microbatches: 2,
            resident: 1,
            max_tokens: 288,
            sidecar: "/run/dejavu/s2.sock".into(),
            successor: "10.0.0.3:7100".into(),
            copy_cpus: "1".into(),
            secret: b"not a real secret".to_vec(),
        }
    }

    #[test]
    fn every_message_decodes_to_what_was_encoded() {
        let seat = Seat { microbatch: 1, slot: 3 };
        let to = [
            ToEngine::Start(start()),
            ToEngine::Step { seat, position: 40, count: 1, replicate: true, input: vec![1, 2, 3, 4] },
            ToEngine::Step { seat, position: 0, count: 32, replicate: false, input: Vec::new() },
            ToEngine::Restore { seat, prompt_len: 32, kv_tokens: 40, from: None },
            ToEngine::Restore {
                seat,
                prompt_len: 32,
                kv_tokens: 40,
                from: Some("127.0.0.1:9".parse().unwrap()),
            },
            ToEngine::Read { seat, tokens: 0..32 },
            ToEngine::Write { seat, tokens: 0..32, replicate: true, kv: vec![5; 640] },
            ToEngine::Write { seat, tokens: 8..9, replicate: false, kv: Vec::new() },
        ];
        for message in to {
            assert_eq!(ToEngine::decode(&message.encode()).unwrap(), message);
        }
        let from = [
            FromEngine::Ready(7),
            FromEngine::Output(vec![9; 1024]),
            FromEngine::Swapped(SwapTotals {
                swap_ins: 1,
                bytes_in: 2,
                swap_outs: 3,
                bytes_out: 4,
                host_bytes: 5,
            }),
            FromEngine::Restored(40),
            FromEngine::Refused("slot 9 of 4".into()),
            FromEngine::Standby,
            FromEngine::Kv(vec![6; 640]),
        ];
        for message in from {
            assert_eq!(FromEngine::decode(&message.encode()).unwrap(), message);
        }
    }

    #[test]
    fn short_long_and_unknown_messages_are_typed_errors() {
        let body = ToEngine::Start(start()).encode();
        for cut in 0..body.len() {
            assert!(
                matches!(ToEngine::decode(&body[..cut]), Err(ExternalError::Malformed(_))),
                "cut at {cut}"
            );
        }
        let mut long = body.clone();
        long.push(0);
        assert!(matches!(ToEngine::decode(&long), Err(ExternalError::Malformed(_))));
        assert!(matches!(ToEngine::decode(&[9]), Err(ExternalError::Malformed(_))));
        assert!(matches!(FromEngine::decode(&[0]), Err(ExternalError::Malformed(_))));
        let bad_flag = [2, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 2];
        assert!(matches!(ToEngine::decode(&bad_flag), Err(ExternalError::Malformed(_))));
    }

    #[test]
    fn messages_are_framed_by_their_length() {
        let mut stream = Vec::new();
        write_message(&mut stream, &FromEngine::Restored(5).encode()).unwrap();
        write_message(&mut stream, &FromEngine::Ready(1).encode()).unwrap();
        let mut r = &stream[..];
        assert_eq!(
            FromEngine::decode(&read_message(&mut r).unwrap().unwrap()).unwrap(),
            FromEngine::Restored(5)
        );
        assert_eq!(
            FromEngine::decode(&read_message(&mut r).unwrap().unwrap()).unwrap(),
            FromEngine::Ready(1)
        );
        assert!(read_message(&mut r).unwrap().is_none());
        // A length beyond the bound, and a message cut short, are errors, not allocations or hangs.
        let mut huge = &(MAX_MESSAGE + 1).to_le_bytes()[..];
        assert!(matches!(read_message(&mut huge), Err(ExternalError::Malformed(_))));
        let cut = [8u8, 0, 0, 0, 1, 2];
        assert!(matches!(read_message(&mut &cut[..]), Err(ExternalError::Gone(_))));
    }
}
