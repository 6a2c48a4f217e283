//! KV sizing: bytes per token, per request, per microbatch and per worker.
//!
//! Bytes per token = `2 x bytes_per_elem x kv_heads x head_dim x layers` (K and V, every layer and
//! KV head), plus the scale arrays of quantized KV. LLaMA-2-13B in bf16: 819,200 B; LLaMA-2-70B
//! with 8 KV heads in fp16: 327,680 B.

use crate::placement::{Setup, WorkerId};
use crate::spec::KvSpec;

/// KV bytes of a model for a workload.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvSizing {
    /// Bytes of one token of one request, every layer.
    pub bytes_per_token: u64,
    /// Bytes of one token of one request in one layer.
    pub bytes_per_token_layer: u64,
    /// Bytes of one request at full length (prompt + output tokens).
    pub bytes_per_request: u64,
    /// Bytes of one microbatch at full length.
    pub bytes_per_microbatch: u64,
}

impl KvSizing {
    /// Sizes `spec` for requests of `prompt + output` tokens in microbatches of `batch` requests.
    pub fn new(spec: &KvSpec, prompt: u64, output: u64, batch: u64) -> Self {
        let bytes_per_token = spec.bytes_per_token();
        let tokens = prompt.saturating_add(output);
        Self {
            bytes_per_token,
            bytes_per_token_layer: bytes_per_token / spec.layers() as u64,
            bytes_per_request: bytes_per_token.saturating_mul(tokens),
            bytes_per_microbatch: bytes_per_token.saturating_mul(tokens).saturating_mul(batch),
        }
    }

    /// KV bytes one worker of `setup` holds per token of one request: its layers and its head
    /// shard (a GQA replica counts in full: each replica holds the head).
    pub fn worker_bytes_per_token(setup: &Setup, worker: WorkerId) -> Option<u64> {
        Some(setup.local_spec(worker).ok()?.bytes_per_token())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::placement::StageSpec;
    use crate::spec::DType;

    #[test]
    fn llama_examples_and_per_request_sizes() {
        let l13 = KvSpec::new(40, 40, 128, DType::BF16).unwrap();
        let s = KvSizing::new(&l13, 1000, 24, 8);
        assert_eq!(s.bytes_per_token, 819_200);
        assert_eq!(s.bytes_per_token_layer, 20_480);
        assert_eq!(s.bytes_per_request, 819_200 * 1024);
        assert_eq!(s.bytes_per_microbatch, 819_200 * 1024 * 8);
        let l70 = KvSpec::new(80, 8, 128, DType::F16).unwrap();
        assert_eq!(KvSizing::new(&l70, 1, 0, 1).bytes_per_token, 327_680);
    }

    #[test]
    fn worker_share_follows_layers_and_heads() {
        let spec = KvSpec::new(80, 8, 128, DType::F16).unwrap();
        let stages = vec![
            StageSpec { layers: 0..48, tp: 4 },
            StageSpec { layers: 48..68, tp: 2 },
            StageSpec { layers: 68..80, tp: 16 },
        ];
        let setup = Setup::new(spec, stages, 1, 1).unwrap();
        let per_layer_head = 2 * 2 * 128;
        let w = |stage, rank| KvSizing::worker_bytes_per_token(&setup, WorkerId { stage, rank }).unwrap();
        assert_eq!(w(0, 0), 48 * 2 * per_layer_head);
        assert_eq!(w(1, 1), 20 * 4 * per_layer_head);
        // TP 16 over 8 KV heads: each rank holds one replicated head.
        assert_eq!(w(2, 15), 12 * per_layer_head);
    }
}
