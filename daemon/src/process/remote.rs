//! The driver's end of a chain of stage processes: it sends each step's tokens to the first stage,
//! takes the next token from the last, and carries recoveries out along the chain.

use std::io::{BufReader, BufWriter, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

use crossbeam_channel::Receiver;
use dejavulib::wire::{read_frame, write_frame, Frame, FrameHeader, Kind, DEFAULT_MAX_PAYLOAD};
use tracing::warn;

use super::chain::{accept_within, closed_by_peer, connect, say_hello, DRIVER};
use super::{tokens_of, tokens_payload, ProcessError, LOAD_PATIENCE};
use dejavu_engine::pipeline::Seat;
use dejavu_proto::fencing::{fenced_since, newest_of};
use dejavulib::message::{Message, SeatIds, NO_STAGE};

/// Frames coming out of the last stage, read whole by a thread of their own (a deadline never
/// leaves half a frame read).
fn read_replies(stream: TcpStream) -> Receiver<Result<Frame, ProcessError>> {
    let (tx, rx) = crossbeam_channel::bounded(64);
    std::thread::spawn(move || {
        let mut r = BufReader::new(stream);
        loop {
            let result = match read_frame(&mut r, DEFAULT_MAX_PAYLOAD) {
                Ok(Some(frame)) => Ok(frame),
                Ok(None) => Err(ProcessError::LastStageClosed),
                Err(e) => Err(ProcessError::Frame(e)),
            };
            let end = result.is_err();
            if tx.send(result).is_err() || end {
                return;
            }
        }
    });
    rx
}

/// A step's result as the last stage reported it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StepReply {
    /// The next token.
    pub token: u32,
    /// The sequence the step ran for.
    pub seat: Seat,
    /// Tokens of the sequence with KV after the step (its position plus its token count).
    pub kv_end: u32,
}

/// Where a replaced stage restores its KV from, as a recovery's controller ordered.
#[derive(Clone, Debug)]
pub struct RestoreSource {
    /// The stage.
    pub stage: u32,
    /// The sidecar holding its KV (`None`: its own).
    pub from: Option<SocketAddr>,
    /// What the controller did and found for it: each sequence's first unreplicated token there.
    pub orders: crate::controller::StageOrders,
}

/// What recovering one sequence took.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SequenceRecovery {
    /// Steps recomputed: what the copy that lacked most did not have.
    pub recomputed: u64,
    /// For each source, in order, the steps its copy lacked (its replication lag).
    pub lacked: Vec<u64>,
}

/// The driver's end of a chain of stage processes.
pub struct RemotePipeline {
    /// Where the first stage is reached.
    first: SocketAddr,
    to_first: BufWriter<TcpStream>,
    results: TcpListener,
    replies: Receiver<Result<Frame, ProcessError>>,
    /// Time a step may take.
    deadline: Duration,
    /// Time a control operation may take (restores and copies move whole sequences).
    control_deadline: Duration,
    next_request: u64,
    /// The cluster's epoch: the driver's hellos carry it, and a replacement of the last stage must
    /// say it or a newer one.
    epoch: u64,
    /// The index of the last stage: only it may connect to `results`.
    last_stage: u32,
    /// The epoch the last stage in use was started in: a connection from an older one is refused
    /// (when the same last stage connects again, after a reset, it says the same).
    last_stage_epoch: u64,
    /// The cluster secret, which its connections prove.
    secret: Vec<u8>,
    /// The epochs the controller opens, as it opens them (see [`RemotePipeline::watch_fences`]).
    fences: Receiver<u64>,
}

