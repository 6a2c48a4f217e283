//! Prompt-token disaggregation (DéjàVu, section 4.2.1): how many of `D` machines should process
//! prompts and how many generate tokens, and whether splitting beats a colocated pipeline.
//!
//! Notation: `D` machines of `M` bytes, `L` layers, per-layer weights `W0`, per-layer KV of the
//! prompts in flight `C0` and of the tokens in flight `K0` (prompt plus generated, all microbatches
//! a pipeline holds), prompt time `Y` and token step time `t` of one microbatch through the whole
//! model, `N` tokens generated per microbatch, and `m >= 1` the slowdown of prompt processing while
//! its KV streams out.
//!
//! 1. Minimum prompt depth: `D_p >= L (W0 + C0) / M`.
//! 2. Minimum token depth: `D_t >= L (W0 + K0) / M`.
//! 3. Colocated inverse throughput (time per microbatch, scaled by `D`): each prompt's `Y / D` per
//!    stage stalls the token steps of the others, a bubble of `(D - 1)(Y - t) / D`:
//!    `I_c = Y + N t + (D - 1)(Y - t) / D`.
//! 4. Disaggregation pays when `I_dis < I_c`, i.e. `Y (D (2 - m) - 1) > t (D - 1)`. For
//!    `D (2 - m) > 1` that is `Y / t > (D - 1) / (D (2 - m) - 1)`; for `D (2 - m) <= 1` it never pays.
//! 5. and 6. Balanced split, where both pipelines finish a microbatch at the same rate
//!    (`m Y / D_p = N t / D_t`, `D_p + D_t = D`): `D_t = D N t / (m Y + N t)`,
//!    `D_p = D m Y / (m Y + N t)`, and then `I_dis = m Y + N t`.
//!
//! Machines come in whole numbers: [`plan_disaggregation`] also tries every integer split that
//! meets the memory minimums, with `I_dis(D_p, D_t) = D max(m Y / D_p, N t / D_t)`, and recommends
//! the best split or colocation.

use super::{non_negative, positive, PlanError};

/// Inputs of the disaggregation planner.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DisaggregationInput {
    /// Machines available, `D`.
    pub machines: u32,
    /// Memory per machine in bytes, `M`.
    pub memory: f64,
    /// Transformer layers, `L`.
    pub layers: u32,
    /// Weights per layer in bytes, `W0`.
    pub weights_per_layer: f64,
    /// Prompt KV per layer in bytes (all prompts in flight), `C0`.
    pub prompt_kv_per_layer: f64,
    /// Token KV per layer in bytes (all microbatches in flight at full length), `K0`.
    pub token_kv_per_layer: f64,
    /// Prompt time of one microbatch through the whole model, `Y`.
    pub prompt_time: f64,
    /// Time of one token step of one microbatch through the whole model, `t`.
    pub token_time: f64,
    /// Tokens generated per microbatch, `N`.
    pub tokens: u32,
    /// Prompt slowdown while streaming its KV, `m` (1 = free).
    pub streaming_overhead: f64,
}

/// What equation 4 says.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Eq4 {
    /// `Y / t` exceeds the threshold: disaggregation pays.
    Pays {
        /// `(D - 1) / (D (2 - m) - 1)`.
        threshold: f64,
    },
    /// `Y / t` is at or below the threshold.
    DoesNotPay {
        /// `(D - 1) / (D (2 - m) - 1)`.
        threshold: f64,
    },
    /// `D (2 - m) <= 1`: the condition has no threshold and disaggregation never pays.
    NeverPays,
}

/// The integer split the planner recommends.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Recommendation {
    /// Separate pipelines of these depths.
    Disaggregate {
        /// Prompt machines.
        prompt: u32,
        /// Token machines.
        token: u32,
        /// Their inverse throughput, `D max(m Y / D_p, N t / D_t)`.
        inverse_throughput: f64,
    },
    /// One pipeline of all machines.
    Colocate {
        /// `I_c`.
        inverse_throughput: f64,
    },
}

