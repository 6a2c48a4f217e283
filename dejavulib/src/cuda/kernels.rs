//! The copy kernels as the engine launches them: compiled from `kernels/copy_blocks.cu` by NVRTC
//! for the device's architecture, and the launch that fits a table (by items or by runs, the table
//! inline as a kernel parameter or uploaded).

use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaFunction, CudaStream, DeviceRepr, LaunchConfig, PushKernelArg};
use cudarc::nvrtc::{compile_ptx_with_opts, CompileOptions};

use super::table::{by_items, Table, INLINE_BLOCKS, WORDS};
use super::upload::{TableUploads, SLOT_WORDS};
use super::CudaError;

/// The kernels' source, compiled by NVRTC when an engine opens.
const KERNELS: &str = dejavu_kernels::COPY_BLOCKS;

/// Threads per block of both kernels.
const THREADS: u32 = 256;

/// Most thread blocks a launch uses (the kernels stride over the rest).
const MAX_BLOCKS: u32 = 8192;

/// Items each thread of the item kernel copies (`ITEMS_PER_THREAD` in `kernels/copy_blocks.cu`):
/// the launch has enough threads for each to have that many.
const ITEMS_PER_THREAD: u64 = 4;

/// NVRTC's name of the architecture `major`.`minor`: NVRTC takes it as a static string, so one
/// per device kind is made and kept for the life of the process.
fn architecture(major: i32, minor: i32) -> &'static str {
    static NAMES: parking_lot::Mutex<Vec<(i32, i32, &'static str)>> = parking_lot::Mutex::new(Vec::new());
    let mut names = NAMES.lock();
    if let Some(&(_, _, name)) = names.iter().find(|&&(a, b, _)| (a, b) == (major, minor)) {
        return name;
    }
    let name: &'static str = Box::leak(format!("sm_{major}{minor}").into_boxed_str());
    names.push((major, minor, name));
    name
}

/// A table passed to the kernels by value (`InlineTable<INLINE_BLOCKS>` in
/// `kernels/copy_blocks.cu`): the blocks' words, then the block count.
#[repr(C)]
#[derive(Clone, Copy)]
struct InlineTable {
    words: [u64; INLINE_BLOCKS * WORDS],
    blocks: u32,
    unused: u32,
}

// SAFETY: plain old data with the C layout of the kernels' `InlineTable` (u64 words, then two
// u32s: no padding on either side), which is how a kernel parameter of that type is passed.
unsafe impl DeviceRepr for InlineTable {}

impl InlineTable {
    fn new(table: &Table) -> Self {
        let mut inline = Self { words: [0; INLINE_BLOCKS * WORDS], blocks: table.blocks, unused: 0 };
        inline.words[..table.words.len()].copy_from_slice(&table.words);
        inline
    }
}

/// The copy kernels: by items (short runs, a few items per thread) or by runs (long runs, one
/// thread block each), the table in device memory or inline.
pub(super) struct Kernels {
    items: CudaFunction,
    runs: CudaFunction,
    items_inline: CudaFunction,
    runs_inline: CudaFunction,
    /// The kernels that copy an uploaded table into shared memory first.
    items_shared: CudaFunction,
    runs_shared: CudaFunction,
    /// Where tables too large to be a kernel parameter are uploaded.
    uploads: TableUploads,
}

impl Kernels {
    /// Compiles the kernels for `ctx`'s device and loads them; `stream` is where the tables are
    /// uploaded from then on.
    pub(super) fn load(ctx: &Arc<CudaContext>, stream: &Arc<CudaStream>) -> Result<Self, CudaError> {
        let (major, minor) = ctx.compute_capability()?;
        let arch = architecture(major, minor);
        let options = CompileOptions { arch: Some(arch), ..CompileOptions::default() };
        let ptx = compile_ptx_with_opts(KERNELS, options).map_err(|e| CudaError::Compile(e.to_string()))?;
        let module = ctx.load_module(ptx)?;
        Ok(Self {
            items: module.load_function("djv_copy_items")?,
            runs: module.load_function("djv_copy_runs")?,
            items_inline: module.load_function("djv_copy_items_inline")?,
            runs_inline: module.load_function("djv_copy_runs_inline")?,
            items_shared: module.load_function("djv_copy_items_shared")?,
            runs_shared: module.load_function("djv_copy_runs_shared")?,
            uploads: TableUploads::new(ctx, stream)?,
        })
    }

