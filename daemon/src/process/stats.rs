//! A stage process's counters and the metrics page that shows them.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use crate::metrics::{Exposition, MetricType};
use crate::swap::SwapStats;

/// Counters of a stage process, read by its metrics page.
#[derive(Debug, Default)]
pub struct StageStats {
    /// Steps computed (prompts and tokens).
    pub steps: AtomicU64,
    /// Tokens computed (a prompt counts its length).
    pub tokens: AtomicU64,
    /// Chunks handed to the stage's own sidecar through shared memory, and their payload bytes.
    pub copied_chunks: AtomicU64,
    /// See [`StageStats::copied_chunks`].
    pub copied_bytes: AtomicU64,
    /// Steps whose replication failed (the copies lack them until a replacement recomputes them).
    pub replication_failures: AtomicU64,
    /// Steps handed to the streamer whose replication is not known to be done.
    pub replication_pending: AtomicU64,
    /// Restores carried out, from the stage's own sidecar and from a peer's.
    pub local_restores: AtomicU64,
    /// See [`StageStats::local_restores`].
    pub peer_restores: AtomicU64,
    /// Tokens of KV restored from the stage's own sidecar and from a peer's.
    pub local_restored_tokens: AtomicU64,
    /// See [`StageStats::local_restored_tokens`].
    pub peer_restored_tokens: AtomicU64,
    /// Input connections refused because their hello came from an older epoch than the one in
    /// use (a fenced predecessor trying to come back).
    pub stale_connections_refused: AtomicU64,
    /// A prompt stage's handoffs: chunks of prompt KV stored at token sidecars, their payload
    /// bytes, and chunks that could not be stored.
    pub handed_chunks: AtomicU64,
    /// See [`StageStats::handed_chunks`].
    pub handed_bytes: AtomicU64,
    /// See [`StageStats::handed_chunks`].
    pub handoff_failures: AtomicU64,
    /// A token stage's loads: sequences whose prompt KV it loaded, their payload bytes, and loads
    /// that failed (the driver then has the prompt computed here).
    pub loaded_sequences: AtomicU64,
    /// See [`StageStats::loaded_sequences`].
    pub loaded_bytes: AtomicU64,
    /// See [`StageStats::loaded_sequences`].
    pub load_failures: AtomicU64,
    /// Bytes of the KV caches in "device" memory (fixed at start).
    pub device_bytes: AtomicU64,
    /// Swapping between device caches and host memory.
    pub swap: Arc<SwapStats>,
}

impl StageStats {
    pub(super) fn add(counter: &AtomicU64, n: u64) {
        counter.fetch_add(n, Ordering::Relaxed);
    }

    /// The stage's metrics page.
    pub fn render(&self, stage: u32) -> String {
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed) as f64;
        let stage = stage.to_string();
        let label = [("stage", stage.as_str())];
        let mut page = Exposition::new();
        let swap = &self.swap;
        let singles = [
            ("dejavu_stage_steps_total", MetricType::Counter, "Steps computed.", &self.steps),
            ("dejavu_stage_tokens_total", MetricType::Counter, "Tokens computed.", &self.tokens),
            (
                "dejavu_stage_replication_failures_total",
                MetricType::Counter,
                "Steps whose KV its sidecar could not keep or forward.",
                &self.replication_failures,
            ),
            (
                "dejavu_stage_copied_chunks_total",
                MetricType::Counter,
                "KV chunks handed to its sidecar through shared memory.",
                &self.copied_chunks,
            ),
            (
                "dejavu_stage_copied_bytes_total",
                MetricType::Counter,
                "KV payload bytes handed to its sidecar through shared memory.",
                &self.copied_bytes,
            ),
            (
                "dejavu_stage_device_kv_bytes",
                MetricType::Gauge,
                "Bytes of the KV caches in device memory.",
                &self.device_bytes,
            ),
            (
                "dejavu_stage_host_kv_bytes",
                MetricType::Gauge,
                "Bytes of KV swapped out to host memory.",
                &swap.host_bytes,
            ),
            ("dejavu_stage_swap_ins_total", MetricType::Counter, "Microbatches swapped in.", &swap.swap_ins),
            ("dejavu_stage_swap_in_bytes_total", MetricType::Counter, "Bytes swapped in.", &swap.bytes_in),
            ("dejavu_stage_swap_outs_total", MetricType::Counter, "Deltas swapped out.", &swap.swap_outs),
            ("dejavu_stage_swap_out_bytes_total", MetricType::Counter, "Bytes swapped out.", &swap.bytes_out),
            (
                "dejavu_stage_stale_connections_refused_total",
                MetricType::Counter,
                "Input connections refused as coming from a fenced predecessor (an older epoch).",
                &self.stale_connections_refused,
            ),
            (
                "dejavu_stage_handoff_chunks_total",
                MetricType::Counter,
                "Chunks of prompt KV handed over to token stages' sidecars.",
                &self.handed_chunks,
            ),
            (
                "dejavu_stage_handoff_bytes_total",
                MetricType::Counter,
                "Bytes of prompt KV handed over to token stages' sidecars.",
                &self.handed_bytes,
            ),
            (
                "dejavu_stage_handoff_failures_total",
                MetricType::Counter,
                "Chunks of prompt KV that could not be handed over.",
                &self.handoff_failures,
            ),
            (
                "dejavu_stage_loaded_sequences_total",
                MetricType::Counter,
                "Sequences whose prompt KV was loaded from a prompt pipeline's handoff.",
                &self.loaded_sequences,
            ),
            (
                "dejavu_stage_loaded_bytes_total",
                MetricType::Counter,
                "Bytes of prompt KV loaded from a prompt pipeline's handoff.",
                &self.loaded_bytes,
            ),
            (
                "dejavu_stage_load_failures_total",
                MetricType::Counter,
                "Loads of handed-over prompt KV that failed.",
                &self.load_failures,
            ),
            (
                "dejavu_stage_replication_lag_steps",
                MetricType::Gauge,
                "Steps whose KV copies are not known to be done.",
                &self.replication_pending,
            ),
        ];
        for (name, kind, help, counter) in singles {
            page.family(name, kind, help).sample(name, &label, get(counter));
        }
        // Counted apart for the stage's own sidecar (local) and another's (peer).
        let split = [
            (
                "dejavu_stage_restores_total",
                "Sequence restores from a sidecar.",
                &self.local_restores,
                &self.peer_restores,
            ),
            (
                "dejavu_stage_restored_tokens_total",
                "Tokens of KV restored from a sidecar.",
                &self.local_restored_tokens,
                &self.peer_restored_tokens,
            ),
        ];
        for (name, help, local, peer) in split {
            page.family(name, MetricType::Counter, help)
                .sample(name, &[("stage", stage.as_str()), ("target", "local")], get(local))
                .sample(name, &[("stage", stage.as_str()), ("target", "peer")], get(peer));
        }
        page.finish()
    }
}
