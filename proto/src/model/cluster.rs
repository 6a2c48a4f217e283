//! Several pipelines under one controller: each pipeline is its own ring with its own epochs and
//! recovery, so a prompt pipeline and a token pipeline may differ in depth, and a failure in one
//! does not disturb the other. Workers choose their pipeline when they register.

use std::collections::BTreeMap;

use super::controller::{Controller, ControllerConfig, Output, Persisted};
use super::message::{Addr, Command, Directive, Epoch, Msg, NodeId};

/// The controllers of every pipeline, and which pipeline each worker joined.
#[derive(Debug)]
pub struct Cluster {
    pipelines: BTreeMap<u32, Controller>,
    homes: BTreeMap<NodeId, u32>,
    /// Rejoin orders for workers no pipeline knows (after a restart), to send.
    rejoins: Vec<(NodeId, u64)>,
}

impl Cluster {
    /// A cluster of pipelines, each with its own settings (depth, microbatches, ...).
    pub fn new(pipelines: impl IntoIterator<Item = (u32, ControllerConfig)>) -> Self {
        Self {
            pipelines: pipelines.into_iter().map(|(id, cfg)| (id, Controller::new(cfg))).collect(),
            homes: BTreeMap::new(),
            rejoins: Vec::new(),
        }
    }

    /// A restarted controller process: each pipeline restarts from its persisted record (see
    /// [`Controller::restart`]); a pipeline without a record starts afresh. Owners are known again
    /// from the records; any other worker is told to rejoin when it reports.
    pub fn restart(
        pipelines: impl IntoIterator<Item = (u32, ControllerConfig)>,
        mut records: BTreeMap<u32, Persisted>,
        now: u64,
    ) -> Self {
        let mut homes = BTreeMap::new();
        let pipelines = pipelines
            .into_iter()
            .map(|(id, cfg)| {
                let controller = match records.remove(&id) {
                    Some(record) => {
                        for node in record.owners.iter().flatten() {
                            homes.insert(*node, id);
                        }
                        Controller::restart(cfg, record, now)
                    }
                    None => Controller::new(cfg),
                };
                (id, controller)
            })
            .collect();
        Self { pipelines, homes, rejoins: Vec::new() }
    }

    /// The controller of pipeline `id`.
    pub fn pipeline(&self, id: u32) -> Option<&Controller> {
        self.pipelines.get(&id)
    }

    /// The pipeline `node` joined.
    pub fn home(&self, node: NodeId) -> Option<u32> {
        self.homes.get(&node).copied()
    }

    /// Routes a message to the pipeline of its sender. A registration for a pipeline that does not
    /// exist is ignored (the worker keeps registering, visibly unassigned).
    pub fn handle(&mut self, msg: Msg, now: u64) {
        let pipeline = match &msg {
            Msg::Register { node, pipeline, .. } => {
                if !self.pipelines.contains_key(pipeline) {
                    return;
                }
                self.homes.insert(*node, *pipeline);
                Some(*pipeline)
            }
            Msg::Status { node, status } => match self.homes.get(node) {
                Some(p) => Some(*p),
                None => {
                    // Unknown here (this process restarted): a worker that has been in an epoch
                    // must register again; a fresh one is registering anyway.
                    if status.epoch > Epoch(0) {
                        self.rejoins.push((*node, status.incarnation));
                    }
                    None
                }
            },
            Msg::Deliver { node, .. } => self.homes.get(node).copied(),
            _ => None,
        };
        if let Some(c) = pipeline.and_then(|p| self.pipelines.get_mut(&p)) {
            c.handle(msg, now);
        }
    }

    /// Advances every pipeline's controller.
    pub fn tick(&mut self, now: u64) {
        for c in self.pipelines.values_mut() {
            c.tick(now);
        }
    }

    /// Takes every pipeline's outputs, tagged with the pipeline.
    pub fn drain(&mut self) -> Vec<(u32, Output)> {
        let mut out = Vec::new();
        for (node, incarnation) in self.rejoins.drain(..) {
            let directive = Directive {
                pipeline: 0,
                epoch: Epoch(0),
                incarnation,
                owners: Vec::new(),
                command: Command::Rejoin { incarnation },
                delivered: Vec::new(),
            };
            out.push((0, Output::Send(Addr::Worker(node), Msg::Directive(directive))));
        }
        for (id, c) in &mut self.pipelines {
            out.extend(c.drain().into_iter().map(|o| (*id, o)));
        }
        out
    }
}
