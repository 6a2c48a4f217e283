//! The DéjàVu resource planner: pure functions that size KV caches, split machines between prompt
//! and token pipelines, decide whether microbatch swapping pays, and estimate transfer costs.
//!
//! Every function checks its inputs and names the offending field in a [`PlanError`]. Units are
//! whatever the caller uses consistently (bytes and milliseconds in `dejavud plan`).

pub mod disaggregation;
pub mod memory;
pub mod sizing;
pub mod swapping;
pub mod transfer;

use thiserror::Error;

pub use disaggregation::{plan_disaggregation, DisaggregationInput, DisaggregationPlan};
pub use memory::{check_stage_memory, StageMemory};
pub use sizing::KvSizing;
pub use swapping::{swapping_pays, SwapInput, SwapVerdict};
pub use transfer::{prompt_transfer, Link, TransferEstimate};

/// Invalid planner input.
#[derive(Debug, Error, PartialEq)]
pub enum PlanError {
    /// A field must be positive (and finite).
    #[error("{field} must be positive, got {value}")]
    NotPositive {
        /// Field name.
        field: &'static str,
        /// Its value.
        value: f64,
    },
    /// A field must not be negative.
    #[error("{field} must not be negative, got {value}")]
    Negative {
        /// Field name.
        field: &'static str,
        /// Its value.
        value: f64,
    },
    /// The model does not fit in the machines at any depth.
    #[error("the model does not fit: {0}")]
    DoesNotFit(String),
    /// A setup or spec is invalid.
    #[error("{0}")]
    Setup(String),
}

/// Checks that `value` is finite and greater than zero.
pub(crate) fn positive(field: &'static str, value: f64) -> Result<f64, PlanError> {
    if value.is_finite() && value > 0.0 {
        Ok(value)
    } else {
        Err(PlanError::NotPositive { field, value })
    }
}

/// Checks that `value` is finite and not negative.
pub(crate) fn non_negative(field: &'static str, value: f64) -> Result<f64, PlanError> {
    if value.is_finite() && value >= 0.0 {
        Ok(value)
    } else {
        Err(PlanError::Negative { field, value })
    }
}
