//! Spare workers: stage and sidecar processes started ahead of any failure, registered with the
//! controller (they heartbeat as spares), and assigned a stage by a recovery instead of starting
//! new processes.
//!
//! A spare stage (`spare` subcommand) listens and waits for one assignment: a connection that
//! proves the cluster secret (the transports' HMAC handshake, the assigner as [`ASSIGNER`]), then
//! [`Message::AssignStage`], the stage's flags exactly as `stage` takes them (the spare's own
//! cluster secret stays the stage's: a `--secret` among them is refused). It answers with
//! [`Message::StageServing`] once it serves as that stage, or an `Error` frame naming what is
//! wrong with the flags, and then waits for another. A spare sidecar (`sidecar --spare N`) is
//! assigned over its local socket ([`Message::Assign`]).

use std::io::{ErrorKind, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::time::Duration;

use clap::{Args, Parser};
use dejavulib::message::Message;
use dejavulib::net::auth::{client_handshake_blocking, server_handshake_blocking};
use dejavulib::wire::{read_frame, write_frame, ErrorCode, FrameHeader, Kind};

use crate::cli::{CliError, MemberArgs, StageArgs};
use crate::heartbeat::{spare_member, Role};
use crate::process::{EngineCommand, EngineProcess};

/// The node id an assigner proves the cluster secret as.
pub const ASSIGNER: u32 = u32::MAX - 1;

/// The node id a spare stage proves the secret as, to its assigner.
const SPARE: u32 = u32::MAX - 2;

/// A spare stage: waits, registered with the controller, until a recovery makes it a stage.
#[derive(Clone, Debug, Args)]
pub struct SpareArgs {
    /// Its number among the spares.
    #[arg(long)]
    pub id: u32,
    /// Where it listens, for its assignment and then as a stage (port 0 picks one).
    #[arg(long, default_value = "127.0.0.1:0")]
    pub listen: SocketAddr,
    /// What it is as a member of the cluster until assigned (its heartbeats, logs).
    #[command(flatten)]
    pub member: MemberArgs,
    /// An engine process to start now, after `--` (as `stage` takes it): it stands by, its
    /// imports done, and becomes the engine of the stage this spare is assigned if the
    /// assignment names the same command (the reference model's stages do not use it).
    #[arg(last = true, value_name = "ENGINE")]
    pub engine: Vec<String>,
}

/// The flags of `stage`, parsed from an assignment.
#[derive(Debug, Parser)]
#[command(name = "stage")]
struct Assigned {
    #[command(flatten)]
    stage: StageArgs,
}

/// Time an assigner has to send its assignment once connected.
const ASSIGNMENT_PATIENCE: Duration = Duration::from_secs(5);

impl SpareArgs {
    /// Waits for an assignment, then serves as the stage it names until killed.
    pub fn run(mut self) -> Result<(), CliError> {
        self.member.secure(&[self.listen])?;
        let heartbeat = self.member.start(Role::Engine, spare_member(self.id))?;
        let at = self.listen;
        let listen = |source| CliError::Listen { what: "for an assignment", at: at.to_string(), source };
        let listener = TcpListener::bind(at).map_err(listen)?;
        let addr = listener.local_addr().map_err(listen)?;
        // Started on this thread, which serves as the stage later: the engine lives as long.
        let standby = (!self.engine.is_empty())
            .then(|| {
                EngineCommand::new(self.engine.clone()).and_then(|command| EngineProcess::spawn(&command))
            })
            .transpose()
            .map_err(|e| CliError::Flags(e.to_string()))?;
        // Ready once its engine is warm: the cluster counts on a spare that says it listens.
        let standby = standby
            .map(|mut engine| engine.standby().map(|()| engine))
            .transpose()
            .map_err(|e| CliError::Flags(format!("its engine process: {e}")))?;
        crate::cli::announce(addr, None);
        for stream in listener.incoming() {
            let Ok(stream) = stream else { continue };
            let stage = match read_assignment(&stream, &self.member.secret, &self.engine) {
                Ok(stage) => stage,
                Err(reason) => {
                    tracing::warn!(%reason, "refused an assignment");
                    let _ = refuse(&stream, &reason.to_string());
                    continue;
                }
            };
            tracing::info!(spare = self.id, stage = ?stage.index.or(stage.replace), "a spare was assigned its stage");
            // From now on it beats as the stage, in the recovery's epoch.
            drop(heartbeat);
            let listener = listener.try_clone().map_err(listen)?;
            let serving = |_, metrics| {
                let (header, payload) = Message::StageServing { metrics }.frame(SPARE, 0, 1);
                let _ = write_frame(&mut &stream, &header, &payload).and_then(|()| (&stream).flush());
            };
            return stage.run_on(listener, serving, standby);
        }
        Err(CliError::SpareStopped)
    }
}

/// Why an assignment failed, at the spare or at its assigner.
#[derive(Debug, thiserror::Error)]
pub enum SpareError {
    /// The other end did not prove the cluster secret, or refused ours.
    #[error("{who}'s handshake: {reason}")]
    Handshake {
        /// The spare, or its assigner.
        who: String,
        /// What failed.
        reason: String,
    },
    /// A socket failed, or the other end went away.
    #[error("{who}: {source}")]
    Io {
        /// The spare, or its assigner.
        who: String,
        /// What failed.
        source: std::io::Error,
    },
    /// A frame that is not what the exchange expects.
    #[error("{who}: {what}")]
    Protocol {
        /// The spare, or its assigner.
        who: String,
        /// What came.
        what: String,
    },
    /// The flags of a stage do not parse, or name a secret.
    #[error("the stage's flags: {0}")]
    Flags(String),
    /// The spare refused its assignment, saying why.
    #[error("the spare refused its assignment: {0}")]
    Refused(String),
}

impl SpareError {
    fn io(who: &str) -> impl Fn(std::io::Error) -> Self + '_ {
        move |source| Self::Io { who: who.to_owned(), source }
    }

    fn frame(who: &str) -> impl Fn(dejavulib::wire::FrameError) -> Self + '_ {
        move |e| Self::Protocol { who: who.to_owned(), what: e.to_string() }
    }
}

