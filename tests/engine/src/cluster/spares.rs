//! The cluster's spare workers: stage and sidecar processes started ahead, registered with the
//! controller, handed to a recovery instead of starting new ones ([`crate::spare`]), and
//! replaced in the background once used.
//!
//! Background starts go through one thread that lives as long as the pool: a process the cluster
//! starts dies with the thread that started it (`PR_SET_PDEATHSIG`), so a thread per start would
//! take its spare down with it as it ends.

use std::path::{Path, PathBuf};
use std::thread::JoinHandle;

use crossbeam_channel::{Receiver, Sender};

use std::sync::Arc;

use crate::netns::Host;
use crate::proc::{spawn_on, SpawnError, Spawned};

use super::START;

/// A spare sidecar and its local socket.
pub(super) struct SpareSidecar {
    pub(super) process: Spawned,
    pub(super) socket: PathBuf,
}

/// A start for the spawner thread: the executable, its host (if not loopback), its arguments, and
/// where to answer.
type Start = (PathBuf, Option<Arc<Host>>, Vec<String>, Sender<Result<Spawned, SpawnError>>);

/// Spares ready, and spares starting.
#[derive(Default)]
pub(super) struct SparePool {
    stages: Vec<Spawned>,
    sidecars: Vec<SpareSidecar>,
    starting_stages: Vec<Receiver<Result<Spawned, SpawnError>>>,
    starting_sidecars: Vec<(PathBuf, Receiver<Result<Spawned, SpawnError>>)>,
    /// The thread that starts spares in the background, made on first use.
    spawner: Option<(Sender<Start>, JoinHandle<()>)>,
    /// Spares started so far (numbers them).
    pub(super) started: u32,
    /// Spare stages and spare sidecars handed to recoveries.
    pub(super) used: (u64, u64),
}

impl SparePool {
    /// Starts `exe args` on `host` now (`wait`), or through the spawner thread.
    fn start(
        &mut self,
        exe: &Path,
        host: Option<Arc<Host>>,
        args: Vec<String>,
        wait: bool,
    ) -> Result<Result<Spawned, Receiver<Result<Spawned, SpawnError>>>, SpawnError> {
        self.started += 1;
        if wait {
            return Ok(Ok(spawn_on(host.as_ref(), exe, &args, "a spare", START)?));
        }
        let (to_spawner, _) = self.spawner.get_or_insert_with(|| {
            let (tx, rx) = crossbeam_channel::unbounded::<Start>();
            let thread = std::thread::spawn(move || {
                for (exe, host, args, answer) in rx {
                    let _ = answer.send(spawn_on(host.as_ref(), &exe, &args, "a spare", START));
                }
            });
            (tx, thread)
        });
        let (answer, started) = crossbeam_channel::bounded(1);
        // The spawner lives as long as the pool: sending cannot fail.
        let _ = to_spawner.send((exe.to_owned(), host, args, answer));
        Ok(Err(started))
    }

    /// Starts a spare stage with `args` on `host`, now (`wait`) or in the background.
    pub(super) fn start_stage(
        &mut self,
        exe: &Path,
        host: Option<Arc<Host>>,
        args: Vec<String>,
        wait: bool,
    ) -> Result<(), SpawnError> {
        match self.start(exe, host, args, wait)? {
            Ok(spawned) => self.stages.push(spawned),
            Err(starting) => self.starting_stages.push(starting),
        }
        Ok(())
    }

    /// Starts a spare sidecar with `args` and local socket `socket` on `host`, now (`wait`) or
    /// in the background.
    pub(super) fn start_sidecar(
        &mut self,
        exe: &Path,
        host: Option<Arc<Host>>,
        args: Vec<String>,
        socket: PathBuf,
        wait: bool,
    ) -> Result<(), SpawnError> {
        match self.start(exe, host, args, wait)? {
            Ok(process) => self.sidecars.push(SpareSidecar { process, socket }),
            Err(starting) => self.starting_sidecars.push((socket, starting)),
        }
        Ok(())
    }

    /// A spare stage, if one is ready or starting (waiting for it then: it is nearly ready).
    pub(super) fn take_stage(&mut self) -> Option<Spawned> {
        while self.stages.is_empty() && !self.starting_stages.is_empty() {
            if let Ok(Ok(spawned)) = self.starting_stages.remove(0).recv() {
                self.stages.push(spawned);
            }
        }
        self.stages.pop()
    }

    /// A spare sidecar, if one is ready or starting.
    pub(super) fn take_sidecar(&mut self) -> Option<SpareSidecar> {
        while self.sidecars.is_empty() && !self.starting_sidecars.is_empty() {
            let (socket, starting) = self.starting_sidecars.remove(0);
            if let Ok(Ok(process)) = starting.recv() {
                self.sidecars.push(SpareSidecar { process, socket });
            }
        }
        self.sidecars.pop()
    }
}

impl Drop for SparePool {
    fn drop(&mut self) {
        // The spares still starting are taken (and killed, dropped) before the spawner ends.
        for starting in self.starting_stages.drain(..) {
            drop(starting.recv());
        }
        for (_, starting) in self.starting_sidecars.drain(..) {
            drop(starting.recv());
        }
        if let Some((to_spawner, thread)) = self.spawner.take() {
            drop(to_spawner);
            let _ = thread.join();
        }
    }
}
