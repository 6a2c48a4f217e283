//! What survives a controller crash: the state file (epoch, incarnation, members and their
//! fences), written whole (temporary file, fsync, rename, directory fsync) before a fence is
//! answered.

use std::collections::BTreeMap;
use std::fmt;
use std::io::{ErrorKind, Write};
use std::path::{Path, PathBuf};

use super::{role_name, ControllerError, Member};
use crate::heartbeat::Role;

/// What survives a controller crash.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct State {
    /// The last epoch handed out (0: none yet).
    pub epoch: u64,
    /// How many controllers have run on this state, this one included.
    pub incarnation: u64,
    /// Every member heard from.
    pub members: BTreeMap<Member, Membership>,
}

/// What the controller keeps of a member.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Membership {
    /// The epoch of its last fence (0: never fenced): only processes started in it or later
    /// count for the member.
    pub fenced_in: u64,
    /// Whether it was fenced and no replacement has beaten since.
    pub awaiting: bool,
}

impl State {
    /// Reads the state at `path`; a missing file is a fresh cluster.
    pub fn load(path: &Path) -> Result<Self, ControllerError> {
        let text = match std::fs::read_to_string(path) {
            Ok(text) => text,
            Err(e) if e.kind() == ErrorKind::NotFound => return Ok(Self::default()),
            Err(e) => return Err(state_error(path, e.to_string())),
        };
        Self::parse(&text).map_err(|why| state_error(path, why))
    }

    fn parse(text: &str) -> Result<Self, String> {
        let mut state = Self::default();
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
                _ => return Err(bad()),
            }
        }
        // A file cut short would otherwise restart the epochs from 0.
        if !(epoch && incarnation) {
            return Err("no epoch or incarnation line: not a whole state file".into());
        }
        Ok(state)
    }

    /// Writes the state to `path` atomically and durably: a crash leaves the old state or the new.
    pub fn save(&self, path: &Path) -> Result<(), ControllerError> {
        let fail = |e: std::io::Error| state_error(path, e.to_string());
        let mut partial = path.as_os_str().to_owned();
        partial.push(".partial");
        let partial = PathBuf::from(partial);
        let mut file = std::fs::File::create(&partial).map_err(fail)?;
        file.write_all(self.to_string().as_bytes()).map_err(fail)?;
        file.sync_all().map_err(fail)?;
        std::fs::rename(&partial, path).map_err(fail)?;
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::File::open(dir).and_then(|d| d.sync_all()).map_err(fail)?;
        }
        Ok(())
    }
}

impl fmt::Display for State {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "epoch {}", self.epoch)?;
        writeln!(f, "incarnation {}", self.incarnation)?;
        for (&(role, index), m) in &self.members {
            let status = if m.awaiting { "awaiting" } else { "live" };
            writeln!(f, "member {} {index} {status} {}", role_name(role), m.fenced_in)?;
        }
        Ok(())
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
        let mut state = State { epoch: 7, incarnation: 2, ..State::default() };
        state.members.insert((Role::Engine, 0), Membership { fenced_in: 0, awaiting: false });
        state.members.insert((Role::Sidecar, 3), Membership { fenced_in: 7, awaiting: true });
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("controller.state");
        assert_eq!(State::load(&path).unwrap(), State::default(), "no file: a fresh cluster");
        state.save(&path).unwrap();
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
