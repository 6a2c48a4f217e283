//! Daemons deployed beside engines that report nothing themselves, without the demo's driver:
//! a controller told the ring's size (`--stages`), two sidecars on fixed ports, each the other's
//! successor, each started with `--join` as a supervisor would start it every time, and an engine
//! per stage that joins its sidecar. A whole worker dies (its sidecar SIGKILLed, its engine gone);
//! the supervisor starts the sidecar again, the same way; the controller restores it by itself, and
//! the replacement engine gets its KV back bit for bit.

use std::io::{BufRead, BufReader, Read, Seek, SeekFrom};
use std::net::SocketAddr;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use dejavu_proto::plan::{Loss, Source};
use dejavud::cli::DEFAULT_SECRET;
use dejavud::cluster::Role;
use dejavud::controller::{Census, ControllerClient, Health};
use dejavud::heartbeat::SPARE_MEMBERS;
use dejavud::metrics::{scrape, value_of};
use dejavulib::chunk::ChunkDescriptor;
use dejavulib::local::LocalSidecar;
use dejavulib::message::RecoveryOrders;
use dejavulib::net::controller::RecoveryFeed;
use dejavulib::{ChunkStore, DType, KvRegion, KvSpec, Packing, WorkerId};

/// A daemon process, killed when dropped.
struct Daemon {
    child: Child,
    lines: std::io::Lines<BufReader<std::process::ChildStdout>>,
    /// Where its standard error goes, read back if it exits before it says what is awaited.
    stderr: std::fs::File,
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Starts `dejavud args` and waits for the address its `prefix` line names.
fn start(args: &[&str]) -> Daemon {
    let stderr = tempfile::tempfile().unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_dejavud"))
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::from(stderr.try_clone().unwrap()))
        .spawn()
        .unwrap();
    let lines = BufReader::new(child.stdout.take().unwrap()).lines();
    Daemon { child, lines, stderr }
}

impl Daemon {
    fn next(&mut self, prefix: &str) -> SocketAddr {
        self.try_next(prefix)
            .unwrap_or_else(|stderr| panic!("dejavud exited before a {prefix:?} line: {stderr}"))
    }

    /// The address its next `prefix` line names, or what it wrote to standard error if it exits
    /// first.
    fn try_next(&mut self, prefix: &str) -> Result<SocketAddr, String> {
        for line in self.lines.by_ref() {
            if let Some(addr) = line.map_err(|e| e.to_string())?.strip_prefix(prefix) {
                return Ok(addr.parse().unwrap());
            }
        }
        let _ = self.child.wait();
        let mut written = String::new();
        self.stderr.seek(SeekFrom::Start(0)).and_then(|_| self.stderr.read_to_string(&mut written)).unwrap();
        Err(written)
    }
}

/// A daemon `launch` starts listening on a port free now, and that port: another one if a test
/// running beside this one took it meanwhile.
fn on_a_free_port(launch: impl Fn(u16) -> Daemon) -> (Daemon, u16) {
    for _ in 0..5 {
        let port = free_port();
        let mut daemon = launch(port);
        match daemon.try_next("listening ") {
            Ok(_) => return (daemon, port),
            Err(stderr) if stderr.contains("in use") => continue,
            Err(stderr) => panic!("dejavud exited before it listened: {stderr}"),
        }
    }
    panic!("no port stayed free for 5 tries")
}

