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

use std::io::{BufReader, BufWriter};
use std::net::SocketAddr;
use std::os::fd::AsRawFd;
use std::os::unix::process::CommandExt;
use std::process::{Child, ChildStdin, ChildStdout, Command, ExitStatus, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use thiserror::Error;
use tracing::{info, warn};

mod messages;

pub use messages::{read_message, write_message, FromEngine, Start, SwapTotals, ToEngine, MAX_MESSAGE};

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

/// Time an engine has to start (its imports) and to build its stage and join its sidecar, each.
pub const START_PATIENCE: Duration = Duration::from_secs(600);

/// Time an engine has to answer a step or a restore before it is taken for hung.
pub const REQUEST_PATIENCE: Duration = Duration::from_secs(120);

/// Time an engine that closed its output has to exit.
const EXIT_PATIENCE: Duration = Duration::from_secs(2);

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
}
