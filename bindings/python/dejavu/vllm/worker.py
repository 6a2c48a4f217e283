"""The connector's worker side: vLLM's paged KV tensors used in place, each step's loads fetched
into a request's blocks before the forward pass, and its saves streamed to the sidecar by the
library's ``Streamer``, a prompt's layer by layer while the later layers compute.

What is acknowledged when: a step's saves go on while the next step computes, and that next
step's ``wait_for_save`` returns once the sidecar keeps every token of the step before it and the
ring successor's sidecar holds a copy. An engine that dies therefore loses at most the KV of its
last step and of the step before, which its requests compute again when they are resubmitted. The
blocks a save reads stay the request's until the save is in: a finished request's blocks are
freed once its last save is acknowledged (``request_finished`` delays their freeing, and
``get_finished`` reports them), and a step that preempts requests first waits for every save.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Callable, Dict, List, Optional, Tuple, Union

import numpy as np
import torch
from vllm.logger import init_logger

from .._dejavu import (
    Completion,
    CudaEngine,
    DeviceKvCache,
    Error,
    KvCache,
    KvLayout,
    KvRegion,
    KvSpec,
    Store,
    Streamer,
    fetch,
)
from .config import ConnectorConfig
from .plan import DejaVuMetadata, LoadJob, SaveJob
from .sequences import TOKENS, token_log, token_region
from .tensors import PagedTensors, paged_tensors

# Under vLLM's own logger, so that its messages show as vLLM's do.
logger = init_logger(f"vllm.{__name__}")


class WorkerSide:
    """A worker's half of the connector, the engine member of its sidecar."""

    def __init__(self, config: ConnectorConfig, block_size: int) -> None:
        self._config = config
        self._block_size = block_size
        self._layers: Dict[str, int] = {}
        self._tensors: Optional[PagedTensors] = None
        self._spec: Optional[KvSpec] = None
        # The GPU's copy kernels, where vLLM's tensors are on one.
        self._engine: Optional[CudaEngine] = None
        self._store: Optional[Store] = None
        self._streamer: Optional[Streamer] = None
        self._worker = (0, 0)
        # The step's saves, each with a view of its request's blocks.
        self._views: List[Tuple[SaveJob, Union[KvCache, DeviceKvCache]]] = []
        # Completions of the step's saves, with what they read (kept alive until waited for), and
        # the sequences to release once they are in.
        self._pending: List[Tuple[Completion, object]] = []
        self._previous: Tuple[List[Tuple[Completion, object]], List[int]] = ([], [])
        # Finished requests whose blocks wait for their last saves.
        self._finishing: set = set()
        self._load_errors: set = set()
        # Loads run here, so that a step waits for one at most ``load_timeout``.
        self._loader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dejavu-load")

    def register(self, kv_caches: Dict[str, torch.Tensor], backend: str) -> None:
        """Wraps vLLM's per-layer KV tensors, as ``backend`` (its attention backend's name) lays
        them out (``tensors``), and joins the sidecar as the stage's engine. On a GPU the library's
        copy kernels read and write them in place (``CudaEngine``)."""
        names = list(kv_caches)
        tensors = [kv_caches[name] for name in names]
        device = tensors[0].device
        if device.type not in ("cpu", "cuda"):
            raise NotImplementedError(f"DejaVuConnector: KV tensors on {device.type} are not supported")
        self._tensors = paged_tensors(tensors, backend, self._block_size)
        self._spec = self._tensors.spec
        self._layers = {name: i for i, name in enumerate(names)}
        if device.type == "cuda":
            # No CUDA driver or NVRTC is a setup error, not a missing sidecar: it stops the engine.
            self._engine = CudaEngine(device.index or 0)
        try:
            self._store = Store.sidecar(self._config.sidecar, self._config.successor, epoch=None, member=True)
            self._streamer = Streamer(self._store)
            self._worker = (self._store.serving()["stage"], 0)
        except Error as e:
            self._store = None
            logger.error("DejaVu: no sidecar at %s (%s): serving without copies", self._config.sidecar, e)
            return
        logger.info(
            "DejaVu: %d layers of %d blocks (%s) joined the sidecar at %s as stage %d, epoch %d",
            len(names), self._tensors.num_blocks, backend, self._config.sidecar, self._worker[0], self._store.epoch(),
        )

    def start_load(self, meta: DejaVuMetadata) -> None:
        """Fetches each load of the step into its request's blocks, before the forward pass reads
        them; a load that fails, or takes longer than ``load_timeout``, has its blocks reported,
        for vLLM to compute them instead (a sidecar that timed out is given up)."""
        for job in meta.loads:
            if self._store is None:
                self._fail_load(job.blocks, job.first, job.tokens)
                continue
            cache = self._view(job.blocks)
            upload = None
            if self._engine is not None:
                # Read here, on vLLM's thread: the loader thread's current stream is the default
                # one, not the forward pass's.
                stream = self._stream()

                def upload(region: KvRegion, data: bytes, cache=cache, stream=stream) -> None:
                    cache.scatter(region, data, stream=stream)

            cancelled = threading.Event()
            fetching = self._loader.submit(self._fetch, cache, job, upload, cancelled)
            try:
                fetching.result(timeout=self._config.load_timeout)
            except FutureTimeout:
                # Its blocks are vLLM's to compute now: the load stops at its next chunk.
                cancelled.set()
                logger.error(
                    "DejaVu: loading request %s took over %.0f s: vLLM computes it, and the engine serves "
                    "on without copies", job.request, self._config.load_timeout,
                )
                self._store = None
                self._fail_load(job.blocks, job.first, job.tokens)
                continue
            except Error as e:
                logger.error("DejaVu: loading request %s failed (%s): vLLM computes it", job.request, e)
                self._fail_load(job.blocks, job.first, job.tokens)
                continue
            logger.info("DejaVu: request %s loaded tokens %d..%d from the sidecar", job.request, job.first, job.tokens)

    def _fetch(
        self,
        cache: Union[KvCache, DeviceKvCache],
        job: LoadJob,
        upload: Optional[Callable[[KvRegion, bytes], None]],
        cancelled: threading.Event,
    ) -> None:
        """Fetches the job's chunks, until ``cancelled``: straight into vLLM's tensors (``cache``)
        where they are in host memory; otherwise each chunk into host memory of its own size,
        then handed to ``upload`` packed (on a GPU: scattered up after the forward pass's queued
        work, which reads it once the load returns)."""
        for layers, tokens in job.chunks:
            if cancelled.is_set():
                return
            region = self._region(layers, tokens)
            if upload is None:
                fetch(self._store, cache, region, self._worker, self._worker, job.sequence)
                continue
            staging = KvCache(host_staging(self._spec, self._block_size, tokens))
            fetch(self._store, staging, region, self._worker, self._worker, job.sequence)
            upload(region, staging.gather(region))

    def bind(self, meta: DejaVuMetadata) -> None:
        """A step begins: views of the blocks its saves read."""
        self._views = [(job, self._view(job.blocks)) for job in meta.saves] if self._store else []

    def save_layer(self, name: str) -> None:
        """vLLM wrote layer ``name`` of this step: queue its new tokens for the sidecar. A prompt's
        tokens go layer by layer, each layer's copy overlapping the next layer's compute; a decode
        step's one token goes once its last layer is written, every layer in one chunk (a chunk
        costs a round trip to the successor, which one token's few bytes do not pay for)."""
        if self._store is None or name not in self._layers:
            return
        layer, last = self._layers[name], len(self._layers) - 1
        for job, cache in self._views:
            if job.end - job.start > 1:
                layers = (layer, layer + 1)
            elif layer == last:
                layers = (0, last + 1)
            else:
                continue
            region = self._region(layers, (job.start, job.end))
            if self._engine is None:
                completion = self._streamer.region_ready(cache, region, self._worker, self._worker, job.sequence)
            else:
                # Queued behind the kernels that wrote the layer, on the forward pass's stream.
                completion = self._streamer.device_region_ready(
                    cache, self._stream(), region, self._worker, self._worker, job.sequence
                )
            self._pending.append((completion, cache))

    def wait_for_save(self, meta: DejaVuMetadata) -> None:
        """Queues the step's token ids after its KV; waits until the sidecar and its successor
        hold the step before it, then drops the sequences that step released. The step's own saves
        go on while the next one computes."""
        if self._store is None:
            return
        for job, _ in self._views:
            ids = np.zeros(job.end, dtype=np.int32)
            ids[job.start :] = job.ids
            log = token_log(ids)
            completion = self._streamer.region_ready(
                log, token_region(job.start, job.end), self._worker, self._worker, job.sequence | TOKENS
            )
            self._pending.append((completion, log))
        self._views = []
        previous, self._previous = self._previous, (self._pending, meta.releases)
        self._pending = []
        self._acknowledge(*previous)

    def wait_for_every_save(self) -> None:
        """Waits for every save queued, before blocks they read are given to other requests."""
        previous, self._previous = self._previous, ([], [])
        self._acknowledge(*previous)
        # The step under way queued none yet: preemptions come before its forward pass.

    def finished(self, finished: set) -> set:
        """Requests that finished before this step whose blocks may be freed: their last saves,
        queued in the step before, are in (this step's ``wait_for_save`` waited for them)."""
        done, self._finishing = self._finishing, set(finished)
        return done

    def _acknowledge(self, pending: List[Tuple[Completion, object]], releases: List[int]) -> None:
        if self._store is None:
            return
        try:
            for completion, _ in pending:
                completion.wait(timeout=self._config.save_timeout)
            for sequence in releases:
                for microbatch in (sequence, sequence | TOKENS):
                    self._store.release(self._worker, microbatch, (0, 1))
        except (Error, TimeoutError) as e:
            logger.error("DejaVu: the sidecar failed (%s): serving on without copies", e)
            self._store = None

    def load_errors(self) -> set:
        """Blocks whose load failed since the last call."""
        errors, self._load_errors = self._load_errors, set()
        return errors

    def shutdown(self) -> None:
        """Finishes the queued saves and stops the streamer."""
        if self._streamer is not None:
            self._streamer.shutdown()
            self._streamer = None
        self._loader.shutdown(wait=False)

    def _view(self, blocks: List[int]) -> Union[KvCache, DeviceKvCache]:
        """vLLM's KV tensors, used in place, as one sequence whose blocks are ``blocks``."""
        layout = self._tensors.layout(blocks)
        if self._engine is not None:
            return self._engine.wrap(layout, self._tensors.buffers)
        return KvCache.wrap(layout, self._tensors.buffers)

    @staticmethod
    def _stream() -> "torch.cuda.Stream":
        return torch.cuda.current_stream()

    def _region(self, layers: Tuple[int, int], tokens: Tuple[int, int]) -> KvRegion:
        return KvRegion(layers=layers, slots=(0, 1), heads=(0, self._spec.kv_heads), tokens=tokens)

    def _fail_load(self, blocks: List[int], first: int, tokens: int) -> None:
        bs = self._block_size
        self._load_errors.update(blocks[first // bs : -(-tokens // bs)])


def host_staging(spec: KvSpec, block_size: int, tokens: Tuple[int, int]) -> KvLayout:
    """A host layout of one sequence holding tokens ``tokens`` of every layer, in the blocks that
    range spans alone: a chunk is fetched into the region it was saved from, so its tokens keep
    their places, and every block before them is one spare block, never written."""
    first, end = tokens[0] // block_size, -(-tokens[1] // block_size)
    table = [0] * first + list(range(1, end - first + 1))
    return KvLayout.paged(spec, 1, block_size, end - first + 1, "nhd", "token", [table])