/// The planner's answer.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DisaggregationPlan {
    /// Equation 1, before rounding up.
    pub min_prompt_depth: f64,
    /// Equation 2, before rounding up.
    pub min_token_depth: f64,
    /// Equation 3; `None` when one pipeline of `D` machines cannot hold the model and its KV.
    pub colocated_inverse_throughput: Option<f64>,
    /// Equation 4.
    pub eq4: Eq4,
    /// Equation 5, `D_t`.
    pub balanced_token_depth: f64,
    /// Equation 6, `D_p`.
    pub balanced_prompt_depth: f64,
    /// `I_dis = m Y + N t` at the balanced split.
    pub balanced_inverse_throughput: f64,
    /// The best integer split meeting the memory minimums, if any.
    pub best_split: Option<(u32, u32, f64)>,
    /// What to deploy.
    pub recommendation: Recommendation,
}

/// Runs equations 1 to 6 and the integer search. Errors name the invalid field, or say that the
/// model fits neither split nor colocated.
pub fn plan_disaggregation(input: &DisaggregationInput) -> Result<DisaggregationPlan, PlanError> {
    let d = positive("machines", input.machines as f64)?;
    let mem = positive("memory", input.memory)?;
    let l = positive("layers", input.layers as f64)?;
    let w0 = non_negative("weights_per_layer", input.weights_per_layer)?;
    let c0 = non_negative("prompt_kv_per_layer", input.prompt_kv_per_layer)?;
    let k0 = non_negative("token_kv_per_layer", input.token_kv_per_layer)?;
    let y = positive("prompt_time", input.prompt_time)?;
    let t = positive("token_time", input.token_time)?;
    let n = positive("tokens", input.tokens as f64)?;
    let m = positive("streaming_overhead", input.streaming_overhead)?;

    let min_prompt_depth = l * (w0 + c0) / mem;
    let min_token_depth = l * (w0 + k0) / mem;
    // A colocated pipeline holds the token KV (which includes the prompts').
    let colocated_fits = min_token_depth <= d;
    let colocated = y + n * t + (d - 1.0) * (y - t).max(0.0) / d;

    let slack = d * (2.0 - m) - 1.0;
    let eq4 = if slack <= 0.0 {
        Eq4::NeverPays
    } else {
        let threshold = (d - 1.0) / slack;
        if y / t > threshold {
            Eq4::Pays { threshold }
        } else {
            Eq4::DoesNotPay { threshold }
        }
    };

    let (prompt_work, token_work) = (m * y, n * t);
    let balanced_token_depth = d * token_work / (prompt_work + token_work);
    let balanced_prompt_depth = d * prompt_work / (prompt_work + token_work);
    let balanced_inverse_throughput = prompt_work + token_work;

    let first_prompt = (min_prompt_depth.ceil() as u32).max(1);
    let first_token = (min_token_depth.ceil() as u32).max(1);
    let best_split = (first_prompt..=input.machines.saturating_sub(first_token))
        .map(|p| {
            let tk = input.machines - p;
            (p, tk, d * (prompt_work / p as f64).max(token_work / tk as f64))
        })
        .min_by(|a, b| a.2.total_cmp(&b.2));

    let recommendation = match best_split {
        Some((prompt, token, inverse)) if !colocated_fits || inverse < colocated => {
            Recommendation::Disaggregate { prompt, token, inverse_throughput: inverse }
        }
        _ if colocated_fits => Recommendation::Colocate { inverse_throughput: colocated },
        _ => {
            return Err(PlanError::DoesNotFit(format!(
                "{} machines of {mem} bytes: a token pipeline needs {min_token_depth:.2} and a prompt \
                 pipeline {min_prompt_depth:.2} machines",
                input.machines
            )))
        }
    };
    Ok(DisaggregationPlan {
        min_prompt_depth,
        min_token_depth,
        colocated_inverse_throughput: colocated_fits.then_some(colocated),
        eq4,
        balanced_token_depth,
        balanced_prompt_depth,
        balanced_inverse_throughput,
        best_split,
        recommendation,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn input(d: u32, y: f64, t: f64, n: u32, m: f64) -> DisaggregationInput {
        DisaggregationInput {
            machines: d,
            memory: 80e9,
            layers: 40,
            weights_per_layer: 0.5e9,
            prompt_kv_per_layer: 0.1e9,
            token_kv_per_layer: 0.5e9,
            prompt_time: y,
            token_time: t,
            tokens: n,
            streaming_overhead: m,
        }
    }

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() < 1e-9 * b.abs().max(1.0)
    }

    #[test]
    fn paper_vector_where_disaggregation_pays() {
        let p = plan_disaggregation(&input(4, 1000.0, 50.0, 100, 1.0)).unwrap();
        assert!(close(p.balanced_token_depth, 10.0 / 3.0));
        assert!(close(p.balanced_prompt_depth, 2.0 / 3.0));
        assert!(close(p.balanced_inverse_throughput, 6000.0));
        assert!(close(p.colocated_inverse_throughput.unwrap(), 6712.5));
        // Threshold (D - 1) / (D (2 - m) - 1) = 3 / 3 = 1, and Y / t = 20.
        assert_eq!(p.eq4, Eq4::Pays { threshold: 1.0 });
        // Integer split 1 + 3: 4 max(1000 / 1, 5000 / 3) = 6666.67 < 6712.5.
        let Recommendation::Disaggregate { prompt: 1, token: 3, inverse_throughput } = p.recommendation
        else {
            panic!("{:?}", p.recommendation)
        };
        assert!(close(inverse_throughput, 20_000.0 / 3.0));
    }

    #[test]
    fn paper_vector_without_gain() {
        let p = plan_disaggregation(&input(4, 100.0, 10.0, 100, 1.9)).unwrap();
        assert!(close(p.balanced_inverse_throughput, 1190.0));
        assert!(close(p.colocated_inverse_throughput.unwrap(), 1167.5));
        assert_eq!(p.eq4, Eq4::NeverPays, "D (2 - m) = 0.4 <= 1");
        assert!(matches!(p.recommendation, Recommendation::Colocate { .. }));
    }

    #[test]
    fn eq4_threshold_matches_the_direct_comparison_on_both_sides() {
        // D = 8, m = 1.2: threshold = 7 / (8 * 0.8 - 1) = 7 / 5.4.
        let threshold = 7.0 / 5.4;
        for (y, pays) in [(threshold * 10.0 * 1.01, true), (threshold * 10.0 * 0.99, false)] {
            let p = plan_disaggregation(&input(8, y, 10.0, 100, 1.2)).unwrap();
            let direct = p.balanced_inverse_throughput < p.colocated_inverse_throughput.unwrap();
            assert_eq!(direct, pays, "y = {y}");
            assert_eq!(matches!(p.eq4, Eq4::Pays { .. }), pays, "y = {y}");
        }
    }

    #[test]
    fn memory_minimums_bound_the_split() {
        // 40 layers x (0.5 + 0.5) GB = 40 GB of token state over 16 GB machines: D_t >= 2.5 -> 3.
        let mut i = input(4, 1000.0, 50.0, 100, 1.0);
        i.memory = 16e9;
        let p = plan_disaggregation(&i).unwrap();
        assert!(close(p.min_token_depth, 2.5));
        assert!(close(p.min_prompt_depth, 1.5));
        // Prompt needs 2 machines and tokens 3: no split of 4 fits, colocation does.
        assert_eq!(p.best_split, None);
        assert!(matches!(p.recommendation, Recommendation::Colocate { .. }));
        i.machines = 2;
        assert!(matches!(plan_disaggregation(&i), Err(PlanError::DoesNotFit(_))));
    }

    #[test]
    fn invalid_fields_are_named() {
        let mut i = input(0, 1000.0, 50.0, 100, 1.0);
        assert_eq!(plan_disaggregation(&i), Err(PlanError::NotPositive { field: "machines", value: 0.0 }));
        i.machines = 4;
        i.token_time = -1.0;
        assert_eq!(plan_disaggregation(&i), Err(PlanError::NotPositive { field: "token_time", value: -1.0 }));
        i.token_time = 50.0;
        i.weights_per_layer = f64::NAN;
        assert!(matches!(
            plan_disaggregation(&i),
            Err(PlanError::Negative { field: "weights_per_layer", .. })
        ));
    }
}
