//! The fake engine: a deterministic pipeline whose KV and tokens are pure functions of the inputs.
//!
//! Stage `s` computing step `t` of microbatch `j` on input `a` produces the KV delta
//! `d = h(s, j, t, a)` and the output `h(a, d, state)`, where `state` folds every delta the stage
//! holds for `j`: a stage that resumes with missing or wrong KV produces a different token, so the
//! token check also checks the KV.

use dejavu_proto::model::Payload;
use dejavu_proto::rng;

/// A well-mixed hash of `x`, with no fixed point at 0: SplitMix64's step.
pub fn mix(x: u64) -> u64 {
    rng::mix(x.wrapping_add(rng::GOLDEN))
}

/// Hash of several words.
pub fn hash(words: &[u64]) -> u64 {
    words.iter().fold(0x243f_6a88_85a3_08d3, |acc, &w| mix(acc ^ w))
}

/// A payload holding one word.
pub fn word(x: u64) -> Payload {
    x.to_le_bytes().to_vec()
}

/// The word a payload holds (0 for a malformed one, which then fails every comparison).
pub fn unword(p: &[u8]) -> u64 {
    p.try_into().map(u64::from_le_bytes).unwrap_or(0)
}

/// The input of step 0 of microbatch `j`.
pub fn prompt(j: u32) -> Payload {
    word(hash(&[0x5052_4f4d_5054, j as u64]))
}

/// One step of one stage: returns (delta, output). `held` are the stage's deltas for steps before
/// `t` of this microbatch.
pub fn step(stage: u32, j: u32, t: u32, input: &[u8], held: &[Payload]) -> (Payload, Payload) {
    let a = unword(input);
    let delta = hash(&[stage as u64, j as u64, t as u64, a]);
    let state = held.iter().fold(delta, |acc, d| mix(acc ^ unword(d)));
    (word(delta), word(hash(&[a, delta, state, stage as u64])))
}

/// The failure-free run: `deltas[s][j][t]` and `tokens[j][t]`.
#[derive(Clone, Debug)]
pub struct Reference {
    /// KV delta of every (stage, microbatch, step).
    pub deltas: Vec<Vec<Vec<Payload>>>,
    /// Every token.
    pub tokens: Vec<Vec<Payload>>,
}

impl Reference {
    /// Computes the failure-free run.
    pub fn new(depth: u32, microbatches: u32, tokens: u32) -> Self {
        let mut deltas = vec![vec![Vec::new(); microbatches as usize]; depth as usize];
        let mut out = vec![Vec::new(); microbatches as usize];
        for j in 0..microbatches {
            let mut input = prompt(j);
            for t in 0..tokens {
                let mut a = input.clone();
                for s in 0..depth {
                    let held = &deltas[s as usize][j as usize];
                    let (d, o) = step(s, j, t, &a, held);
                    deltas[s as usize][j as usize].push(d);
                    a = o;
                }
                out[j as usize].push(a.clone());
                input = a;
            }
        }
        Self { deltas, tokens: out }
    }
}