impl RemotePipeline {
    /// Connects to the first stage at `first` and takes the last stage's connection on `results`
    /// (stage `last_stage`'s), both proving the cluster secret `secret`; a step slower than
    /// `deadline` is a [`ProcessError::Timeout`].
    pub fn connect(
        first: SocketAddr,
        results: TcpListener,
        last_stage: u32,
        deadline: Duration,
        secret: &[u8],
    ) -> Result<Self, ProcessError> {
        let to_first = Self::connect_first(first, 0, secret, Duration::from_secs(30))?;
        let (_, placeholder) = crossbeam_channel::bounded(0);
        let control_deadline = (deadline * 20).max(Duration::from_secs(10));
        let mut pipeline = Self {
            first,
            to_first,
            results,
            replies: placeholder,
            deadline,
            control_deadline,
            next_request: 1,
            epoch: 0,
            last_stage,
            last_stage_epoch: 0,
            secret: secret.to_vec(),
            fences: crossbeam_channel::never(),
        };
        // The last stage connects when it first passes something on: send a probe through.
        let request = pipeline.send(&Message::Probe)?;
        let last = accept_within(&pipeline.results, last_stage, 0, secret, control_deadline)?;
        pipeline.replies = read_replies(last);
        pipeline.reply(request, control_deadline)?;
        Ok(pipeline)
    }

    fn connect_first(
        first: SocketAddr,
        epoch: u64,
        secret: &[u8],
        patience: Duration,
    ) -> Result<BufWriter<TcpStream>, ProcessError> {
        let to_first = connect(first, patience)?;
        say_hello(&to_first, secret, DRIVER, epoch)?;
        Ok(BufWriter::new(to_first))
    }

    /// Takes the epochs the controller opens from `fences`, as it opens them: a step waiting for
    /// its reply when one newer than the pipeline's comes fails at once, with
    /// [`ProcessError::Fenced`] (the controller declared a stage dead: the reply may never come),
    /// rather than at its deadline.
    pub fn watch_fences(&mut self, fences: Receiver<u64>) {
        self.fences = fences;
    }

    /// The epoch it is in: the last recovery's (0: none yet).
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// Moves to a new epoch (a recovery's): replacements are started in it, and from now on a new
    /// last stage must say it (or a newer one) to be taken.
    pub fn set_epoch(&mut self, epoch: u64) {
        self.epoch = newest_of(self.epoch, epoch);
    }

    fn write(&mut self, kind: Kind, ids: [u32; 4], payload: &[u8]) -> Result<u64, ProcessError> {
        let request = self.next_request;
        self.next_request += 1;
        let mut header = FrameHeader::new(kind, u32::MAX, 0, request);
        header.ids = ids;
        let sent = if closed_by_peer(self.to_first.get_ref()) {
            Err(std::io::Error::from(std::io::ErrorKind::ConnectionReset))
        } else {
            write_frame(&mut self.to_first, &header, payload).and_then(|()| self.to_first.flush())
        };
        if sent.is_err() {
            // The connection broke (a reset, or a first stage that went away): connect again,
            // once, and send the frame there.
            self.to_first = Self::connect_first(self.first, self.epoch, &self.secret, self.deadline)?;
            write_frame(&mut self.to_first, &header, payload)?;
            self.to_first.flush()?;
        }
        Ok(request)
    }

    /// The reply to `request`, skipping late replies to earlier requests. When the last stage's
    /// connection breaks (a reset, a corrupted frame), the reply it carried is lost: this returns
    /// at once, and the next wait first takes the connection the last stage makes again as it next
    /// sends something.
    fn reply(&mut self, request: u64, deadline: Duration) -> Result<Frame, ProcessError> {
        self.await_reply(request, deadline, false)
    }

