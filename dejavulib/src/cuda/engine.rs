//! The engine: a device, its compiled kernels and its copy stream.

use std::sync::Arc;

use cudarc::driver::{
    sys, CudaContext, CudaFunction, CudaSlice, CudaStream, DevicePtr, LaunchConfig, PinnedHostSlice,
    PushKernelArg,
};
use cudarc::nvrtc::{compile_ptx_with_opts, CompileOptions};

use super::table::{encode, Table, SHORT_RUN};
use super::{driver_present, nvrtc_present, CudaError};
use crate::cache::GatherPlan;
use crate::layout::KvLayout;
use crate::plan::CopyPlan;

/// The kernels' source, compiled by NVRTC when an engine opens.
const KERNELS: &str = include_str!("../../kernels/copy_blocks.cu");

/// Threads per block of both kernels.
const THREADS: u32 = 256;

/// Most thread blocks a launch uses (the kernels stride over the rest).
const MAX_BLOCKS: u32 = 8192;

/// A device with the copy kernels loaded and a stream of its own for copies.
pub struct CudaEngine {
    ctx: Arc<CudaContext>,
    copy: Arc<CudaStream>,
    short: CudaFunction,
    long: CudaFunction,
    /// Tables of launches not known to be done: freed at the next synchronisation (freeing one
    /// earlier would wait for its kernel).
    tables: parking_lot::Mutex<Vec<CudaSlice<u64>>>,
}

impl std::fmt::Debug for CudaEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaEngine").field("ordinal", &self.ctx.ordinal()).finish_non_exhaustive()
    }
}

/// Device memory the library allocated; the copy stream is synchronised before it is freed (the
/// kernels write through raw addresses, which cudarc does not track).
pub struct DeviceBuffer {
    slice: CudaSlice<u8>,
    stream: Arc<CudaStream>,
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        let _ = self.stream.synchronize();
    }
}

impl DeviceBuffer {
    /// Bytes.
    pub fn len(&self) -> usize {
        self.slice.len()
    }

    /// Whether it holds no byte.
    pub fn is_empty(&self) -> bool {
        self.slice.len() == 0
    }

    fn address(&self) -> u64 {
        let (ptr, _sync) = self.slice.device_ptr(&self.stream);
        ptr
    }
}

/// A KV cache in device memory, laid out as a [`KvLayout`]: one allocation per buffer, owned by
/// the library or by the engine that hands its own tensors over.
pub struct DeviceKv {
    layout: KvLayout,
    buffers: Vec<DeviceMem>,
}

enum DeviceMem {
    Owned(DeviceBuffer),
    /// An engine's own memory: its address and length.
    Borrowed(u64),
}

impl DeviceKv {
    /// The layout.
    pub fn layout(&self) -> &KvLayout {
        &self.layout
    }

    /// A cache over device memory the engine owns (as PyTorch hands a tensor out): buffer `i` of
    /// `layout` at device address `addresses[i]`.
    ///
    /// # Safety
    /// 1. Each address must be a device allocation of the engine's device, at least as long as
    ///    the layout's buffer `i`, and stay allocated while this cache is used.
    /// 2. Nothing may write it while a copy the library enqueued runs, but what the engine orders
    ///    with [`CudaEngine::after`].
    pub unsafe fn borrowed(layout: KvLayout, addresses: &[u64]) -> Result<Self, CudaError> {
        let needed = layout.buffer_sizes().len() as u64;
        if addresses.len() as u64 != needed {
            return Err(CudaError::Size { what: "buffer addresses", needed, got: addresses.len() as u64 });
        }
        Ok(Self { layout, buffers: addresses.iter().map(|&a| DeviceMem::Borrowed(a)).collect() })
    }

    fn bases(&self) -> Vec<u64> {
        self.buffers
            .iter()
            .map(|b| match b {
                DeviceMem::Owned(buffer) => buffer.address(),
                DeviceMem::Borrowed(address) => *address,
            })
            .collect()
    }
}

/// Page-locked host memory, allocated with flags 0: cached for CPU reads (cudarc's default is
/// write-combined, very slow to read from the CPU).
pub struct PinnedBuffer {
    slice: PinnedHostSlice<u8>,
}

impl PinnedBuffer {
    /// The bytes (once the copies that write them are done: see [`CudaEngine::synchronize`]).
    pub fn as_slice(&self) -> Result<&[u8], CudaError> {
        Ok(self.slice.as_slice()?)
    }

    /// The bytes, to fill before a copy to the device.
    pub fn as_mut_slice(&mut self) -> Result<&mut [u8], CudaError> {
        Ok(self.slice.as_mut_slice()?)
    }
}

