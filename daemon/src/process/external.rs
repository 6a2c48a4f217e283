//! An engine process of any language as the engine of a stage: the stage host keeps the chain
//! and the cluster membership, and the engine process computes each step and keeps its KV with
//! its own sidecar (through the library's bindings: `dejavu.SidecarClient`, `Streamer`, `fetch`).
//!
//! The host starts the engine's command with pipes on its standard input and output (its
//! standard error is the host's) and asks the kernel to kill it if the host dies. They talk in
//! messages: a little-endian `u32` length of what follows, then a `u8` kind and its fields,
//! integers little-endian, byte strings as a `u32` length and the bytes.
//!
//! The host sends:
//! - `1` **start**, once: the stage's index (`u32`), its epoch (`u64`), its first and end layers,
//!   slots per microbatch, microbatches, microbatches kept resident (`u32` each; as many as there
//!   are microbatches unless fewer are swapped), tokens per sequence at most (`u32`), then four
//!   byte strings: its sidecar's local socket (empty: no replication), its successor's sidecar
//!   (`host:port`, or `none`), the CPUs for its copies (such as `2-3`; empty: any) and the
//!   cluster secret (to read a peer sidecar after its own died with its worker).
//! - `2` **step**: microbatch, slot, position and token count (`u32` each), whether to replicate
//!   the step's KV (`u8`, 0 or 1), then the input: token ids (`u32`) into the first stage, hidden
//!   states (`f32`) into the others.
//! - `3` **restore**: microbatch, slot, prompt length and the tokens with KV (`u32` each), then
//!   the sidecar to read from (a byte string, `host:port`; empty: its own). The KV is kept as one
//!   chunk for the prompt, then one per token; the engine fetches them in that order while they
//!   are there.
//! - `4` **read**: microbatch, slot, first and end token (`u32` each): the sequence's KV of those
//!   tokens, which a prompt stage's host hands over to the token pipeline
//!   ([`crate::handoff`]) once the prompt's step is answered.
//! - `5` **write**: microbatch, slot, first and end token (`u32` each), whether to replicate
//!   (`u8`), then the KV of those tokens: a token stage's host loads a handed-over prompt from its
//!   sidecar and has the engine take it in place of computing it. The sequence then holds KV up to
//!   the end token; replicated, it goes to the sidecar as a prompt computed there would.
//!
//! KV travels packed as the library packs a region (`KvCache.gather`): the stage's layers, K then
//! V, the slot, each KV head, each token's vector whole (`[layer][part][head][token][element]`),
//! in the model's KV dtype.
//!
//! The engine says first, unasked:
//! - `5` **standby**, once it has started (its imports done): a spare's engine waits so, warm,
//!   until its stage is known.
//!
//! Then it answers each request in turn:
//! - `1` **ready**, to start, once it has built its model and joined its sidecar: the epoch it
//!   joined in (`u64`).
//! - `2` **output**, to a step: the hidden states (`f32`) to pass on, or from the last stage the
//!   next token (`u32`).
//! - `3` **restored**, to a restore or a write: the tokens restored (`u32`; a write's end token).
//! - `4` **refused**, to a step, a restore, a read or a write it cannot carry out (shapes or
//!   positions out of range): why, in UTF-8. The host drops the request and goes on.
//! - `7` **kv**, to a read: the KV asked for, packed.
//!
//! Before any answer, an engine that swaps microbatches between its device and host memory may
//! send `6` **swapped**: its totals so far of microbatches swapped in, bytes swapped in, deltas
//! swapped out and bytes swapped out, and the bytes of KV it holds in host memory now (`u64`
//! each). The host publishes them as its stage's swap metrics and reads on for the answer.
//!
//! An engine whose sidecar is gone exits. The host stops when its engine is gone (it finds so at the
//! next request), answers out of turn or with an output of the wrong size, or takes longer than
//! [`REQUEST_PATIENCE`] to answer; the controller, hearing the host fall silent, replaces the
//! stage. The command must be the engine itself (or `exec` it): only the process the host started
//! is killed with it.

use std::io::{BufReader, BufWriter, Read, Write};
use std::net::SocketAddr;
use std::os::fd::AsRawFd;
use std::os::unix::process::CommandExt;
use std::process::{Child, ChildStdin, ChildStdout, Command, ExitStatus, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use thiserror::Error;
use tracing::{info, warn};

use super::host_handoff::HostHandoff;
use super::{ProcessError, StageConfig, StageEngine, StageStats};
use dejavu_engine::pipeline::Seat;

/// The command line of an engine process: a program and its arguments.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EngineCommand {
    argv: Vec<String>,
}

