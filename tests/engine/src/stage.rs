//! A pipeline stage: a range of layers, run over one sequence slot of a KV cache.
//!
//! Each layer writes the new tokens' K and V into the cache with one scatter, then reads the keys
//! and values of every token so far with one gather, both in token-major packing: the KV really
//! lives in the cache (in whatever layout it uses), so a cache restored from a replica continues
//! the sequence exactly as the original would have.

use std::ops::Range;

use dejavulib::{CacheError, KvCache, KvRegion, KvSpec, Packing};
use thiserror::Error;

use crate::math::{argmax, matvec, rms_norm, rope, silu, softmax};
use crate::model::{Embedding, Head, LayerWeights, ModelConfig};

/// Errors of a stage.
#[derive(Debug, Error)]
pub enum StageError {
    /// The configuration or layer range is unusable.
    #[error("invalid stage: {0}")]
    Invalid(String),
    /// Input of the wrong size or a token outside the vocabulary.
    #[error("bad input: {0}")]
    Input(String),
    /// The cache refused a read or write (full, wrong layout).
    #[error(transparent)]
    Cache(#[from] CacheError),
}

/// Layers `layers` of the model, with the embedding if it is the first stage and the output head
/// if it is the last.
pub struct Stage {
    config: ModelConfig,
    layers: Range<u32>,
    weights: Vec<LayerWeights>,
    embedding: Option<Embedding>,
    head: Option<Head>,
}

impl Stage {
    /// The stage running global `layers` of `config`.
    pub fn new(config: ModelConfig, layers: Range<u32>) -> Result<Self, StageError> {
        config.validate().map_err(StageError::Invalid)?;
        if layers.is_empty() || layers.end > config.layers {
            return Err(StageError::Invalid(format!("layers {layers:?} of a {}-layer model", config.layers)));
        }
        Ok(Self {
            weights: layers.clone().map(|l| LayerWeights::generate(&config, l)).collect(),
            embedding: (layers.start == 0).then(|| Embedding::generate(&config)),
            head: (layers.end == config.layers).then(|| Head::generate(&config)),
            config,
            layers,
        })
    }

    /// Global layers it runs.
    pub fn layers(&self) -> Range<u32> {
        self.layers.clone()
    }

    /// The spec of its KV caches (its layers, every KV head).
    pub fn local_spec(&self) -> KvSpec {
        self.config.kv_spec().share(self.layers.len() as u32, self.config.kv_heads).expect("a valid share")
    }

    /// Hidden states (`tokens.len()` rows of `d_model`) for `tokens`. First stage only.
    pub fn embed(&self, tokens: &[u32]) -> Result<Vec<f32>, StageError> {
        let table =
            self.embedding.as_ref().ok_or_else(|| StageError::Invalid("not the first stage".into()))?;
        let d = self.config.d_model as usize;
        let mut hidden = Vec::with_capacity(tokens.len() * d);
        for &t in tokens {
            if t >= self.config.vocab {
                return Err(StageError::Input(format!(
                    "token {t} outside a vocabulary of {}",
                    self.config.vocab
                )));
            }
            hidden.extend_from_slice(&table.table[t as usize * d..(t as usize + 1) * d]);
        }
        Ok(hidden)
    }

    /// Runs the stage's layers over `hidden` (rows of `d_model`, the tokens at positions
    /// `position..`) of sequence `slot`, whose earlier tokens' KV is in `cache`; writes the new
    /// tokens' KV into `cache` and leaves the output in `hidden`.
    pub fn forward(
        &self,
        cache: &KvCache,
        slot: u32,
        position: u32,
        hidden: &mut [f32],
    ) -> Result<(), StageError> {
        let d = self.config.d_model as usize;
        if hidden.is_empty() || hidden.len() % d != 0 {
            return Err(StageError::Input(format!(
                "hidden state of {} values is not rows of {d}",
                hidden.len()
            )));
        }
        let spec = *cache.layout().spec();
        if !spec.same_elements(&self.local_spec()) || spec.layers() != self.layers.len() as u32 {
            return Err(StageError::Invalid(format!(
                "cache spec {spec:?} does not fit stage {:?}",
                self.local_spec()
            )));
        }
        for (local, weights) in self.weights.iter().enumerate() {
            self.layer(cache, local as u32, weights, slot, position, hidden)?;
        }
        Ok(())
    }

    /// Final norm, output projection and argmax of one hidden row. Last stage only.
    pub fn next_token(&self, last: &[f32]) -> Result<u32, StageError> {
        let head = self.head.as_ref().ok_or_else(|| StageError::Invalid("not the last stage".into()))?;
        let mut x = last.to_vec();
        rms_norm(&mut x, &head.norm);
        let mut logits = vec![0.0; self.config.vocab as usize];
        matvec(&x, &head.w, logits.len(), &mut logits);
        Ok(argmax(&logits) as u32)
    }

