//! The model's shape and its deterministic weights.

use dejavulib::{DType, KvSpec};

use crate::math::Rng;

/// Shape of the reference model and the seed of its weights.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ModelConfig {
    /// Transformer layers.
    pub layers: u32,
    /// Width of the residual stream.
    pub d_model: u32,
    /// Query heads.
    pub q_heads: u32,
    /// Key/value heads (grouped-query attention: a divisor of `q_heads`).
    pub kv_heads: u32,
    /// Hidden width of the MLP.
    pub ffn: u32,
    /// Vocabulary size.
    pub vocab: u32,
    /// Seed of every weight.
    pub seed: u64,
}

impl ModelConfig {
    /// The reference model: 8 layers, d_model 256, 8 query and 2 KV heads of 32, MLP 512,
    /// vocabulary 512.
    pub fn reference() -> Self {
        Self { layers: 8, d_model: 256, q_heads: 8, kv_heads: 2, ffn: 512, vocab: 512, seed: 0xde1a_5eed }
    }

    /// Elements per head.
    pub fn head_dim(&self) -> u32 {
        self.d_model / self.q_heads
    }

    /// The KV cache spec of the whole model (f32 K and V).
    pub fn kv_spec(&self) -> KvSpec {
        KvSpec::new(self.layers, self.kv_heads, self.head_dim(), DType::F32).expect("a validated config")
    }

    /// Checks that the shape is usable.
    pub fn validate(&self) -> Result<(), String> {
        let ok = self.layers > 0
            && self.d_model > 0
            && self.vocab > 0
            && self.ffn > 0
            && self.q_heads > 0
            && self.kv_heads > 0
            && self.d_model % self.q_heads == 0
            && self.q_heads % self.kv_heads == 0
            && self.head_dim() % 2 == 0;
        if ok {
            Ok(())
        } else {
            Err(format!("unusable model shape {self:?}: d_model must split into q_heads heads of even size, q_heads into kv_heads groups"))
        }
    }

    fn rng(&self, stream: u64) -> Rng {
        Rng::new(self.seed ^ stream.wrapping_mul(0xa076_1d64_78bd_642f))
    }
}

/// Uniform weights with unit output variance for an input of `fan_in` unit-variance values.
fn weights(rng: &mut Rng, fan_in: u32, n: usize) -> Vec<f32> {
    rng.fill(n, (3.0 / fan_in as f32).sqrt())
}

/// One layer's weights (row-major matrices, input dimension first).
pub struct LayerWeights {
    pub(crate) attn_norm: Vec<f32>,
    pub(crate) wq: Vec<f32>,
    pub(crate) wk: Vec<f32>,
    pub(crate) wv: Vec<f32>,
    pub(crate) wo: Vec<f32>,
    pub(crate) mlp_norm: Vec<f32>,
    pub(crate) w_gate: Vec<f32>,
    pub(crate) w_up: Vec<f32>,
    pub(crate) w_down: Vec<f32>,
}

impl LayerWeights {
    /// The weights of global layer `layer`: the same in every process that asks.
    pub fn generate(config: &ModelConfig, layer: u32) -> Self {
        let mut rng = config.rng(layer as u64 + 1);
        let (d, q, kv, f) = (
            config.d_model as usize,
            (config.q_heads * config.head_dim()) as usize,
            (config.kv_heads * config.head_dim()) as usize,
            config.ffn as usize,
        );
        Self {
            attn_norm: vec![1.0; d],
            wq: weights(&mut rng, config.d_model, d * q),
            wk: weights(&mut rng, config.d_model, d * kv),
            wv: weights(&mut rng, config.d_model, d * kv),
            wo: weights(&mut rng, q as u32, q * d),
            mlp_norm: vec![1.0; d],
            w_gate: weights(&mut rng, config.d_model, d * f),
            w_up: weights(&mut rng, config.d_model, d * f),
            w_down: weights(&mut rng, config.ffn, f * d),
        }
    }
}

/// Token embeddings (first stage).
pub struct Embedding {
    pub(crate) table: Vec<f32>,
}

impl Embedding {
    /// The embedding table of `config`.
    pub fn generate(config: &ModelConfig) -> Self {
        let mut rng = config.rng(0);
        Self { table: rng.fill((config.vocab * config.d_model) as usize, 1.0) }
    }
}

/// Final norm and output projection (last stage).
pub struct Head {
    pub(crate) norm: Vec<f32>,
    pub(crate) w: Vec<f32>,
}

impl Head {
    /// The output head of `config`.
    pub fn generate(config: &ModelConfig) -> Self {
        let mut rng = config.rng(u64::MAX);
        Self {
            norm: vec![1.0; config.d_model as usize],
            w: weights(&mut rng, config.d_model, (config.d_model * config.vocab) as usize),
        }
    }
}