    /// As [`RemotePipeline::reply`]; with `fenceable`, a fence newer than the pipeline's epoch
    /// ends the wait too.
    fn await_reply(
        &mut self,
        request: u64,
        deadline: Duration,
        fenceable: bool,
    ) -> Result<Frame, ProcessError> {
        let until = Instant::now() + deadline;
        let never = crossbeam_channel::never();
        loop {
            let left = until.saturating_duration_since(Instant::now());
            let (replies, fences) = (self.replies.clone(), if fenceable { &self.fences } else { &never });
            let got = crossbeam_channel::select! {
                recv(replies) -> got => got,
                recv(fences) -> fence => match fence {
                    Ok(epoch) if fenced_since(self.epoch, epoch) => return Err(ProcessError::Fenced(epoch)),
                    // An epoch the pipeline has moved to already (its own recovery's).
                    Ok(_) => continue,
                    Err(_) => {
                        self.fences = crossbeam_channel::never();
                        continue;
                    }
                },
                default(left) => return Err(ProcessError::Timeout(deadline)),
            };
            match got {
                Ok(Ok(frame)) if frame.header.request == request => return Ok(frame),
                Ok(Ok(_late)) => continue,
                Ok(Err(e)) => {
                    let (_, closed) = crossbeam_channel::bounded(0);
                    self.replies = closed;
                    return Err(e);
                }
                Err(_disconnected) => {
                    let epoch = self.last_stage_epoch;
                    match accept_within(&self.results, self.last_stage, epoch, &self.secret, left) {
                        Ok(stream) => self.replies = read_replies(stream),
                        Err(ProcessError::Timeout(_)) => return Err(ProcessError::Timeout(deadline)),
                        Err(e) => return Err(e),
                    }
                }
            }
        }
    }

    /// Sends a control message round the chain.
    fn send(&mut self, message: &Message) -> Result<u64, ProcessError> {
        self.write(Kind::Control, [NO_STAGE; 4], &message.encode())
    }

    /// Sends a control message round the chain and waits for what comes back; with `fenceable`,
    /// a fence newer than the pipeline's epoch ends the wait ([`ProcessError::Fenced`]).
    fn control(&mut self, message: &Message, fenceable: bool) -> Result<Message, ProcessError> {
        let request = self.send(message)?;
        let reply = self.await_reply(request, self.control_deadline, fenceable)?;
        Message::decode(&reply.payload).map_err(|e| ProcessError::Protocol(e.to_string()))
    }

    /// Runs `tokens` at `position` of `seat` through the chain; returns the next token.
    pub fn run(&mut self, seat: Seat, tokens: &[u32], position: u32) -> Result<u32, ProcessError> {
        Ok(self.step(seat, tokens, position)?.token)
    }

    /// A step a recovery recomputes: a fence opened meanwhile (another failure) does not cut it
    /// short, since the chain is only partly repaired and the recovery's attempt would be left
    /// half done; the next step of the run finds the fence.
    fn recompute(&mut self, seat: Seat, tokens: &[u32], position: u32) -> Result<u32, ProcessError> {
        Ok(self.step_unless(seat, tokens, position, false)?.token)
    }

    /// Runs `tokens` at `position` of `seat` through the chain; returns the next token with what
    /// the last stage says it computed. A fence the pipeline has not recovered from ends the wait
    /// ([`RemotePipeline::watch_fences`]).
    pub fn step(&mut self, seat: Seat, tokens: &[u32], position: u32) -> Result<StepReply, ProcessError> {
        self.step_unless(seat, tokens, position, true)
    }

    /// As [`RemotePipeline::step`]; with `fenceable` false, only the deadline ends the wait.
    fn step_unless(
        &mut self,
        seat: Seat,
        tokens: &[u32],
        position: u32,
        fenceable: bool,
    ) -> Result<StepReply, ProcessError> {
        let ids = [seat.microbatch, seat.slot, position, tokens.len() as u32];
        let request = self.write(Kind::Activation, ids, &tokens_payload(tokens))?;
        let Frame { header, payload } = self.await_reply(request, self.deadline, fenceable)?;
        let [microbatch, slot, position, count] = header.ids;
        match tokens_of(&payload)[..] {
            [token] => Ok(StepReply { token, seat: Seat { microbatch, slot }, kv_end: position + count }),
            _ => Err(ProcessError::Protocol("a step's reply is one token".into())),
        }
    }