    /// Launches every kernel once with nothing to copy, and waits: the driver loads a kernel
    /// lazily at its first launch (CUDA 11.7 and later by default), and that load can wait for
    /// the whole context, so a first copy queued behind an engine's compute stream would block
    /// the host until that stream is done. Loaded here, no later launch waits.
    pub(super) fn warm(&self, stream: &Arc<CudaStream>) -> Result<(), CudaError> {
        let config = LaunchConfig { grid_dim: (1, 1, 1), block_dim: (THREADS, 1, 1), shared_mem_bytes: 0 };
        let (none, blocks) = (0u64, 0u32);
        let inline = InlineTable { words: [0; INLINE_BLOCKS * WORDS], blocks, unused: 0 };
        let words = stream.alloc_zeros::<u64>(WORDS)?;
        for kernel in [&self.items_inline, &self.runs_inline] {
            let mut launch = stream.launch_builder(kernel);
            launch.arg(&inline).arg(&none);
            // SAFETY: the kernel's arguments in order; with no item or run to copy, no thread
            // reads the table.
            unsafe { launch.launch(config) }?;
        }
        for kernel in [&self.items, &self.runs, &self.items_shared, &self.runs_shared] {
            let mut launch = stream.launch_builder(kernel);
            launch.arg(&words).arg(&blocks).arg(&none);
            // SAFETY: as above; `words` outlives the launch (the stream is synchronised below).
            unsafe { launch.launch(config) }?;
        }
        Ok(stream.synchronize()?)
    }

    /// Launches the kernel that fits `table`'s runs: the table travels as a kernel parameter when
    /// it is small (a decode step's is), else it is uploaded first.
    ///
    /// # Safety
    /// Every address in `table` must lie inside device memory of `stream`'s device that stays
    /// allocated until the kernel has run, and nothing else may write what it writes meanwhile.
    pub(super) unsafe fn launch(&self, stream: &Arc<CudaStream>, table: &Table) -> Result<(), CudaError> {
        if table.runs == 0 {
            return Ok(());
        }
        let items = by_items(table);
        let (grid, count) = if items {
            (table.items.div_ceil(THREADS as u64 * ITEMS_PER_THREAD), table.items)
        } else {
            (table.runs, table.runs)
        };
        let config = LaunchConfig {
            grid_dim: (grid.min(MAX_BLOCKS as u64) as u32, 1, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY (both launches): the arguments are the kernel's, in order; the table's addresses
        // are the caller's promise (this function's contract).
        if table.blocks as usize <= INLINE_BLOCKS {
            let inline = InlineTable::new(table);
            let kernel = if items { &self.items_inline } else { &self.runs_inline };
            let mut launch = stream.launch_builder(kernel);
            launch.arg(&inline).arg(&count);
            // SAFETY: see above; the inline table is copied into the launch's parameters.
            unsafe { launch.launch(config) }?;
            return Ok(());
        }
        if table.words.len() <= SLOT_WORDS {
            let kernel = if items { &self.items_shared } else { &self.runs_shared };
            // Each thread block copies the table into its shared memory (at most 38 KiB: under
            // the 48 KiB every device gives without asking).
            let shared = (table.words.len() * std::mem::size_of::<u64>()) as u32;
            let config = LaunchConfig { shared_mem_bytes: shared, ..config };
            let launched = self.uploads.with_table(stream, &table.words, |words| {
                let mut launch = stream.launch_builder(kernel);
                launch.arg(&words).arg(&table.blocks).arg(&count);
                // SAFETY: see above; the table's slot is not reused before the kernel is done, and
                // the launch gives the kernel the shared memory the table takes.
                unsafe { launch.launch(config) }?;
                Ok(())
            })?;
            if launched.is_some() {
                return Ok(());
            }
            // Every slot still in use (uploads queued far behind): rather than wait, the table goes
            // up the slow way below, and the kernel reads it from device memory.
        }
        let kernel = if items { &self.items } else { &self.runs };
        let words = stream.clone_htod(&table.words)?;
        let mut launch = stream.launch_builder(kernel);
        launch.arg(&words).arg(&table.blocks).arg(&count);
        // SAFETY: see above; the uploaded table lives until its kernel has run: dropping it frees
        // it in stream order (after the kernel), or after synchronising the stream.
        unsafe { launch.launch(config) }?;
        Ok(())
    }
}