impl EngineCommand {
    /// The command `argv` (the program first); an empty one is refused.
    pub fn new(argv: Vec<String>) -> Result<Self, ExternalError> {
        if argv.is_empty() {
            return Err(ExternalError::EmptyCommand);
        }
        Ok(Self { argv })
    }

    /// The program and its arguments.
    pub fn argv(&self) -> &[String] {
        &self.argv
    }
}

/// Errors of an engine process or of what it says.
#[derive(Debug, Error)]
pub enum ExternalError {
    /// No program was given.
    #[error("an engine command needs a program")]
    EmptyCommand,
    /// The program could not be started.
    #[error("cannot start the engine {program}: {source}")]
    Spawn {
        /// The program.
        program: String,
        /// Why.
        source: std::io::Error,
    },
    /// The engine process ended, or closed its pipes.
    #[error("the engine process is gone ({0})")]
    Gone(String),
    /// A message that is not one of the protocol's, or not the answer expected.
    #[error("the engine process said something malformed: {0}")]
    Malformed(String),
    /// The engine refused a request (it changed nothing).
    #[error("the engine refused: {0}")]
    Refused(String),
    /// Something the stage is configured for that an engine process does not do.
    #[error("an engine process cannot {0}")]
    Unsupported(&'static str),
    /// No answer within the patience given: the engine is taken for hung.
    #[error("the engine process gave no answer within {0:?}")]
    Stuck(Duration),
}

/// Longest message either side may send: a step's input or output of a long prompt fits easily.
pub const MAX_MESSAGE: u32 = 1 << 30;

/// Time an engine has to start (its imports) and to build its stage and join its sidecar, each.
pub const START_PATIENCE: Duration = Duration::from_secs(600);

/// Time an engine has to answer a step or a restore before it is taken for hung.
pub const REQUEST_PATIENCE: Duration = Duration::from_secs(120);

/// Time an engine that closed its output has to exit.
const EXIT_PATIENCE: Duration = Duration::from_secs(2);

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

/// Waits at most `patience` for `reader` to have something to read (or its end).
fn readable_within(reader: &BufReader<ChildStdout>, patience: Duration) -> Result<(), ExternalError> {
    if !reader.buffer().is_empty() {
        return Ok(());
    }
    let deadline = Instant::now() + patience;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let mut fd = libc::pollfd { fd: reader.get_ref().as_raw_fd(), events: libc::POLLIN, revents: 0 };
        let ms = left.as_millis().min(i32::MAX as u128) as i32;
        // SAFETY: `fd` is one valid pollfd, and its descriptor is open for as long as `reader` is.
        match unsafe { libc::poll(&mut fd, 1, ms) } {
            0 => return Err(ExternalError::Stuck(patience)),
            n if n > 0 => return Ok(()),
            _ if std::io::Error::last_os_error().kind() == std::io::ErrorKind::Interrupted => continue,
            _ => return Err(ExternalError::Gone(std::io::Error::last_os_error().to_string())),
        }
    }
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

/// An engine process started and not told its stage yet: a spare's, standing by with its
/// imports done, or a stage's own about to be told it.
pub struct EngineProcess {
    command: EngineCommand,
    child: Child,
    to: BufWriter<ChildStdin>,
    from: BufReader<ChildStdout>,
    /// Whether it has said it stands by.
    standing_by: bool,
}

impl EngineProcess {
    /// Starts `command`, its standard input and output piped to this process and its standard
    /// error this process's. The kernel kills it when the calling thread exits (the stage host's
    /// main thread, for as long as the process lives).
    pub fn spawn(command: &EngineCommand) -> Result<Self, ExternalError> {
        let argv = command.argv();
        let mut process = Command::new(&argv[0]);
        process.args(&argv[1..]).stdin(Stdio::piped()).stdout(Stdio::piped()).stderr(Stdio::inherit());
        // The start message gives it the secret; its own children need not inherit it.
        process.env_remove(dejavulib::net::auth::SECRET_ENV);
        let host = std::process::id();
        // SAFETY: between fork and exec the closure only calls prctl and getppid, which are
        // async-signal-safe and touch no memory of the parent's.
        unsafe {
            process.pre_exec(move || {
                // The engine dies with the host (the thread that started it), killed or not; a
                // host that died before this took effect is no longer its parent.
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                if libc::getppid() as u32 != host {
                    return Err(std::io::Error::other("the stage host is gone"));
                }
                Ok(())
            });
        }
        let mut child =
            process.spawn().map_err(|source| ExternalError::Spawn { program: argv[0].clone(), source })?;
        let (to, from) = (child.stdin.take().expect("piped"), child.stdout.take().expect("piped"));
        let (to, from) = (BufWriter::new(to), BufReader::new(from));
        Ok(Self { command: command.clone(), child, to, from, standing_by: false })
    }