    /// Tells stage `stage` to restore `seat`'s KV (prompt of `prompt_len`, KV of up to `kv_tokens`
    /// tokens) from the sidecar at `from` (`None`: its own); returns how many tokens it restored.
    /// A fence newer than the pipeline's epoch (a stage died during the recovery) fails it at once
    /// ([`ProcessError::Fenced`]).
    pub fn restore(
        &mut self,
        stage: u32,
        seat: Seat,
        prompt_len: u32,
        kv_tokens: u32,
        from: Option<SocketAddr>,
    ) -> Result<u32, ProcessError> {
        let seat = SeatIds { microbatch: seat.microbatch, slot: seat.slot };
        let restore = Message::Restore { stage, seat, prompt_len, kv_tokens, from };
        // Only recoveries restore: a stage that dies during one keeps the reply from ever coming
        // round the chain, and its fence says so long before the control deadline.
        match self.control(&restore, true)? {
            Message::Restored { stage: s, tokens } if s == stage => Ok(tokens),
            _ => Err(ProcessError::Protocol(format!("stage {stage} did not report a restore"))),
        }
    }

    /// Tells each of the first `stages` stages to load `seat`'s prompt KV (`prompt_len` tokens),
    /// handed over by a prompt pipeline; returns the fewest tokens a stage loaded (0: some stage
    /// could not, and the prompt must be computed here).
    pub fn load(&mut self, stages: u32, seat: Seat, prompt_len: u32) -> Result<u32, ProcessError> {
        let seat = SeatIds { microbatch: seat.microbatch, slot: seat.slot };
        // All sent at once: the loads run one after another down the chain, not one round trip each.
        let requests = (0..stages)
            .map(|stage| Ok((stage, self.send(&Message::Load { stage, seat, prompt_len })?)))
            .collect::<Result<Vec<_>, ProcessError>>()?;
        // A step's time, and each stage's patience for chunks on their way.
        let deadline = self.deadline + LOAD_PATIENCE * stages;
        let mut fewest = prompt_len;
        for (stage, request) in requests {
            let reply = self.reply(request, deadline)?.payload;
            match Message::decode(&reply) {
                Ok(Message::Loaded { stage: s, tokens }) if s == stage => fewest = fewest.min(tokens),
                _ => return Err(ProcessError::Protocol(format!("stage {stage} did not report a load"))),
            }
        }
        Ok(fewest)
    }

    /// Tells prompt stage `stage` to hand token stage `token_stage`'s prompts to the sidecar at
    /// `to` from now on.
    pub fn handoff_to(&mut self, stage: u32, token_stage: u32, to: SocketAddr) -> Result<(), ProcessError> {
        let request = self.send(&Message::HandoffTo { stage, token_stage, to })?;
        // Nothing to move: a step's deadline, so that a dead prompt pipeline does not hold the
        // token pipeline's recovery up for a control operation's.
        self.reply(request, self.deadline)?;
        Ok(())
    }

    /// Pauses (`on` false) or resumes stage `stage`'s replication of the steps it computes (a
    /// prompt loaded from a prompt pipeline is still replicated; a replacement starts with
    /// replication on). A step computed while paused is not in the stage's copies: a recovery
    /// restores a sequence up to its first such step and recomputes the rest. While paused, the
    /// stage does not look at its earlier copies' completions either, so its pending-copies
    /// metric and failures are counted once it resumes. For measuring what replication costs,
    /// in one run ([`crate::cluster::Cluster::set_replication`]).
    pub fn set_replication(&mut self, stage: u32, on: bool) -> Result<(), ProcessError> {
        self.control(&Message::Replication { stage, on }, false)?;
        Ok(())
    }

