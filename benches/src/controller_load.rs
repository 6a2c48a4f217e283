//! The scale of one controller: `members` members heartbeating at 10 Hz, simulated from this
//! process (signed heartbeat datagrams, as `dejavud` members send them), to one `dejavud
//! controller`. Measured: the controller's CPU time per heartbeat over a window (from
//! `/proc/PID/stat`), and how long it takes to declare a member dead once its beats stop, against
//! the same for a controller of a few members in the same run.

use std::collections::HashSet;
use std::net::{SocketAddr, UdpSocket};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use dejavud::heartbeat::{Beat, Role};

use crate::controller_process::{metric, ControllerProcess, SECRET};
use crate::Row;

/// The members' heartbeat interval (10 Hz) and the silence after which the controller declares
/// one dead: the controller's defaults.
const HEARTBEAT: Duration = Duration::from_millis(100);
const TIMEOUT: Duration = Duration::from_millis(300);

/// A controller with the benchmark's timeout and heartbeat, and where it listens and serves its
/// metrics.
struct Controller {
    process: ControllerProcess,
    listen: SocketAddr,
    metrics: SocketAddr,
}

impl Controller {
    fn start(exe: &Path, dir: &Path) -> Result<Self, String> {
        let process = ControllerProcess::start(
            exe,
            &[
                "--listen=127.0.0.1:0".into(),
                "--metrics=127.0.0.1:0".into(),
                format!("--state={}", dir.join("state").display()),
                format!("--timeout-ms={}", TIMEOUT.as_millis()),
                format!("--heartbeat-ms={}", HEARTBEAT.as_millis()),
            ],
        )?;
        let metrics = process.address("metrics ")?;
        let listen = process.address("listening ")?;
        Ok(Self { process, listen, metrics })
    }

    fn metric(&self, name: &str, labels: &[(&str, &str)]) -> Result<f64, String> {
        metric(self.metrics, name, labels)
    }
}

/// Slices the members' beats are spread in over each interval.
const SLICES: u32 = 20;

/// What the load has sent: beats so far, and the last slice and when it went.
#[derive(Clone, Copy)]
struct Sent {
    beats: u64,
    slice: u32,
    at: Instant,
}

