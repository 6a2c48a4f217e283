//! Controllers in high availability on a real 3-member etcd cluster, started on loopback in a
//! temporary directory: one leads and the others stand by; a killed leader's successor goes on
//! from the record the first kept in etcd; members that name every controller follow the leader
//! (their beats and lifelines reach whichever leads); a paused leader, back after its successor
//! took over, cannot write an epoch, answers no replacement's epoch, and stops; a leader stopped by SIGTERM gives the leadership up
//! at once. A controller reaches an etcd that takes TLS only, checks its clients' certificates and
//! has user authentication on, and writes past the lifetime of its authentication token. A
//! recovery feed that names every controller follows the leader. A controller standing by takes
//! over from a killed leader long before the leader's lease lapses, but not from a paused one. A
//! leader goes on when an etcd member dies; when etcd stops answering, the leader stops, and once
//! etcd is back a controller standing by leads from the record.
//!
//! Needs Debian's `etcd-server` (`etcd` on the PATH, as `.ci/run` installs it).

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc::{channel, Receiver};
use std::time::{Duration, Instant};

use dejavud::cli::DEFAULT_SECRET;
use dejavud::cluster::Role;
use dejavud::controller::{Census, ControllerClient, Health, DEPOSED_EXIT};
use dejavud::etcd_cluster::{ClientTls, EtcdCluster, EtcdOptions};

