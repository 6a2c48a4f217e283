//! Every control message of the runtime, typed, with one encoding and one version.
//!
//! A control message travels as the payload of a [`Kind::Control`] frame ([`crate::wire`]): the
//! frame says who sent it, in which epoch, and which request a reply answers; the payload is
//! [`MESSAGE_VERSION`] and the message's code (two little-endian `u16`s), then its fields
//! (little-endian integers; an address as its family, 4 or 6, then its bytes, port, and for IPv6
//! flow and scope; texts and lists as a `u32` length, then their items). Every message has one
//! encoding only. A
//! refusal is an [`Kind::Error`] frame, not a message. The codes form one namespace, whatever
//! the connection:
//!
//! | codes | connection | requests (→ reply) |
//! |---|---|---|
//! | 1–9 | an engine to its sidecar, on its local socket | [`Message::Mapped`], [`Message::Successor`], [`Message::Keep`] (→ [`Message::Done`]); [`Message::Held`] (→ [`Message::HeldPage`]); [`Message::Release`] (→ [`Message::Released`]), also from a sidecar to its successor's over the transport; from the cluster to a spare sidecar, [`Message::Assign`] (→ `Done`) |
//! | 20–29 | the controller to a sidecar's control port | [`Message::HeldOf`] (→ [`Message::HeldOfPage`]); [`Message::Reseed`] (→ [`Message::Reseeded`]) |
//! | 30–49 | anyone to the controller's query port | [`Message::Census`] (→ [`Message::CensusReply`]); [`Message::Fence`], [`Message::FencedIn`], [`Message::AwaitFence`], [`Message::Lifeline`] (→ [`Message::Epoch`], then [`Message::Fenced`] if it is fenced); [`Message::Recover`] (→ [`Message::Orders`]); [`Message::ReseedRestored`] (→ [`Message::Reseeded`]); from whoever feeds a pipeline, [`Message::WatchRecovery`] (→ [`Message::Orders`], or [`Message::Epoch`] if none is ready in time) and [`Message::AcknowledgeRecovery`] (→ `Epoch`) |
//! | 50–69 | whoever feeds a pipeline to its stages, round the chain | [`Message::Probe`], [`Message::Rewire`], [`Message::HandoffTo`], [`Message::Replication`] (passed on as they are); [`Message::Restore`] (→ [`Message::Restored`]); [`Message::Load`] (→ [`Message::Loaded`]) |
//! | 70–79 | the cluster to a spare stage | [`Message::AssignStage`] (→ [`Message::StageServing`]) |
//!
//! Decoding never panics and never trusts a length: [`Message::decode`] of `n` bytes allocates
//! at most [`decode_allocation_bound`]`(n)` bytes (a proptest counts them), and refuses trailing
//! bytes, unknown codes and other versions with a [`MessageError`].
//!
//! [`Kind::Control`]: crate::wire::Kind::Control
//! [`Kind::Error`]: crate::wire::Kind::Error

use std::net::SocketAddr;

use thiserror::Error;

use crate::chunk::{ChunkKey, SequencePlace};
use crate::placement::WorkerId;
use crate::resume::HeldChunk;
use crate::wire::{Frame, FrameHeader, Kind};

mod codec;
mod recovery;

use codec::{Reader, Writer};
pub use recovery::{Mark, RecoveryOrders, StageOrders};

/// The version of the message set, first in every message: a peer of another version is refused
/// with [`MessageError::Version`] rather than misread.
pub const MESSAGE_VERSION: u16 = 1;

/// Bytes [`Message::decode`] allocates at most for an input of `len` bytes.
pub const fn decode_allocation_bound(len: usize) -> usize {
    8 * len + 1024
}

/// A stage to which a message is addressed that concerns no stage in particular.
pub const NO_STAGE: u32 = u32::MAX;

pub use dejavu_proto::liveness::{Health, Member, Role};

/// A sequence's place in a stage's caches.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SeatIds {
    /// Its microbatch.
    pub microbatch: u32,
    /// Its slot.
    pub slot: u32,
}