    fn layer(
        &self,
        cache: &KvCache,
        layer: u32,
        w: &LayerWeights,
        slot: u32,
        position: u32,
        hidden: &mut [f32],
    ) -> Result<(), StageError> {
        let c = &self.config;
        let (d, hd) = (c.d_model as usize, c.head_dim() as usize);
        let (qh, kvh) = (c.q_heads as usize, c.kv_heads as usize);
        let tokens = hidden.len() / d;
        let packing = Packing::token_major(cache.layout().spec());

        // Project every new token, then write their K and V with one scatter.
        let mut queries = vec![0.0; tokens * qh * hd];
        let mut new_kv = vec![0.0f32; 2 * kvh * tokens * hd]; // [K|V][head][token][dim]
        let mut normed = vec![0.0; d];
        let (mut k, mut v) = (vec![0.0; kvh * hd], vec![0.0; kvh * hd]);
        for t in 0..tokens {
            normed.copy_from_slice(&hidden[t * d..(t + 1) * d]);
            rms_norm(&mut normed, &w.attn_norm);
            let q = &mut queries[t * qh * hd..(t + 1) * qh * hd];
            matvec(&normed, &w.wq, qh * hd, q);
            matvec(&normed, &w.wk, kvh * hd, &mut k);
            matvec(&normed, &w.wv, kvh * hd, &mut v);
            let pos = position + t as u32;
            for head in q.chunks_mut(hd).chain(k.chunks_mut(hd)) {
                rope(head, pos);
            }
            for h in 0..kvh {
                let at = (h * tokens + t) * hd;
                new_kv[at..at + hd].copy_from_slice(&k[h * hd..(h + 1) * hd]);
                let at = ((kvh + h) * tokens + t) * hd;
                new_kv[at..at + hd].copy_from_slice(&v[h * hd..(h + 1) * hd]);
            }
        }
        let written = KvRegion::new(
            layer..layer + 1,
            slot..slot + 1,
            0..c.kv_heads,
            position..position + tokens as u32,
        );
        cache.scatter(&written, packing, &to_bytes(&new_kv))?;

        // Read back every token so far with one gather, and attend causally.
        let total = position as usize + tokens;
        let context = KvRegion::new(layer..layer + 1, slot..slot + 1, 0..c.kv_heads, 0..total as u32);
        let mut bytes = vec![0u8; cache.packed_len(&context) as usize];
        cache.gather(&context, packing, &mut bytes)?;
        let kv = from_bytes(&bytes); // [K|V][head][token][dim]
        let scale = 1.0 / (hd as f32).sqrt();
        let mut attended = vec![0.0; qh * hd];
        let mut projected = vec![0.0; d];
        let mut scores = Vec::with_capacity(total);
        for t in 0..tokens {
            let visible = position as usize + t + 1;
            for h in 0..qh {
                let g = h / (qh / kvh);
                let q = &queries[(t * qh + h) * hd..(t * qh + h + 1) * hd];
                scores.clear();
                for s in 0..visible {
                    let key = &kv[(g * total + s) * hd..(g * total + s + 1) * hd];
                    scores.push(q.iter().zip(key).map(|(a, b)| a * b).sum::<f32>() * scale);
                }
                softmax(&mut scores);
                let out = &mut attended[h * hd..(h + 1) * hd];
                out.fill(0.0);
                for (s, p) in scores.iter().enumerate() {
                    let value = &kv[((kvh + g) * total + s) * hd..((kvh + g) * total + s + 1) * hd];
                    for (o, x) in out.iter_mut().zip(value) {
                        *o += p * x;
                    }
                }
            }
            matvec(&attended, &w.wo, d, &mut projected);
            let row = &mut hidden[t * d..(t + 1) * d];
            for (x, p) in row.iter_mut().zip(&projected) {
                *x += p;
            }
            self.mlp(w, row);
        }
        Ok(())
    }

    fn mlp(&self, w: &LayerWeights, row: &mut [f32]) {
        let f = self.config.ffn as usize;
        let mut normed = row.to_vec();
        rms_norm(&mut normed, &w.mlp_norm);
        let (mut gate, mut up) = (vec![0.0; f], vec![0.0; f]);
        matvec(&normed, &w.w_gate, f, &mut gate);
        matvec(&normed, &w.w_up, f, &mut up);
        for (g, u) in gate.iter_mut().zip(&up) {
            *g = silu(*g) * u;
        }
        let mut down = vec![0.0; row.len()];
        matvec(&gate, &w.w_down, row.len(), &mut down);
        for (x, y) in row.iter_mut().zip(&down) {
            *x += y;
        }
    }
}

fn to_bytes(values: &[f32]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

fn from_bytes(bytes: &[u8]) -> Vec<f32> {
    bytes.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect()
}