/// A port free now on loopback (the sidecars listen on fixed ports, as in a deployment).
/// A controller of a 2-stage ring with its state in `dir`, on ports the kernel chose: the process,
/// its metrics address and its listening address.
fn ring_controller(dir: &Path) -> (Daemon, SocketAddr, SocketAddr) {
    let state = dir.join("controller.state");
    let mut controller = start(&[
        "controller",
        "--listen",
        "127.0.0.1:0",
        "--state",
        state.to_str().unwrap(),
        "--metrics",
        "127.0.0.1:0",
        "--stages",
        "2",
    ]);
    let metrics = controller.next("metrics ");
    let addr = controller.next("listening ");
    (controller, metrics, addr)
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// Stage `stage`'s sidecar, started the same way every time (`--join`), as a supervisor would,
/// once it listens.
fn sidecar(stage: u32, port: u16, controllers: &[SocketAddr], local: &Path) -> Daemon {
    let mut daemon = launch_sidecar(stage, port, controllers, local);
    daemon.next("listening ");
    daemon
}

/// Stage `stage`'s first sidecar, on a port free now; and the port.
fn first_sidecar(stage: u32, controllers: &[SocketAddr], local: &Path) -> (Daemon, u16) {
    on_a_free_port(|port| launch_sidecar(stage, port, controllers, local))
}

/// Stage `stage`'s sidecar on `port`, beating to `controllers` (several on etcd).
fn launch_sidecar(stage: u32, port: u16, controllers: &[SocketAddr], local: &Path) -> Daemon {
    let heartbeat = controllers.iter().map(SocketAddr::to_string).collect::<Vec<_>>().join(",");
    let (index, listen) = (stage.to_string(), format!("127.0.0.1:{port}"));
    start(&[
        "sidecar",
        "--join",
        &index,
        "--listen",
        &listen,
        "--heartbeat",
        &heartbeat,
        "--local",
        local.to_str().unwrap(),
    ])
}

/// A step's KV of stage `stage`: tokens `tokens` of the sequence in slot 0.
fn step(stage: u32, tokens: std::ops::Range<u32>) -> (ChunkDescriptor, Vec<u8>) {
    let spec = KvSpec::new(2, 2, 8, DType::F16).unwrap();
    let worker = WorkerId { stage, rank: 0 };
    let descriptor = ChunkDescriptor {
        source: worker,
        destination: worker,
        microbatch: 0,
        region: KvRegion::new(0..2, 0..1, 0..2, tokens.clone()),
        spec,
        packing: Packing::token_major(&spec),
    };
    let len = descriptor.payload_len() as usize;
    let seed = (stage * 1000 + tokens.start) as u8;
    (descriptor, (0..len).map(|i| (i as u8).wrapping_mul(17).wrapping_add(seed)).collect())
}

/// The controller's metrics page once it has restored one replaced sidecar (`what` says what
/// never happened otherwise).
fn restored_once(metrics: SocketAddr, what: &str) -> String {
    let started = Instant::now();
    loop {
        let page = scrape(metrics).unwrap();
        if value_of(&page, "dejavu_controller_recovery_seconds_count", &[]) == Some(1.0) {
            return page;
        }
        assert!(started.elapsed() < Duration::from_secs(30), "{what}: {page}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

fn wait_until(client: &mut ControllerClient, what: &str, done: impl Fn(&Census) -> bool) {
    let started = Instant::now();
    while !done(&client.census().unwrap()) {
        assert!(started.elapsed() < Duration::from_secs(20), "never {what}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// A controller told the ring's size (`--stages 2`) and a sidecar per stage on fixed ports, each
/// started with `--join`.
struct Ring {
    _controller: Daemon,
    metrics: SocketAddr,
    addr: SocketAddr,
    ports: [u16; 2],
    locals: [std::path::PathBuf; 2],
    workers: Vec<Daemon>,
}

impl Ring {
    fn start(dir: &Path) -> Self {
        let (controller, metrics, addr) = ring_controller(dir);
        let locals = [dir.join("s0.sock"), dir.join("s1.sock")];
        let (workers, ports): (Vec<Daemon>, Vec<u16>) =
            (0..2).map(|k| first_sidecar(k as u32, &[addr], &locals[k])).unzip();
        let ports = [ports[0], ports[1]];
        Self { _controller: controller, metrics, addr, ports, locals, workers }
    }
}

#[test]
fn a_whole_worker_lost_outside_the_demo_is_restored_by_the_controller() {
    let dir = tempfile::tempdir().unwrap();
    let Ring { _controller, metrics, addr, ports, locals, mut workers } = Ring::start(dir.path());
    let at = |stage: usize| -> SocketAddr { format!("127.0.0.1:{}", ports[stage]).parse().unwrap() };
    let mut worker0 = workers.remove(0);

    // A second sidecar joining stage 0 while its sidecar lives is refused.
    let heartbeat = addr.to_string();
    let twice = Command::new(env!("CARGO_BIN_EXE_dejavud"))
        .args(["sidecar", "--join", "0", "--heartbeat", &heartbeat, "--local"])
        .arg(dir.path().join("other.sock"))
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&twice.stderr);
    assert_eq!(twice.status.code(), Some(2), "{err}");
    assert!(err.contains("not fenced"), "{err}");

    // Each engine joins its sidecar (forwarding to the other's) and reports a prompt and steps.
    let mut engines: Vec<LocalSidecar> =
        (0..2).map(|k| LocalSidecar::join(&locals[k], at(1 - k)).unwrap()).collect();
    let mut written = [Vec::new(), Vec::new()];
    for (stage, engine) in engines.iter_mut().enumerate() {
        for tokens in [0..16, 16..17, 17..18, 18..19] {
            let (descriptor, payload) = step(stage as u32, tokens);
            engine.put(&descriptor, &payload).unwrap();
            written[stage].push((descriptor, payload));
        }
    }

    // Worker 0 dies whole: its sidecar is killed, its engine goes with the machine.
    let mut client = ControllerClient::new(addr, Duration::from_secs(5), DEFAULT_SECRET.as_bytes());
    let _ = worker0.child.kill();
    let _ = worker0.child.wait();
    drop(engines.remove(0));
    wait_until(&mut client, "worker 0 fenced", |c| {
        c.is_fenced((Role::Sidecar, 0)) && c.is_fenced((Role::Engine, 0))
    });

    // A supervisor starts its sidecar again, the same way: it joins as the replacement, and the
    // controller restores it.
    let _replacement = sidecar(0, ports[0], &[addr], &locals[0]);
    let restored = restored_once(metrics, "the controller never restored it");
    // Stage 1's replica (re-seeded from its sidecar) and stage 0's own KV (handed back).
    let sent = value_of(&restored, "dejavu_controller_reseeded_chunks_total", &[]).unwrap();
    assert_eq!(sent, 8.0, "{restored}");

    // The replacement engine joins in the fence's epoch and finds its KV there, bit for bit.
    let fenced_in = client.fenced_in((Role::Engine, 0)).unwrap();
    let mut engine = LocalSidecar::join(&locals[0], at(1)).unwrap();
    assert_eq!(engine.epoch(), fenced_in);
    let mut out = Vec::new();
    for (descriptor, payload) in &written[0] {
        assert_eq!(engine.get(&descriptor.key(), &mut out).unwrap(), *descriptor);
        assert_eq!(&out, payload, "{:?}", descriptor.region.tokens);
    }
    let held = engine.recovery().unwrap();
    let points = held.resume_points();
    assert_eq!(points.len(), 1, "{points:?}");
    assert_eq!(points[0].tokens, 19, "the sequence resumes after its last step");
    wait_until(&mut client, "worker 0 alive again", |c| {
        !c.is_dead((Role::Sidecar, 0)) && !c.is_dead((Role::Engine, 0))
    });
}

/// A mark as (microbatch, slots, tokens).
type MarkTuple = (u32, std::ops::Range<u32>, u32);

/// The marks of a recovery's stages, as (stage, loss, source, marks) in stage order.
fn orders_of(orders: &RecoveryOrders) -> Vec<(u32, Loss, Source, Vec<MarkTuple>)> {
    orders
        .stages
        .iter()
        .map(|s| {
            let marks = s.marks.iter().map(|m| (m.microbatch, m.slots.clone(), m.tokens)).collect();
            (s.plan.stage, s.plan.loss, s.plan.source, marks)
        })
        .collect()
}

#[test]
fn whoever_feeds_the_pipeline_learns_each_recovery_and_where_its_sequences_resume() {
    let dir = tempfile::tempdir().unwrap();
    let Ring { _controller, metrics, addr, ports, locals, mut workers } = Ring::start(dir.path());
    let at = |stage: usize| -> SocketAddr { format!("127.0.0.1:{}", ports[stage]).parse().unwrap() };
    let mut engines: Vec<LocalSidecar> =
        (0..2).map(|k| LocalSidecar::join(&locals[k], at(1 - k)).unwrap()).collect();
    for (stage, engine) in engines.iter_mut().enumerate() {
        for tokens in [0..16, 16..17, 17..18] {
            let (descriptor, payload) = step(stage as u32, tokens);
            engine.put(&descriptor, &payload).unwrap();
        }
    }
    let mut client = ControllerClient::new(addr, Duration::from_secs(5), DEFAULT_SECRET.as_bytes());
    let mut feed = RecoveryFeed::new(addr, DEFAULT_SECRET.as_bytes());
    assert_eq!(feed.watch(0, Duration::from_millis(100)).unwrap(), None, "no recovery yet");

    // Stage 1's engine dies alone. Until its replacement joins, the recovery is not published.
    drop(engines.remove(1));
    wait_until(&mut client, "engine 1 fenced", |c| c.is_fenced((Role::Engine, 1)));
    let first = client.fenced_in((Role::Engine, 1)).unwrap();
    assert_eq!(
        feed.watch(0, Duration::from_millis(200)).unwrap(),
        None,
        "published before the engine's replacement joined"
    );
    let watcher = std::thread::spawn(move || (feed.watch(0, Duration::from_secs(10)), feed));
    let _engine1 = LocalSidecar::join(&locals[1], at(0)).unwrap();
    let (orders, mut feed) = watcher.join().unwrap();
    let orders = orders.unwrap().expect("the recovery, once the engine's replacement joined");
    assert_eq!(orders.epoch, first);
    assert_eq!(orders_of(&orders), vec![(1, Loss::Engine, Source::Own, vec![(0, 0..1, 18)])]);
    feed.acknowledge(orders.epoch).unwrap();

    // Worker 0 dies whole; its sidecar is started again by a supervisor, the controller restores
    // it, and its engine's replacement joins: then the feeder learns that stage 0 resumes from
    // the replica stage 1's sidecar held.
    let mut worker0 = workers.remove(0);
    let _ = worker0.child.kill();
    let _ = worker0.child.wait();
    drop(engines.remove(0));
    wait_until(&mut client, "worker 0 fenced", |c| c.is_fenced((Role::Sidecar, 0)));
    let second = client.fenced_in((Role::Sidecar, 0)).unwrap();
    assert!(second > first);
    let _replacement = sidecar(0, ports[0], &[addr], &locals[0]);
    restored_once(metrics, "the controller never restored worker 0's sidecar");
    assert_eq!(
        feed.watch(first, Duration::from_millis(200)).unwrap(),
        None,
        "published before the engine joined"
    );
    let _engine0 = LocalSidecar::join(&locals[0], at(1)).unwrap();
    let orders = feed.watch(first, Duration::from_secs(10)).unwrap().expect("the second recovery");
    assert_eq!(orders.epoch, second);
    assert_eq!(orders_of(&orders), vec![(0, Loss::Worker, Source::Successor(1), vec![(0, 0..1, 18)])]);
    feed.acknowledge(orders.epoch).unwrap();
    feed.acknowledge(orders.epoch).unwrap();
    assert_eq!(feed.watch(second, Duration::from_millis(100)).unwrap(), None, "nothing after it");

    let page = scrape(metrics).unwrap();
    // Two recoveries, one acknowledged twice: counted once.
    assert_eq!(value_of(&page, "dejavu_controller_recoveries_acknowledged_total", &[]), Some(2.0), "{page}");
    assert_eq!(
        value_of(&page, "dejavu_controller_recovery_acknowledged_epoch", &[]),
        Some(second as f64),
        "{page}"
    );
    // An acknowledgement of an epoch not opened yet is refused, and says why.
    let refused = feed.acknowledge(second + 100).unwrap_err().to_string();
    assert!(refused.contains("not one yet"), "{refused}");
}

#[test]
fn a_spare_sidecar_takes_a_lost_workers_place_handed_over_by_the_controller() {
    let dir = tempfile::tempdir().unwrap();
    let Ring { _controller, metrics, addr, ports, locals, mut workers } = Ring::start(dir.path());
    let at = |stage: usize| -> SocketAddr { format!("127.0.0.1:{}", ports[stage]).parse().unwrap() };
    let mut worker0 = workers.remove(0);
    // A spare sidecar on a machine of its own, registered and waiting.
    let spare_local = dir.path().join("spare.sock");
    let heartbeat = addr.to_string();
    let (_spare, _) = on_a_free_port(|port| {
        let listen = format!("127.0.0.1:{port}");
        start(&[
            "sidecar",
            "--spare",
            "0",
            "--listen",
            &listen,
            "--heartbeat",
            &heartbeat,
            "--local",
            spare_local.to_str().unwrap(),
        ])
    });

    let mut engines: Vec<LocalSidecar> =
        (0..2).map(|k| LocalSidecar::join(&locals[k], at(1 - k)).unwrap()).collect();
    let mut written = Vec::new();
    for tokens in [0..16, 16..17, 17..18] {
        for (stage, engine) in engines.iter_mut().enumerate() {
            let (descriptor, payload) = step(stage as u32, tokens.clone());
            engine.put(&descriptor, &payload).unwrap();
            if stage == 0 {
                written.push((descriptor, payload));
            }
        }
    }
    let mut client = ControllerClient::new(addr, Duration::from_secs(5), DEFAULT_SECRET.as_bytes());
    wait_until(&mut client, "the spare registered", |c| {
        c.members.iter().any(|(&member, &health)| member.1 >= SPARE_MEMBERS && health == Health::Alive)
    });

    // Worker 0 dies whole, and nobody starts it again: the controller hands the spare its place
    // and restores it there.
    let _ = worker0.child.kill();
    let _ = worker0.child.wait();
    drop(engines.remove(0));
    let restored = restored_once(metrics, "the spare never took the place");
    assert_eq!(value_of(&restored, "dejavu_controller_spares_assigned_total", &[]), Some(1.0), "{restored}");
    // Stage 1's replica (3 chunks, re-seeded) and stage 0's own KV (3 chunks, handed back).
    assert_eq!(value_of(&restored, "dejavu_controller_reseeded_chunks_total", &[]), Some(6.0), "{restored}");

    // The replacement engine runs beside the spare: it joins it as stage 0, in the fence's epoch,
    // and finds its KV there bit for bit.
    let fenced_in = client.fenced_in((Role::Engine, 0)).unwrap();
    let mut engine = LocalSidecar::join(&spare_local, at(1)).unwrap();
    assert_eq!(engine.epoch(), fenced_in);
    let held = engine.recovery().unwrap();
    assert_eq!(held.serving.stage, 0);
    let mut out = Vec::new();
    for (descriptor, payload) in &written {
        assert_eq!(engine.get(&descriptor.key(), &mut out).unwrap(), *descriptor);
        assert_eq!(&out, payload, "{:?}", descriptor.region.tokens);
    }
    assert_eq!(held.resume_points()[0].tokens, 18, "the sequence resumes after its last step");
    // Stage 1's next step reaches the spare, now its successor.
    let (descriptor, payload) = step(1, 18..19);
    engines[0].put(&descriptor, &payload).unwrap();
    wait_until(&mut client, "stage 0 alive again on the spare", |c| !c.is_dead((Role::Sidecar, 0)));
}

/// Where the controllers of [`a_restore_survives_its_controller`] keep their record.
enum Controllers {
    /// One at a time on a state file: the one that dies is started again on it.
    File(std::path::PathBuf),
    /// Two on etcd: the leader dies, and the one standing by takes over.
    Etcd(dejavud::etcd_cluster::EtcdCluster),
}

/// The etcd cluster name the etcd variant's controllers use.
const RESTORE_CLUSTER: &str = "restore-test";

impl Controllers {
    /// The first controller's command: on a fixed port with a state file (the members find a
    /// restarted one there), or on etcd. A long timeout, so that the sidecar stopped in the test
    /// is not declared dead meanwhile.
    fn args(&self, listen: &str) -> Vec<String> {
        let mut args: Vec<String> =
            ["controller", "--listen", listen, "--metrics", "127.0.0.1:0", "--stages", "2"]
                .map(str::to_owned)
                .to_vec();
        args.extend(["--timeout-ms", "10000"].map(str::to_owned));
        match self {
            Controllers::File(state) => args.extend(["--state".into(), state.display().to_string()]),
            Controllers::Etcd(etcd) => args.extend(
                ["--etcd", etcd.endpoints(), "--cluster", RESTORE_CLUSTER, "--lease-secs", "1"]
                    .map(str::to_owned),
            ),
        }
        args
    }

    /// The record as text: the state file, or the record in etcd.
    fn record(&self) -> String {
        match self {
            Controllers::File(state) => std::fs::read_to_string(state).unwrap_or_default(),
            Controllers::Etcd(etcd) => tokio::runtime::Runtime::new().unwrap().block_on(async {
                let endpoints: Vec<&str> = etcd.endpoints().split(',').collect();
                let mut client = etcd_client::Client::connect(endpoints, None).await.unwrap();
                let found = client.get(format!("/dejavu/{RESTORE_CLUSTER}/record"), None).await.unwrap();
                found.kvs().first().map(|kv| kv.value_str().unwrap().to_owned()).unwrap_or_default()
            }),
        }
    }
}

/// A whole worker dies and its replacement sidecar joins; the controller records the restore and
/// starts it, but the surviving sidecar it restores from is stopped. The controller dies in the
/// middle of the restore: another goes on from the record (restarted on the state file, or the
/// one standing by on etcd), and finishes the restore once the stopped sidecar goes on; the
/// replacement engine then gets its KV back bit for bit.
fn a_restore_survives_its_controller(controllers: Controllers) {
    let dir = tempfile::tempdir().unwrap();
    let listen = match controllers {
        Controllers::File(_) => format!("127.0.0.1:{}", free_port()),
        Controllers::Etcd(_) => "127.0.0.1:0".to_owned(),
    };
    let args = controllers.args(&listen);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let mut controller = start(&args);
    controller.next("metrics ");
    let addr = controller.next("listening ");
    let mut standby = match controllers {
        Controllers::File(_) => None,
        Controllers::Etcd(_) => {
            let mut standby = start(&args);
            let at = standby.next("standby ");
            Some((standby, at))
        }
    };
    let named: Vec<SocketAddr> = std::iter::once(addr).chain(standby.as_ref().map(|(_, at)| *at)).collect();
    let locals = [dir.path().join("s0.sock"), dir.path().join("s1.sock")];
    let (mut worker0, port0) = first_sidecar(0, &named, &locals[0]);
    let (worker1, port1) = first_sidecar(1, &named, &locals[1]);
    let ports = [port0, port1];
    let at = |stage: usize| -> SocketAddr { format!("127.0.0.1:{}", ports[stage]).parse().unwrap() };
    let mut engine0 = LocalSidecar::join(&locals[0], at(1)).unwrap();
    let mut engine1 = LocalSidecar::join(&locals[1], at(0)).unwrap();
    let mut written = Vec::new();
    for tokens in [0..16, 16..17] {
        let (descriptor, payload) = step(0, tokens.clone());
        engine0.put(&descriptor, &payload).unwrap();
        written.push((descriptor, payload));
        let (descriptor, payload) = step(1, tokens);
        engine1.put(&descriptor, &payload).unwrap();
    }

    // Worker 0 dies; the surviving sidecar is stopped, so that the restore cannot finish.
    let mut client = ControllerClient::new(addr, Duration::from_secs(5), DEFAULT_SECRET.as_bytes());
    let _ = worker0.child.kill();
    let _ = worker0.child.wait();
    drop(engine0);
    wait_until(&mut client, "worker 0 fenced", |c| c.is_fenced((Role::Sidecar, 0)));
    // SAFETY: kill(2) on the pid of a child this test started and has not reaped.
    assert_eq!(unsafe { libc::kill(worker1.child.id() as i32, libc::SIGSTOP) }, 0);
    let _replacement = sidecar(0, ports[0], &named, &locals[0]);
    let started = Instant::now();
    while !controllers.record().contains("restoring 0") {
        assert!(started.elapsed() < Duration::from_secs(20), "the restore was never recorded");
        std::thread::sleep(Duration::from_millis(10));
    }

    // The controller dies in the middle of it; another goes on from the record, and the stopped
    // sidecar goes on.
    drop(controller);
    let metrics = match standby.take() {
        None => {
            controller = start(&args);
            let metrics = controller.next("metrics ");
            controller.next("listening ");
            metrics
        }
        Some((mut next, _)) => {
            let metrics = next.next("metrics ");
            next.next("listening ");
            controller = next;
            metrics
        }
    };
    // SAFETY: as above.
    assert_eq!(unsafe { libc::kill(worker1.child.id() as i32, libc::SIGCONT) }, 0);
    restored_once(metrics, "the next controller never restored it");
    assert!(!controllers.record().contains("restoring"), "the restore is recorded done");

    // The replacement engine finds its KV, bit for bit.
    let mut engine = LocalSidecar::join(&locals[0], at(1)).unwrap();
    let mut out = Vec::new();
    for (descriptor, payload) in &written {
        assert_eq!(engine.get(&descriptor.key(), &mut out).unwrap(), *descriptor);
        assert_eq!(&out, payload, "{:?}", descriptor.region.tokens);
    }
    drop((worker1, controller));
}

#[test]
fn a_controller_restarted_in_the_middle_of_a_restore_finishes_it() {
    let dir = tempfile::tempdir().unwrap();
    a_restore_survives_its_controller(Controllers::File(dir.path().join("controller.state")));
}

#[test]
fn a_leader_on_etcd_killed_in_the_middle_of_a_restore_is_followed_by_one_that_finishes_it() {
    let dir = tempfile::tempdir().unwrap();
    let etcd = dejavud::etcd_cluster::EtcdCluster::start(dir.path(), 1)
        .expect("etcd (Debian's etcd-server) on the PATH");
    a_restore_survives_its_controller(Controllers::Etcd(etcd));
}

#[test]
fn a_thousand_members_beating_in_step_are_all_heard() {
    use dejavud::heartbeat::Beat;
    const MEMBERS: u32 = 1000;
    // The controller asks the kernel for a receive buffer that holds a round of everyone's beats;
    // a process like it here (this test's) learns what the kernel grants.
    let probe = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
    let granted = dejavud::controller::enlarge_receive_buffer(&probe);
    if granted < 4 << 20 {
        eprintln!("skipped: the kernel grants {granted} bytes of receive buffer (raise net.core.rmem_max, or run as root)");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state");
    // A long silence timeout: a burst delayed on a busy machine must not get members declared
    // dead meanwhile.
    let mut controller = start(&[
        "controller",
        "--listen=127.0.0.1:0",
        "--metrics=127.0.0.1:0",
        "--secret=scale test",
        "--timeout-ms=10000",
        &format!("--state={}", state.display()),
    ]);
    let metrics = controller.next("metrics ");
    let addr = controller.next("listening ");
    let page = || scrape(metrics).unwrap();
    // A few rounds, each every member's beat in one burst, as members started together send
    // them; together (some 800 bytes charged a beat) they fit in 4 MiB, even if the controller
    // reads none of them before the last is sent. With the kernel's default buffer, most of a
    // burst is lost. Each member is heard at least once.
    const ROUNDS: u32 = 3;
    for sequence in 1..=u64::from(ROUNDS) {
        for index in 0..MEMBERS {
            let beat = Beat {
                member: (Role::Engine, index),
                pid: 1,
                epoch: 0,
                sequence,
                control_port: None,
                data_port: None,
            };
            probe.send_to(&beat.encode(b"scale test"), addr).unwrap();
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    // Loopback itself may drop a beat of a burst on a busy machine (its backlog holds 1,000
    // packets by default): all but 1% must be heard. Without the larger buffer, about a third
    // were.
    let sent = f64::from(ROUNDS * MEMBERS);
    let enough = sent * 0.99;
    let started = Instant::now();
    let heard = loop {
        let heard = value_of(&page(), "dejavu_controller_heartbeats_total", &[]).unwrap_or(0.0);
        if heard >= sent || (heard >= enough && started.elapsed() > Duration::from_secs(2)) {
            break heard;
        }
        assert!(started.elapsed() < Duration::from_secs(20), "{heard} of {sent} beats heard");
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(heard >= enough, "{heard} of {sent} beats heard");
    let alive = value_of(&page(), "dejavu_controller_members", &[("health", "alive")]);
    assert_eq!(alive, Some(f64::from(MEMBERS)));
}

#[test]
fn a_sidecar_whose_port_is_taken_fails_before_it_joins() {
    let dir = tempfile::tempdir().unwrap();
    let (_controller, metrics, addr) = ring_controller(dir.path());
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = taken.local_addr().unwrap().port();
    let err =
        launch_sidecar(0, port, &[addr], &dir.path().join("s0.sock")).try_next("listening ").unwrap_err();
    assert!(err.contains("in use") && err.contains(&port.to_string()), "{err}");
    // It asked for no epoch and never beat: the controller has nobody to fence.
    let page = scrape(metrics).unwrap();
    assert_eq!(value_of(&page, "dejavu_controller_fences_total", &[]), Some(0.0), "{page}");
    let mut client = ControllerClient::new(addr, Duration::from_secs(5), DEFAULT_SECRET.as_bytes());
    assert!(client.census().unwrap().members.is_empty());
}