    /// Recovers one sequence on replaced stages: restores each stage's KV from the sidecar its
    /// source names, up to the source's mark for the sequence if the controller found one (its
    /// first unreplicated token), then recomputes the steps the copies lacked (the replication
    /// lag; recomputing a step rewrites the same KV everywhere), checking that they give the
    /// tokens already generated.
    pub fn recover(
        &mut self,
        sources: &[RestoreSource],
        seat: Seat,
        prompt: &[u32],
        generated: &[u32],
    ) -> Result<SequenceRecovery, ProcessError> {
        let mut recovery = SequenceRecovery { recomputed: 0, lacked: vec![0; sources.len()] };
        if generated.is_empty() {
            return Ok(recovery);
        }
        let prompt_len = prompt.len() as u32;
        // KV exists for the prompt and every generated token but the last.
        let needed = prompt_len + generated.len() as u32 - 1;
        // Steps that rebuild KV up to `needed` from `restored` tokens (the prompt is one step).
        let steps_from = |restored: u32| {
            if restored < prompt_len {
                1 + u64::from(needed - prompt_len)
            } else {
                u64::from(needed - restored)
            }
        };
        let mut restored = needed;
        for (i, source) in sources.iter().enumerate() {
            let mark = source.orders.mark_of(seat.microbatch, seat.slot);
            let wanted = mark.map_or(needed, |mark| mark.min(needed));
            let this = self.restore(source.stage, seat, prompt_len, wanted, source.from)?;
            if mark.is_some() && this != wanted {
                // The copy changed since the controller looked: what was restored counts.
                warn!(stage = source.stage, ?seat, wanted, restored = this, "restored other than the mark");
            }
            recovery.lacked[i] = steps_from(this);
            restored = restored.min(this);
        }
        let mismatch = |position| {
            ProcessError::Protocol(format!("a recomputed step at position {position} gave another token"))
        };
        if restored < prompt_len {
            if self.recompute(seat, prompt, 0)? != generated[0] {
                return Err(mismatch(0));
            }
            restored = prompt_len;
            recovery.recomputed += 1;
        }
        for position in restored..needed {
            let index = (position - prompt_len) as usize;
            if self.recompute(seat, &[generated[index]], position)? != generated[index + 1] {
                return Err(mismatch(position));
            }
            recovery.recomputed += 1;
        }
        Ok(recovery)
    }

    /// Repairs the chain after stage `stage` was replaced by a process listening at `addr`: its
    /// predecessor sends there from now on (or, for the first stage, the driver does; for the last,
    /// the driver takes the replacement's connection). Returns once a frame has gone all the way
    /// round.
    pub fn replace(&mut self, stage: u32, addr: SocketAddr, last: bool) -> Result<(), ProcessError> {
        self.replace_all(&[(stage, addr)], last)
    }

    /// Repairs the chain after several stages were replaced at once (`replaced`: each stage and
    /// its replacement's address, `last_replaced`: whether the last stage is among them), in the
    /// only order that works: the driver connects to a new first stage, then each rewire travels
    /// the chain, then the driver takes a new last stage's connection, then every reply is awaited.
    pub fn replace_all(
        &mut self,
        replaced: &[(u32, SocketAddr)],
        last_replaced: bool,
    ) -> Result<(), ProcessError> {
        if let Some(&(_, addr)) = replaced.iter().find(|(stage, _)| *stage == 0) {
            self.to_first = Self::connect_first(addr, self.epoch, &self.secret, Duration::from_secs(30))?;
            self.first = addr;
        }
        // One frame rewires every stage before a replaced one, each as the frame passes it, so it
        // goes round the repaired chain; with nothing to rewire (only the first stage replaced)
        // it is a probe that proves the chain.
        let rewires: Vec<(u32, SocketAddr)> = replaced
            .iter()
            .filter(|(stage, _)| *stage != 0)
            .map(|&(stage, addr)| (stage - 1, addr))
            .collect();
        let request = self.send(&Message::Rewire(rewires))?;
        if last_replaced {
            let last = accept_within(
                &self.results,
                self.last_stage,
                self.epoch,
                &self.secret,
                self.control_deadline,
            )?;
            self.replies = read_replies(last);
            self.last_stage_epoch = self.epoch;
        }
        self.reply(request, self.control_deadline)?;
        Ok(())
    }
}
