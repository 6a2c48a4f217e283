//! The reference engine as separate OS processes on loopback: a chain of stage processes produces
//! the same tokens as the in-process pipeline; stages killed mid-decode (engines alone, or with
//! their sidecars) are replaced, restore their KV from a sidecar and continue bit-identically.

use std::io::{BufRead, BufReader, Read};
use std::net::{SocketAddr, TcpListener};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use dejavu_engine::process::RemotePipeline;
use dejavu_engine::{CacheLayout, ModelConfig, Pipeline, Seat};

const SLOTS: u32 = 2;
const MICROBATCHES: u32 = 2;
const MAX_TOKENS: u32 = 64;
const NEW_TOKENS: usize = 10;

/// A child process, killed when dropped.
struct Proc(Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Starts `dejavu-engine args...` and waits for its `listening ADDR` line.
fn start(args: &[String]) -> (Proc, SocketAddr) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_dejavu-engine"))
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn dejavu-engine");
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap()).read_line(&mut line).unwrap();
    let Some(addr) = line.trim().strip_prefix("listening ") else {
        let mut err = String::new();
        child.stderr.take().unwrap().read_to_string(&mut err).unwrap();
        panic!("dejavu-engine {args:?} did not start: {line}{err}");
    };
    let addr = addr.parse().unwrap();
    (Proc(child), addr)
}

fn splits() -> Vec<std::ops::Range<u32>> {
    vec![0..2, 2..4, 4..6, 6..8]
}

/// The arguments of stage `index`, sending to `next`, keeping copies in `sidecars` (its own, its
/// successor's).
fn stage_args(index: usize, next: SocketAddr, sidecars: Option<(SocketAddr, SocketAddr)>) -> Vec<String> {
    let layers = &splits()[index];
    let mut args = vec![
        "stage".to_string(),
        format!("--index={index}"),
        format!("--layers={}..{}", layers.start, layers.end),
        format!("--next={next}"),
        format!("--slots={SLOTS}"),
        format!("--microbatches={MICROBATCHES}"),
        format!("--max-tokens={MAX_TOKENS}"),
    ];
    if let Some((local, successor)) = sidecars {
        args.push(format!("--local={local}"));
        args.push(format!("--successor={successor}"));
    }
    args
}

fn sidecar() -> (Proc, SocketAddr) {
    start(&["sidecar".to_string()])
}

/// A chain of stage processes, their sidecars and the driver's end.
struct Chain {
    stages: Vec<Proc>,
    addrs: Vec<SocketAddr>,
    sidecars: Vec<(Proc, SocketAddr)>,
    driver: SocketAddr,
    remote: RemotePipeline,
}

impl Chain {
    /// Starts sidecars (when replicating) and stage processes, last first so each knows where to
    /// send, and connects to them.
    fn start(replicate: bool) -> Chain {
        let n = splits().len();
        let sidecars: Vec<_> = if replicate { (0..n).map(|_| sidecar()).collect() } else { Vec::new() };
        let results = TcpListener::bind("127.0.0.1:0").unwrap();
        let driver = results.local_addr().unwrap();
        let (mut stages, mut addrs, mut next) = (Vec::new(), Vec::new(), driver);
        for index in (0..n).rev() {
            let copies = replicate.then(|| (sidecars[index].1, sidecars[(index + 1) % n].1));
            let (proc, addr) = start(&stage_args(index, next, copies));
            stages.push(proc);
            addrs.push(addr);
            next = addr;
        }
        stages.reverse();
        addrs.reverse();
        let remote = RemotePipeline::connect(next, results, Duration::from_secs(1)).unwrap();
        Chain { stages, addrs, sidecars, driver, remote }
    }

    fn next_of(&self, stage: usize) -> SocketAddr {
        if stage + 1 == self.stages.len() {
            self.driver
        } else {
            self.addrs[stage + 1]
        }
    }

