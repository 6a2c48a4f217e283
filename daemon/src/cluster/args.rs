//! The command lines of the cluster's processes: stages, sidecars and their replacements.

use std::net::{IpAddr, SocketAddr};
use std::ops::Range;
use std::path::{Path, PathBuf};

use super::{Cluster, ClusterConfig, Link};
use crate::handoff::Shapes;
use crate::proc::Spawned;
use dejavu_engine::pipeline::CacheLayout;

impl Cluster {
    /// The flags that give a stage both pipelines' shapes.
    pub(super) fn shape_args(shapes: &Shapes) -> Vec<String> {
        let list = |splits: &[Range<u32>]| {
            splits.iter().map(|l| format!("{}..{}", l.start, l.end)).collect::<Vec<_>>().join(",")
        };
        vec![
            format!("--prompt-stages={}", list(&shapes.prompt)),
            format!("--prompt-slots={}", shapes.prompt_slots),
            format!("--token-stages={}", list(&shapes.token)),
            format!("--token-slots={}", shapes.token_slots),
            format!("--requests={}", shapes.requests),
        ]
    }

    pub(super) fn sidecar_args(
        config: &ClusterConfig,
        heartbeat: &str,
        who: SidecarOf,
        socket: &std::path::Path,
        dir: &Path,
        ip: IpAddr,
    ) -> Vec<String> {
        let mut args = vec!["sidecar".to_owned()];
        args.extend(match who {
            SidecarOf::Stage(stage, start) => start.flags(stage),
            SidecarOf::Spare(n) => vec![format!("--spare={n}"), "--epoch=0".to_owned()],
        });
        args.extend([
            format!("--local={}", socket.display()),
            format!("--shm-dir={}", dir.display()),
            format!("--heartbeat={heartbeat}"),
            format!("--heartbeat-ms={}", config.heartbeat.as_millis()),
            format!("--listen={}", SocketAddr::new(ip, 0)),
            format!("--metrics={}", SocketAddr::new(ip, 0)),
        ]);
        if config.sabotage_replicas {
            args.push("--test-only-skip-replicas".to_owned());
        }
        if let Some(split) = &config.cpus {
            args.push(format!("--cpus={}", split.replication));
        }
        args.extend(config.transport_args(dir));
        if let Some(limits) = config.spill {
            args.push(format!("--spill-dir={}", spill_dir_of(socket).display()));
            args.push(format!("--memory-bytes={}", limits.memory_bytes));
            args.push(format!("--spill-dir-bytes={}", limits.dir_bytes));
        }
        args
    }

    pub(super) fn stage_args(
        config: &ClusterConfig,
        heartbeat: &str,
        sidecars: Option<(PathBuf, SocketAddr)>,
        (index, start): (usize, Start),
        next: SocketAddr,
        dir: &Path,
        ip: IpAddr,
    ) -> Vec<String> {
        let layers = &config.splits[index];
        let next = config.route(Link::Activation { from: index as u32 }, next);
        let mut args = vec!["stage".to_owned()];
        args.extend(start.flags(index));
        args.extend([
            format!("--layers={}..{}", layers.start, layers.end),
            format!("--next={next}"),
            format!("--slots={}", config.slots),
            format!("--microbatches={}", config.microbatches),
            format!("--max-tokens={}", config.max_tokens),
            format!("--heartbeat={heartbeat}"),
            format!("--heartbeat-ms={}", config.heartbeat.as_millis()),
            format!("--listen={}", SocketAddr::new(ip, 0)),
            format!("--metrics={}", SocketAddr::new(ip, 0)),
        ]);
        if let Some(device) = config.device_caches {
            args.push(format!("--device-caches={device}"));
        }
        args.extend(config.step_args());
        if config.layout == CacheLayout::PerLayer {
            args.push("--layout=per-layer".to_owned());
        }
        if let Some(shapes) = config.shapes() {
            args.push("--pipeline=token".to_owned());
            args.extend(Self::shape_args(&shapes));
        }
        if let Some((local, successor)) = sidecars {
            args.push(format!("--local={}", local.display()));
            if config.splits.len() == 1 {
                // A ring of one stage: no other sidecar to keep a replica.
                args.push("--successor=none".to_owned());
            } else {
                let successor = config.route(Link::Replica { from: index as u32 }, successor);
                args.push(format!("--successor={successor}"));
            }
            if let Some(split) = &config.cpus {
                args.push(format!("--streamer-cpus={}", split.replication));
            }
        }
        if let Some(split) = &config.cpus {
            args.push(format!("--cpus={}", split.compute));
        }
        args.extend(config.transport_args(dir));
        if let Some(engine) = &config.engine {
            args.push("--".to_owned());
            args.extend(engine.argv().iter().cloned());
        }
        args
    }

    /// Stage `index`'s sidecars: its own (its local socket) and its ring successor's.
    pub(super) fn copies(
        sidecars: &[Spawned],
        sockets: &[PathBuf],
        index: usize,
    ) -> Option<(PathBuf, SocketAddr)> {
        (!sidecars.is_empty()).then(|| (sockets[index].clone(), sidecars[(index + 1) % sidecars.len()].addr))
    }
}

/// Which of a stage's processes (engine or sidecar) is started.
#[derive(Clone, Copy, Debug)]
pub(super) enum Start {
    /// The first, in epoch 0.
    First,
    /// The replacement of a fenced one, in the epoch of the fence, which it asks the controller
    /// for (`--replace`).
    Replacement,
}

impl Start {
    /// The flags that start stage `stage`'s process so.
    fn flags(self, stage: usize) -> Vec<String> {
        match self {
            Start::First => vec![format!("--index={stage}"), "--epoch=0".to_owned()],
            Start::Replacement => vec![format!("--replace={stage}")],
        }
    }
}

/// Whose a sidecar is started as.
#[derive(Clone, Copy, Debug)]
pub(super) enum SidecarOf {
    /// Stage `.0`'s.
    Stage(usize, Start),
    /// Spare number `.0`, no stage's yet.
    Spare(u32),
}

/// The fabric host of worker `stage` (its stage and sidecar processes, and their replacements).
pub(super) fn worker_host(stage: usize) -> String {
    format!("worker-{stage}")
}

/// The spill directory of the sidecar with local socket `socket`: beside it, in the cluster's
/// directory.
pub(super) fn spill_dir_of(socket: &std::path::Path) -> PathBuf {
    socket.with_extension("spill")
}