/// A process, killed when dropped.
struct Killed(Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A controller and the lines it prints, read on a thread of their own.
struct Controller {
    process: Killed,
    lines: Receiver<String>,
}

impl Controller {
    fn start(etcd: &str) -> Self {
        Self::start_with(etcd, &[])
    }

    /// A controller given `extra` flags too.
    fn start_with(etcd: &str, extra: &[&std::ffi::OsStr]) -> Self {
        let mut child = Command::new(env!("CARGO_BIN_EXE_dejavud"))
            .args(["controller", "--etcd", etcd, "--cluster", "ha-test", "--listen", "127.0.0.1:0"])
            .args(["--timeout-ms", "300", "--lease-secs", "1"])
            .args(extra)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let out = BufReader::new(child.stdout.take().unwrap());
        let (tx, lines) = channel();
        std::thread::spawn(move || {
            for line in out.lines().map_while(Result::ok) {
                let _ = tx.send(line);
            }
        });
        Self { process: Killed(child), lines }
    }

    /// The address it serves at once it leads, waiting up to `patience`.
    fn leading(&self, patience: Duration) -> Option<SocketAddr> {
        self.line("listening ", patience)
    }

    /// Its address, once it says it stands by while another leads.
    fn standing_by(&self) -> SocketAddr {
        self.line("standby ", Duration::from_secs(30)).expect("a controller standing by")
    }

    fn line(&self, prefix: &str, patience: Duration) -> Option<SocketAddr> {
        let until = Instant::now() + patience;
        loop {
            let left = until.saturating_duration_since(Instant::now());
            let line = self.lines.recv_timeout(left).ok()?;
            if let Some(addr) = line.strip_prefix(prefix) {
                return Some(addr.trim().parse().unwrap());
            }
        }
    }

    /// How it exits, waiting up to 30 s for it (`never` says what it did not do otherwise).
    fn exit_status(mut self, never: &str) -> std::process::ExitStatus {
        let started = Instant::now();
        loop {
            if let Some(status) = self.process.0.try_wait().unwrap() {
                return status;
            }
            assert!(started.elapsed() < Duration::from_secs(30), "{never}");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn signal(&self, signal: i32) {
        // SAFETY: kill(2) on the pid of a child this test started and has not reaped.
        let rc = unsafe { libc::kill(self.process.0.id() as i32, signal) };
        assert_eq!(rc, 0);
    }
}

/// A sidecar of stage `index` beating to `controllers`.
fn sidecar(index: u32, controllers: &[SocketAddr], dir: &Path) -> Killed {
    let controllers: Vec<String> = controllers.iter().map(SocketAddr::to_string).collect();
    let mut child = Command::new(env!("CARGO_BIN_EXE_dejavud"))
        .args(["sidecar", "--index", &index.to_string(), "--heartbeat", &controllers.join(",")])
        .arg("--local")
        .arg(dir.join(format!("s{index}.sock")))
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap()).read_line(&mut line).unwrap();
    assert!(line.starts_with("listening"), "{line}");
    Killed(child)
}

fn wait_until(addr: SocketAddr, what: &str, done: impl Fn(&Census) -> bool) -> Census {
    let mut client = ControllerClient::new(addr, Duration::from_secs(5), DEFAULT_SECRET.as_bytes());
    let started = Instant::now();
    loop {
        if let Ok(census) = client.census() {
            if done(&census) {
                return census;
            }
        }
        assert!(started.elapsed() < Duration::from_secs(30), "never {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The record the leader keeps in etcd, as text.
fn record_in_etcd(etcd: &str) -> String {
    record_in_etcd_with(etcd, None)
}

/// As [`record_in_etcd`], connecting with `options`.
fn record_in_etcd_with(etcd: &str, options: Option<etcd_client::ConnectOptions>) -> String {
    let runtime = tokio::runtime::Runtime::new().unwrap();
    runtime.block_on(async {
        let endpoints: Vec<&str> = etcd.split(',').collect();
        let mut client = etcd_client::Client::connect(endpoints, options).await.unwrap();
        let found = client.get("/dejavu/ha-test/record", None).await.unwrap();
        found.kvs().first().map(|kv| kv.value_str().unwrap().to_owned()).unwrap_or_default()
    })
}

#[test]
fn one_controller_leads_members_follow_the_leader_and_a_paused_leader_is_fenced() {
    let dir = tempfile::tempdir().unwrap();
    let etcd = EtcdCluster::start(dir.path(), 3).expect("etcd (Debian's etcd-server) on the PATH");
    let endpoints = etcd.endpoints().to_owned();

    // The first to campaign leads; the second stands by (members can name it already).
    let first = Controller::start(&endpoints);
    let a = first.leading(Duration::from_secs(30)).expect("the first controller leads");
    let second = Controller::start(&endpoints);
    let b = second.standing_by();
    assert_eq!(second.leading(Duration::from_secs(2)), None, "a second leader while the first lives");

    // A member that names both controllers, and one that names the first only, which dies and is
    // fenced in epoch 1.
    let follower = sidecar(0, &[a, b], dir.path());
    let member = sidecar(2, &[a], dir.path());
    wait_until(a, "both members alive", |census| {
        census.health((Role::Sidecar, 0)) == Health::Alive
            && census.health((Role::Sidecar, 2)) == Health::Alive
    });
    drop(member);
    wait_until(a, "sidecar 2 fenced", |census| census.is_fenced((Role::Sidecar, 2)) && census.epoch == 1);

    // The leader is killed: the second takes over, from the record the first kept in etcd.
    drop(first);
    assert_eq!(second.leading(Duration::from_secs(30)), Some(b), "the second controller takes over");
    let census = wait_until(b, "the record carried over", |census| census.epoch == 1);
    assert!(census.is_fenced((Role::Sidecar, 2)), "{census:?}");
    assert!(record_in_etcd(&endpoints).contains("incarnation 2"));
    // The follower's beats reach the new leader: alive past a full timeout (300 ms) after the
    // takeover, and its lifeline moved there, so its death is seen at once.
    std::thread::sleep(Duration::from_millis(900));
    assert_eq!(wait_until(b, "a census", |_| true).health((Role::Sidecar, 0)), Health::Alive);
    drop(follower);
    wait_until(b, "the follower fenced by the new leader", |census| {
        census.is_fenced((Role::Sidecar, 0)) && census.epoch == 2
    });

    // A third controller stands by; a member names the second and the third. The leader is
    // paused past its lease, and the third takes over.
    let third = Controller::start(&endpoints);
    let c = third.standing_by();
    let member = sidecar(1, &[b, c], dir.path());
    wait_until(b, "sidecar 1 alive", |census| census.health((Role::Sidecar, 1)) == Health::Alive);
    second.signal(libc::SIGSTOP);
    assert_eq!(third.leading(Duration::from_secs(30)), Some(c), "the third controller takes over");
    // The member dies: the new leader fences it in a new epoch.
    std::thread::sleep(Duration::from_millis(900));
    drop(member);
    let census = wait_until(c, "sidecar 1 fenced by the new leader", |census| {
        census.is_fenced((Role::Sidecar, 1)) && census.epoch == 3
    });
    let epoch = census.epoch;

    // The paused leader comes back: it cannot write, and stops without issuing an epoch.
    second.signal(libc::SIGCONT);
    // Nor does it tell a replacement the epoch to start in: it confirms that it leads first.
    let mut asked = ControllerClient::new(b, Duration::from_secs(5), DEFAULT_SECRET.as_bytes());
    let answer = asked.fenced_in((Role::Sidecar, 2));
    assert!(answer.is_err(), "the deposed leader answered a replacement's epoch: {answer:?}");
    assert_eq!(second.exit_status("the old leader never stopped").code(), Some(DEPOSED_EXIT));
    let record = record_in_etcd(&endpoints);
    assert!(record.starts_with(&format!("epoch {epoch}\n")), "{record}");
    assert!(record.contains("incarnation 3"), "{record}");
    let census = wait_until(c, "the new leader still serving", |census| census.epoch == epoch);
    assert!(census.is_fenced((Role::Sidecar, 1)));

    // A leader stopped by SIGTERM gives its leadership up as it exits, without waiting for its
    // lease to lapse: when it is gone, etcd names it leader no more.
    let fourth = Controller::start(&endpoints);
    let d = fourth.standing_by();
    third.signal(libc::SIGTERM);
    let mut stopped = third.process;
    assert_eq!(stopped.0.wait().unwrap().code(), Some(0));
    assert_ne!(leader_in_etcd(&endpoints), Some(c.to_string()), "the stopped leader still leads");
    assert_eq!(fourth.leading(Duration::from_secs(30)), Some(d), "the fourth controller takes over");
}

/// The address the cluster's election names as its leader, if any.
fn leader_in_etcd(etcd: &str) -> Option<String> {
    let runtime = tokio::runtime::Runtime::new().unwrap();
    runtime.block_on(async {
        let endpoints: Vec<&str> = etcd.split(',').collect();
        let mut client = etcd_client::Client::connect(endpoints, None).await.unwrap();
        let leader = client.leader("/dejavu/ha-test/leader").await.ok()?;
        leader.kv().map(|kv| kv.value_str().unwrap().to_owned())
    })
}

/// A controller's password on the secured etcd.
const PASSWORD: &str = "controller-password";

/// TLS options for the secured etcd: its authority, and a client certificate of `node`'s.
fn tls_options(certs: &Path, node: &str) -> etcd_client::TlsOptions {
    let read = |name: &str| std::fs::read_to_string(certs.join(name)).unwrap();
    etcd_client::TlsOptions::new()
        .ca_certificate(etcd_client::Certificate::from_pem(read("ca.pem")))
        .identity(etcd_client::Identity::from_pem(read(&format!("{node}.pem")), read(&format!("{node}.key"))))
}

/// Turns etcd's user authentication on, as an operator would: a root user, and a user
/// `dejavu` allowed to read and write the keys under `/dejavu/` only.
fn enable_authentication(etcd: &str, certs: &Path) {
    use etcd_client::{Client, ConnectOptions, Permission};
    let runtime = tokio::runtime::Runtime::new().unwrap();
    runtime.block_on(async {
        let options = ConnectOptions::new().with_tls(tls_options(certs, "operator"));
        // etcd may still be starting.
        let started = Instant::now();
        let mut client = loop {
            if let Ok(mut client) = Client::connect([etcd], Some(options.clone())).await {
                if client.status().await.is_ok() {
                    break client;
                }
            }
            assert!(started.elapsed() < Duration::from_secs(30), "etcd never answered");
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        client.user_add("root", "root-password", None).await.unwrap();
        client.user_grant_role("root", "root").await.unwrap();
        client.role_add("dejavu").await.unwrap();
        client
            .role_grant_permission("dejavu", Permission::read_write("/dejavu/").with_prefix())
            .await
            .unwrap();
        client.user_add("dejavu", PASSWORD, None).await.unwrap();
        client.user_grant_role("dejavu", "dejavu").await.unwrap();
        client.auth_enable().await.unwrap();
    });
}

/// What a controller prints to its standard error before it exits, given `args`.
fn refusal(args: &[&std::ffi::OsStr]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_dejavud"))
        .args(["controller", "--cluster", "ha-test", "--listen", "127.0.0.1:0"])
        .args(args)
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert!(!out.status.success(), "a controller started with {args:?}");
    String::from_utf8_lossy(&out.stderr).into_owned()
}

#[test]
fn a_controller_reaches_an_etcd_with_tls_client_certificates_and_users_past_its_token_lifetime() {
    let dir = tempfile::tempdir().unwrap();
    let certs = dir.path().join("certs");
    // The certificates come from `dejavud certs`: etcd's own (valid for `localhost`), the
    // controller's and the operator's.
    let issued = Command::new(env!("CARGO_BIN_EXE_dejavud"))
        .args(["certs", "--cluster", "etcd-test", "--out"])
        .arg(&certs)
        .args(["localhost", "controller", "operator"])
        .output()
        .unwrap();
    assert!(issued.status.success(), "{}", String::from_utf8_lossy(&issued.stderr));
    let tls = ClientTls {
        cert: certs.join("localhost.pem"),
        key: certs.join("localhost.key"),
        ca: certs.join("ca.pem"),
    };
    // Tokens that live one second: the controller's first one is long gone at its later writes.
    let options = EtcdOptions { tls: Some(tls), auth_token_ttl: Some(1) };
    let etcd = EtcdCluster::start_with(&dir.path().join("etcd"), 1, &options).expect("etcd on the PATH");
    let endpoints = etcd.endpoints().to_owned();
    assert!(endpoints.starts_with("https://localhost:"), "{endpoints}");
    enable_authentication(&endpoints, &certs);
    let password = dir.path().join("password");
    std::fs::write(&password, format!("{PASSWORD}\n")).unwrap();
    let wrong = dir.path().join("wrong-password");
    std::fs::write(&wrong, "guessed\n").unwrap();

    // Settings that cannot work are refused at once, and named.
    let said = refusal(&["--etcd".as_ref(), endpoints.as_ref()]);
    assert!(said.contains("--etcd-ca") && said.contains(&endpoints), "{said}");
    let http = endpoints.replace("https://", "http://");
    let said =
        refusal(&["--etcd".as_ref(), http.as_ref(), "--etcd-ca".as_ref(), certs.join("ca.pem").as_os_str()]);
    assert!(said.contains("plain http://"), "{said}");
    let with_certificate = |password: &Path| -> Vec<std::ffi::OsString> {
        let mut args: Vec<std::ffi::OsString> = vec!["--etcd".into(), endpoints.clone().into()];
        for (flag, file) in
            [("--etcd-ca", "ca.pem"), ("--etcd-cert", "controller.pem"), ("--etcd-key", "controller.key")]
        {
            args.push(flag.into());
            args.push(certs.join(file).into());
        }
        args.extend(["--etcd-user".into(), "dejavu".into(), "--etcd-password-file".into(), password.into()]);
        args
    };
    let wrong_args = with_certificate(&wrong);
    let said = refusal(&wrong_args.iter().map(|a| a.as_os_str()).collect::<Vec<_>>());
    assert!(said.contains("refused this controller's credentials"), "{said}");

    // The right settings: it leads, and members follow it.
    let args = with_certificate(&password);
    let leader = Controller::start_with(&endpoints, &args.iter().map(|a| a.as_os_str()).collect::<Vec<_>>());
    let a = leader.leading(Duration::from_secs(30)).expect("the controller leads on the secured etcd");
    let member = sidecar(0, &[a], dir.path());
    wait_until(a, "the member alive", |census| census.health((Role::Sidecar, 0)) == Health::Alive);

    // Past its token's lifetime, it still writes: the member dies, and its fence reaches etcd.
    std::thread::sleep(Duration::from_millis(2500));
    drop(member);
    wait_until(a, "the member fenced", |census| census.is_fenced((Role::Sidecar, 0)) && census.epoch == 1);
    let reader = etcd_client::ConnectOptions::new()
        .with_tls(tls_options(&certs, "operator"))
        .with_user("dejavu", PASSWORD);
    let record = record_in_etcd_with(&endpoints, Some(reader));
    assert!(record.starts_with("epoch 1\n"), "{record}");
    let mut leader = leader.process;
    assert_eq!(leader.0.try_wait().unwrap(), None, "the controller stopped");
}

#[test]
fn a_recovery_feed_naming_every_controller_follows_the_leader() {
    use dejavulib::net::controller::RecoveryFeed;
    let dir = tempfile::tempdir().unwrap();
    let etcd = EtcdCluster::start(dir.path(), 1).expect("etcd (Debian's etcd-server) on the PATH");
    let endpoints = etcd.endpoints().to_owned();
    let stages = ["--stages".as_ref(), "2".as_ref()];
    let first = Controller::start_with(&endpoints, &stages);
    let a = first.leading(Duration::from_secs(30)).expect("the first controller leads");
    let second = Controller::start_with(&endpoints, &stages);
    let b = second.standing_by();

    // The standby is named first: the feed finds it serves nothing, and asks the leader.
    let mut feed = RecoveryFeed::following(&[b, a], DEFAULT_SECRET.as_bytes()).unwrap();
    assert_eq!(feed.watch(0, Duration::from_millis(50)).unwrap(), None, "no recovery yet");
    assert_eq!(feed.controller(), a);

    // The leader dies: once the second leads, the feed's requests reach it.
    drop(first);
    assert_eq!(second.leading(Duration::from_secs(30)), Some(b), "the second controller takes over");
    let started = Instant::now();
    let answer = loop {
        match feed.watch(0, Duration::from_millis(50)) {
            Ok(answer) => break answer,
            Err(e) => assert!(
                started.elapsed() < Duration::from_secs(30),
                "the feed never reached the new leader: {e}"
            ),
        }
    };
    assert_eq!(answer, None);
    assert_eq!(feed.controller(), b);
    assert!(RecoveryFeed::following(&[], DEFAULT_SECRET.as_bytes()).is_none());
}

#[test]
fn a_standby_takes_over_from_a_dead_leader_at_once_and_from_a_paused_one_only_after_its_lease() {
    let dir = tempfile::tempdir().unwrap();
    let etcd = EtcdCluster::start(dir.path(), 1).expect("etcd (Debian's etcd-server) on the PATH");
    let endpoints = etcd.endpoints().to_owned();
    // A lease of a minute: a takeover within seconds can only come from the dead leader's lease
    // being revoked.
    let long_lease = ["--lease-secs".as_ref(), "60".as_ref()];
    let first = Controller::start_with(&endpoints, &long_lease);
    first.leading(Duration::from_secs(30)).expect("the first controller leads");
    let second = Controller::start_with(&endpoints, &long_lease);
    let b = second.standing_by();

    // Killed: its address refuses connections, and the standby revokes its lease.
    drop(first);
    assert_eq!(
        second.leading(Duration::from_secs(20)),
        Some(b),
        "the standby did not take over from the dead leader"
    );

    // Paused: its port is still bound, so it may only be slow; the standby waits for its lease.
    let third = Controller::start_with(&endpoints, &long_lease);
    third.standing_by();
    second.signal(libc::SIGSTOP);
    assert_eq!(third.leading(Duration::from_secs(3)), None, "the standby took over from a paused leader");
    second.signal(libc::SIGCONT);
}

#[test]
fn a_leader_goes_on_when_an_etcd_member_dies() {
    let dir = tempfile::tempdir().unwrap();
    let mut etcd = EtcdCluster::start(dir.path(), 3).expect("etcd (Debian's etcd-server) on the PATH");
    let endpoints = etcd.endpoints().to_owned();
    // A lease longer than etcd takes to elect a new leader of its own (up to twice its 1 s election
    // timeout) when the member that died led etcd: renewals wait for that election meanwhile.
    let leader = Controller::start_with(&endpoints, &["--lease-secs".as_ref(), "5".as_ref()]);
    let a = leader.leading(Duration::from_secs(30)).expect("the controller leads");
    let member = sidecar(0, &[a], dir.path());
    wait_until(a, "the member alive", |census| census.health((Role::Sidecar, 0)) == Health::Alive);

    // The first etcd member named dies: the other two keep the quorum, and the leader, whose
    // client spreads its requests over every endpoint (a renewal stream that went to the dead
    // member is opened again through the others), keeps its lease and goes on writing.
    etcd.kill_member(0);
    std::thread::sleep(Duration::from_secs(3));
    drop(member);
    wait_until(a, "the member fenced", |census| census.is_fenced((Role::Sidecar, 0)) && census.epoch == 1);
    let mut leader = leader.process;
    assert_eq!(leader.0.try_wait().unwrap(), None, "the controller stopped when one etcd member died");
    let rest = endpoints.split(',').skip(1).collect::<Vec<_>>().join(",");
    assert!(record_in_etcd(&rest).starts_with("epoch 1\n"));
}

#[test]
fn when_etcd_stops_answering_the_leader_stops_and_once_it_is_back_another_leads_from_the_record() {
    let dir = tempfile::tempdir().unwrap();
    let etcd = EtcdCluster::start(dir.path(), 1).expect("etcd (Debian's etcd-server) on the PATH");
    let endpoints = etcd.endpoints().to_owned();
    let first = Controller::start(&endpoints);
    let a = first.leading(Duration::from_secs(30)).expect("the first controller leads");
    let second = Controller::start(&endpoints);
    let b = second.standing_by();
    let dead = sidecar(1, &[a, b], dir.path());
    let member = sidecar(0, &[a, b], dir.path());
    wait_until(a, "both members alive", |census| {
        census.health((Role::Sidecar, 0)) == Health::Alive
            && census.health((Role::Sidecar, 1)) == Health::Alive
    });
    drop(dead);
    wait_until(a, "sidecar 1 fenced", |census| census.is_fenced((Role::Sidecar, 1)) && census.epoch == 1);

    // etcd stops answering (down, or cut off): the leader cannot renew its lease (1 s), and
    // stops rather than act on a leadership it may have lost.
    etcd.signal_all(libc::SIGSTOP);
    assert_eq!(first.exit_status("the leader went on without etcd").code(), Some(DEPOSED_EXIT));

    // etcd answers again: the controller standing by leads, from the record, and the member that
    // beat to both all along is alive there.
    etcd.signal_all(libc::SIGCONT);
    assert_eq!(second.leading(Duration::from_secs(30)), Some(b), "no controller leads once etcd is back");
    let census = wait_until(b, "the member alive at the new leader", |census| {
        census.health((Role::Sidecar, 0)) == Health::Alive
    });
    assert_eq!(census.epoch, 1);
    assert!(census.is_fenced((Role::Sidecar, 1)), "{census:?}");
    drop(member);
    wait_until(b, "sidecar 0 fenced by the new leader", |census| {
        census.is_fenced((Role::Sidecar, 0)) && census.epoch == 2
    });
}
