//! # dejavud
//!
//! The DéjàVu daemon. Today it carries the planner (`dejavud plan`) and the cluster certificate
//! tool (`dejavud certs`); the sidecar and controller subcommands join them as they are built.

pub mod certs;
pub mod plan;
