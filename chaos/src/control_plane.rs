//! The control plane's invariants with controllers on etcd, checked after a run from etcd's own
//! history of the clusters' keys and from how each controller process ended:
//!
//! - **epochs only grow:** in revision order, the epoch of each cluster's record never goes down
//!   (an epoch handed out twice would let a fenced process pass for a live one);
//! - **one leader at a time:** every write of the record comes from the controller that led at
//!   that revision. A leader is the campaigner whose key under `/dejavu/<cluster>/leader/` is the
//!   oldest alive; each controller that takes the lead writes the record with an incarnation of
//!   its own, so the writes of one incarnation must all fall in its writer's term, and the
//!   incarnations never go back;
//! - **a deposed leader stops:** a leader paused past its lease, whom another succeeded while it
//!   was stopped, ends deposed once resumed (its writes fail, and it exits) rather than going on.

use std::collections::BTreeMap;
use std::net::SocketAddr;

use dejavud::cluster::{ControllerEnd, ControllerLife};
use dejavud::controller::State;
use etcd_client::{Client, EventType, GetOptions, WatchOptions};

use crate::check::Violation;

/// Where every cluster's keys are.
const PREFIX: &str = "/dejavu/";

/// One change of a cluster's keys, as etcd recorded it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Change {
    /// The record was written with this epoch and incarnation.
    Record {
        /// Its last epoch.
        epoch: u64,
        /// Its controller's incarnation.
        incarnation: u64,
    },
    /// A controller campaigned: its key under the election was created (at this revision).
    Campaigned(String),
    /// A campaigner's key went (its lease revoked or lapsed, or it resigned).
    Left(String),
    /// The record was written with text that is not a record (why).
    Unreadable(String),
}

/// A change at a revision, to a cluster's keys.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Event {
    /// etcd's revision of the change.
    pub revision: i64,
    /// The DéjàVu cluster's name.
    pub cluster: String,
    /// What changed.
    pub change: Change,
}

/// Every change under `/dejavu/` since etcd's first revision, from the etcd members at
/// `endpoints` (any that answers).
pub fn history(endpoints: &[SocketAddr]) -> Result<Vec<Event>, String> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| format!("no runtime to read etcd with: {e}"))?;
    let urls: Vec<String> = endpoints.iter().map(|a| format!("http://{a}")).collect();
    let reading = async {
        let fail = |e: etcd_client::Error| format!("reading etcd's history: {e}");
        let mut client = Client::connect(&urls, None).await.map_err(fail)?;
        let now = client
            .get(PREFIX, Some(GetOptions::new().with_prefix().with_count_only()))
            .await
            .map_err(fail)?;
        if now.count() == 0 {
            return Ok(Vec::new());
        }
        let last = now.header().map_or(0, |h| h.revision());
        let options = WatchOptions::new().with_prefix().with_start_revision(1);
        let mut stream = client.watch(PREFIX, Some(options)).await.map_err(fail)?;
        let mut events = Vec::new();
        let mut seen = 0;
        while seen < last {
            let Some(response) = stream.message().await.map_err(fail)? else { break };
            if response.canceled() {
                return Err(format!("etcd cancelled the watch of its history: {}", response.cancel_reason()));
            }
            for event in response.events() {
                let Some(kv) = event.kv() else { continue };
                seen = seen.max(kv.mod_revision());
                if let Some(event) = parse(event.event_type(), kv) {
                    events.push(event);
                }
            }
        }
        Ok(events)
    };
    runtime.block_on(async {
        tokio::time::timeout(HISTORY_PATIENCE, reading)
            .await
            .unwrap_or_else(|_| Err(format!("etcd's history was not read within {HISTORY_PATIENCE:?}")))
    })
}

/// How long reading etcd's history may take.
const HISTORY_PATIENCE: std::time::Duration = std::time::Duration::from_secs(30);

/// The event a key's change is, if it is one of a cluster's.
fn parse(kind: EventType, kv: &etcd_client::KeyValue) -> Option<Event> {
    let key = kv.key_str().ok()?.strip_prefix(PREFIX)?;
    let (cluster, rest) = key.split_once('/')?;
    let change = match (rest, kind) {
        ("record", EventType::Put) => {
            match kv.value_str().map_err(|e| e.to_string()).and_then(State::parse) {
                Ok(record) => Change::Record { epoch: record.epoch, incarnation: record.incarnation },
                Err(why) => Change::Unreadable(why),
            }
        }
        (rest, EventType::Put) if rest.starts_with("leader/") && kv.version() == 1 => {
            Change::Campaigned(key.to_owned())
        }
        (rest, EventType::Delete) if rest.starts_with("leader/") => Change::Left(key.to_owned()),
        _ => return None,
    };
    Some(Event { revision: kv.mod_revision(), cluster: cluster.to_owned(), change })
}