/// Reads an assignment off `stream`: the assigner's proof of the cluster secret `secret`, then
/// the stage's flags, whose engine process, if any, must be the spare's own `engine`: an
/// assignment names no command of its own to run.
fn read_assignment(stream: &TcpStream, secret: &str, engine: &[String]) -> Result<StageArgs, SpareError> {
    let who = "an assigner";
    server_handshake_blocking(stream, secret.as_bytes(), SPARE, ASSIGNMENT_PATIENCE)
        .map_err(|e| SpareError::Handshake { who: who.into(), reason: e.to_string() })?;
    stream.set_read_timeout(Some(ASSIGNMENT_PATIENCE)).map_err(SpareError::io(who))?;
    let mut reader = stream;
    let frame = read_frame(&mut reader, 1 << 16).map_err(SpareError::frame(who))?;
    let frame =
        frame.ok_or_else(|| SpareError::Io { who: who.into(), source: ErrorKind::UnexpectedEof.into() })?;
    let flags = match Message::of_frame(&frame) {
        Ok(Message::AssignStage { flags }) => flags,
        Ok(other) => {
            return Err(SpareError::Protocol {
                who: who.into(),
                what: format!("{other:?}, not an assignment"),
            })
        }
        Err(e) => return Err(SpareError::Protocol { who: who.into(), what: e.to_string() }),
    };
    let own_flags = flags.iter().take_while(|flag| *flag != "--");
    if own_flags.clone().any(|flag| flag.starts_with("--secret")) {
        return Err(SpareError::Flags(
            "an assignment names no secret: the spare's own is the stage's".into(),
        ));
    }
    let args = std::iter::once("stage").chain(flags.iter().map(String::as_str));
    let mut stage =
        Assigned::try_parse_from(args).map(|a| a.stage).map_err(|e| SpareError::Flags(e.to_string()))?;
    if !stage.engine.is_empty() && stage.engine != engine {
        return Err(SpareError::Flags(
            "an assignment's engine process must be the one the spare was started with".into(),
        ));
    }
    stage.member.secret = secret.to_owned();
    Ok(stage)
}