    /// Waits until it says it stands by (its imports done), at most [`START_PATIENCE`].
    pub fn standby(&mut self) -> Result<(), ExternalError> {
        if self.standing_by {
            return Ok(());
        }
        match self.answer(START_PATIENCE)? {
            FromEngine::Standby => {
                self.standing_by = true;
                Ok(())
            }
            other => Err(ExternalError::Malformed(format!("{other:?} before it stood by"))),
        }
    }

    /// The next message, within `patience`.
    fn answer(&mut self, patience: Duration) -> Result<FromEngine, ExternalError> {
        readable_within(&self.from, patience)?;
        match read_message(&mut self.from)? {
            Some(body) => FromEngine::decode(&body),
            None => Err(ExternalError::Gone(self.exit_status())),
        }
    }

    /// How it ended, in words. It closed its output: it is exiting, and is killed if it has not
    /// within [`EXIT_PATIENCE`].
    fn exit_status(&mut self) -> String {
        let deadline = Instant::now() + EXIT_PATIENCE;
        while matches!(self.child.try_wait(), Ok(None)) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
        let _ = self.child.kill();
        self.child.wait().map_or_else(|_| "it closed its output".into(), |s: ExitStatus| s.to_string())
    }

    /// The command it was started with.
    pub fn command(&self) -> &EngineCommand {
        &self.command
    }

