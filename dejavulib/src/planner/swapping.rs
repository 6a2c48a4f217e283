//! Microbatch swapping (DéjàVu, Appendix E): does running batch `2B` with swapping beat batch `B`
//! without it?
//!
//! With swapping, all microbatches' KV lives in host memory and each token step first swaps in the
//! KV of the next microbatch while the current one computes, and swaps out the new token's delta of
//! the previous one (the other PCIe direction, so the two overlap). Step `i` of a microbatch
//! (`i = 1..=N`) starts with a context of `p + i - 1` tokens, so it waits for
//! `s_i = 2B (p + i - 1) k / bw` of swap-in, where `k` is the KV bytes of one token of one request
//! on the worker and `bw` the host-device bandwidth; the step takes `max(t_2B, s_i)`.
//!
//! Swapping pays when `2B` tokens per step over `T_swap = sum_{i=1..N} max(t_2B, s_i)` beat `B`
//! tokens per step over `N t_B`, i.e. when `T_swap < 2 N t_B`.
//!
//! The paper writes the sum once over `N` and once over `N + p` steps; only the `N` generated steps
//! swap, and the prompt length enters through the context each step carries. That is the reading
//! used here.

use super::{non_negative, positive, PlanError};

/// Inputs of the swapping condition.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SwapInput {
    /// Tokens generated per request, `N`.
    pub tokens: u32,
    /// Token step time at batch `B`, `t_B`.
    pub step_time: f64,
    /// Token step time at batch `2B`, `t_2B` (token steps are memory-bound: often close to `t_B`).
    pub step_time_double: f64,
    /// Prompt length, `p`.
    pub prompt: u32,
    /// Batch without swapping, `B`.
    pub batch: u32,
    /// KV bytes of one token of one request on this worker, `k`.
    pub kv_bytes_per_token: f64,
    /// Host-device bandwidth in bytes per time unit, `bw`.
    pub host_bandwidth: f64,
}

/// The verdict.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SwapVerdict {
    /// `T_swap`: time to generate `N` tokens for `2B` requests with swapping.
    pub swap_time: f64,
    /// `2 N t_B`: time to generate the same tokens at batch `B` without swapping.
    pub no_swap_time: f64,
    /// Whether swapping pays.
    pub pays: bool,
    /// Throughput ratio, swapping over not swapping.
    pub speedup: f64,
    /// The first step whose swap-in takes longer than its compute, if any.
    pub first_exposed_step: Option<u32>,
}

/// Evaluates the swapping condition.
pub fn swapping_pays(input: &SwapInput) -> Result<SwapVerdict, PlanError> {
    let n = positive("tokens", input.tokens as f64)?;
    let t_b = positive("step_time", input.step_time)?;
    let t_2b = positive("step_time_double", input.step_time_double)?;
    let p = non_negative("prompt", input.prompt as f64)?;
    let b = positive("batch", input.batch as f64)?;
    let k = positive("kv_bytes_per_token", input.kv_bytes_per_token)?;
    let bw = positive("host_bandwidth", input.host_bandwidth)?;
    let swap_in = |i: u32| 2.0 * b * (p + i as f64 - 1.0) * k / bw;
    let swap_time: f64 = (1..=input.tokens).map(|i| t_2b.max(swap_in(i))).sum();
    let no_swap_time = 2.0 * n * t_b;
    // s_i grows with i: the first exposed step is where it crosses t_2B.
    let first_exposed_step = (1..=input.tokens).find(|&i| swap_in(i) > t_2b);
    Ok(SwapVerdict {
        swap_time,
        no_swap_time,
        pays: swap_time < no_swap_time,
        speedup: no_swap_time / swap_time,
        first_exposed_step,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn input(prompt: u32, bw: f64) -> SwapInput {
        SwapInput {
            tokens: 100,
            step_time: 10.0,
            step_time_double: 10.0,
            prompt,
            batch: 8,
            kv_bytes_per_token: 1000.0,
            host_bandwidth: bw,
        }
    }

    #[test]
    fn fully_hidden_swaps_double_throughput() {
        // Largest swap-in: 16 x (100 + 99) x 1000 / 1e6 = 3.18 < 10.
        let v = swapping_pays(&input(100, 1e6)).unwrap();
        assert_eq!(v.swap_time, 1000.0);
        assert_eq!(v.no_swap_time, 2000.0);
        assert!(v.pays);
        assert_eq!(v.speedup, 2.0);
        assert_eq!(v.first_exposed_step, None);
    }

    #[test]
    fn the_boundary_from_both_sides() {
        // With s_i all exposed, T_swap = sum 16 (p + i - 1) k / bw = 16 k / bw (100 p + 4950).
        // Pays iff that is < 2000: with k / bw = 1e-3, 100 p + 4950 < 125000, p < 1200.5.
        let below = swapping_pays(&input(1200, 1e6)).unwrap();
        let above = swapping_pays(&input(1201, 1e6)).unwrap();
        assert!(below.pays && below.swap_time < 2000.0, "{below:?}");
        assert!(!above.pays && above.swap_time > 2000.0, "{above:?}");
        assert_eq!(below.first_exposed_step, Some(1));
    }

    #[test]
    fn partially_exposed_swaps_are_summed_step_by_step() {
        // k / bw = 1e-3: s_i = 0.016 (p + i - 1) exceeds 10 once p + i - 1 > 625.
        let v = swapping_pays(&input(600, 1e6)).unwrap();
        assert_eq!(v.first_exposed_step, Some(27));
        let expected: f64 = (1..=100).map(|i| (0.016 * (600.0 + i as f64 - 1.0)).max(10.0)).sum();
        assert!((v.swap_time - expected).abs() < 1e-9);
    }

    #[test]
    fn invalid_fields_are_named() {
        let mut i = input(10, 1e6);
        i.host_bandwidth = 0.0;
        assert_eq!(swapping_pays(&i), Err(PlanError::NotPositive { field: "host_bandwidth", value: 0.0 }));
    }
}
