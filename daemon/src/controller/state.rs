//! What survives a controller crash: the state file (epoch, incarnation, members and their
//! fences, restores under way), written whole (temporary file, fsync, rename, directory fsync) before a fence is
//! answered.

use std::fmt::Write as _;
use std::io::{ErrorKind, Write};
use std::path::{Path, PathBuf};

use super::{role_name, ControllerError};
use crate::heartbeat::Role;

pub use dejavu_proto::liveness::{Membership, Record};

/// The controller's state file: the [`Record`] of its liveness machine, one fact per line.
#[derive(Clone, Debug)]
pub struct State;

impl State {
    /// Reads the record at `path`; a missing file is a fresh cluster.
    pub fn load(path: &Path) -> Result<Record, ControllerError> {
        let text = match std::fs::read_to_string(path) {
            Ok(text) => text,
            Err(e) if e.kind() == ErrorKind::NotFound => return Ok(Record::default()),
            Err(e) => return Err(state_error(path, e.to_string())),
        };
        Self::parse(&text).map_err(|why| state_error(path, why))
    }

    /// The record a state file's text holds.
    pub fn parse(text: &str) -> Result<Record, String> {
        let mut state = Record::default();
        let (mut epoch, mut incarnation) = (false, false);
        for (n, line) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
            let bad = || format!("line {}: cannot read {line:?}", n + 1);
            let words: Vec<&str> = line.split_whitespace().collect();
            match words.as_slice() {
                ["epoch", e] => (state.epoch, epoch) = (e.parse().map_err(|_| bad())?, true),
                ["incarnation", i] => {
                    (state.incarnation, incarnation) = (i.parse().map_err(|_| bad())?, true)
                }
                ["member", role, index, status, fenced_in] => {
                    let role = match *role {
                        "engine" => Role::Engine,
                        "sidecar" => Role::Sidecar,
                        _ => return Err(bad()),
                    };
                    let awaiting = match *status {
                        "awaiting" => true,
                        "live" => false,
                        _ => return Err(bad()),
                    };
                    let fenced_in = fenced_in.parse().map_err(|_| bad())?;
                    let member = (role, index.parse().map_err(|_| bad())?);
                    state.members.insert(member, Membership { fenced_in, awaiting });
                }
                ["restoring", stage] => {
                    state.restoring.insert(stage.parse().map_err(|_| bad())?);
                }
                _ => return Err(bad()),
            }
        }
        // A file cut short would otherwise restart the epochs from 0.
        if !(epoch && incarnation) {
            return Err("no epoch or incarnation line: not a whole state file".into());
        }
        Ok(state)
    }

    /// Writes `record` to `path` atomically and durably: a crash leaves the old record or the new.
    pub fn save(record: &Record, path: &Path) -> Result<(), ControllerError> {
        let fail = |e: std::io::Error| state_error(path, e.to_string());
        let mut partial = path.as_os_str().to_owned();
        partial.push(".partial");
        let partial = PathBuf::from(partial);
        let mut file = std::fs::File::create(&partial).map_err(fail)?;
        file.write_all(Self::encode(record).as_bytes()).map_err(fail)?;
        file.sync_all().map_err(fail)?;
        std::fs::rename(&partial, path).map_err(fail)?;
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::File::open(dir).and_then(|d| d.sync_all()).map_err(fail)?;
        }
        Ok(())
    }
}

impl State {
    /// The file's text for `record`.
    pub(super) fn encode(record: &Record) -> String {
        let mut text = format!("epoch {}\nincarnation {}\n", record.epoch, record.incarnation);
        for (&(role, index), m) in &record.members {
            let status = if m.awaiting { "awaiting" } else { "live" };
            let _ = writeln!(text, "member {} {index} {status} {}", role_name(role), m.fenced_in);
        }
        for stage in &record.restoring {
            let _ = writeln!(text, "restoring {stage}");
        }
        text
    }
}

fn state_error(path: &Path, why: String) -> ControllerError {
    ControllerError::State { path: path.to_owned(), why }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_state_file_round_trips_and_bad_files_are_refused() {
        let mut state = Record { epoch: 7, incarnation: 2, ..Record::default() };
        state.members.insert((Role::Engine, 0), Membership { fenced_in: 0, awaiting: false });
        state.members.insert((Role::Sidecar, 3), Membership { fenced_in: 7, awaiting: true });
        state.restoring.insert(3);
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("controller.state");
        assert_eq!(State::load(&path).unwrap(), Record::default(), "no file: a fresh cluster");
        State::save(&state, &path).unwrap();
        assert_eq!(State::load(&path).unwrap(), state);
        assert!(!dir.path().join("controller.state.partial").exists(), "the partial file was renamed");
        for bad in [
            "epoch x\n",
            "member engine 0 maybe 0\n",
            "member gpu 0 live 0\n",
            "member engine 0 live\n",
            "epoch\n",
            "nonsense 1\n",
        ] {
            std::fs::write(&path, bad).unwrap();
            let error = State::load(&path).unwrap_err().to_string();
            assert!(error.contains("line 1"), "{bad:?}: {error}");
        }
        // A file cut short (no epoch) is not a fresh cluster: epochs would start again at 0.
        for short in ["", "incarnation 3\n", "epoch 4\n"] {
            std::fs::write(&path, short).unwrap();
            let error = State::load(&path).unwrap_err().to_string();
            assert!(error.contains("not a whole state file"), "{short:?}: {error}");
        }
    }
}
