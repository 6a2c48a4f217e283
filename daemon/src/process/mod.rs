//! Stages as separate processes that pass activations over TCP, and the driver that feeds them.
//!
//! The stages form a chain: the driver sends a step's tokens to stage 0, each stage runs its layers
//! and sends the hidden states on, and the last stage sends the next token back to the driver.
//! Every message is one [`dejavulib::wire`] frame. An `Activation` frame's ids are (microbatch,
//! slot, position, token count); its payload is tokens (`u32`) into stage 0 and out of the last
//! stage, hidden states (`f32`) in between, all little-endian. The driver numbers every frame it
//! sends (the request id) and stages pass headers on unchanged, so each reply is matched to its
//! request exactly.
//!
//! With replication configured, a stage hands the KV it wrote in each step (the prompt's, then each
//! token's) to a background streamer and passes the step on at once (replication is off the
//! critical path and may lag a few steps). The streamer hands every chunk to the stage's own
//! sidecar through shared memory ([`crate::sidecar`]), which keeps it (a local copy: an engine
//! that dies alone restores from it, through shared memory again, without any network transfer)
//! and forwards it to the ring successor's sidecar (a replica: a worker that dies with its sidecar
//! restores from there, over the transport).
//!
//! `Control` frames travel the same chain. Their payload is an operation byte, the index of the
//! stage it is for (`u32`), and an argument; ids name a sequence as (microbatch, slot, prompt
//! length, tokens with KV):
//!
//! - restore (argument: a sidecar address, or none for the stage's own): fetch that sequence's KV
//!   into the cache, in order, as far as the sidecar has it, and copy it into the stage's own
//!   sidecar if it came from elsewhere; the number of tokens restored travels on, and the driver
//!   recomputes the steps after it ([`RemotePipeline::recover`]);
//! - rewire (argument: the new next address): send to another next stage from now on;
//! - load (no argument; ids: microbatch, slot, prompt length): in a token pipeline fed by a prompt
//!   pipeline ([`crate::handoff`]), load the sequence's prompt KV from the stage's own sidecar,
//!   where the prompt stages handed it over, and replicate it as a computed prompt's; the number
//!   of tokens loaded (0 if it could not) travels on;
//! - hand over to (argument: a token stage's index, `u32`, then its sidecar's new address): a prompt
//!   stage hands that token stage's prompt KV to the new sidecar from now on;
//! - replication (argument: one byte, 0 to pause, 1 to resume): the stage stops or starts again
//!   handing the KV of the steps it computes to the streamer (to measure replication's cost within
//!   one run; a prompt loaded from a prompt pipeline is still replicated, and a replacement stage
//!   starts with replication on).
//!
//! Every connection on the chain (driver to stage 0, stage to stage, last stage to driver) proves
//! the cluster secret and then says hello (the `chain` module): a `Hello` frame whose epoch is the
//! one its sender was started in (a replacement's is the epoch of the recovery that started it)
//! and whose sender is the stage's predecessor. A receiver takes a connection with an epoch at
//! least that of the one in use, which it then shuts (a replacement takes over; it connects as
//! soon as it starts), and refuses an older one: a stage presumed dead and replaced, but back
//! from a pause or a partition, cannot take its link back.
//! Its sidecar, taken over by the replacement (a newer epoch on the local socket), has closed its
//! connection too, so none of its KV is kept.
//!
//! Every stage passes a control frame on, so its arrival back at the driver says the operation is
//! done and the chain whole. A stage whose predecessor goes away accepts the next connection (the
//! replacement); a frame it cannot pass on (its successor died) is dropped, and the driver sends it
//! again once the chain is repaired. A frame a stage cannot carry out is reported on its standard
//! error and dropped: the driver's deadline notices.
//!
//! The driver's end is [`RemotePipeline`] (the `remote` module); a stage's counters and metrics
//! page are [`StageStats`] (`stats`), and the `sidecars` module reaches its own sidecar and a
//! recovery's restore sources.

