//! A journal of a [`Liveness`] machine's life: how it started, then every call that can change it
//! and what it answered, one line each, so that a run of the real controller can be replayed
//! through a fresh machine and give the same answers (`dejavu-sim`'s `liveness::replay`).
//!
//! Lines (members as `engine:3` or `sidecar:3`, lists comma-separated, `-` for none):
//!
//! ```text
//! start <timeout_ms> <grace_ms> <now> <epoch> <incarnation> <member>=<fenced_in>/<live|awaiting> ...
//! beat <member> <epoch> <sequence> <now> -> taken <first:0|1> <fenced_for_ms|-> <gap_ms|-> | stale | replay
//! open <member> <epoch> -> <number> | stale <fenced_in>
//! close <member> <number> <now> -> <0|1>
//! fence <members> <reuse|-> <now> <written:0|1> -> <epoch|->
//! tick <now> -> <members>
//! written
//! ```

use super::{Beat, Heard, LifelineRefused, Liveness, LivenessConfig, Member, Membership, Record, Role};

/// How a journaled machine started.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Start {
    /// Its settings.
    pub config: LivenessConfig,
    /// The record it started from (before it counted its own incarnation).
    pub record: Record,
    /// The time it started at.
    pub now: u64,
}

/// One call into a machine and its answer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Entry {
    /// [`Liveness::heartbeat`].
    Heartbeat {
        /// The beat.
        beat: Beat,
        /// When.
        now: u64,
        /// What became of it.
        heard: Heard,
    },
    /// [`Liveness::lifeline_opened`].
    LifelineOpened {
        /// Whose.
        member: Member,
        /// The epoch its process was started in.
        epoch: u64,
        /// Its process.
        process: u32,
        /// Its number, or why it was refused.
        result: Result<u64, LifelineRefused>,
    },
    /// [`Liveness::lifeline_closed`].
    LifelineClosed {
        /// Whose.
        member: Member,
        /// Which.
        number: u64,
        /// When.
        now: u64,
        /// Whether it was the member's current one.
        current: bool,
    },
    /// [`Liveness::fence`].
    Fence {
        /// The members.
        members: Vec<Member>,
        /// The lowest epoch to reuse, if any.
        reuse: Option<u64>,
        /// When.
        now: u64,
        /// Whether the shell could write the record (if it was asked to).
        written: bool,
        /// The epoch, if the fence took effect.
        epoch: Option<u64>,
    },
    /// [`Liveness::tick`].
    Tick {
        /// When.
        now: u64,
        /// The members to fence.
        dead: Vec<Member>,
    },
    /// [`Liveness::record_written`].
    RecordWritten,
}

impl Start {
    /// Its line.
    pub fn encode(&self) -> String {
        let mut line = format!(
            "start {} {} {} {} {}",
            self.config.timeout_ms,
            self.config.grace_ms,
            self.now,
            self.record.epoch,
            self.record.incarnation
        );
        for (&member, m) in &self.record.members {
            let status = if m.awaiting { "awaiting" } else { "live" };
            line.push_str(&format!(" {}={}/{status}", member_text(member), m.fenced_in));
        }
        line
    }

    /// The start a line encodes.
    pub fn parse(line: &str) -> Result<Self, String> {
        let bad = || format!("not a journal start: {line:?}");
        let words: Vec<&str> = line.split_whitespace().collect();
        let ["start", timeout, grace, now, epoch, incarnation, members @ ..] = words.as_slice() else {
            return Err(bad());
        };
        let number = |w: &str| w.parse::<u64>().map_err(|_| bad());
        let mut record =
            Record { epoch: number(epoch)?, incarnation: number(incarnation)?, ..Record::default() };
        for word in members {
            let (member, rest) = word.split_once('=').ok_or_else(bad)?;
            let (fenced_in, status) = rest.split_once('/').ok_or_else(bad)?;
            let awaiting = match status {
                "awaiting" => true,
                "live" => false,
                _ => return Err(bad()),
            };
            record
                .members
                .insert(parse_member(member)?, Membership { fenced_in: number(fenced_in)?, awaiting });
        }
        let config = LivenessConfig { timeout_ms: number(timeout)?, grace_ms: number(grace)? };
        Ok(Self { config, record, now: number(now)? })
    }
}

impl Entry {
    /// Its line.
    pub fn encode(&self) -> String {
        match self {
            Self::Heartbeat { beat, now, heard } => {
                let heard = match heard {
                    Heard::Taken { first_of_process, fenced_for_ms, gap_ms } => {
                        format!(
                            "taken {} {} {}",
                            u8::from(*first_of_process),
                            option(*fenced_for_ms),
                            option(*gap_ms)
                        )
                    }
                    Heard::Stale => "stale".into(),
                    Heard::Replay => "replay".into(),
                };
                format!("beat {} {} {} {now} -> {heard}", member_text(beat.member), beat.epoch, beat.sequence)
            }
            Self::LifelineOpened { member, epoch, process, result } => {
                let result = match result {
                    Ok(number) => number.to_string(),
                    Err(LifelineRefused::Stale { fenced_in, .. }) => format!("stale {fenced_in}"),
                    Err(LifelineRefused::Claimed { by, .. }) => format!("claimed {by}"),
                };
                format!("open {} {epoch} {process} -> {result}", member_text(*member))
            }
            Self::LifelineClosed { member, number, now, current } => {
                format!("close {} {number} {now} -> {}", member_text(*member), u8::from(*current))
            }
            Self::Fence { members, reuse, now, written, epoch } => {
                let written = u8::from(*written);
                format!(
                    "fence {} {} {now} {written} -> {}",
                    members_text(members),
                    option(*reuse),
                    option(*epoch)
                )
            }
            Self::Tick { now, dead } => format!("tick {now} -> {}", members_text(dead)),
            Self::RecordWritten => "written".into(),
        }
    }