/// Every control message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Message {
    /// Any reply that says only that the request was carried out.
    Done,

    /// The engine has mapped the shared region (the sidecar removes its file).
    Mapped,
    /// Forward to this successor sidecar from now on. Also the first and only request of a
    /// connection of its own, whose frame carries the engine's epoch.
    Successor(SocketAddr),
    /// Keep `chunks` chunks, `bytes` in all, written one after another into the shared region,
    /// without forwarding them (they came from a copy that exists).
    Keep {
        /// How many.
        chunks: u32,
        /// Their length in the region.
        bytes: u64,
    },
    /// Which of the stage's own chunks the sidecar keeps: at most `want` keys (0: none, only what
    /// it serves as), after `after` (`None`: from the first), in the order of their encoding.
    Held {
        /// Keys wanted at most.
        want: u32,
        /// The last key of the page before.
        after: Option<ChunkKey>,
    },
    /// The reply to [`Message::Held`]: `count` keys written into the region as
    /// [`HeldChunk::encode`]s, `left` after them.
    HeldPage {
        /// The stage it serves.
        stage: u32,
        /// The newest epoch it knows (its engine's, or its assignment's).
        epoch: u64,
        /// The successor sidecar it forwards to, if any.
        successor: Option<SocketAddr>,
        /// Keys in the region.
        count: u32,
        /// Keys after them.
        left: u32,
    },
    /// A spare sidecar becomes stage `stage`'s, as of the recovery of `epoch` (the first and only
    /// request of a connection of the cluster's).
    Assign {
        /// The stage.
        stage: u32,
        /// The recovery's epoch.
        epoch: u64,
    },

    /// The sequence at this place is finished: drop every chunk of it (an engine to its sidecar,
    /// and a sidecar to its successor's over the transport, to drop the replica).
    Release(SequencePlace),
    /// The reply to [`Message::Release`]: chunks the receiver dropped.
    Released {
        /// How many.
        chunks: u64,
    },

    /// The chunks a sidecar keeps for `stage` (its own stage's, or its predecessor's replica): at
    /// most `want`, after `after`.
    HeldOf {
        /// The stage.
        stage: u32,
        /// Entries wanted at most.
        want: u32,
        /// The last key of the page before (`None`: from the first).
        after: Option<ChunkKey>,
    },
    /// The reply to [`Message::HeldOf`].
    HeldOfPage {
        /// The chunks, in the order of their keys.
        chunks: Vec<HeldChunk>,
        /// How many come after them.
        left: u32,
    },
    /// Forward to the sidecar at `to` from now on, and first send it every chunk of its own stage.
    Reseed {
        /// The new successor's sidecar.
        to: SocketAddr,
    },
    /// The reply to [`Message::Reseed`], [`Message::ReseedRestored`] and [`Message::HandBack`]:
    /// chunks sent.
    Reseeded {
        /// How many.
        chunks: u64,
    },
    /// Send every chunk of `stage` held here (the replica of the predecessor's KV) to the sidecar
    /// at `to`, which replaced that stage's sidecar: they become its local copy.
    HandBack {
        /// The replaced sidecar's stage.
        stage: u32,
        /// The replacement's KV transport.
        to: SocketAddr,
    },

    /// Who is alive, suspect, dead or fenced.
    Census,
    /// The reply to [`Message::Census`].
    CensusReply {
        /// The controller's epoch.
        epoch: u64,
        /// Every member it knows, and its health.
        members: Vec<(Member, Health)>,
    },
    /// Fence `members` in a new epoch (or, with `reuse`, in that epoch if it is the newest and
    /// fenced them already: a retried request).
    Fence {
        /// The members.
        members: Vec<Member>,
        /// An epoch to reuse.
        reuse: Option<u64>,
    },
    /// The epoch a fenced member was fenced in, which its replacement starts in.
    FencedIn(Member),
    /// Answer once an epoch after `after` is opened, or once `wait_ms` has passed.
    AwaitFence {
        /// The epoch known.
        after: u64,
        /// The longest wait, in milliseconds.
        wait_ms: u32,
    },
    /// Hold this connection open as `member`'s lifeline, for its process `process` started in
    /// `epoch`.
    Lifeline {
        /// The member.
        member: Member,
        /// The epoch its process was started in.
        epoch: u64,
        /// Its process (the operating system's id): a second process claiming the member in the
        /// same epoch is refused.
        process: u32,
    },
    /// The reply to the fence and lifeline requests: an epoch.
    Epoch(u64),
    /// Sent by the controller on a member's lifeline when it fences the member: the process was
    /// declared dead in this epoch, and its replacement takes its place.
    Fenced(u64),
    /// From whoever feeds a pipeline: answer with the recovery of the first epoch after `after`
    /// in which a stage was fenced ([`Message::Orders`]: each stage's loss and where each of its
    /// sequences resumes), once every stage it fenced has its replacement in place; or with the
    /// current [`Message::Epoch`] once `wait_ms` has passed without one.
    WatchRecovery {
        /// The last recovery's epoch the feeder knows (0: none).
        after: u64,
        /// The longest wait, in milliseconds.
        wait_ms: u32,
    },
    /// From whoever feeds a pipeline: every sequence of the recovery of this epoch was fed again
    /// from its mark.
    AcknowledgeRecovery(u64),
    /// Carry out the recovery of `epoch` for a ring whose stage `k` reaches its successor's
    /// sidecar at `book[k]`.
    Recover {
        /// The recovery's epoch.
        epoch: u64,
        /// The ring's address book.
        book: Vec<SocketAddr>,
    },
    /// The reply to [`Message::Recover`].
    Orders(RecoveryOrders),
    /// Re-seed the replaced sidecars whose predecessors were replaced too, once those restored.
    ReseedRestored {
        /// The recovery's epoch.
        epoch: u64,
        /// The ring's address book.
        book: Vec<SocketAddr>,
    },

    /// Goes round the chain untouched: proves it is whole.
    Probe,
    /// The stages named send their output to these addresses from now on. One message carries
    /// every rewire of a repair: each stage applies its own as the message passes it, so the
    /// message crosses each repaired link after its repair.
    Rewire(Vec<(u32, SocketAddr)>),
    /// Stage `stage` restores a sequence's KV (prompt of `prompt_len` tokens, up to `kv_tokens`)
    /// from the sidecar at `from` (`None`: its own).
    Restore {
        /// The stage.
        stage: u32,
        /// The sequence.
        seat: SeatIds,
        /// Its prompt's length.
        prompt_len: u32,
        /// Tokens of KV wanted.
        kv_tokens: u32,
        /// The sidecar to restore from.
        from: Option<SocketAddr>,
    },
    /// The reply to [`Message::Restore`]: tokens restored.
    Restored {
        /// The stage.
        stage: u32,
        /// How many.
        tokens: u32,
    },
    /// Stage `stage` loads a sequence's prompt KV (`prompt_len` tokens) handed over by a prompt
    /// pipeline.
    Load {
        /// The stage.
        stage: u32,
        /// The sequence.
        seat: SeatIds,
        /// Its prompt's length.
        prompt_len: u32,
    },
    /// The reply to [`Message::Load`]: tokens loaded.
    Loaded {
        /// The stage.
        stage: u32,
        /// How many.
        tokens: u32,
    },
    /// Prompt stage `stage` hands token stage `token_stage`'s prompts to the sidecar at `to`.
    HandoffTo {
        /// The prompt stage.
        stage: u32,
        /// The token stage.
        token_stage: u32,
        /// Its sidecar.
        to: SocketAddr,
    },
    /// Stage `stage` replicates the steps it computes (`on`) or not.
    Replication {
        /// The stage.
        stage: u32,
        /// Whether it replicates.
        on: bool,
    },

    /// A spare stage serves as the stage these flags describe (as `dejavud stage` takes them,
    /// without the subcommand and the secret).
    AssignStage {
        /// The flags, one per item.
        flags: Vec<String>,
    },
    /// The reply to [`Message::AssignStage`]: the spare serves, with metrics there if any.
    StageServing {
        /// Its metrics address.
        metrics: Option<SocketAddr>,
    },
}