use std::io::{BufReader, BufWriter, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::ops::Range;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use dejavulib::affinity::CpuList;
use dejavulib::message::Message;
use dejavulib::wire::{read_frame, write_frame, Frame, Kind, DEFAULT_MAX_PAYLOAD};
use thiserror::Error;
use tracing::{error, info, warn};

use crate::handoff::Shapes;
use crate::transport::Transports;
use dejavu_engine::model::ModelConfig;
use dejavu_engine::pipeline::{CacheLayout, Seat};
use dejavu_engine::stage::StageError;

mod chain;
pub mod external;
mod host_handoff;
mod reference;
mod remote;
mod sidecars;
mod stats;

use chain::{accept_upstreams, closed_by_peer, connect, say_hello};
pub use external::{EngineCommand, EngineProcess, ExternalError};
use reference::ReferenceStage;
pub use remote::{RemotePipeline, RestoreSource, SequenceRecovery, StepReply};
pub use stats::StageStats;

/// Errors of a stage process or the driver.
#[derive(Debug, Error)]
pub enum ProcessError {
    /// The stage's computation failed.
    #[error(transparent)]
    Stage(#[from] StageError),
    /// A socket failed.
    #[error("i/o: {0}")]
    Io(#[from] std::io::Error),
    /// A malformed frame.
    #[error(transparent)]
    Frame(#[from] dejavulib::wire::FrameError),
    /// The stage's part in a handoff between prompt and token pipelines.
    #[error(transparent)]
    Handoff(#[from] crate::handoff::HandoffError),
    /// A sidecar refused or failed.
    #[error("sidecar: {0}")]
    Sidecar(String),
    /// A message that does not belong in the chain.
    #[error("protocol: {0}")]
    Protocol(String),
    /// The stage's engine process failed, or refused a request.
    #[error(transparent)]
    External(#[from] ExternalError),
    /// The stage's KV caches cannot be made.
    #[error(transparent)]
    Cache(#[from] dejavulib::CacheError),
    /// The last stage closed its connection to whoever feeds the pipeline.
    #[error("the last stage closed its connection")]
    LastStageClosed,
    /// No reply within the deadline: a stage is presumed dead.
    #[error("no reply within {0:?}")]
    Timeout(Duration),
    /// The controller fenced members in this epoch, one the pipeline has not recovered from,
    /// while a step was in flight: a stage was declared dead, and the step's reply may never come.
    #[error("the controller fenced members in epoch {0} while a step was in flight")]
    Fenced(u64),
}

/// Where a stage keeps copies of its KV.
#[derive(Clone, Debug)]
pub struct Replication {
    /// Its own sidecar's local socket: the local copy, through shared memory, which the sidecar
    /// forwards to the successor.
    pub local: PathBuf,
    /// Its ring successor's sidecar (the replica), or none (a ring of one stage: local copies
    /// only).
    pub successor: dejavulib::local::Successor,
    /// CPUs of the streamer thread (`None`: the process's).
    pub streamer_cpus: Option<CpuList>,
}

/// What one stage process runs.
#[derive(Clone, Debug)]
pub struct StageConfig {
    /// The model.
    pub model: ModelConfig,
    /// Its position in the chain.
    pub index: u32,
    /// Global layers it runs.
    pub layers: Range<u32>,
    /// Its cache layout.
    pub layout: CacheLayout,
    /// Sequences per microbatch.
    pub slots: u32,
    /// Microbatches (one cache each).
    pub microbatches: u32,
    /// Tokens per sequence at most.
    pub max_tokens: u32,
    /// Time each step takes on top of the reference model's arithmetic (a real model's kernels;
    /// the stage sleeps, leaving the CPU free as while a GPU computes).
    pub step_time: Duration,
    /// Where to send its output (the next stage, or the driver after the last stage).
    pub next: SocketAddr,
    /// Where to keep copies of its KV, if anywhere.
    pub replication: Option<Replication>,
    /// The epoch it was started in: its hellos and KV copies carry it.
    pub epoch: u64,
    /// The cluster secret: its connections on the chain and to sidecars prove it.
    pub secret: Vec<u8>,
    /// KV caches in "device" memory, if fewer than microbatches: the others are swapped to host
    /// memory ([`crate::swap`]).
    pub device_caches: Option<u32>,
    /// Its part in prompt-token disaggregation, if any.
    pub handoff: Option<Handoff>,
    /// The transport to other sidecars (restores, copies, handoffs).
    pub transport: Transports,
    /// An engine process to run instead of the reference model ([`external`]): it computes the
    /// steps and keeps their KV with the sidecar itself; `model`, `layout` and `step_time` are
    /// then the reference model's only.
    pub engine: Option<EngineCommand>,
}

/// A stage's part in prompt-token disaggregation ([`crate::handoff`]).
#[derive(Clone, Debug)]
pub enum Handoff {
    /// A prompt stage: hands each prompt's KV it computes over to the token stages' sidecars
    /// (`sidecars`, in token stage order, reached with the cluster secret `secret`).
    Prompt {
        /// Both pipelines' shapes.
        shapes: Shapes,
        /// The token stages' sidecars.
        sidecars: Vec<SocketAddr>,
        /// The cluster secret.
        secret: Vec<u8>,
    },
    /// A token stage: loads prompt KV from its own sidecar when told to (it still computes a
    /// prompt it is sent, as a recovery does).
    Token {
        /// Both pipelines' shapes.
        shapes: Shapes,
    },
}

/// Time a load waits for prompt KV still on its way from the prompt stages (it was sent while the
/// rest of the prompt pipeline computed: normally it is there).
const LOAD_PATIENCE: Duration = Duration::from_millis(500);

fn tokens_payload(tokens: &[u32]) -> Vec<u8> {
    tokens.iter().flat_map(|t| t.to_le_bytes()).collect()
}

fn tokens_of(payload: &[u8]) -> Vec<u32> {
    payload.chunks_exact(4).map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect()
}

/// What the stage host needs of the engine it runs. The host keeps the chain (its connections,
/// hellos and rewiring, every frame passed on) and hands the engine each step and each control
/// message addressed to it: the reference model in this process ([`reference`]), or an engine
/// process of any language ([`external`]).
pub(crate) trait StageEngine {
    /// Runs `count` tokens of `seat` from `position`. `input` is token ids (`u32`) into the first
    /// stage and hidden states (`f32`) into the others, little-endian; the result is the hidden
    /// states to pass on or, from the last stage, the next token.
    fn step(&mut self, seat: Seat, position: u32, count: u32, input: &[u8]) -> Result<Vec<u8>, ProcessError>;
    /// Restores `seat`'s KV (the prompt's chunk, then one per token up to `kv_tokens`) from the
    /// sidecar at `from`, or from its own, in order, as far as it is kept; returns the tokens
    /// restored (the driver recomputes the rest). An error means the engine itself failed.
    fn restore(
        &mut self,
        seat: Seat,
        prompt_len: u32,
        kv_tokens: u32,
        from: Option<SocketAddr>,
    ) -> Result<u32, ProcessError>;
    /// Loads `seat`'s prompt KV, handed over by a prompt pipeline, from its own sidecar; returns
    /// the tokens loaded (0: the driver has the prompt computed here).
    fn load(&mut self, seat: Seat, prompt_len: u32) -> u32;
    /// As a prompt stage, hands `token_stage`'s prompts to the sidecar at `to` from now on.
    fn handoff_to(&mut self, token_stage: u32, to: SocketAddr) -> Result<(), ProcessError>;
    /// Stops (`false`) or resumes handing each step's KV to the sidecar.
    fn set_replication(&mut self, on: bool);
    /// A step of `microbatch` has been passed on (time to bring the next microbatch in).
    fn passed_on(&mut self, _microbatch: u32) {}
    /// Whether the engine can compute no more (its sidecar or its process is gone): the stage
    /// then stops, to be replaced.
    fn lost(&self) -> bool;
}

/// Carries out a control message through `engine` if it is addressed to stage `index` (a rewire
/// changes `next`); returns the payload to pass on (the message's answer, or the message itself).
fn control(
    engine: &mut dyn StageEngine,
    index: u32,
    next: &mut SocketAddr,
    payload: Vec<u8>,
) -> Result<Vec<u8>, ProcessError> {
    let message = Message::decode(&payload).map_err(|e| ProcessError::Protocol(e.to_string()))?;
    if let Message::Rewire(rewires) = &message {
        if let Some(&(_, to)) = rewires.iter().find(|(stage, _)| *stage == index) {
            *next = to;
        }
        return Ok(payload);
    }
    if message.stage() != index {
        return Ok(payload);
    }
    match message {
        Message::Restore { stage, seat, prompt_len, kv_tokens, from } => {
            let seat = Seat { microbatch: seat.microbatch, slot: seat.slot };
            let tokens = engine.restore(seat, prompt_len, kv_tokens, from)?;
            Ok(Message::Restored { stage, tokens }.encode())
        }
        Message::Load { stage, seat, prompt_len } => {
            let tokens = engine.load(Seat { microbatch: seat.microbatch, slot: seat.slot }, prompt_len);
            Ok(Message::Loaded { stage, tokens }.encode())
        }
        Message::HandoffTo { token_stage, to, .. } => {
            engine.handoff_to(token_stage, to)?;
            Ok(payload)
        }
        Message::Replication { on, .. } => {
            engine.set_replication(on);
            Ok(payload)
        }
        other => Err(ProcessError::Protocol(format!("unexpected {other:?}"))),
    }
}

/// Runs a stage: listens at `listen` (and serves its metrics at `metrics`, if given), reports the
/// bound addresses through `ready`, then serves one upstream connection at a time (a
/// predecessor's replacement connects after it) until killed.
pub fn serve_stage(
    config: StageConfig,
    listen: SocketAddr,
    metrics: Option<SocketAddr>,
    ready: impl FnOnce(SocketAddr, Option<SocketAddr>),
) -> Result<(), ProcessError> {
    serve_stage_on(config, TcpListener::bind(listen)?, metrics, ready, None)
}

/// [`serve_stage`] on a listener already bound (a spare's, which it was started with), and with
/// the engine process `standby` that spare started ahead, if any: it becomes the stage's engine
/// if it was started with the stage's engine command (and is ended otherwise).
pub fn serve_stage_on(
    config: StageConfig,
    listener: TcpListener,
    metrics: Option<SocketAddr>,
    ready: impl FnOnce(SocketAddr, Option<SocketAddr>),
    standby: Option<EngineProcess>,
) -> Result<(), ProcessError> {
    let stats = Arc::new(StageStats::default());
    let (index, epoch, secret, mut next) = (config.index, config.epoch, config.secret.clone(), config.next);
    let mut engine: Box<dyn StageEngine> = match (config.engine.clone(), standby) {
        (Some(command), Some(standby)) if *standby.command() == command => {
            Box::new(standby.start(&config, stats.clone())?)
        }
        (Some(command), _) => Box::new(EngineProcess::spawn(&command)?.start(&config, stats.clone())?),
        (None, _) => Box::new(ReferenceStage::new(config, stats.clone())?),
    };
    let metrics = match metrics {
        Some(at) => {
            let stats = stats.clone();
            Some(crate::metrics::serve(at, move || stats.render(index))?)
        }
        None => None,
    };
    let addr = listener.local_addr()?;
    info!(stage = index, epoch, %addr, "stage listening");
    ready(addr, metrics);
    let upstreams = accept_upstreams(listener, index, secret.clone(), stats.clone());
    // Connect to the next stage at once: a replacement takes its successor's input over from the
    // process it replaces before that one could send anything more.
    let connect_next = |next: SocketAddr, patience: Duration| {
        let stream = connect(next, patience).ok()?;
        say_hello(&stream, &secret, index, epoch).ok()?;
        Some((next, BufWriter::with_capacity(1 << 20, stream)))
    };
    let mut downstream: Option<(SocketAddr, BufWriter<TcpStream>)> =
        connect_next(next, Duration::from_secs(2));
    while let Ok(upstream) = upstreams.recv() {
        // Connections that took over meanwhile shut the ones before them: the newest counts.
        let upstream = upstreams.try_iter().last().unwrap_or(upstream);
        upstream.set_nodelay(true)?;
        let mut r = BufReader::with_capacity(1 << 20, upstream);
        // A predecessor that goes away (closed, broken or taken over) is replaced by the next
        // connection.
        while let Ok(Some(frame)) = read_frame(&mut r, DEFAULT_MAX_PAYLOAD) {
            let Frame { header, payload } = frame;
            let out = match header.kind {
                Kind::Activation => {
                    let [microbatch, slot, position, count] = header.ids;
                    engine.step(Seat { microbatch, slot }, position, count, &payload)
                }
                Kind::Control => control(engine.as_mut(), index, &mut next, payload),
                other => Err(ProcessError::Protocol(format!("unexpected {other:?} frame"))),
            };
            let out = match out {
                // Without its sidecar (or its engine process) it can neither compute nor keep KV:
                // it stops, and is replaced.
                Err(e) if engine.lost() => {
                    error!(stage = index, error = %e, "the stage stops");
                    return Err(e);
                }
                Ok(out) => out,
                Err(e) => {
                    warn!(stage = index, error = %e, "dropped a frame");
                    continue;
                }
            };
            if downstream.as_ref().is_some_and(|(addr, w)| *addr != next || closed_by_peer(w.get_ref())) {
                downstream = None;
            }
            // A connection that breaks (a reset) is made again and the frame sent once more; if
            // that fails too, the successor is gone and the frame is lost until the driver repairs
            // the chain and sends it again. Connecting is tried once: a successor that refuses is
            // dead, and waiting for it would only hold up the repair.
            for _ in 0..2 {
                if downstream.is_none() {
                    downstream = connect_next(next, Duration::ZERO);
                }
                let Some((_, w)) = downstream.as_mut() else { break };
                if write_frame(w, &header, &out).and_then(|()| w.flush()).is_ok() {
                    break;
                }
                downstream = None;
            }
            if header.kind == Kind::Activation {
                engine.passed_on(header.ids[0]);
            }
        }
        // Shut the connection, not only this handle on it: the acceptor holds another, and the
        // predecessor must see it end (to connect again after a corrupted frame, say).
        let _ = r.get_ref().shutdown(Shutdown::Both);
    }
    Err(ProcessError::Protocol("the stage stopped accepting connections".into()))
}