impl CudaEngine {
    /// Opens device `ordinal`: checks that the driver and NVRTC can be loaded (a typed error, not
    /// a panic, where they cannot), compiles the kernels for its architecture and makes a copy
    /// stream.
    pub fn open(ordinal: usize) -> Result<Self, CudaError> {
        if !driver_present() {
            return Err(CudaError::NoDriver);
        }
        let count = CudaContext::device_count()? as usize;
        if ordinal >= count {
            return Err(CudaError::NoDevice { ordinal, count });
        }
        if !nvrtc_present() {
            return Err(CudaError::NoNvrtc);
        }
        let ctx = CudaContext::new(ordinal)?;
        let (major, minor) = ctx.compute_capability()?;
        // NVRTC takes the architecture as a static string: one per device kind, kept.
        let arch: &'static str = Box::leak(format!("sm_{major}{minor}").into_boxed_str());
        let options = CompileOptions { arch: Some(arch), ..CompileOptions::default() };
        let ptx = compile_ptx_with_opts(KERNELS, options).map_err(|e| CudaError::Compile(e.to_string()))?;
        let module = ctx.load_module(ptx)?;
        let short = module.load_function("djv_copy_short")?;
        let long = module.load_function("djv_copy_long")?;
        let copy = ctx.new_stream()?;
        Ok(Self { ctx, copy, short, long, tables: parking_lot::Mutex::new(Vec::new()) })
    }

    /// `bytes` of device memory, zeroed.
    pub fn alloc(&self, bytes: usize) -> Result<DeviceBuffer, CudaError> {
        Ok(DeviceBuffer { slice: self.copy.alloc_zeros::<u8>(bytes)?, stream: self.copy.clone() })
    }

    /// A KV cache of `layout` in device memory the library allocates, zeroed.
    pub fn alloc_kv(&self, layout: KvLayout) -> Result<DeviceKv, CudaError> {
        let buffers = layout
            .buffer_sizes()
            .iter()
            .map(|&bytes| self.alloc(bytes as usize).map(DeviceMem::Owned))
            .collect::<Result<_, _>>()?;
        Ok(DeviceKv { layout, buffers })
    }

    /// `bytes` of pinned host memory (flags 0, not write-combined).
    pub fn pinned(&self, bytes: usize) -> Result<PinnedBuffer, CudaError> {
        // SAFETY: the memory is not initialised; it is only handed out as bytes, which any bit
        // pattern is, and the copies that fill it are ordered on the copy stream.
        let slice = unsafe { self.ctx.alloc_pinned_with_flags::<u8>(bytes, 0) }?;
        Ok(PinnedBuffer { slice })
    }

    /// Copies `host` into `device` on the copy stream (it must be as long).
    pub fn upload(&self, host: &[u8], device: &mut DeviceBuffer) -> Result<(), CudaError> {
        same_len("device buffer", host.len(), device.len())?;
        Ok(self.copy.memcpy_htod(host, &mut device.slice)?)
    }

    /// Copies `device` into `host` on the copy stream and waits for it.
    pub fn download(&self, device: &DeviceBuffer, host: &mut [u8]) -> Result<(), CudaError> {
        same_len("host buffer", device.len(), host.len())?;
        self.copy.memcpy_dtoh(&device.slice, host)?;
        Ok(self.copy.synchronize()?)
    }

    /// Copies `device` into pinned `host` on the copy stream without waiting (the DMA engine
    /// reads pinned memory directly); [`CudaEngine::synchronize`] before reading it.
    pub fn download_pinned(&self, device: &DeviceBuffer, host: &mut PinnedBuffer) -> Result<(), CudaError> {
        same_len("pinned buffer", device.len(), host.slice.len())?;
        Ok(self.copy.memcpy_dtoh(&device.slice, &mut host.slice)?)
    }

    /// Copies `src` into `dst` (as long) on the device, on the copy stream: the limit a gather
    /// kernel is measured against.
    pub fn copy_device(&self, src: &DeviceBuffer, dst: &mut DeviceBuffer) -> Result<(), CudaError> {
        same_len("device buffer", src.len(), dst.len())?;
        Ok(self.copy.memcpy_dtod(&src.slice, &mut dst.slice)?)
    }

    /// Copies pinned `host` into `device` on the copy stream without waiting (swap-in).
    pub fn upload_pinned(&self, host: &PinnedBuffer, device: &mut DeviceBuffer) -> Result<(), CudaError> {
        same_len("device buffer", host.slice.len(), device.len())?;
        Ok(self.copy.memcpy_htod(&host.slice, &mut device.slice)?)
    }

