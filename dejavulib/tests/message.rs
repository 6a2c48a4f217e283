//! The control messages: every one survives its encoding; cut, padded, mutated or random bytes
//! are refused without a panic, and decoding allocates within its stated bound.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::net::SocketAddr;

use dejavu_proto::plan::{Loss, Reseed, Source, StagePlan};
use dejavulib::chunk::{ChunkKey, SequencePlace};
use dejavulib::message::{
    decode_allocation_bound, Health, Mark, Message, MessageError, RecoveryOrders, Role, SeatIds, StageOrders,
    MESSAGE_VERSION,
};
use dejavulib::resume::HeldChunk;
use dejavulib::wire::{Frame, FrameHeader, Kind};
use dejavulib::{KvRegion, WorkerId};
use proptest::prelude::*;

/// Counts the bytes this thread allocates (each test runs on a thread of its own).
struct Counting;

thread_local! {
    static ALLOCATED: Cell<usize> = const { Cell::new(0) };
}

// SAFETY: every call is passed on to the system allocator unchanged; the thread-local counter is
// a const-initialised `Cell` without a destructor, so touching it allocates nothing.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        ALLOCATED.with(|a| a.set(a.get() + layout.size()));
        // SAFETY: the caller's contract for `layout` is passed on as it is.
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` was allocated by `System` with `layout` (through `alloc` above).
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        ALLOCATED.with(|a| a.set(a.get() + new_size));
        // SAFETY: as for `dealloc`; `new_size` is the caller's.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

/// Decodes `bytes`, and checks that it allocated no more than the bound says.
fn decode_counted(bytes: &[u8]) -> Result<Message, MessageError> {
    let before = ALLOCATED.with(Cell::get);
    let decoded = Message::decode(bytes);
    let allocated = ALLOCATED.with(Cell::get) - before;
    assert!(
        allocated <= decode_allocation_bound(bytes.len()),
        "{allocated} bytes allocated to decode {} bytes: {decoded:?}",
        bytes.len()
    );
    decoded
}

fn addr(s: &str) -> SocketAddr {
    s.parse().unwrap()
}

fn key(n: u32) -> ChunkKey {
    ChunkKey {
        destination: WorkerId { stage: n, rank: 0 },
        microbatch: 1,
        region: KvRegion::new(0..4, n..n + 1, 0..2, 0..17),
    }
}

/// One of each message, with fields that differ from one another.
fn every_message() -> Vec<Message> {
    let orders = RecoveryOrders {
        epoch: 7,
        stages: vec![
            StageOrders {
                plan: StagePlan {
                    stage: 1,
                    loss: Loss::Worker,
                    source: Source::Lost,
                    reseed: Some((0, Reseed::Now)),
                },
                reseeded: Some(12),
                marks: vec![],
            },
            StageOrders {
                plan: StagePlan {
                    stage: 2,
                    loss: Loss::Worker,
                    source: Source::Successor(3),
                    reseed: Some((1, Reseed::AfterRestore)),
                },
                reseeded: None,
                marks: vec![
                    Mark { microbatch: 1, slots: 0..1, tokens: 40 },
                    Mark { microbatch: 0, slots: 2..3, tokens: 9 },
                ],
            },
            StageOrders {
                plan: StagePlan { stage: 3, loss: Loss::Engine, source: Source::Own, reseed: None },
                reseeded: None,
                marks: vec![Mark { microbatch: 0, slots: 0..1, tokens: 3 }],
            },
        ],
    };
    let seat = SeatIds { microbatch: 2, slot: 5 };
    vec![
        Message::Done,
        Message::Mapped,
        Message::Successor(addr("127.0.0.1:4000")),
        Message::Keep { chunks: 3, bytes: 5 << 32 | 9 },
        Message::Held { want: 0, after: None },
        Message::Held { want: 100, after: Some(key(3)) },
        Message::HeldPage { stage: 2, epoch: 9, successor: None, count: 0, left: 0 },
        Message::HeldPage { stage: 2, epoch: 9, successor: Some(addr("[::1]:7")), count: 4, left: 1 },
        Message::Assign { stage: 3, epoch: 1 << 40 },
        Message::Release(SequencePlace {
            destination: WorkerId { stage: 2, rank: 1 },
            microbatch: 3,
            slots: 4..6,
        }),
        Message::Released { chunks: 12 },
        Message::HeldOf { stage: 1, want: 65536, after: Some(key(1)) },
        Message::HeldOfPage {
            chunks: vec![HeldChunk { key: key(1), put: 4 }, HeldChunk { key: key(2), put: 5 }],
            left: 7,
        },
        Message::Reseed { to: addr("10.0.0.2:9") },
        Message::Reseeded { chunks: 77 },
        Message::Census,
        Message::CensusReply {
            epoch: 4,
            members: vec![((Role::Engine, 0), Health::Alive), ((Role::Sidecar, 3), Health::Fenced)],
        },
        Message::Fence { members: vec![(Role::Engine, 1), (Role::Sidecar, 1)], reuse: None },
        Message::Fence { members: vec![(Role::Engine, 2)], reuse: Some(6) },
        Message::FencedIn((Role::Sidecar, 2)),
        Message::AwaitFence { after: 3, wait_ms: 250 },
        Message::Lifeline { member: (Role::Engine, 1 << 20), epoch: 2, process: 4242 },
        Message::Epoch(u64::MAX - 1),
        Message::Fenced(9),
        Message::WatchRecovery { after: 5, wait_ms: 1000 },
        Message::AcknowledgeRecovery(6),
        Message::HandBack { stage: 3, to: "10.0.0.7:7500".parse().unwrap() },
        Message::Recover { epoch: 7, book: vec![addr("127.0.0.1:5"), addr("[::1]:6")] },
        Message::Orders(orders),
        Message::ReseedRestored { epoch: 8, book: vec![addr("127.0.0.1:5")] },
        Message::Probe,
        Message::Rewire(vec![(0, addr("127.0.0.1:1")), (2, addr("127.0.0.1:3"))]),
        Message::Rewire(vec![]),
        Message::Restore { stage: 1, seat, prompt_len: 16, kv_tokens: 20, from: Some(addr("127.0.0.1:8")) },
        Message::Restore { stage: 1, seat, prompt_len: 16, kv_tokens: 20, from: None },
        Message::Restored { stage: 1, tokens: 19 },
        Message::Load { stage: 0, seat, prompt_len: 16 },
        Message::Loaded { stage: 0, tokens: 16 },
        Message::HandoffTo { stage: 1, token_stage: 2, to: addr("127.0.0.1:11") },
        Message::Replication { stage: 3, on: false },
        Message::AssignStage { flags: vec!["--index".into(), "2".into(), String::new()] },
        Message::StageServing { metrics: None },
        Message::StageServing { metrics: Some(addr("127.0.0.1:9100")) },
    ]
}

#[test]
fn every_message_survives_its_encoding_and_its_frame() {
    let messages = every_message();
    let mut codes: Vec<u16> = messages.iter().map(Message::code).collect();
    codes.dedup();
    let distinct = codes.len();
    codes.sort_unstable();
    codes.dedup();
    assert_eq!(codes.len(), distinct, "two messages share a code");
    let Some(Message::Orders(orders)) = messages.iter().find(|m| matches!(m, Message::Orders(_))) else {
        panic!("no orders among the messages")
    };
    assert_eq!(orders.stages[1].mark_of(0, 2), Some(9));
    assert_eq!(orders.stages[1].mark_of(0, 0), None);
    for message in messages {
        let encoded = message.encode();
        assert_eq!(decode_counted(&encoded).as_ref(), Ok(&message));
        let (header, payload) = message.frame(3, 9, 12);
        let frame = Frame { header, payload };
        assert_eq!(Message::of_frame(&frame).as_ref(), Ok(&message));
    }
    let frame = Frame { header: FrameHeader::new(Kind::Put, 0, 0, 1), payload: Message::Done.encode() };
    assert_eq!(Message::of_frame(&frame), Err(MessageError::NotControl(Kind::Put)));
}

#[test]
fn cut_padded_and_foreign_messages_are_refused() {
    for message in every_message() {
        let encoded = message.encode();
        for cut in 0..encoded.len() {
            assert!(decode_counted(&encoded[..cut]).is_err(), "{message:?} cut at {cut}");
        }
        let mut padded = encoded.clone();
        padded.push(0);
        assert_eq!(decode_counted(&padded), Err(MessageError::Trailing(1)), "{message:?}");
        let mut other_version = encoded.clone();
        other_version[..2].copy_from_slice(&(MESSAGE_VERSION + 1).to_le_bytes());
        assert_eq!(decode_counted(&other_version), Err(MessageError::Version(MESSAGE_VERSION + 1)));
    }
    let mut unknown = MESSAGE_VERSION.to_le_bytes().to_vec();
    unknown.extend_from_slice(&999u16.to_le_bytes());
    assert_eq!(decode_counted(&unknown), Err(MessageError::UnknownCode(999)));
}

#[test]
fn a_length_that_claims_more_than_is_left_allocates_nothing_for_it() {
    // A census that claims four billion members, in twelve bytes.
    let mut lying = MESSAGE_VERSION.to_le_bytes().to_vec();
    lying.extend_from_slice(&31u16.to_le_bytes());
    lying.extend_from_slice(&4u64.to_le_bytes());
    lying.extend_from_slice(&u32::MAX.to_le_bytes());
    assert!(matches!(decode_counted(&lying), Err(MessageError::Truncated(_))));
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    #[test]
    fn random_bytes_never_panic_and_allocate_within_the_bound(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
        let _ = decode_counted(&bytes);
    }

    #[test]
    fn random_bytes_after_a_valid_header_never_panic(code in 0u16..80, body in proptest::collection::vec(any::<u8>(), 0..256)) {
        let mut bytes = MESSAGE_VERSION.to_le_bytes().to_vec();
        bytes.extend_from_slice(&code.to_le_bytes());
        bytes.extend_from_slice(&body);
        let _ = decode_counted(&bytes);
    }

    #[test]
    fn mutated_messages_never_panic_and_allocate_within_the_bound(
        which in any::<prop::sample::Index>(),
        flips in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..6),
    ) {
        let messages = every_message();
        let mut bytes = which.get(&messages).encode();
        for (at, value) in flips {
            let i = at.index(bytes.len());
            bytes[i] = value;
        }
        if let Ok(decoded) = decode_counted(&bytes) {
            // Whatever still decodes is a message that encodes back to the same bytes.
            prop_assert_eq!(decoded.encode(), bytes);
        }
    }
}

#[test]
fn a_sequence_resumes_from_the_first_token_some_failed_stage_lacks() {
    let stage = |stage: u32, marks: Vec<Mark>| StageOrders {
        plan: StagePlan { stage, loss: Loss::Engine, source: Source::Own, reseed: None },
        reseeded: None,
        marks,
    };
    let orders = RecoveryOrders {
        epoch: 3,
        stages: vec![
            stage(
                0,
                vec![
                    Mark { microbatch: 1, slots: 0..2, tokens: 10 },
                    Mark { microbatch: 0, slots: 0..2, tokens: 20 },
                ],
            ),
            stage(2, vec![Mark { microbatch: 0, slots: 0..2, tokens: 18 }]),
        ],
    };
    // Microbatch 1's sequence is held by stage 0 only: stage 2 recomputes it from the start.
    assert_eq!(
        orders.resume_from(),
        vec![Mark { microbatch: 0, slots: 0..2, tokens: 18 }, Mark { microbatch: 1, slots: 0..2, tokens: 0 }]
    );
    assert_eq!(RecoveryOrders { epoch: 3, stages: vec![] }.resume_from(), vec![]);
}
