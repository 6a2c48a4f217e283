//! An engine process's part in prompt-token disaggregation ([`crate::handoff`]), carried out by its
//! stage host, so that an engine of any language takes part with two messages: **read** (the KV
//! of a sequence's tokens, packed) and **write** (KV to take in place of computing it).
//!
//! - A prompt stage's host, once the engine has answered a prompt's step, reads the prompt's KV
//!   out of the engine into host memory of its own and hands it over from there, in the
//!   background, as the reference model's stage does from its cache.
//! - A token stage's host, told to load a sequence, reads the prompt's KV from its own sidecar (a
//!   reader connection beside the engine's) into host memory, resharded to the stage's layers,
//!   and writes it into the engine, which keeps it with its sidecar as a prompt computed there.
//!
//! The host memory is one cache per microbatch, made when first needed, in a layout whose packing
//! is the protocol's (each head's vectors whole, token by token).

use std::collections::HashMap;
use std::net::SocketAddr;
use std::ops::Range;
use std::sync::Arc;

use dejavulib::layout::PerLayerOrder;
use dejavulib::local::LocalSidecar;
use dejavulib::{KvCache, KvLayout, KvRegion, KvSpec, Packing};
use parking_lot::Mutex;

use super::{Handoff, ProcessError, StageConfig, LOAD_PATIENCE};
use crate::handoff::{Handed, HandoffReceiver, HandoffSender};
use dejavu_engine::pipeline::Seat;

/// Which end of the handoff the stage is.
enum End {
    /// A prompt stage: hands each prompt over.
    Prompt(HandoffSender),
    /// A token stage: loads prompts from its sidecar, over a reader connection.
    Token { receiver: HandoffReceiver, sidecar: Mutex<LocalSidecar> },
}

/// A stage host's end of a handoff, for its engine process.
pub(super) struct HostHandoff {
    end: End,
    /// The KV spec of the stage's layers.
    spec: KvSpec,
    slots: u32,
    max_tokens: u32,
    /// Host memory per microbatch, made when first needed.
    caches: HashMap<u32, Arc<KvCache>>,
}

impl HostHandoff {
    /// The stage's end of the handoff `config` gives it, if any; `config.model` is the model the
    /// engine computes (its KV spec).
    pub(super) fn new(config: &StageConfig) -> Result<Option<Self>, ProcessError> {
        let Some(handoff) = &config.handoff else { return Ok(None) };
        let (model_spec, index, layers) = (config.model.kv_spec(), config.index, &config.layers);
        let spec = model_spec
            .share(layers.len() as u32, model_spec.kv_heads())
            .map_err(|e| ProcessError::Protocol(format!("layers {layers:?} of the model's KV: {e}")))?;
        let end = match handoff {
            Handoff::Prompt { shapes, sidecars, secret } => {
                shapes.check_stage(true, index, layers, config.slots, config.microbatches)?;
                let epoch = (index, config.epoch);
                End::Prompt(HandoffSender::new(
                    shapes,
                    model_spec,
                    epoch,
                    sidecars,
                    secret,
                    &config.transport,
                )?)
            }
            Handoff::Token { shapes } => {
                shapes.check_stage(false, index, layers, config.slots, config.microbatches)?;
                let Some(replication) = &config.replication else {
                    return Err(ProcessError::Protocol(
                        "a token stage loads prompts from its sidecar: it needs one".into(),
                    ));
                };
                let sidecar = LocalSidecar::reader(&replication.local)
                    .map_err(|e| ProcessError::Sidecar(format!("{}: {e}", replication.local.display())))?;
                let receiver = HandoffReceiver::new(shapes, model_spec, index)?;
                End::Token { receiver, sidecar: Mutex::new(sidecar) }
            }
        };
        let (slots, max_tokens) = (config.slots, config.max_tokens);
        Ok(Some(Self { end, spec, slots, max_tokens, caches: HashMap::new() }))
    }

    /// Whether the stage hands prompts over (a prompt stage).
    pub(super) fn hands_over(&self) -> bool {
        matches!(self.end, End::Prompt(_))
    }

    /// The region of `seat`'s `tokens` in the stage's KV.
    fn region(&self, seat: Seat, tokens: Range<u32>) -> KvRegion {
        KvRegion::new(0..self.spec.layers(), seat.slot..seat.slot + 1, 0..self.spec.kv_heads(), tokens)
    }

    /// `microbatch`'s host memory.
    fn cache(&mut self, microbatch: u32) -> Result<Arc<KvCache>, ProcessError> {
        if let Some(cache) = self.caches.get(&microbatch) {
            return Ok(cache.clone());
        }
        let layout = KvLayout::per_layer(self.spec, self.slots, self.max_tokens, PerLayerOrder::Bhsd)
            .map_err(|e| ProcessError::Protocol(e.to_string()))?;
        let cache = Arc::new(KvCache::new(layout)?);
        self.caches.insert(microbatch, cache.clone());
        Ok(cache)
    }

    /// As a prompt stage: `kv` is `seat`'s prompt (`tokens`) as the engine read it out; hands it
    /// over in the background. Returns the handoffs finished since the last call.
    pub(super) fn prompt_done(
        &mut self,
        seat: Seat,
        tokens: Range<u32>,
        kv: &[u8],
    ) -> Result<Handed, ProcessError> {
        let region = self.region(seat, tokens.clone());
        let cache = self.cache(seat.microbatch)?;
        cache.scatter(&region, Packing::token_major(&self.spec), kv)?;
        let End::Prompt(sender) = &mut self.end else {
            return Err(ProcessError::Protocol("a prompt handed over by a token stage".into()));
        };
        sender.prompt_done(&cache, seat, tokens)?;
        Ok(sender.finished())
    }

    /// As a token stage: `seat`'s prompt KV (`prompt_len` tokens) from the stage's sidecar,
    /// packed for the engine, and the payload bytes it came in.
    pub(super) fn load(&mut self, seat: Seat, prompt_len: u32) -> Result<(Vec<u8>, u64), ProcessError> {
        let cache = self.cache(seat.microbatch)?;
        let region = self.region(seat, 0..prompt_len);
        let End::Token { receiver, sidecar } = &self.end else {
            return Err(ProcessError::Protocol("a load for a stage that is not a token stage".into()));
        };
        let store: &Mutex<dyn dejavulib::ChunkStore> = sidecar;
        let bytes = receiver
            .load(&cache, seat, prompt_len, store, LOAD_PATIENCE)
            .map_err(|e| ProcessError::Sidecar(e.to_string()))?;
        let mut kv = vec![0; cache.packed_len(&region) as usize];
        cache.gather(&region, Packing::token_major(&self.spec), &mut kv)?;
        Ok((kv, bytes))
    }

    /// As a prompt stage: hands `token_stage`'s prompts to the sidecar at `to` from now on.
    pub(super) fn retarget(&self, token_stage: u32, to: SocketAddr) -> Result<(), ProcessError> {
        match &self.end {
            End::Prompt(sender) => Ok(sender.retarget(token_stage, to)?),
            End::Token { .. } => {
                Err(ProcessError::Protocol("a handoff target for a stage that is not a prompt stage".into()))
            }
        }
    }
}