/// Refuses an assignment, saying why.
fn refuse(mut stream: &TcpStream, reason: &str) -> std::io::Result<()> {
    let mut header = FrameHeader::new(Kind::Error, SPARE, 0, 1);
    header.ids[0] = ErrorCode::Unexpected as u32;
    write_frame(&mut stream, &header, reason.as_bytes())?;
    stream.flush()
}

/// Assigns the spare stage at `spare` the stage `flags` describe (as `stage` takes them, without
/// the subcommand and the secret), as of `epoch`, proving the cluster secret `secret`; returns its
/// metrics address once it serves.
pub fn assign_stage(
    spare: SocketAddr,
    flags: &[String],
    epoch: u64,
    secret: &[u8],
    patience: Duration,
) -> Result<Option<SocketAddr>, SpareError> {
    let who = format!("the spare at {spare}");
    let mut stream = TcpStream::connect_timeout(&spare, patience).map_err(SpareError::io(&who))?;
    client_handshake_blocking(&stream, secret, ASSIGNER, patience)
        .map_err(|e| SpareError::Handshake { who: who.clone(), reason: e.to_string() })?;
    stream.set_read_timeout(Some(patience)).map_err(SpareError::io(&who))?;
    let (header, payload) = Message::AssignStage { flags: flags.to_vec() }.frame(ASSIGNER, epoch, 1);
    write_frame(&mut stream, &header, &payload).map_err(SpareError::io(&who))?;
    stream.flush().map_err(SpareError::io(&who))?;
    answer(&mut stream, &who).and_then(|reply| match reply {
        Message::StageServing { metrics } => Ok(metrics),
        other => Err(SpareError::Protocol { who, what: format!("answered {other:?}") }),
    })
}

/// Assigns the spare sidecar whose local socket is `socket` to stage `stage`, as of `epoch`.
pub fn assign_sidecar(
    socket: &std::path::Path,
    stage: u32,
    epoch: u64,
    patience: Duration,
) -> Result<(), SpareError> {
    use std::os::unix::net::UnixStream;
    let who = format!("the spare sidecar at {}", socket.display());
    let mut stream = UnixStream::connect(socket).map_err(SpareError::io(&who))?;
    stream.set_read_timeout(Some(patience)).map_err(SpareError::io(&who))?;
    let (header, payload) = Message::Assign { stage, epoch }.frame(ASSIGNER, epoch, 1);
    write_frame(&mut stream, &header, &payload).map_err(SpareError::io(&who))?;
    stream.flush().map_err(SpareError::io(&who))?;
    answer(&mut stream, &who).and_then(|reply| match reply {
        Message::Done => Ok(()),
        other => Err(SpareError::Protocol { who, what: format!("answered {other:?}") }),
    })
}

/// The message a spare (`who`) answered an assignment with, or its refusal.
fn answer(stream: &mut impl std::io::Read, who: &str) -> Result<Message, SpareError> {
    let reply = read_frame(stream, 1 << 16).map_err(SpareError::frame(who))?;
    let reply =
        reply.ok_or_else(|| SpareError::Io { who: who.into(), source: ErrorKind::UnexpectedEof.into() })?;
    if reply.header.kind == Kind::Error {
        return Err(SpareError::Refused(String::from_utf8_lossy(&reply.payload).into_owned()));
    }
    Message::of_frame(&reply).map_err(|e| SpareError::Protocol { who: who.into(), what: e.to_string() })
}