    /// The entry a line encodes.
    pub fn parse(line: &str) -> Result<Self, String> {
        let bad = || format!("not a journal entry: {line:?}");
        let words: Vec<&str> = line.split_whitespace().collect();
        let number = |w: &str| w.parse::<u64>().map_err(|_| bad());
        let flag = |w: &str| match w {
            "0" => Ok(false),
            "1" => Ok(true),
            _ => Err(bad()),
        };
        let optional = |w: &str| if w == "-" { Ok(None) } else { number(w).map(Some) };
        Ok(match words.as_slice() {
            ["beat", member, epoch, sequence, now, "->", heard @ ..] => {
                let beat = Beat {
                    member: parse_member(member)?,
                    epoch: number(epoch)?,
                    sequence: number(sequence)?,
                };
                let heard = match heard {
                    ["taken", first, fenced, gap] => Heard::Taken {
                        first_of_process: flag(first)?,
                        fenced_for_ms: optional(fenced)?,
                        gap_ms: optional(gap)?,
                    },
                    ["stale"] => Heard::Stale,
                    ["replay"] => Heard::Replay,
                    _ => return Err(bad()),
                };
                Self::Heartbeat { beat, now: number(now)?, heard }
            }
            ["open", member, epoch, process, "->", result @ ..] => {
                let epoch = number(epoch)?;
                let process = u32::try_from(number(process)?).map_err(|_| bad())?;
                let result = match result {
                    [n] => Ok(number(n)?),
                    ["stale", fenced_in] => {
                        Err(LifelineRefused::Stale { epoch, fenced_in: number(fenced_in)? })
                    }
                    ["claimed", by] => Err(LifelineRefused::Claimed {
                        epoch,
                        by: u32::try_from(number(by)?).map_err(|_| bad())?,
                    }),
                    _ => return Err(bad()),
                };
                Self::LifelineOpened { member: parse_member(member)?, epoch, process, result }
            }
            ["close", member, n, now, "->", current] => Self::LifelineClosed {
                member: parse_member(member)?,
                number: number(n)?,
                now: number(now)?,
                current: flag(current)?,
            },
            ["fence", members, reuse, now, written, "->", epoch] => Self::Fence {
                members: parse_members(members)?,
                reuse: optional(reuse)?,
                now: number(now)?,
                written: flag(written)?,
                epoch: optional(epoch)?,
            },
            ["tick", now, "->", dead] => Self::Tick { now: number(now)?, dead: parse_members(dead)? },
            ["written"] => Self::RecordWritten,
            _ => return Err(bad()),
        })
    }
}

/// Where a replay's answer differs from the journal's.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Divergence {
    /// The entry's place in its run (0: the first after the start).
    pub index: usize,
    /// What the journal says.
    pub recorded: Entry,
    /// What the machine answered.
    pub replayed: Entry,
}

impl Liveness {
    /// Calls the machine as `entry` says, and returns the entry its answer makes: equal to
    /// `entry` when the machine answers as it did when the journal was written.
    pub fn replay(&mut self, entry: &Entry) -> Entry {
        match entry.clone() {
            Entry::Heartbeat { beat, now, .. } => {
                Entry::Heartbeat { beat, now, heard: self.heartbeat(beat, now) }
            }
            Entry::LifelineOpened { member, epoch, process, .. } => Entry::LifelineOpened {
                member,
                epoch,
                process,
                result: self.lifeline_opened(member, epoch, process),
            },
            Entry::LifelineClosed { member, number, now, .. } => Entry::LifelineClosed {
                member,
                number,
                now,
                current: self.lifeline_closed(member, number, now),
            },
            Entry::Fence { members, reuse, now, written, .. } => {
                let epoch = self.fence(&members, reuse, now, |_| if written { Ok(()) } else { Err(()) }).ok();
                Entry::Fence { members, reuse, now, written, epoch }
            }
            Entry::Tick { now, .. } => Entry::Tick { now, dead: self.tick(now) },
            Entry::RecordWritten => {
                self.record_written();
                Entry::RecordWritten
            }
        }
    }
}

fn option(value: Option<u64>) -> String {
    value.map_or_else(|| "-".into(), |v| v.to_string())
}

fn member_text((role, index): Member) -> String {
    let role = match role {
        Role::Engine => "engine",
        Role::Sidecar => "sidecar",
    };
    format!("{role}:{index}")
}

fn members_text(members: &[Member]) -> String {
    if members.is_empty() {
        return "-".into();
    }
    members.iter().map(|&m| member_text(m)).collect::<Vec<_>>().join(",")
}

fn parse_member(text: &str) -> Result<Member, String> {
    let bad = || format!("not a member: {text:?}");
    let (role, index) = text.split_once(':').ok_or_else(bad)?;
    let role = match role {
        "engine" => Role::Engine,
        "sidecar" => Role::Sidecar,
        _ => return Err(bad()),
    };
    Ok((role, index.parse().map_err(|_| bad())?))
}

fn parse_members(text: &str) -> Result<Vec<Member>, String> {
    if text == "-" {
        return Ok(Vec::new());
    }
    text.split(',').map(parse_member).collect()
}
