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

from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Dict, List, Optional, Tuple

import numpy as np
import torch
from vllm.logger import init_logger

from .._dejavu import Completion, Error, KvCache, KvLayout, KvRegion, KvSpec, Store, Streamer, fetch
from .config import ConnectorConfig
from .plan import DejaVuMetadata, LoadJob, SaveJob
from .sequences import TOKENS, token_log, token_region

# Under vLLM's own logger, so that its messages show as vLLM's do.
logger = init_logger(f"vllm.{__name__}")

DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}


class WorkerSide:
    """A worker's half of the connector, the engine member of its sidecar."""

    def __init__(self, config: ConnectorConfig, block_size: int) -> None:
        self._config = config
        self._block_size = block_size
        self._layers: Dict[str, int] = {}
        self._buffers: List[torch.Tensor] = []
        self._spec: Optional[KvSpec] = None
        self._num_blocks = 0
        self._k_chunk = 0
        self._store: Optional[Store] = None
        self._streamer: Optional[Streamer] = None
        self._worker = (0, 0)
        # The step's saves, each with a view of its request's blocks.
        self._views: List[Tuple[SaveJob, KvCache]] = []
        # Completions of the step's saves, with what they read (kept alive until waited for), and
        # the sequences to release once they are in.
        self._pending: List[Tuple[Completion, object]] = []
        self._previous: Tuple[List[Tuple[Completion, object]], List[int]] = ([], [])
        # Finished requests whose blocks wait for their last saves.
        self._finishing: set = set()
        self._load_errors: set = set()
        # Loads run here, so that a step waits for one at most ``load_timeout``.
        self._loader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dejavu-load")

    def register(self, kv_caches: Dict[str, torch.Tensor]) -> None:
        """Wraps vLLM's per-layer KV tensors (its CPU backend's ``[num_blocks][H][block_size][2 * D]``:
        per block and head, K then V, K in the order its kernels chose) and joins the sidecar as
        the stage's engine."""
        names = list(kv_caches)
        tensors = [kv_caches[name] for name in names]
        first = tensors[0]
        if first.device.type != "cpu" or first.dim() != 4:
            raise NotImplementedError(
                f"DejaVuConnector supports vLLM's CPU attention backend; got {first.device.type} "
                f"KV tensors of shape {tuple(first.shape)}"
            )
        num_blocks, heads, block_size, twice_dim = first.shape
        if block_size != self._block_size or first.dtype not in DTYPES:
            raise NotImplementedError(f"DejaVuConnector: KV tensors {tuple(first.shape)} of {first.dtype}")
        self._spec = KvSpec(layers=len(names), kv_heads=heads, head_dim=twice_dim // 2, dtype=DTYPES[first.dtype])
        self._layers = {name: i for i, name in enumerate(names)}
        self._buffers = tensors
        self._num_blocks = num_blocks
        self._k_chunk = cpu_k_chunk(first.dtype, block_size, heads, twice_dim // 2)
        if self._k_chunk is None:
            logger.error("DejaVu: vLLM's CPU kernels keep K in an order not known here: serving without copies")
            return
        try:
            self._store = Store.sidecar(self._config.sidecar, self._config.successor, epoch=None, member=True)
            self._streamer = Streamer(self._store)
            self._worker = (self._store.serving()["stage"], 0)
        except Error as e:
            self._store = None
            logger.error("DejaVu: no sidecar at %s (%s): serving without copies", self._config.sidecar, e)
            return
        logger.info(
            "DejaVu: %d layers of %d blocks joined the sidecar at %s as stage %d, epoch %d",
            len(names), num_blocks, self._config.sidecar, self._worker[0], self._store.epoch(),
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
            fetching = self._loader.submit(self._fetch, cache, job)
            try:
                fetching.result(timeout=self._config.load_timeout)
            except FutureTimeout:
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

    def _fetch(self, cache: KvCache, job: LoadJob) -> None:
        for layers, tokens in job.chunks:
            fetch(self._store, cache, self._region(layers, tokens), self._worker, self._worker, job.sequence)

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
            completion = self._streamer.region_ready(cache, region, self._worker, self._worker, job.sequence)
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

    def _view(self, blocks: List[int]) -> KvCache:
        """vLLM's KV tensors, used in place, as one sequence whose blocks are ``blocks``."""
        layout = KvLayout.paged(
            self._spec,
            1,
            self._block_size,
            self._num_blocks,
            order="hnd",
            interleaved="head",
            block_tables=[blocks],
            k_chunk=self._k_chunk,
        )
        return KvCache.wrap(layout, self._buffers)

    def _region(self, layers: Tuple[int, int], tokens: Tuple[int, int]) -> KvRegion:
        return KvRegion(layers=layers, slots=(0, 1), heads=(0, self._spec.kv_heads), tokens=tokens)

    def _fail_load(self, blocks: List[int], first: int, tokens: int) -> None:
        bs = self._block_size
        self._load_errors.update(blocks[first // bs : -(-tokens // bs)])


def cpu_k_chunk(dtype: torch.dtype, block_size: int, heads: int, head_dim: int) -> Optional[int]:
    """How vLLM's CPU attention kernels lay out a token's K in a block, found by having them write
    one: the elements of its vector they keep together (``k_chunk`` of the library's per-head paged
    layout; 1 for the portable kernels, which keep K transposed). ``None`` if no such layout
    holds what they wrote, V included."""
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    isa = _get_attn_isa(dtype, block_size, head_dim)
    block = torch.zeros(1, heads, block_size, 2 * head_dim, dtype=dtype)
    keys, values = block.view(1, heads, 2 * block_size, head_dim).chunk(2, dim=2)
    key = (torch.arange(heads * head_dim) % 251 + 1).reshape(1, heads, head_dim).to(dtype)
    token = 1
    ops.cpu_attn_reshape_and_cache(key, -key, keys, values, torch.tensor([token]), isa)
    written = torch.cat([key.flatten(), -key.flatten()]).view(torch.uint8).numpy().tobytes()
    spec = KvSpec(layers=1, kv_heads=heads, head_dim=head_dim, dtype=DTYPES[dtype])
    region = KvRegion(layers=(0, 1), slots=(0, 1), heads=(0, heads), tokens=(token, token + 1))
    for k_chunk in (d for d in range(1, head_dim + 1) if head_dim % d == 0):
        layout = KvLayout.paged(spec, 1, block_size, 1, "hnd", "head", [[0]], k_chunk=k_chunk)
        if bytes(KvCache.wrap(layout, [block]).gather(region)) == written:
            return k_chunk
    return None