/// Why bytes are not a message.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum MessageError {
    /// A message of another version of the message set.
    #[error("a message of version {0}, not {MESSAGE_VERSION}")]
    Version(u16),
    /// A code no message has.
    #[error("an unknown message code {0}")]
    UnknownCode(u16),
    /// The bytes end inside a field, or a length claims more than is left.
    #[error("a message cut short in {0}")]
    Truncated(&'static str),
    /// A field holds what it cannot (a flag other than 0 or 1, an address that does not parse).
    #[error("a malformed {0}")]
    Malformed(&'static str),
    /// Bytes after the last field.
    #[error("{0} bytes after a message's last field")]
    Trailing(usize),
    /// A frame of another kind where a control message was expected.
    #[error("a {0:?} frame, not a control message")]
    NotControl(Kind),
}

impl Message {
    /// Its code.
    pub fn code(&self) -> u16 {
        match self {
            Self::Done => 0,
            Self::Mapped => 1,
            Self::Successor(_) => 2,
            Self::Keep { .. } => 3,
            Self::Held { .. } => 4,
            Self::HeldPage { .. } => 5,
            Self::Assign { .. } => 6,
            Self::Release(_) => 7,
            Self::Released { .. } => 8,
            Self::HeldOf { .. } => 20,
            Self::HeldOfPage { .. } => 21,
            Self::Reseed { .. } => 22,
            Self::Reseeded { .. } => 23,
            Self::HandBack { .. } => 24,
            Self::Census => 30,
            Self::CensusReply { .. } => 31,
            Self::Fence { .. } => 32,
            Self::FencedIn(_) => 33,
            Self::AwaitFence { .. } => 34,
            Self::Lifeline { .. } => 35,
            Self::Epoch(_) => 36,
            Self::Recover { .. } => 37,
            Self::Orders(_) => 38,
            Self::ReseedRestored { .. } => 39,
            Self::Fenced(_) => 40,
            Self::WatchRecovery { .. } => 41,
            Self::AcknowledgeRecovery(_) => 42,
            Self::Probe => 50,
            Self::Rewire(_) => 51,
            Self::Restore { .. } => 52,
            Self::Restored { .. } => 53,
            Self::Load { .. } => 54,
            Self::Loaded { .. } => 55,
            Self::HandoffTo { .. } => 56,
            Self::Replication { .. } => 57,
            Self::AssignStage { .. } => 70,
            Self::StageServing { .. } => 71,
        }
    }

    /// The stage a message that goes round a pipeline's chain is for ([`NO_STAGE`] for those
    /// every stage reads, and for every other message).
    pub fn stage(&self) -> u32 {
        match self {
            Self::Restore { stage, .. }
            | Self::Load { stage, .. }
            | Self::HandoffTo { stage, .. }
            | Self::Replication { stage, .. } => *stage,
            _ => NO_STAGE,
        }
    }

    /// The message's bytes: version, code, fields.
    pub fn encode(&self) -> Vec<u8> {
        let mut w = Writer::default();
        w.u16(MESSAGE_VERSION);
        w.u16(self.code());
        match self {
            Self::Done | Self::Mapped | Self::Census | Self::Probe => {}
            Self::Successor(addr) | Self::Reseed { to: addr } => w.addr(*addr),
            Self::HandBack { stage, to } => {
                w.u32(*stage);
                w.addr(*to);
            }
            Self::Keep { chunks, bytes } => {
                w.u32(*chunks);
                w.u64(*bytes);
            }
            Self::Held { want, after } => {
                w.u32(*want);
                key(&mut w, after.as_ref());
            }
            Self::HeldPage { stage, epoch, successor, count, left } => {
                w.u32(*stage);
                w.u64(*epoch);
                w.option_addr(*successor);
                w.u32(*count);
                w.u32(*left);
            }
            Self::Assign { stage, epoch } => {
                w.u32(*stage);
                w.u64(*epoch);
            }
            Self::HeldOf { stage, want, after } => {
                w.u32(*stage);
                w.u32(*want);
                key(&mut w, after.as_ref());
            }
            Self::HeldOfPage { chunks, left } => {
                w.len(chunks.len());
                chunks.iter().for_each(|c| w.0.extend_from_slice(&c.encode()));
                w.u32(*left);
            }
            Self::Reseeded { chunks } | Self::Released { chunks } => w.u64(*chunks),
            Self::Release(place) => {
                w.u32(place.destination.stage);
                w.u32(place.destination.rank);
                w.u32(place.microbatch);
                w.u32(place.slots.start);
                w.u32(place.slots.end);
            }
            Self::CensusReply { epoch, members } => {
                w.u64(*epoch);
                w.len(members.len());
                for &(m, health) in members {
                    member(&mut w, m);
                    w.u8(health as u8);
                }
            }
            Self::Fence { members, reuse } => {
                w.len(members.len());
                members.iter().for_each(|&m| member(&mut w, m));
                match reuse {
                    None => w.u8(0),
                    Some(epoch) => {
                        w.u8(1);
                        w.u64(*epoch);
                    }
                }
            }
            Self::FencedIn(m) => member(&mut w, *m),
            Self::AwaitFence { after, wait_ms } | Self::WatchRecovery { after, wait_ms } => {
                w.u64(*after);
                w.u32(*wait_ms);
            }
            Self::Lifeline { member: m, epoch, process } => {
                member(&mut w, *m);
                w.u64(*epoch);
                w.u32(*process);
            }
            Self::Epoch(epoch) | Self::Fenced(epoch) | Self::AcknowledgeRecovery(epoch) => w.u64(*epoch),
            Self::Recover { epoch, book } | Self::ReseedRestored { epoch, book } => {
                w.u64(*epoch);
                w.len(book.len());
                book.iter().for_each(|&a| w.addr(a));
            }
            Self::Orders(orders) => orders.encode(&mut w),
            Self::Rewire(rewires) => {
                w.len(rewires.len());
                for &(stage, addr) in rewires {
                    w.u32(stage);
                    w.addr(addr);
                }
            }
            Self::Restore { stage, seat, prompt_len, kv_tokens, from } => {
                w.u32(*stage);
                w.u32(seat.microbatch);
                w.u32(seat.slot);
                w.u32(*prompt_len);
                w.u32(*kv_tokens);
                w.option_addr(*from);
            }
            Self::Restored { stage, tokens } | Self::Loaded { stage, tokens } => {
                w.u32(*stage);
                w.u32(*tokens);
            }
            Self::Load { stage, seat, prompt_len } => {
                w.u32(*stage);
                w.u32(seat.microbatch);
                w.u32(seat.slot);
                w.u32(*prompt_len);
            }
            Self::HandoffTo { stage, token_stage, to } => {
                w.u32(*stage);
                w.u32(*token_stage);
                w.addr(*to);
            }
            Self::Replication { stage, on } => {
                w.u32(*stage);
                w.u8(u8::from(*on));
            }
            Self::AssignStage { flags } => {
                w.len(flags.len());
                flags.iter().for_each(|f| w.text(f));
            }
            Self::StageServing { metrics } => w.option_addr(*metrics),
        }
        w.0
    }

    /// The message `bytes` encode ([`Message::encode`]).
    pub fn decode(bytes: &[u8]) -> Result<Self, MessageError> {
        let mut r = Reader(bytes);
        let version = r.u16("the version")?;
        if version != MESSAGE_VERSION {
            return Err(MessageError::Version(version));
        }
        let code = r.u16("the code")?;
        let message = match code {
            0 => Self::Done,
            1 => Self::Mapped,
            2 => Self::Successor(r.addr("a successor")?),
            3 => Self::Keep { chunks: r.u32("a keep")?, bytes: r.u64("a keep")? },
            4 => Self::Held { want: r.u32("a held request")?, after: read_key(&mut r)? },
            5 => Self::HeldPage {
                stage: r.u32("a held page")?,
                epoch: r.u64("a held page")?,
                successor: r.option_addr("a held page's successor")?,
                count: r.u32("a held page")?,
                left: r.u32("a held page")?,
            },
            6 => Self::Assign { stage: r.u32("an assignment")?, epoch: r.u64("an assignment")? },
            7 => Self::Release(SequencePlace {
                destination: WorkerId { stage: r.u32("a release")?, rank: r.u32("a release")? },
                microbatch: r.u32("a release")?,
                slots: r.u32("a release")?..r.u32("a release")?,
            }),
            8 => Self::Released { chunks: r.u64("a release's reply")? },
            20 => Self::HeldOf {
                stage: r.u32("a listing request")?,
                want: r.u32("a listing request")?,
                after: read_key(&mut r)?,
            },
            21 => Self::HeldOfPage {
                chunks: r.list(HeldChunk::ENCODED_LEN, "a listing", |r| {
                    let (encoded, rest) =
                        r.0.split_at_checked(HeldChunk::ENCODED_LEN)
                            .ok_or(MessageError::Truncated("a listing"))?;
                    r.0 = rest;
                    HeldChunk::decode(encoded).ok_or(MessageError::Malformed("a held chunk"))
                })?,
                left: r.u32("a listing")?,
            },
            22 => Self::Reseed { to: r.addr("a re-seed")? },
            23 => Self::Reseeded { chunks: r.u64("a re-seed's count")? },
            24 => Self::HandBack { stage: r.u32("a hand-back")?, to: r.addr("a hand-back")? },
            30 => Self::Census,
            31 => Self::CensusReply {
                epoch: r.u64("a census")?,
                members: r.list(MEMBER_LEN + 1, "a census", |r| {
                    let m = read_member(r)?;
                    let health =
                        Health::from_code(r.u8("a health")?).ok_or(MessageError::Malformed("a health"))?;
                    Ok((m, health))
                })?,
            },
            32 => Self::Fence {
                members: r.list(MEMBER_LEN, "a fence", read_member)?,
                reuse: if r.bool("a fence")? { Some(r.u64("a fence")?) } else { None },
            },
            33 => Self::FencedIn(read_member(&mut r)?),
            34 => Self::AwaitFence { after: r.u64("a fence wait")?, wait_ms: r.u32("a fence wait")? },
            35 => Self::Lifeline {
                member: read_member(&mut r)?,
                epoch: r.u64("a lifeline")?,
                process: r.u32("a lifeline")?,
            },
            36 => Self::Epoch(r.u64("an epoch")?),
            37 | 39 => {
                let epoch = r.u64("a recovery")?;
                let book = r.list(ADDR_MIN_LEN, "an address book", |r| r.addr("an address book"))?;
                if code == 37 {
                    Self::Recover { epoch, book }
                } else {
                    Self::ReseedRestored { epoch, book }
                }
            }
            38 => Self::Orders(RecoveryOrders::decode(&mut r)?),
            40 => Self::Fenced(r.u64("a fence")?),
            41 => {
                Self::WatchRecovery { after: r.u64("a recovery watch")?, wait_ms: r.u32("a recovery watch")? }
            }
            42 => Self::AcknowledgeRecovery(r.u64("a recovery's acknowledgement")?),
            50 => Self::Probe,
            51 => Self::Rewire(
                r.list(4 + ADDR_MIN_LEN, "a rewire", |r| Ok((r.u32("a rewire")?, r.addr("a rewire")?)))?,
            ),
            52 => Self::Restore {
                stage: r.u32("a restore")?,
                seat: SeatIds { microbatch: r.u32("a restore")?, slot: r.u32("a restore")? },
                prompt_len: r.u32("a restore")?,
                kv_tokens: r.u32("a restore")?,
                from: r.option_addr("a restore's source")?,
            },
            53 => Self::Restored { stage: r.u32("a restore's reply")?, tokens: r.u32("a restore's reply")? },
            54 => Self::Load {
                stage: r.u32("a load")?,
                seat: SeatIds { microbatch: r.u32("a load")?, slot: r.u32("a load")? },
                prompt_len: r.u32("a load")?,
            },
            55 => Self::Loaded { stage: r.u32("a load's reply")?, tokens: r.u32("a load's reply")? },
            56 => Self::HandoffTo {
                stage: r.u32("a handoff target")?,
                token_stage: r.u32("a handoff target")?,
                to: r.addr("a handoff target")?,
            },
            57 => Self::Replication {
                stage: r.u32("a replication switch")?,
                on: r.bool("a replication switch")?,
            },
            70 => Self::AssignStage {
                flags: r.list(4, "a stage's flags", |r| Ok(r.text("a stage's flag")?.to_owned()))?,
            },
            71 => Self::StageServing { metrics: r.option_addr("a spare's metrics address")? },
            other => return Err(MessageError::UnknownCode(other)),
        };
        r.finish()?;
        Ok(message)
    }

    /// A control frame carrying the message, from `sender` in `epoch`, as request (or the reply
    /// to request) `request`.
    pub fn frame(&self, sender: u32, epoch: u64, request: u64) -> (FrameHeader, Vec<u8>) {
        (FrameHeader::new(Kind::Control, sender, epoch, request), self.encode())
    }

    /// The message a control frame carries.
    pub fn of_frame(frame: &Frame) -> Result<Self, MessageError> {
        match frame.header.kind {
            Kind::Control => Self::decode(&frame.payload),
            other => Err(MessageError::NotControl(other)),
        }
    }
}

/// Bytes of an encoded member: its role, then its index.
const MEMBER_LEN: usize = 5;

/// Bytes of the shortest encoded address (an IPv4 one: its family, address and port).
const ADDR_MIN_LEN: usize = 1 + 4 + 2;

fn member(w: &mut Writer, (role, index): Member) {
    w.u8(role as u8);
    w.u32(index);
}

fn read_member(r: &mut Reader<'_>) -> Result<Member, MessageError> {
    let role = Role::from_code(r.u8("a member")?).ok_or(MessageError::Malformed("a member's role"))?;
    Ok((role, r.u32("a member")?))
}

fn key(w: &mut Writer, key: Option<&ChunkKey>) {
    match key {
        None => w.u8(0),
        Some(key) => {
            w.u8(1);
            w.0.extend_from_slice(&key.encode());
        }
    }
}

fn read_key(r: &mut Reader<'_>) -> Result<Option<ChunkKey>, MessageError> {
    if !r.bool("a key")? {
        return Ok(None);
    }
    let (encoded, rest) =
        r.0.split_at_checked(ChunkKey::ENCODED_LEN).ok_or(MessageError::Truncated("a key"))?;
    r.0 = rest;
    ChunkKey::decode(encoded).map(Some).ok_or(MessageError::Malformed("a key"))
}