/// Every violation of the control plane's invariants in `events` (etcd's history) and `lives`
/// (each controller process).
pub fn check(events: &[Event], lives: &[ControllerLife]) -> Vec<Violation> {
    let mut out = Vec::new();
    let mut clusters: BTreeMap<&str, Vec<&Event>> = BTreeMap::new();
    for event in events {
        clusters.entry(&event.cluster).or_default().push(event);
    }
    for (cluster, mut events) in clusters {
        events.sort_by_key(|e| e.revision);
        check_cluster(cluster, &events, &mut out);
    }
    for life in lives {
        let stopped = matches!(life.end, ControllerEnd::Deposed | ControllerEnd::Killed);
        if life.deposed_while_paused && !stopped {
            out.push(Violation {
                invariant: "a deposed leader stops",
                detail: format!(
                    "controller pid {} was paused while it led and succeeded meanwhile, and once resumed it \
                     did not stop as deposed: {:?}",
                    life.pid, life.end
                ),
                step: None,
            });
        }
    }
    out
}

fn check_cluster(cluster: &str, events: &[&Event], out: &mut Vec<Violation>) {
    // Campaigners' keys alive, by the revision they were created at: the oldest leads.
    let mut campaigners: BTreeMap<i64, &str> = BTreeMap::new();
    let mut created: BTreeMap<&str, i64> = BTreeMap::new();
    // Each incarnation's writer (its leader key), and the last epoch and incarnation written.
    let mut writers: BTreeMap<u64, &str> = BTreeMap::new();
    let (mut last_epoch, mut last_incarnation) = (0, 0);
    let mut violation = |invariant: &'static str, detail: String| {
        out.push(Violation { invariant, detail: format!("cluster {cluster}: {detail}"), step: None });
    };
    for event in events {
        match &event.change {
            Change::Campaigned(key) => {
                campaigners.insert(event.revision, key);
                created.insert(key, event.revision);
            }
            Change::Left(key) => {
                if let Some(revision) = created.remove(key.as_str()) {
                    campaigners.remove(&revision);
                }
            }
            Change::Unreadable(why) => {
                violation(
                    "epochs only grow",
                    format!("a record written at revision {} that cannot be read: {why}", event.revision),
                );
            }
            &Change::Record { epoch, incarnation } => {
                let at = event.revision;
                if epoch < last_epoch {
                    violation(
                        "epochs only grow",
                        format!("epoch {epoch} written at revision {at}, after {last_epoch}"),
                    );
                }
                if incarnation < last_incarnation {
                    violation(
                        "one leader at a time",
                        format!("incarnation {incarnation} wrote at revision {at}, after incarnation {last_incarnation}"),
                    );
                }
                (last_epoch, last_incarnation) = (last_epoch.max(epoch), last_incarnation.max(incarnation));
                let Some((_, &leader)) = campaigners.first_key_value() else {
                    violation("one leader at a time", format!("a write at revision {at} while nobody led"));
                    continue;
                };
                match writers.get(&incarnation) {
                    None => {
                        writers.insert(incarnation, leader);
                    }
                    Some(&writer) if writer != leader => violation(
                        "one leader at a time",
                        format!(
                            "incarnation {incarnation} (leader key {writer}) wrote at revision {at}, while {leader} led"
                        ),
                    ),
                    Some(_) => {}
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(revision: i64, change: Change) -> Event {
        Event { revision, cluster: "c".into(), change }
    }

    fn record(epoch: u64, incarnation: u64) -> Change {
        Change::Record { epoch, incarnation }
    }

    fn key(lease: &str) -> String {
        format!("/dejavu/c/leader/{lease}")
    }

    #[test]
    fn a_clean_failover_passes() {
        let events = [
            at(2, Change::Campaigned(key("a"))),
            at(3, record(0, 1)),
            at(4, Change::Campaigned(key("b"))),
            at(5, record(1, 1)),
            at(6, Change::Left(key("a"))),
            at(7, record(1, 2)),
            at(8, record(2, 2)),
        ];
        assert!(check(&events, &[]).is_empty());
    }

    #[test]
    fn a_deposed_leaders_write_a_going_back_epoch_and_a_write_with_no_leader_are_caught() {
        // "a" lost its key at revision 6, and "b" led; a write of a's incarnation follows.
        let events = [
            at(2, Change::Campaigned(key("a"))),
            at(3, record(1, 1)),
            at(4, Change::Campaigned(key("b"))),
            at(6, Change::Left(key("a"))),
            at(7, record(2, 2)),
            at(8, record(1, 1)),
            at(9, Change::Left(key("b"))),
            at(10, record(3, 3)),
        ];
        let found: Vec<&str> = check(&events, &[]).iter().map(|v| v.invariant).collect();
        assert_eq!(
            found,
            ["epochs only grow", "one leader at a time", "one leader at a time", "one leader at a time"],
            "the epoch and incarnation went back at 8, written outside its writer's term, and 10 had no leader"
        );
    }

    #[test]
    fn a_superseded_leader_that_goes_on_is_caught() {
        let life = |end| ControllerLife { pid: 1, led: true, deposed_while_paused: true, end };
        assert!(check(&[], &[life(ControllerEnd::Deposed)]).is_empty());
        assert_eq!(check(&[], &[life(ControllerEnd::Running)]).len(), 1);
        assert_eq!(check(&[], &[life(ControllerEnd::Exited(Some(1)))]).len(), 1);
    }
}