    /// Replaces stage `stage` with a new process keeping copies in `sidecars`.
    fn replace(&mut self, stage: usize, sidecars: (SocketAddr, SocketAddr)) {
        let (proc, addr) = start(&stage_args(stage, self.next_of(stage), Some(sidecars)));
        self.stages[stage] = proc;
        self.addrs[stage] = addr;
        let last = stage + 1 == self.stages.len();
        self.remote.replace(stage as u32, addr, last).unwrap();
    }
}

fn kill(proc: &mut Proc) {
    proc.0.kill().unwrap();
    proc.0.wait().unwrap();
}

fn prompts() -> Vec<Vec<u32>> {
    vec![vec![3, 141, 59, 26, 5], vec![9, 9], (0..17).map(|i| (i * 53 + 7) % 512).collect()]
}

fn reference() -> Vec<Vec<u32>> {
    Pipeline::new(
        ModelConfig::reference(),
        &splits(),
        CacheLayout::FasterTransformer,
        SLOTS,
        MICROBATCHES,
        MAX_TOKENS,
    )
    .unwrap()
    .generate(&prompts(), NEW_TOKENS)
    .unwrap()
}

fn seat(i: usize) -> Seat {
    Seat { microbatch: i as u32 / SLOTS, slot: i as u32 % SLOTS }
}

/// Extends request `i`'s generated tokens `out` (at least one) to `until` tokens.
fn decode(remote: &mut RemotePipeline, i: usize, mut out: Vec<u32>, until: usize) -> Vec<u32> {
    let prompt_len = prompts()[i].len();
    while out.len() < until {
        // Token n (n >= 1) comes from running token n - 1, at position prompt_len + n - 1.
        let position = (prompt_len + out.len() - 1) as u32;
        let token = remote.run(seat(i), &[*out.last().unwrap()], position).unwrap();
        out.push(token);
    }
    out
}

/// Prefills every request and decodes each to `done` tokens.
fn start_requests(remote: &mut RemotePipeline, done: usize) -> Vec<Vec<u32>> {
    prompts()
        .iter()
        .enumerate()
        .map(|(i, prompt)| {
            let first = remote.run(seat(i), prompt, 0).unwrap();
            decode(remote, i, vec![first], done)
        })
        .collect()
}

#[test]
fn stage_processes_produce_the_in_process_tokens() {
    let mut chain = Chain::start(false);
    assert_eq!(start_requests(&mut chain.remote, NEW_TOKENS), reference());
}

#[test]
fn engines_killed_together_restore_from_their_own_sidecars() {
    let expected = reference();
    let mut chain = Chain::start(true);
    let done = 4;
    let so_far = start_requests(&mut chain.remote, done);
    for (i, tokens) in so_far.iter().enumerate() {
        assert_eq!(*tokens, expected[i][..done]);
    }
    // Every engine process is SIGKILLed; the sidecars live on.
    chain.stages.iter_mut().for_each(kill);

    // Control: fresh engines that do not restore the KV continue differently.
    {
        let mut blind = Chain::start(false);
        let astray = decode(&mut blind.remote, 0, so_far[0].clone(), NEW_TOKENS);
        assert_ne!(astray, expected[0], "the check must depend on the restored KV");
    }

    // Fresh engines beside the same sidecars restore from them (no copy comes from elsewhere).
    let n = splits().len();
    let sidecars: Vec<SocketAddr> = chain.sidecars.iter().map(|s| s.1).collect();
    let results = TcpListener::bind("127.0.0.1:0").unwrap();
    let mut next = results.local_addr().unwrap();
    let mut fresh = Vec::new();
    for index in (0..n).rev() {
        let (proc, addr) =
            start(&stage_args(index, next, Some((sidecars[index], sidecars[(index + 1) % n]))));
        fresh.push(proc);
        next = addr;
    }
    let mut remote = RemotePipeline::connect(next, results, Duration::from_secs(1)).unwrap();
    let every_stage: Vec<u32> = (0..n as u32).collect();
    for (i, prompt) in prompts().iter().enumerate() {
        remote.recover(&every_stage, seat(i), prompt, &so_far[i], None).unwrap();
        assert_eq!(decode(&mut remote, i, so_far[i].clone(), NEW_TOKENS), expected[i], "request {i}");
    }
}

