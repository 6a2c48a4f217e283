//! The reference engine as separate OS processes on loopback: a chain of stage processes produces
//! the same tokens as the in-process pipeline, and after every stage process is SIGKILLed mid-decode,
//! fresh processes restore the KV their predecessors replicated to a replica process and continue
//! bit-identically.

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

/// The arguments of stage `index`, sending to `next`.
fn stage_args(index: usize, next: SocketAddr, replica: Option<SocketAddr>) -> Vec<String> {
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
    if let Some(replica) = replica {
        args.push(format!("--replica={replica}"));
    }
    args
}

/// Starts a chain of stage processes (last first, so each knows where to send) and connects to it.
/// Returns the processes in stage order, their addresses and the driver's end.
fn chain(replica: Option<SocketAddr>) -> (Vec<Proc>, Vec<SocketAddr>, SocketAddr, RemotePipeline) {
    let results = TcpListener::bind("127.0.0.1:0").unwrap();
    let driver = results.local_addr().unwrap();
    let mut next = driver;
    let mut procs = Vec::new();
    let mut addrs = Vec::new();
    for index in (0..splits().len()).rev() {
        let (proc, addr) = start(&stage_args(index, next, replica));
        procs.push(proc);
        addrs.push(addr);
        next = addr;
    }
    addrs.reverse();
    let remote = RemotePipeline::connect(next, results, Duration::from_secs(1)).unwrap();
    procs.reverse();
    (procs, addrs, driver, remote)
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

#[test]
fn stage_processes_produce_the_in_process_tokens() {
    let (_procs, _, _, mut remote) = chain(None);
    let got: Vec<Vec<u32>> = prompts()
        .iter()
        .enumerate()
        .map(|(i, prompt)| {
            let first = remote.run(seat(i), prompt, 0).unwrap();
            decode(&mut remote, i, vec![first], NEW_TOKENS)
        })
        .collect();
    assert_eq!(got, reference());
}

#[test]
fn replacements_restore_replicated_kv_and_continue_bit_identically() {
    let (_replica, replica_addr) = start(&["replica".to_string()]);
    let expected = reference();
    let (mut procs, _, _, mut remote) = chain(Some(replica_addr));
    // Every request decodes a few tokens; each stage replicates every step's KV as it goes.
    let done = 4;
    let mut so_far = Vec::new();
    for (i, prompt) in prompts().iter().enumerate() {
        let first = remote.run(seat(i), prompt, 0).unwrap();
        let produced = decode(&mut remote, i, vec![first], done);
        assert_eq!(produced, expected[i][..done]);
        so_far.push(produced);
    }
    // Every stage process is killed (SIGKILL) mid-decode.
    for proc in procs.iter_mut() {
        proc.0.kill().unwrap();
        proc.0.wait().unwrap();
    }
    drop(remote);

    // Control: fresh processes that do not restore the KV continue differently.
    {
        let (_blind, _, _, mut remote) = chain(None);
        let astray = decode(&mut remote, 0, so_far[0].clone(), NEW_TOKENS);
        assert_ne!(astray, expected[0], "the check must depend on the restored KV");
    }

    // Fresh processes start with empty caches and restore each sequence from the replicas.
    let (_fresh, _, _, mut remote) = chain(Some(replica_addr));
    let every_stage: Vec<u32> = (0..splits().len() as u32).collect();
    for (i, prompt) in prompts().iter().enumerate() {
        remote.recover(&every_stage, seat(i), prompt, &so_far[i]).unwrap();
        let all = decode(&mut remote, i, so_far[i].clone(), NEW_TOKENS);
        assert_eq!(all, expected[i], "request {i}");
    }
}

#[test]
fn one_killed_stage_is_replaced_and_the_sequence_resumes_bit_identically() {
    let (_replica, replica_addr) = start(&["replica".to_string()]);
    let expected = reference();
    for victim in [2usize, 0, 3] {
        let (mut procs, addrs, driver, mut remote) = chain(Some(replica_addr));
        let done = 3;
        let mut so_far: Vec<Vec<u32>> = prompts()
            .iter()
            .enumerate()
            .map(|(i, prompt)| {
                let first = remote.run(seat(i), prompt, 0).unwrap();
                decode(&mut remote, i, vec![first], done)
            })
            .collect();
        // SIGKILL one stage; the next step gets no answer.
        procs[victim].0.kill().unwrap();
        procs[victim].0.wait().unwrap();
        let position = (prompts()[0].len() + done - 1) as u32;
        assert!(remote.run(seat(0), &[so_far[0][done - 1]], position).is_err(), "victim {victim}");

        // A replacement takes the victim's place and restores its KV from the replica peer.
        let last = victim == splits().len() - 1;
        let next = if last { driver } else { addrs[victim + 1] };
        let (replacement, addr) = start(&stage_args(victim, next, Some(replica_addr)));
        procs[victim] = replacement;
        remote.replace(victim as u32, addr, last).unwrap();
        for (i, prompt) in prompts().iter().enumerate() {
            remote.recover(&[victim as u32], seat(i), prompt, &so_far[i]).unwrap();
        }
        for (i, tokens) in so_far.iter_mut().enumerate() {
            *tokens = decode(&mut remote, i, tokens.clone(), NEW_TOKENS);
            assert_eq!(*tokens, expected[i], "victim {victim}, request {i}");
        }
    }
}