    /// Gathers `plan`'s region of `kv` into `staging` with one kernel, on the copy stream.
    pub fn gather(
        &self,
        kv: &DeviceKv,
        plan: &GatherPlan,
        staging: &mut DeviceBuffer,
    ) -> Result<(), CudaError> {
        let needed = plan.copy_plan().bytes();
        same_len("staging buffer", needed as usize, staging.len())?;
        self.run(&encode(plan.copy_plan(), &kv.bases(), &[staging.address()])?)
    }

    /// Scatters `staging` into `kv` as `plan` (a scatter plan of `kv`'s layout) says, with one
    /// kernel, on the copy stream.
    pub fn scatter(&self, staging: &DeviceBuffer, kv: &DeviceKv, plan: &CopyPlan) -> Result<(), CudaError> {
        same_len("staging buffer", plan.bytes() as usize, staging.len())?;
        self.run(&encode(plan, &[staging.address()], &kv.bases())?)
    }

    /// Makes the copy stream wait, from now on, for the work enqueued so far on the engine's
    /// compute stream `compute` (a layer or step it has just computed): an event recorded there,
    /// waited for here. The host never blocks, and neither does the compute stream.
    ///
    /// # Safety
    /// `compute` must be a live stream of this engine's device context.
    pub unsafe fn after(&self, compute: sys::CUstream) -> Result<(), CudaError> {
        let event = self.ctx.new_event(None)?;
        // SAFETY: `compute` is a live stream of this context (the caller's promise); the event is
        // this context's and lives until both calls below have been enqueued.
        unsafe {
            cudarc::driver::result::event::record(event.cu_event(), compute)?;
        }
        Ok(self.copy.wait(&event)?)
    }

    /// Waits for every copy enqueued so far.
    pub fn synchronize(&self) -> Result<(), CudaError> {
        self.copy.synchronize()?;
        self.tables.lock().clear();
        Ok(())
    }

    /// Copies every buffer of `host` into `kv` (same layout) and waits: for tests and checks.
    pub fn upload_kv(&self, host: &[Vec<u8>], kv: &mut DeviceKv) -> Result<(), CudaError> {
        same_len("buffers", kv.buffers.len(), host.len())?;
        for (bytes, buffer) in host.iter().zip(&mut kv.buffers) {
            match buffer {
                DeviceMem::Owned(device) => self.upload(bytes, device)?,
                DeviceMem::Borrowed(_) => {
                    return Err(CudaError::Driver("uploading into an engine's own memory".into()))
                }
            }
        }
        self.synchronize()
    }

    /// Every buffer of `kv` (library-owned), copied to the host: for tests and checks.
    pub fn download_kv(&self, kv: &DeviceKv) -> Result<Vec<Vec<u8>>, CudaError> {
        self.synchronize()?;
        kv.buffers
            .iter()
            .map(|buffer| match buffer {
                DeviceMem::Owned(device) => {
                    let mut host = vec![0u8; device.len()];
                    self.download(device, &mut host)?;
                    Ok(host)
                }
                DeviceMem::Borrowed(_) => Err(CudaError::Driver("downloading an engine's own memory".into())),
            })
            .collect()
    }

    /// Launches the kernel that fits `table`'s runs.
    fn run(&self, table: &Table) -> Result<(), CudaError> {
        if table.runs == 0 {
            return Ok(());
        }
        let words = self.copy.clone_htod(&table.words)?;
        let (function, grid) = if table.longest_run <= SHORT_RUN {
            (&self.short, table.runs.div_ceil(THREADS as u64))
        } else {
            (&self.long, table.runs)
        };
        let config = LaunchConfig {
            grid_dim: (grid.min(MAX_BLOCKS as u64) as u32, 1, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut launch = self.copy.launch_builder(function);
        launch.arg(&words).arg(&table.blocks).arg(&table.runs);
        // SAFETY: the arguments are those of both kernels, in order (a table of `blocks` blocks
        // of 17 words, its block count as u32 and its run count as u64); every address in the
        // table lies inside a buffer of the plan's size (checked by the callers' length checks
        // and by the plan, which was made for these layouts), and those buffers outlive the
        // copy (owned ones synchronise the stream before they are freed; borrowed ones are the
        // caller's promise).
        unsafe { launch.launch(config) }?;
        self.tables.lock().push(words);
        Ok(())
    }
}

fn same_len(what: &'static str, needed: usize, got: usize) -> Result<(), CudaError> {
    if needed != got {
        return Err(CudaError::Size { what, needed: needed as u64, got: got as u64 });
    }
    Ok(())
}