    /// Makes it the engine of the stage `config` describes, and waits until it is ready: built,
    /// and joined to its sidecar.
    pub(super) fn start(
        mut self,
        config: &StageConfig,
        stats: Arc<StageStats>,
    ) -> Result<ExternalEngine, ProcessError> {
        if config.transport.is_quic() {
            return Err(
                ExternalError::Unsupported("read a peer sidecar over QUIC (it reads over TCP)").into()
            );
        }
        self.standby()?;
        let replication = config.replication.as_ref();
        let start = Start {
            index: config.index,
            epoch: config.epoch,
            layers: config.layers.clone(),
            slots: config.slots,
            microbatches: config.microbatches,
            resident: config
                .device_caches
                .unwrap_or(config.microbatches)
                .clamp(1, config.microbatches.max(1)),
            max_tokens: config.max_tokens,
            sidecar: replication.map(|r| r.local.display().to_string()).unwrap_or_default(),
            successor: replication.map(|r| r.successor.to_string()).unwrap_or_else(|| "none".into()),
            copy_cpus: replication
                .and_then(|r| r.streamer_cpus.as_ref())
                .map(|c| c.to_string())
                .unwrap_or_default(),
            secret: config.secret.clone(),
        };
        if config.handoff.is_some() && config.device_caches.is_some_and(|d| d < config.microbatches) {
            // As the reference stage: a prompt stage's handoff reads the prompt back after its
            // step, and a token stage's loads write whole prompts.
            return Err(ProcessError::Protocol(
                "a stage of a disaggregated pipeline keeps every microbatch: no --device-caches".into(),
            ));
        }
        let handoff = HostHandoff::new(config)?;
        let mut engine = ExternalEngine {
            process: self,
            replicate: replication.is_some(),
            lost: false,
            stats,
            index: config.index,
            handoff,
        };
        match engine.ask(&ToEngine::Start(start), START_PATIENCE)? {
            FromEngine::Ready(epoch) => {
                let command = engine.process.command.argv().join(" ");
                info!(stage = config.index, epoch, engine = %command, "the engine process is ready");
                Ok(engine)
            }
            other => Err(engine.out_of_step("start", &other).into()),
        }
    }
}

impl Drop for EngineProcess {
    fn drop(&mut self) {
        // The host is going: so is its engine.
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A stage's engine process, told its stage.
pub(super) struct ExternalEngine {
    process: EngineProcess,
    /// Whether steps' KV goes to the sidecar (there is one, and replication is not paused).
    replicate: bool,
    /// Set once the process is gone or out of step with the host: the stage stops.
    lost: bool,
    stats: Arc<StageStats>,
    index: u32,
    /// Its part in prompt-token disaggregation, carried out here.
    handoff: Option<HostHandoff>,
}

impl ExternalEngine {
    /// Sends `message` and reads the answer, within `patience`; a failure on either pipe, a
    /// malformed answer or none in time loses the engine.
    fn ask(&mut self, message: &ToEngine, patience: Duration) -> Result<FromEngine, ExternalError> {
        if self.lost {
            return Err(ExternalError::Gone("it was lost before".into()));
        }
        let sent = write_message(&mut self.process.to, &message.encode());
        let answer = sent.map_err(|e| ExternalError::Gone(e.to_string())).and_then(|()| loop {
            match self.process.answer(patience)? {
                FromEngine::Swapped(totals) => self.record(totals),
                answer => break Ok(answer),
            }
        });
        if answer.is_err() {
            self.lost = true;
        }
        answer
    }

    /// Publishes the engine's swap totals as the stage's swap metrics.
    fn record(&self, totals: SwapTotals) {
        let swap = &self.stats.swap;
        for (metric, value) in [
            (&swap.swap_ins, totals.swap_ins),
            (&swap.bytes_in, totals.bytes_in),
            (&swap.swap_outs, totals.swap_outs),
            (&swap.bytes_out, totals.bytes_out),
            (&swap.host_bytes, totals.host_bytes),
        ] {
            metric.store(value, std::sync::atomic::Ordering::Relaxed);
        }
    }

    /// As a prompt stage whose engine has just computed `seat`'s prompt (`tokens`): reads its KV
    /// out of the engine and hands it over.
    fn hand_over(&mut self, seat: Seat, tokens: std::ops::Range<u32>) -> Result<(), ProcessError> {
        let kv = match self.ask(&ToEngine::Read { seat, tokens: tokens.clone() }, REQUEST_PATIENCE)? {
            FromEngine::Kv(kv) => kv,
            FromEngine::Refused(why) => return Err(ExternalError::Refused(why).into()),
            other => return Err(self.out_of_step("read", &other).into()),
        };
        let Some(handoff) = &mut self.handoff else {
            return Err(ProcessError::Protocol("a handoff from a stage that is not a prompt stage".into()));
        };
        let handed = handoff.prompt_done(seat, tokens, &kv)?;
        StageStats::add(&self.stats.handed_chunks, handed.chunks);
        StageStats::add(&self.stats.handed_bytes, handed.bytes);
        StageStats::add(&self.stats.handoff_failures, handed.failures);
        Ok(())
    }

    /// As a token stage: loads `seat`'s prompt KV from the sidecar and writes it into the engine;
    /// returns the tokens the engine took.
    fn load_prompt(&mut self, seat: Seat, prompt_len: u32) -> Result<u32, ProcessError> {
        let Some(handoff) = &mut self.handoff else {
            return Err(ExternalError::Unsupported("load a prompt outside a token pipeline").into());
        };
        let (kv, bytes) = handoff.load(seat, prompt_len)?;
        let write = ToEngine::Write { seat, tokens: 0..prompt_len, replicate: self.replicate, kv };
        match self.ask(&write, REQUEST_PATIENCE)? {
            FromEngine::Restored(tokens) if tokens == prompt_len => {
                StageStats::add(&self.stats.loaded_sequences, 1);
                StageStats::add(&self.stats.loaded_bytes, bytes);
                Ok(tokens)
            }
            FromEngine::Restored(tokens) => {
                Err(self.out_of_step("write", &FromEngine::Restored(tokens)).into())
            }
            FromEngine::Refused(why) => Err(ExternalError::Refused(why).into()),
            other => Err(self.out_of_step("write", &other).into()),
        }
    }

    /// An answer of the wrong kind to `request`: the engine is out of step, and lost.
    fn out_of_step(&mut self, request: &str, answer: &FromEngine) -> ExternalError {
        self.lost = true;
        ExternalError::Malformed(format!("{answer:?} in answer to a {request}"))
    }
}

impl StageEngine for ExternalEngine {
    fn step(&mut self, seat: Seat, position: u32, count: u32, input: &[u8]) -> Result<Vec<u8>, ProcessError> {
        if count == 0 {
            return Err(ProcessError::Protocol("a step of no tokens".into()));
        }
        let step = ToEngine::Step { seat, position, count, replicate: self.replicate, input: input.to_vec() };
        match self.ask(&step, REQUEST_PATIENCE)? {
            // A token from the last stage, hidden states (f32) for the step's tokens from others.
            FromEngine::Output(out)
                if out.len() != 4 && (out.is_empty() || out.len() % (4 * count as usize) != 0) =>
            {
                let e = ExternalError::Malformed(format!("{} bytes of output for {count} tokens", out.len()));
                self.lost = true;
                Err(e.into())
            }
            FromEngine::Output(out) => {
                StageStats::add(&self.stats.steps, 1);
                StageStats::add(&self.stats.tokens, count as u64);
                if position == 0 && self.handoff.as_ref().is_some_and(HostHandoff::hands_over) {
                    self.hand_over(seat, 0..count)?;
                }
                Ok(out)
            }
            FromEngine::Refused(why) => Err(ExternalError::Refused(why).into()),
            other => Err(self.out_of_step("step", &other).into()),
        }
    }

    fn restore(
        &mut self,
        seat: Seat,
        prompt_len: u32,
        kv_tokens: u32,
        from: Option<SocketAddr>,
    ) -> Result<u32, ProcessError> {
        let restore = ToEngine::Restore { seat, prompt_len, kv_tokens, from };
        let restored = match self.ask(&restore, REQUEST_PATIENCE)? {
            FromEngine::Restored(tokens) => tokens,
            FromEngine::Refused(why) => {
                warn!(stage = self.index, why, "the engine refused a restore");
                0
            }
            other => return Err(self.out_of_step("restore", &other).into()),
        };
        let (restores, tokens) = match from {
            None => (&self.stats.local_restores, &self.stats.local_restored_tokens),
            Some(_) => (&self.stats.peer_restores, &self.stats.peer_restored_tokens),
        };
        StageStats::add(restores, 1);
        StageStats::add(tokens, restored as u64);
        Ok(restored)
    }

    fn load(&mut self, seat: Seat, prompt_len: u32) -> u32 {
        match self.load_prompt(seat, prompt_len) {
            Ok(tokens) => tokens,
            Err(e) => {
                StageStats::add(&self.stats.load_failures, 1);
                warn!(stage = self.index, ?seat, error = %e, "could not load a prompt's KV: computed instead");
                0
            }
        }
    }

    fn handoff_to(&mut self, token_stage: u32, to: SocketAddr) -> Result<(), ProcessError> {
        match &self.handoff {
            Some(handoff) => handoff.retarget(token_stage, to),
            None => {
                Err(ProcessError::Protocol("a handoff target for a stage that is not a prompt stage".into()))
            }
        }
    }

    fn set_replication(&mut self, on: bool) {
        self.replicate = on;
    }

    fn lost(&self) -> bool {
        self.lost
    }
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

    /// An engine process that answers each step with its swap totals so far (one more swap in
    /// and out of 100 bytes per step, 300 bytes in host memory) and then a token.
    const SWAPPING_ENGINE: &str = r#"
import struct, sys
steps = 0
while True:
    length = sys.stdin.buffer.read(4)
    if len(length) < 4:
        break
    sys.stdin.buffer.read(struct.unpack("<I", length)[0])
    steps += 1
    for body in (bytes([6]) + struct.pack("<5Q", steps, 100 * steps, steps, 100 * steps, 300),
                 bytes([2]) + struct.pack("<I", 7)):
        sys.stdout.buffer.write(struct.pack("<I", len(body)) + body)
    sys.stdout.buffer.flush()
"#;

    #[test]
    fn an_engine_s_swap_totals_become_the_stage_s_swap_metrics() {
        let command =
            EngineCommand::new(vec!["python3".into(), "-c".into(), SWAPPING_ENGINE.into()]).unwrap();
        let stats = Arc::new(StageStats::default());
        let mut engine = ExternalEngine {
            process: EngineProcess::spawn(&command).unwrap(),
            replicate: false,
            lost: false,
            stats: stats.clone(),
            index: 0,
            handoff: None,
        };
        let seat = Seat { microbatch: 0, slot: 0 };
        for position in 0..3 {
            // The swap report before each answer is recorded, and the answer is the step's.
            assert_eq!(engine.step(seat, position, 1, &[0; 4]).unwrap(), 7u32.to_le_bytes());
        }
        let swap = &stats.swap;
        let read = |metric: &std::sync::atomic::AtomicU64| metric.load(std::sync::atomic::Ordering::Relaxed);
        assert_eq!(
            [&swap.swap_ins, &swap.bytes_in, &swap.swap_outs, &swap.bytes_out, &swap.host_bytes].map(read),
            [3, 300, 3, 300, 300]
        );
        assert_eq!(read(&stats.steps), 3);
        assert!(!engine.lost());
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
