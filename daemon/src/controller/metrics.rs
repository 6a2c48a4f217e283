//! The controller's metrics page.

use std::sync::atomic::{AtomicU64, Ordering};

use super::{Counters, Health, Tables};
use crate::metrics::{Exposition, MetricType};

/// The metrics page of `tables` and `counters`, in Prometheus text.
pub(super) fn render(tables: &Tables, counters: &Counters) -> String {
    let mut page = Exposition::new();
    let get = |c: &AtomicU64| c.load(Ordering::Relaxed) as f64;
    page.single(
        "dejavu_controller_epoch",
        MetricType::Gauge,
        "The last epoch handed out.",
        tables.machine.epoch() as f64,
    )
    .single(
        "dejavu_controller_incarnation",
        MetricType::Gauge,
        "Controllers that have run on this state file, this one included.",
        tables.machine.record().incarnation as f64,
    )
    .single(
        "dejavu_controller_heartbeats_total",
        MetricType::Counter,
        "Heartbeats received.",
        get(&counters.heartbeats),
    )
    .single(
        "dejavu_controller_heartbeats_missed_total",
        MetricType::Counter,
        "Heartbeat intervals that passed without a beat from a member that beat again later.",
        get(&counters.missed_heartbeats),
    )
    .single(
        "dejavu_controller_stale_heartbeats_total",
        MetricType::Counter,
        "Heartbeats ignored because they came from a fenced process.",
        get(&counters.stale_heartbeats),
    )
    .single(
        "dejavu_controller_replayed_heartbeats_total",
        MetricType::Counter,
        "Heartbeats ignored because they were no newer than the last one of their member (replays).",
        get(&counters.replayed_heartbeats),
    )
    .single(
        "dejavu_controller_refused_heartbeats_total",
        MetricType::Counter,
        "Datagrams on the heartbeat port that were not heartbeats signed with the cluster secret.",
        get(&counters.refused_heartbeats),
    )
    .single(
        "dejavu_controller_spares_assigned_total",
        MetricType::Counter,
        "Spare sidecars handed over to take a fenced sidecar's place (with --stages).",
        get(&counters.spares_assigned),
    )
    .single(
        "dejavu_controller_spare_failures_total",
        MetricType::Counter,
        "Spare sidecars that could not be handed over (another was tried).",
        get(&counters.spare_failures),
    )
    .single(
        "dejavu_controller_lifelines",
        MetricType::Gauge,
        "Lifelines held open by members now.",
        get(&counters.lifelines),
    )
    .single(
        "dejavu_controller_severed_lifelines_total",
        MetricType::Counter,
        "Members' lifelines that broke (their process was gone), each declaring its member dead.",
        get(&counters.severed_lifelines),
    )
    .single(
        "dejavu_controller_fences_total",
        MetricType::Counter,
        "Epochs opened to fence failed members.",
        get(&counters.fences),
    )
    .single(
        "dejavu_controller_detections_total",
        MetricType::Counter,
        "Fences the controller opened on its own, declaring silent members dead.",
        get(&counters.detections),
    )
    .single(
        "dejavu_controller_queries_total",
        MetricType::Counter,
        "Queries answered.",
        get(&counters.queries),
    )
    .single(
        "dejavu_controller_refused_queries_total",
        MetricType::Counter,
        "Query connections closed unanswered: they did not prove the cluster secret, or too many were open.",
        get(&counters.refused_queries),
    );
    page.family(
        "dejavu_controller_replacement_seconds",
        MetricType::Summary,
        "From fencing a member to its replacement's first heartbeat.",
    )
    .sample("dejavu_controller_replacement_seconds_sum", &[], get(&counters.replacement_micros) / 1e6)
    .sample("dejavu_controller_replacement_seconds_count", &[], get(&counters.replacements));
    page.family(
        "dejavu_controller_recovery_seconds",
        MetricType::Summary,
        "Recoveries the controller carried out (re-seeds and resume points), and how long they took.",
    )
    .sample("dejavu_controller_recovery_seconds_sum", &[], get(&counters.recovery_micros) / 1e6)
    .sample("dejavu_controller_recovery_seconds_count", &[], get(&counters.recoveries));
    page.single(
        "dejavu_controller_recoveries_acknowledged_total",
        MetricType::Counter,
        "Recoveries whose sequences the feeder acknowledged it fed again (the recovery feed).",
        get(&counters.acknowledged_recoveries),
    );
    page.single(
        "dejavu_controller_recovery_acknowledged_epoch",
        MetricType::Gauge,
        "The epoch of the newest recovery the feeder acknowledged (0: none).",
        get(&counters.last_acknowledged),
    );
    page.single(
        "dejavu_controller_reseeded_chunks_total",
        MetricType::Counter,
        "Chunks surviving sidecars sent replaced ones on the controller's orders.",
        get(&counters.reseeded_chunks),
    );
    page.family("dejavu_controller_members", MetricType::Gauge, "Members by health.");
    let census = tables.machine.census(tables.now());
    let healths = [
        (Health::Alive, "alive"),
        (Health::Suspect, "suspect"),
        (Health::Dead, "dead"),
        (Health::Fenced, "fenced"),
    ];
    for (health, name) in healths {
        let count = census.iter().filter(|&&(_, h)| h == health).count();
        page.sample("dejavu_controller_members", &[("health", name)], count as f64);
    }
    page.finish()
}
