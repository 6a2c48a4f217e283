"""DéjàVu KV-cache streaming for fault-tolerant LLM serving.

Layouts of the KV caches engines use, buffered gather/scatter (many small KV pieces into one
staging buffer), flush/fetch of checksummed chunks to files or host memory, and resharding between
pipeline setups (``stream_out`` / ``stream_in``), and the client of the engine's sidecar
(``SidecarClient``: step completion, recovery after a restart). Arrays and tensors are used in place: numpy
arrays, CPU torch tensors, bytearrays; on a GPU, CUDA torch tensors through ``CudaEngine.wrap``, gathered
and scattered by the library's kernels and streamed by ``Streamer.device_layer_ready`` after the
engine's stream writes them. Copies and I/O release the GIL.

Example::

    import numpy as np, dejavu
    spec = dejavu.KvSpec(layers=4, kv_heads=2, head_dim=64, dtype="float16")
    layout = dejavu.KvLayout.per_layer(spec, slots=2, max_tokens=128)
    tensors = [np.zeros(n // 2, dtype=np.float16) for n in layout.buffer_sizes]
    cache = dejavu.KvCache.wrap(layout, tensors)          # the engine's own memory
    step = dejavu.KvRegion(layers=range(4), slots=range(2), heads=range(2), tokens=range(7, 8))
    staged = cache.gather(step)                            # one contiguous buffer
"""

from ._dejavu import (
    Completion,
    ControllerError,
    CorruptChunkError,
    CudaEngine,
    CudaError,
    DeviceKvCache,
    Error,
    KvCache,
    KvLayout,
    KvRegion,
    KvSpec,
    LayoutError,
    NotFoundError,
    PeerServer,
    PinnedBuffer,
    RecoveryFeed,
    Setup,
    Store,
    StoreError,
    Streamer,
    fetch,
    fetch_chunks,
    flush,
    stream_in,
    stream_out,
)
from .sidecar import SidecarClient


def FileStore(path):
    """A directory of chunk files (created if needed); same as ``Store.file(path)``."""
    return Store.file(path)


def HostStore():
    """Chunks kept in this process's memory; same as ``Store.host()``."""
    return Store.host()


__all__ = [
    "Completion",
    "ControllerError",
    "CorruptChunkError",
    "CudaEngine",
    "CudaError",
    "DeviceKvCache",
    "Error",
    "FileStore",
    "HostStore",
    "KvCache",
    "KvLayout",
    "KvRegion",
    "KvSpec",
    "LayoutError",
    "NotFoundError",
    "PeerServer",
    "PinnedBuffer",
    "RecoveryFeed",
    "Setup",
    "SidecarClient",
    "Store",
    "StoreError",
    "Streamer",
    "fetch",
    "fetch_chunks",
    "flush",
    "stream_in",
    "stream_out",
]