#[test]
fn a_killed_engine_is_replaced_and_restores_from_its_own_sidecar() {
    let expected = reference();
    for victim in [2usize, 0, 3] {
        let mut chain = Chain::start(true);
        let done = 3;
        let mut so_far = start_requests(&mut chain.remote, done);
        kill(&mut chain.stages[victim]);
        let position = (prompts()[0].len() + done - 1) as u32;
        assert!(chain.remote.run(seat(0), &[so_far[0][done - 1]], position).is_err(), "victim {victim}");

        let n = splits().len();
        let copies = (chain.sidecars[victim].1, chain.sidecars[(victim + 1) % n].1);
        chain.replace(victim, copies);
        for (i, prompt) in prompts().iter().enumerate() {
            chain.remote.recover(&[victim as u32], seat(i), prompt, &so_far[i], None).unwrap();
        }
        for (i, tokens) in so_far.iter_mut().enumerate() {
            *tokens = decode(&mut chain.remote, i, tokens.clone(), NEW_TOKENS);
            assert_eq!(*tokens, expected[i], "victim {victim}, request {i}");
        }
    }
}

#[test]
fn a_killed_worker_restores_from_its_successor_and_replication_goes_on() {
    let expected = reference();
    let n = splits().len();
    let mut chain = Chain::start(true);
    let done = 3;
    let mut so_far = start_requests(&mut chain.remote, done);

    // Worker 1 dies whole: its engine and its sidecar (which held worker 0's replica).
    let victim = 1;
    kill(&mut chain.stages[victim]);
    kill(&mut chain.sidecars[victim].0);
    chain.sidecars[victim] = sidecar();
    let successor = chain.sidecars[victim + 1].1;
    chain.replace(victim, (chain.sidecars[victim].1, successor));
    let kv = |i: usize, tokens: &[u32]| {
        (prompts()[i].len() as u32, (prompts()[i].len() + tokens.len() - 1) as u32)
    };
    for (i, prompt) in prompts().iter().enumerate() {
        chain.remote.recover(&[victim as u32], seat(i), prompt, &so_far[i], Some(successor)).unwrap();
        // Worker 0 replicates to the new sidecar, starting with what the old one held.
        let (prompt_len, kv_tokens) = kv(i, &so_far[i]);
        chain.remote.replicate_to(0, seat(i), prompt_len, kv_tokens, chain.sidecars[victim].1).unwrap();
    }
    let more = done + 3;
    for (i, tokens) in so_far.iter_mut().enumerate() {
        *tokens = decode(&mut chain.remote, i, tokens.clone(), more);
        assert_eq!(*tokens, expected[i][..more], "request {i}");
    }

    // Then worker 0 dies whole: its replica is in the new sidecar of worker 1.
    kill(&mut chain.stages[0]);
    kill(&mut chain.sidecars[0].0);
    chain.sidecars[0] = sidecar();
    chain.replace(0, (chain.sidecars[0].1, chain.sidecars[1].1));
    for (i, prompt) in prompts().iter().enumerate() {
        chain.remote.recover(&[0], seat(i), prompt, &so_far[i], Some(chain.sidecars[1].1)).unwrap();
        let (prompt_len, kv_tokens) = kv(i, &so_far[i]);
        chain
            .remote
            .replicate_to((n - 1) as u32, seat(i), prompt_len, kv_tokens, chain.sidecars[0].1)
            .unwrap();
    }
    for (i, tokens) in so_far.iter_mut().enumerate() {
        *tokens = decode(&mut chain.remote, i, tokens.clone(), NEW_TOKENS);
        assert_eq!(*tokens, expected[i], "request {i}");
    }
}
