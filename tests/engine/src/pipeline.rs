//! Stages chained in one process: the reference against which distributed runs are compared.

use std::ops::Range;
use std::sync::Arc;

use dejavulib::layout::PerLayerOrder;
use dejavulib::{KvCache, KvLayout};

use crate::model::ModelConfig;
use crate::stage::{Stage, StageError};

/// The KV cache layout the stages keep.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CacheLayout {
    /// FasterTransformer's K `[L][B][H][D/x][S][x]`, V `[L][B][H][S][D]` (the paper's engine).
    FasterTransformer,
    /// One `[B][H][S][D]` tensor per layer and K/V (HF style).
    PerLayer,
}

/// Where a request lives: its microbatch and its slot in that microbatch's caches.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Seat {
    /// Microbatch.
    pub microbatch: u32,
    /// Slot within the microbatch.
    pub slot: u32,
}

/// A pipeline of stages, each with one KV cache per microbatch.
pub struct Pipeline {
    stages: Vec<Stage>,
    /// `caches[stage][microbatch]`.
    caches: Vec<Vec<Arc<KvCache>>>,
    slots: u32,
}

impl Pipeline {
    /// Stages over `splits` (consecutive layer ranges covering the model), each with
    /// `microbatches` caches of `slots` sequences of up to `max_tokens` tokens in `layout`.
    pub fn new(
        config: ModelConfig,
        splits: &[Range<u32>],
        layout: CacheLayout,
        slots: u32,
        microbatches: u32,
        max_tokens: u32,
    ) -> Result<Self, StageError> {
        let covered = splits.iter().try_fold(0, |next, r| (r.start == next).then_some(r.end));
        if splits.is_empty() || covered != Some(config.layers) {
            return Err(StageError::Invalid(format!(
                "splits {splits:?} do not cover layers 0..{}",
                config.layers
            )));
        }
        let stages = splits.iter().map(|r| Stage::new(config, r.clone())).collect::<Result<Vec<_>, _>>()?;
        let caches = stages
            .iter()
            .map(|stage| {
                (0..microbatches)
                    .map(|_| Ok(Arc::new(KvCache::new(cache_layout(stage, layout, slots, max_tokens)?)?)))
                    .collect::<Result<Vec<_>, StageError>>()
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Self { stages, caches, slots })
    }

    /// The stages.
    pub fn stages(&self) -> &[Stage] {
        &self.stages
    }

    /// The caches of `stage`, one per microbatch.
    pub fn caches(&self, stage: usize) -> &[Arc<KvCache>] {
        &self.caches[stage]
    }

    /// The seat of the `i`-th request.
    pub fn seat(&self, i: usize) -> Seat {
        Seat { microbatch: i as u32 / self.slots, slot: i as u32 % self.slots }
    }

    /// Runs `prompt` through every stage (its KV lands in the caches) and returns the first
    /// generated token.
    pub fn prefill(&self, seat: Seat, prompt: &[u32]) -> Result<u32, StageError> {
        self.run(seat, prompt, 0)
    }

    /// Runs `token` (at `position`) through every stage and returns the next token.
    pub fn decode(&self, seat: Seat, token: u32, position: u32) -> Result<u32, StageError> {
        self.run(seat, &[token], position)
    }

    /// Greedy generation of `new_tokens` tokens for each prompt, request `i` in [`Pipeline::seat`]`(i)`.
    pub fn generate(&self, prompts: &[Vec<u32>], new_tokens: usize) -> Result<Vec<Vec<u32>>, StageError> {
        prompts
            .iter()
            .enumerate()
            .map(|(i, prompt)| {
                let seat = self.seat(i);
                let mut out = Vec::with_capacity(new_tokens);
                let mut token = self.prefill(seat, prompt)?;
                while out.len() < new_tokens {
                    out.push(token);
                    if out.len() < new_tokens {
                        let position = (prompt.len() + out.len() - 1) as u32;
                        token = self.decode(seat, token, position)?;
                    }
                }
                Ok(out)
            })
            .collect()
    }

    fn run(&self, seat: Seat, tokens: &[u32], position: u32) -> Result<u32, StageError> {
        let caches = |stage: usize| {
            self.caches[stage]
                .get(seat.microbatch as usize)
                .ok_or_else(|| StageError::Input(format!("no microbatch {}", seat.microbatch)))
        };
        let mut hidden = self.stages[0].embed(tokens)?;
        for (i, stage) in self.stages.iter().enumerate() {
            stage.forward(caches(i)?, seat.slot, position, &mut hidden)?;
        }
        let d = hidden.len() / tokens.len();
        self.stages.last().expect("at least one stage").next_token(&hidden[hidden.len() - d..])
    }
}

/// The layout of one cache of `stage`.
pub fn cache_layout(
    stage: &Stage,
    layout: CacheLayout,
    slots: u32,
    max_tokens: u32,
) -> Result<KvLayout, StageError> {
    let spec = stage.local_spec();
    let built = match layout {
        CacheLayout::FasterTransformer => KvLayout::faster_transformer(spec, slots, max_tokens),
        CacheLayout::PerLayer => KvLayout::per_layer(spec, slots, max_tokens, PerLayerOrder::Bhsd),
    };
    built.map_err(|e| StageError::Invalid(e.to_string()))
}
