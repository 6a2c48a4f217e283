//! # dejavulib
//!
//! KV-cache streaming primitives for fault-tolerant LLM serving, after the DéjàVu paper
//! (arXiv 2403.01876):
//!
//! - a **layout algebra** ([`spec`], [`layout`], [`region`], [`plan`]) that maps every KV element of
//!   the layouts engines use (FasterTransformer, per-layer HF/PyTorch tensors, vLLM paged blocks) to
//!   bytes, and turns a region copy into a few strided loops of contiguous runs;
//! - **buffered copies** ([`cache`], [`copy`], [`memory`]): gather many small KV pieces into one
//!   staging buffer from a reusable pool, then move that buffer once;
//! - **flush / fetch** ([`chunk`], [`store`], [`net`]): checksummed chunks to host memory, files or a
//!   remote peer over TCP, TLS or QUIC ([`wire`] frames, cluster authentication, backpressure);
//! - **resharding** ([`placement`], [`reshard`]): `stream_out` / `stream_in` between pipeline setups of
//!   different depth, tensor-parallel degree, microbatch size and layer split;
//! - a background **streamer** ([`streamer`]) that moves layer `l` while the engine computes `l + 1`;
//! - the engine's end of its **sidecar** ([`local`]): chunks through a shared memory region
//!   ([`shm`]) and a local socket, to a process that keeps them and forwards them to the ring
//!   successor; after a restart, what it keeps and where each sequence resumes ([`resume`]).
//!
//! ```
//! use dejavulib::{Coord, DType, KvCache, KvLayout, KvRegion, KvSpec, Part};
//! use dejavulib::layout::PerLayerOrder;
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! // A small worker in FasterTransformer's layout, and a receiver holding per-layer tensors.
//! let spec = KvSpec::new(2, 4, 64, DType::F16)?;
//! let engine = KvCache::new(KvLayout::faster_transformer(spec, 2, 128)?)?;
//! let receiver = KvCache::new(KvLayout::per_layer(spec, 2, 128, PerLayerOrder::Bshd)?)?;
//! let at = Coord { layer: 1, slot: 0, head: 3, token: 7 };
//! engine.write_vector(Part::K, at, &[7u8; 128])?;
//!
//! // One decode step (token 7 of every layer, slot and head), gathered into one staging buffer...
//! let step = KvRegion::new(0..2, 0..2, 0..4, 7..8);
//! let packing = engine.layout().preferred_packing();
//! let mut staging = vec![0u8; engine.packed_len(&step) as usize];
//! engine.gather(&step, packing, &mut staging)?;
//!
//! // ...and scattered into a different layout.
//! receiver.scatter(&step, packing, &staging)?;
//! let mut k = [0u8; 128];
//! receiver.read_vector(Part::K, at, &mut k)?;
//! assert_eq!(k, [7u8; 128]);
//! # Ok(())
//! # }
//! ```

// Without the `net` feature the crate documentation still names the transports it leaves out.
#![cfg_attr(not(feature = "net"), allow(rustdoc::broken_intra_doc_links))]

pub mod affinity;
pub mod baseline;
pub mod cache;
pub mod checksum;
pub mod chunk;
pub mod copy;
pub mod cuda;
pub mod file_io;
mod handover;
pub mod layout;
pub mod local;
pub mod memory;
pub mod message;
#[cfg(feature = "net")]
pub mod net;
pub mod placement;
pub mod plan;
pub mod planner;
pub mod region;
pub mod reshard;
pub mod restore;
pub mod resume;
pub mod shm;
pub mod spec;
pub mod spill;
pub mod store;
pub mod streamer;
pub mod wire;

pub use cache::{CacheError, KvCache};
pub use layout::{KvLayout, LayoutError, Packing};
pub use memory::{HostBuffer, Staging, StagingPool};
pub use placement::{Setup, StageSpec, WorkerId};
pub use region::{Coord, KvRegion, Shape};
pub use reshard::{
    plan_stream_in, plan_stream_out, stream_in, stream_out, transfer_key, ChunkReceipt, StreamStats, Transfer,
};
pub use spec::{DType, KvSpec, Part, ScaleMode};
pub use store::{ChunkStore, FileStore, HostStore};
pub use streamer::{Streamer, StreamerConfig};
