//! Transfer cost of a prompt's KV between two workers, `alpha + bytes / beta` per message (HexGen's
//! model of heterogeneous links), sent whole after prefill or layer by layer during it.
//!
//! Layer by layer: layer `l` (`1..=L`) is ready at `l Y / L` and its `S / L` bytes take
//! `c = alpha + S / (L beta)` on a link that carries one message at a time. The last byte lands at
//! `F = max_l (l Y / L + (L - l + 1) c)`, which is `Y + c` when `c <= Y / L` (the link keeps up:
//! only the last layer is exposed) and `Y / L + L c` otherwise. Sent whole after prefill, the
//! exposed time is `alpha + S / beta`.

use super::{non_negative, positive, PlanError};

/// A link between two workers.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Link {
    /// Per-message latency, `alpha`, in milliseconds.
    pub latency_ms: f64,
    /// Bandwidth, `beta`, in bytes per millisecond.
    pub bytes_per_ms: f64,
}

impl Link {
    /// A link from a latency in milliseconds and a bandwidth in gigabits per second.
    pub fn from_gbps(latency_ms: f64, gbps: f64) -> Self {
        Self { latency_ms, bytes_per_ms: gbps * 1e9 / 8.0 / 1e3 }
    }

    /// HexGen's in-region link: 2 ms, 5 Gbps.
    pub fn in_region() -> Self {
        Self::from_gbps(2.0, 5.0)
    }

    /// A cross-region link (HexGen: 40-150 ms, 0.3-1 Gbps).
    pub fn cross_region(latency_ms: f64, gbps: f64) -> Self {
        Self::from_gbps(latency_ms, gbps)
    }
}

/// Estimated cost of moving one prompt's KV.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TransferEstimate {
    /// `alpha + S / beta`: sent whole after prefill, all of it is exposed.
    pub whole_ms: f64,
    /// `c = alpha + S / (L beta)`: one layer's message.
    pub per_layer_ms: f64,
    /// Time after prefill ends until the last layer lands, streaming layer by layer.
    pub streamed_exposed_ms: f64,
    /// Whether the link keeps up with prefill (`c <= Y / L`), hiding all but the last layer.
    pub hidden_behind_prefill: bool,
}

/// Cost of moving `kv_bytes` of prompt KV in `layers` layers over `link`, for a prefill of
/// `prefill_ms`.
pub fn prompt_transfer(
    kv_bytes: f64,
    layers: u32,
    prefill_ms: f64,
    link: Link,
) -> Result<TransferEstimate, PlanError> {
    let s = non_negative("kv_bytes", kv_bytes)?;
    let l = positive("layers", layers as f64)?;
    let y = positive("prefill_ms", prefill_ms)?;
    let alpha = non_negative("latency_ms", link.latency_ms)?;
    let beta = positive("bandwidth", link.bytes_per_ms)?;
    let c = alpha + s / (l * beta);
    let finish = (y + c).max(y / l + l * c);
    Ok(TransferEstimate {
        whole_ms: alpha + s / beta,
        per_layer_ms: c,
        streamed_exposed_ms: finish - y,
        hidden_behind_prefill: c <= y / l,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn in_region_link_hides_a_13b_prompt_behind_prefill() {
        // 1000 tokens of LLaMA-2-13B: 819.2 MB over 40 layers; 5 Gbps = 625,000 B/ms.
        let e = prompt_transfer(819.2e6, 40, 2000.0, Link::in_region()).unwrap();
        assert!((e.whole_ms - (2.0 + 1310.72)).abs() < 1e-9);
        assert!((e.per_layer_ms - (2.0 + 32.768)).abs() < 1e-9);
        assert!(e.hidden_behind_prefill, "34.8 ms per layer < 50 ms of prefill per layer");
        assert!((e.streamed_exposed_ms - e.per_layer_ms).abs() < 1e-9);
    }

    #[test]
    fn slow_cross_region_link_is_exposed() {
        // 0.3 Gbps = 37,500 B/ms: 546 ms per layer against 50 ms of prefill per layer.
        let e = prompt_transfer(819.2e6, 40, 2000.0, Link::cross_region(100.0, 0.3)).unwrap();
        assert!(!e.hidden_behind_prefill);
        let c = 100.0 + 819.2e6 / 40.0 / 37_500.0;
        assert!((e.streamed_exposed_ms - (50.0 + 40.0 * c - 2000.0)).abs() < 1e-6);
        assert!(e.streamed_exposed_ms < e.whole_ms + 40.0 * 100.0);
    }

    #[test]
    fn invalid_fields_are_named() {
        let err = prompt_transfer(1.0, 0, 1.0, Link::in_region()).unwrap_err();
        assert_eq!(err, PlanError::NotPositive { field: "layers", value: 0.0 });
    }
}
