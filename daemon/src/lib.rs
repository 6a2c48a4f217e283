//! # dejavud
//!
//! The DéjàVu daemon: the demo (`dejavud demo`: a pipeline of reference-engine processes that
//! survives a killed stage), the planner (`dejavud plan`) and the cluster certificate tool
//! (`dejavud certs`); the sidecar and controller subcommands join them as they are built.

pub mod certs;
pub mod demo;
pub mod plan;
