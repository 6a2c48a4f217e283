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

use std::io::Write;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::time::Duration;

use clap::{Args, Parser};
use dejavulib::message::Message;
use dejavulib::net::auth::{client_handshake_blocking, server_handshake_blocking};
use dejavulib::wire::{read_frame, write_frame, ErrorCode, FrameHeader, Kind};

use crate::cli::{CliError, MemberArgs, StageArgs};
use crate::heartbeat::{spare_member, Role};

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
        crate::cli::announce(addr, None);
        for stream in listener.incoming() {
            let Ok(stream) = stream else { continue };
            let stage = match read_assignment(&stream, &self.member.secret) {
                Ok(stage) => stage,
                Err(reason) => {
                    tracing::warn!(%reason, "refused an assignment");
                    let _ = refuse(&stream, &reason);
                    continue;
                }
            };
            tracing::info!(spare = self.id, stage = ?stage.index.or(stage.replace), "a spare was assigned its stage");
            // From now on it beats as the stage, in the recovery's epoch.
            drop(heartbeat);
            let listener = listener.try_clone().map_err(listen)?;
            return stage.run_on(listener, |_, metrics| {
                let (header, payload) = Message::StageServing { metrics }.frame(SPARE, 0, 1);
                let _ = write_frame(&mut &stream, &header, &payload).and_then(|()| (&stream).flush());
            });
        }
        Err(CliError::SpareStopped)
    }
}

/// Reads an assignment off `stream`: the assigner's proof of the cluster secret `secret`, then
/// the stage's flags.
fn read_assignment(stream: &TcpStream, secret: &str) -> Result<StageArgs, String> {
    server_handshake_blocking(stream, secret.as_bytes(), SPARE, ASSIGNMENT_PATIENCE)
        .map_err(|e| format!("an assigner's handshake: {e}"))?;
    stream.set_read_timeout(Some(ASSIGNMENT_PATIENCE)).map_err(|e| e.to_string())?;
    let mut reader = stream;
    let frame =
        read_frame(&mut reader, 1 << 16).map_err(|e| e.to_string())?.ok_or("closed before its flags")?;
    let flags = match Message::of_frame(&frame) {
        Ok(Message::AssignStage { flags }) => flags,
        Ok(other) => return Err(format!("{other:?}, not an assignment")),
        Err(e) => return Err(e.to_string()),
    };
    if flags.iter().any(|flag| flag.starts_with("--secret")) {
        return Err("an assignment names no secret: the spare's own is the stage's".into());
    }
    let args = std::iter::once("stage").chain(flags.iter().map(String::as_str));
    let mut stage = Assigned::try_parse_from(args).map(|a| a.stage).map_err(|e| e.to_string())?;
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
) -> Result<Option<SocketAddr>, String> {
    let mut stream =
        TcpStream::connect_timeout(&spare, patience).map_err(|e| format!("spare at {spare}: {e}"))?;
    client_handshake_blocking(&stream, secret, ASSIGNER, patience)
        .map_err(|e| format!("spare at {spare}: {e}"))?;
    stream.set_read_timeout(Some(patience)).map_err(|e| e.to_string())?;
    let (header, payload) = Message::AssignStage { flags: flags.to_vec() }.frame(ASSIGNER, epoch, 1);
    write_frame(&mut stream, &header, &payload).map_err(|e| e.to_string())?;
    stream.flush().map_err(|e| e.to_string())?;
    let reply = read_frame(&mut stream, 1 << 16).map_err(|e| e.to_string())?.ok_or("the spare closed")?;
    match Message::of_frame(&reply) {
        Ok(Message::StageServing { metrics }) => Ok(metrics),
        Ok(other) => Err(format!("a spare answered {other:?}")),
        Err(_) => {
            Err(format!("the spare refused its assignment: {}", String::from_utf8_lossy(&reply.payload)))
        }
    }
}

/// Assigns the spare sidecar whose local socket is `socket` to stage `stage`, as of `epoch`.
pub fn assign_sidecar(
    socket: &std::path::Path,
    stage: u32,
    epoch: u64,
    patience: Duration,
) -> Result<(), String> {
    use std::os::unix::net::UnixStream;
    let mut stream =
        UnixStream::connect(socket).map_err(|e| format!("spare sidecar {}: {e}", socket.display()))?;
    stream.set_read_timeout(Some(patience)).map_err(|e| e.to_string())?;
    let (header, payload) = Message::Assign { stage, epoch }.frame(ASSIGNER, epoch, 1);
    write_frame(&mut stream, &header, &payload).map_err(|e| e.to_string())?;
    stream.flush().map_err(|e| e.to_string())?;
    let reply =
        read_frame(&mut stream, 1 << 16).map_err(|e| e.to_string())?.ok_or("the spare sidecar closed")?;
    match Message::of_frame(&reply) {
        Ok(Message::Done) => Ok(()),
        Ok(other) => Err(format!("a spare sidecar answered {other:?}")),
        Err(_) => Err(format!("the spare sidecar refused: {}", String::from_utf8_lossy(&reply.payload))),
    }
}