/// Members beating from one thread: every interval, one signed datagram per member not silenced
/// to each controller, the members in `SLICES` slices spread over the interval.
pub(crate) struct Load {
    controllers: Arc<Mutex<Vec<SocketAddr>>>,
    stop: Arc<AtomicBool>,
    silenced: Arc<Mutex<HashSet<u32>>>,
    sent: Arc<Mutex<Sent>>,
    per_slice: u32,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Load {
    pub(crate) fn start(controllers: Vec<SocketAddr>, members: u32) -> Result<Self, String> {
        let socket = UdpSocket::bind("127.0.0.1:0").map_err(|e| e.to_string())?;
        let controllers = Arc::new(Mutex::new(controllers));
        let targets = controllers.clone();
        let (stop, silenced) = (Arc::new(AtomicBool::new(false)), Arc::new(Mutex::new(HashSet::new())));
        let sent = Arc::new(Mutex::new(Sent { beats: 0, slice: SLICES, at: Instant::now() }));
        let per_slice = members.div_ceil(SLICES);
        let (stopped, quiet, counted) = (stop.clone(), silenced.clone(), sent.clone());
        let thread = std::thread::spawn(move || {
            let mut next = Instant::now();
            while !stopped.load(Ordering::Relaxed) {
                // The members in slices spread over the interval, as processes started at
                // different times beat.
                for slice in 0..SLICES {
                    let quiet = quiet.lock().expect("not poisoned").clone();
                    let targets = targets.lock().expect("not poisoned").clone();
                    let sequence =
                        SystemTime::now().duration_since(SystemTime::UNIX_EPOCH).map_or(0, |d| d.as_micros());
                    let first = slice * per_slice;
                    let mut beats = 0;
                    for index in (first..(first + per_slice).min(members)).filter(|i| !quiet.contains(i)) {
                        let beat = Beat {
                            member: (Role::Engine, index),
                            pid: 100_000 + index,
                            epoch: 0,
                            sequence: sequence as u64,
                            control_port: None,
                            data_port: None,
                        };
                        let datagram = beat.encode(SECRET.as_bytes());
                        for &controller in &targets {
                            if socket.send_to(&datagram, controller).is_ok() {
                                beats += 1;
                            }
                        }
                    }
                    {
                        let mut sent = counted.lock().expect("not poisoned");
                        *sent = Sent { beats: sent.beats + beats, slice, at: Instant::now() };
                    }
                    next += HEARTBEAT / SLICES;
                    std::thread::sleep(next.saturating_duration_since(Instant::now()));
                }
            }
        });
        Ok(Self { controllers, stop, silenced, sent, per_slice, thread: Some(thread) })
    }

    /// Beats go to `controllers` from the next slice on.
    pub(crate) fn beat_to(&self, controllers: Vec<SocketAddr>) {
        *self.controllers.lock().expect("not poisoned") = controllers;
    }

    fn sent(&self) -> Sent {
        *self.sent.lock().expect("not poisoned")
    }

    /// Stops `member`'s beats just after its next one went; returns when that was.
    pub(crate) fn silence(&self, member: u32) -> Instant {
        let before = self.sent().at;
        loop {
            let sent = self.sent();
            if sent.at > before && sent.slice == member / self.per_slice {
                // Its next beat is an interval away: silenced well before it.
                self.silenced.lock().expect("not poisoned").insert(member);
                return sent.at;
            }
            std::thread::sleep(Duration::from_micros(200));
        }
    }
}

impl Drop for Load {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// Waits up to `patience` for `ready`, polling.
pub(crate) fn wait_for(
    patience: Duration,
    mut ready: impl FnMut() -> Result<bool, String>,
) -> Result<Instant, String> {
    let deadline = Instant::now() + patience;
    loop {
        if ready()? {
            return Ok(Instant::now());
        }
        if Instant::now() > deadline {
            return Err(format!("waited {patience:?}"));
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// What one controller under load showed: its CPU seconds per heartbeat, and the milliseconds
/// each detection of a silenced member took, sorted.
struct Sitting {
    /// CPU seconds per heartbeat (counted in the kernel's ticks of 10 ms: meaningless for a few
    /// members over seconds).
    cpu_per_beat: f64,
    cpu_share: f64,
    detections: Vec<f64>,
}

impl Sitting {
    fn median(&self) -> f64 {
        self.detections[self.detections.len() / 2]
    }

    fn slowest(&self) -> f64 {
        self.detections[self.detections.len() - 1]
    }
}

/// A fresh controller under `members` members: its CPU over `window`, then `detections`
/// members silenced one after another.
fn sit(exe: &Path, members: u32, window: Duration, detections: u32) -> Result<Sitting, String> {
    let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
    let controller = Controller::start(exe, dir.path())?;
    let load = Load::start(vec![controller.listen], members)?;
    let alive = || controller.metric("dejavu_controller_members", &[("health", "alive")]);
    wait_for(Duration::from_secs(30), || Ok(alive()? >= f64::from(members))).map_err(|e| {
        let shown = |value: Result<f64, String>| value.map_or("?".into(), |v| v.to_string());
        format!(
            "{members} members never all alive ({e}): {} alive, {} heartbeats taken, {} refused",
            shown(alive()),
            shown(controller.metric("dejavu_controller_heartbeats_total", &[])),
            shown(controller.metric("dejavu_controller_refused_heartbeats_total", &[]))
        )
    })?;
    let (cpu0, beats0) = (controller.process.cpu_seconds()?, load.sent().beats);
    std::thread::sleep(window);
    let (cpu1, beats1) = (controller.process.cpu_seconds()?, load.sent().beats);
    let mut times = Vec::new();
    for member in 0..detections.min(members) {
        let detected = controller.metric("dejavu_controller_detections_total", &[])?;
        let last = load.silence(member);
        let seen = wait_for(Duration::from_secs(10), || {
            Ok(controller.metric("dejavu_controller_detections_total", &[])? > detected)
        })
        .map_err(|e| format!("member {member} of {members} never declared dead: {e}"))?;
        times.push(seen.duration_since(last).as_secs_f64() * 1e3);
    }
    times.sort_by(f64::total_cmp);
    Ok(Sitting {
        cpu_per_beat: (cpu1 - cpu0) / (beats1 - beats0).max(1) as f64,
        cpu_share: (cpu1 - cpu0) / window.as_secs_f64(),
        detections: times,
    })
}

/// Members of the unloaded controller whose detections are the limit of the loaded one's.
const FEW: u32 = 10;

/// Rows for one controller under `members` simulated members against one under `FEW` measured in
/// the same run: the median and slowest of `detections` detections of a silenced member (beats
/// every 100 ms, declared dead after 300 ms of silence), and a note with the CPU per heartbeat.
pub fn measure(
    exe: &Path,
    members: u32,
    window: Duration,
    detections: u32,
) -> Result<(Vec<Row>, String), String> {
    let few = sit(exe, FEW, window, detections)?;
    let many = sit(exe, members, window, detections)?;
    let row = |name: &str, value: f64, limit: f64, target: f64| {
        Row {
        name: format!("controller under {members} members at 10 Hz: {name} of {detections} detections of a silenced member"),
        value,
        unit: "ms",
        limit_name: format!("the same under {FEW} members"),
        limit,
        target,
        higher_is_better: false,
    }
    };
    let rows = vec![
        row("median", many.median(), few.median(), 0.9),
        row("slowest", many.slowest(), few.slowest(), 0.0),
    ];
    let note = format!(
        "controller scale: {members} members heartbeating at 10 Hz (spread over each interval) \
         from one load process; the controller used {:.1} us of CPU per heartbeat ({:.1}% of a core); \
         detections {:.0}-{:.0} ms (under {FEW}: {:.0}-{:.0} ms), against a silence timeout of {} ms and \
         beats every {} ms",
        many.cpu_per_beat * 1e6,
        many.cpu_share * 100.0,
        many.detections[0],
        many.slowest(),
        few.detections[0],
        few.slowest(),
        TIMEOUT.as_millis(),
        HEARTBEAT.as_millis()
    );
    Ok((rows, note))
}
