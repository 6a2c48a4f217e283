//! # dejavud
//!
//! The DéjàVu daemon. Today it carries the planner (`dejavud plan`); the sidecar and controller
//! subcommands join it as they are built.

pub mod plan;
