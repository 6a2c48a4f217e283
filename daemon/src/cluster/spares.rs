//! The cluster's spare workers: stage and sidecar processes started ahead, registered with the
//! controller, handed to a recovery instead of starting new ones ([`crate::spare`]), and
//! replaced in the background once used.
//!
//! Background starts go through one thread that lives as long as the pool: a process the cluster
//! starts dies with the thread that started it (`PR_SET_PDEATHSIG`), so a thread per start would
//! take its spare down with it as it ends.

use std::path::PathBuf;
use std::thread::JoinHandle;

use crossbeam_channel::{Receiver, Sender};

use crate::proc::{SpawnError, Spawned};

/// A spare sidecar and its local socket.
pub(super) struct SpareSidecar {
    pub(super) process: Spawned,
    pub(super) socket: PathBuf,
}

/// What starts a spare: it spawns the process (after making its host, with network namespaces),
/// on the caller's thread or the spawner's.
pub(super) type Job = Box<dyn FnOnce() -> Result<Spawned, SpawnError> + Send>;

/// A start for the spawner thread, and where to answer.
type Start = (Job, Sender<Result<Spawned, SpawnError>>);

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
    /// Runs `job` now (`wait`), or on the spawner thread.
    fn start(
        &mut self,
        job: Job,
        wait: bool,
    ) -> Result<Result<Spawned, Receiver<Result<Spawned, SpawnError>>>, SpawnError> {
        self.started += 1;
        if wait {
            return Ok(Ok(job()?));
        }
        let (to_spawner, _) = self.spawner.get_or_insert_with(|| {
            let (tx, rx) = crossbeam_channel::unbounded::<Start>();
            let thread = std::thread::spawn(move || {
                for (job, answer) in rx {
                    let _ = answer.send(job());
                }
            });
            (tx, thread)
        });
        let (answer, started) = crossbeam_channel::bounded(1);
        // The spawner lives as long as the pool: sending cannot fail.
        let _ = to_spawner.send((job, answer));
        Ok(Err(started))
    }

    /// Starts a spare stage with `job`, now (`wait`) or in the background.
    pub(super) fn start_stage(&mut self, job: Job, wait: bool) -> Result<(), SpawnError> {
        match self.start(job, wait)? {
            Ok(spawned) => self.stages.push(spawned),
            Err(starting) => self.starting_stages.push(starting),
        }
        Ok(())
    }

    /// Starts a spare sidecar with `job` (its local socket: `socket`), now (`wait`) or in the
    /// background.
    pub(super) fn start_sidecar(&mut self, job: Job, socket: PathBuf, wait: bool) -> Result<(), SpawnError> {
        match self.start(job, wait)? {
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

    /// Whether it holds spare sidecars, ready or starting.
    pub(super) fn has_sidecars(&self) -> bool {
        !self.sidecars.is_empty() || !self.starting_sidecars.is_empty()
    }

    /// The ready spare sidecar that `chosen` picks, if any (those started since are ready now).
    pub(super) fn take_sidecar_where(&mut self, chosen: impl Fn(&Spawned) -> bool) -> Option<SpareSidecar> {
        let mut i = 0;
        while i < self.starting_sidecars.len() {
            match self.starting_sidecars[i].1.try_recv() {
                Ok(started) => {
                    let (socket, _) = self.starting_sidecars.remove(i);
                    if let Ok(process) = started {
                        self.sidecars.push(SpareSidecar { process, socket });
                    }
                }
                // Its start was dropped (the spawner is gone): no spare will come of it.
                Err(crossbeam_channel::TryRecvError::Disconnected) => {
                    self.starting_sidecars.remove(i);
                }
                Err(crossbeam_channel::TryRecvError::Empty) => i += 1,
            }
        }
        let i = self.sidecars.iter().position(|spare| chosen(&spare.process))?;
        Some(self.sidecars.remove(i))
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
