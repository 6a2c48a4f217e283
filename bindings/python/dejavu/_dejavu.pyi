"""Type stubs of the native module ``dejavu._dejavu`` (re-exported by ``dejavu``)."""

from os import PathLike
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

RangeLike = Union[range, Tuple[int, int], int]
Worker = Tuple[int, int]
Buffer = Any  # numpy array, DLPack tensor in host memory, CPU torch tensor, bytearray (or bytes where only read)

class Error(Exception):
    """Base class of the errors dejavu raises."""

class LayoutError(Error):
    """A layout, region or cache buffer does not fit."""

class StoreError(Error):
    """Flush or fetch failed (I/O, disk full)."""

class CorruptChunkError(StoreError):
    """A chunk failed verification (truncated, corrupted, not the one expected)."""

class NotFoundError(StoreError):
    """No chunk under the key asked for."""

class CudaError(Error):
    """No CUDA driver, NVRTC or device, or a CUDA call failed."""

class ControllerError(Error):
    """The controller cannot be reached, refused the cluster secret, or refused the request."""

class KvSpec:
    """The shape of a model's KV cache."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, dtype: str = "float16") -> None:
        """``dtype``: "float32", "float16", "bfloat16", "float8_e4m3" or "int8"."""
    @property
    def layers(self) -> int: ...
    @property
    def kv_heads(self) -> int: ...
    @property
    def head_dim(self) -> int: ...
    @property
    def bytes_per_token(self) -> int:
        """Bytes of K and V one token takes across all layers and heads."""

class KvLayout:
    """Where every KV element of a cache lives."""

    @staticmethod
    def faster_transformer(spec: KvSpec, slots: int, max_tokens: int) -> "KvLayout":
        """K ``[L][B][H][D/x][S][x]`` (x = 16 bytes of elements), V ``[L][B][H][S][D]``; 2 buffers."""
    @staticmethod
    def per_layer(spec: KvSpec, slots: int, max_tokens: int, order: str = "bhsd") -> "KvLayout":
        """One K and one V tensor per layer, ``[B][H][S][D]`` or ``[B][S][H][D]`` ("bshd")."""
    @staticmethod
    def paged(
        spec: KvSpec,
        slots: int,
        block_size: int,
        num_blocks: int,
        order: str = "nhd",
        interleaved: Union[bool, str] = False,
        block_tables: Optional[List[List[int]]] = None,
        k_chunk: Optional[int] = None,
    ) -> "KvLayout":
        """vLLM-style paged blocks per layer; ``block_tables[slot]`` lists a sequence's blocks.
        K and V separate (``interleaved=False``: buffers ``2l`` and ``2l + 1``), interleaved per
        block (``True`` or ``"block"``: ``[num_blocks][2][block]``) or per head (``"head"``,
        vLLM's CPU backend; ``order="hnd"`` only): per block and head, K as
        ``[D / k_chunk][block_size][k_chunk]`` (``k_chunk`` elements of a token's K together;
        whole rows by default), then V as ``[block_size][D]``; or per token (``"token"``, vLLM's
        unified cache on its GPU backends: each token's K vector of a head, then its V vector,
        per block ``[block_size][H][2][D]`` with ``order="nhd"``, ``[H][block_size][2][D]`` with
        ``"hnd"``)."""
    @property
    def buffer_sizes(self) -> List[int]:
        """Bytes of each buffer a cache of this layout has, in order."""
    @property
    def spec(self) -> KvSpec: ...
    @property
    def slots(self) -> int: ...
    @property
    def max_tokens(self) -> int: ...

class KvRegion:
    """Layers x slots x heads x tokens of a cache (half-open ranges)."""

    def __init__(self, layers: RangeLike, slots: RangeLike, heads: RangeLike, tokens: RangeLike) -> None: ...
    @property
    def layers(self) -> Tuple[int, int]: ...
    @property
    def slots(self) -> Tuple[int, int]: ...
    @property
    def heads(self) -> Tuple[int, int]: ...
    @property
    def tokens(self) -> Tuple[int, int]: ...

class KvCache:
    """A KV cache over library memory, or over the engine's own arrays (``KvCache.wrap``)."""

    def __init__(self, layout: KvLayout) -> None:
        """Zeroed memory allocated by the library."""
    @staticmethod
    def wrap(layout: KvLayout, buffers: Sequence[Buffer]) -> "KvCache":
        """The engine's buffers (one per ``layout.buffer_sizes`` entry, contiguous, writable, at
        least as large), used in place. Do not resize or free them while the cache lives."""
    @property
    def layout(self) -> KvLayout: ...
    def packed_len(self, region: KvRegion) -> int:
        """Bytes a gather of ``region`` produces."""
    def gather(self, region: KvRegion, out: Optional[Buffer] = None) -> Buffer:
        """Gathers ``region`` into ``out`` (exactly ``packed_len`` bytes) or a new bytearray."""
    def scatter(self, region: KvRegion, data: Buffer) -> None:
        """Scatters ``data`` (as ``gather`` packs it) into ``region``."""

class CudaEngine:
    """A GPU: the library's copy kernels compiled for it (NVRTC) and its copy stream."""

    def __init__(self, device: int = 0) -> None:
        """Raises ``CudaError`` where there is no CUDA driver, no NVRTC or no such device."""
    def wrap(self, layout: KvLayout, tensors: Sequence[Any]) -> "DeviceKvCache":
        """The engine's GPU tensors (``__cuda_array_interface__``: CUDA torch tensors, CuPy
        arrays; one per ``layout.buffer_sizes`` entry, C-contiguous, exactly that size, memory of
        this device), used in place. Do not free them while the cache lives."""
    def alloc(self, layout: KvLayout) -> "DeviceKvCache":
        """A cache in zeroed GPU memory the library allocates."""

StreamLike = Any
"""A raw ``CUstream`` (an int) or an object with ``.cuda_stream`` (``torch.cuda.current_stream()``)."""

class DeviceKvCache:
    """A KV cache in GPU memory (``CudaEngine.wrap`` or ``CudaEngine.alloc``)."""

    @property
    def layout(self) -> KvLayout: ...
    def packed_len(self, region: KvRegion) -> int:
        """Bytes a gather of ``region`` produces."""
    def gather(
        self, region: KvRegion, out: Optional[Buffer] = None, stream: Optional[StreamLike] = None
    ) -> Union[Buffer, "PinnedBuffer"]:
        """Gathers ``region`` into host ``out`` (exactly ``packed_len`` bytes) or, without one, into
        a ``PinnedBuffer`` from the engine's pool, after the work queued on ``stream`` (default:
        the legacy default stream). Kernels and copies run in pieces of whole layers on two
        streams, each piece's kernel overlapping the copy of another: into pinned memory (a
        pinned torch tensor, a ``PinnedBuffer``) a prompt moves at the speed of one plain copy, a
        decode step somewhat slower (its kernel is not all hidden)."""
    def scatter(self, region: KvRegion, data: Buffer, stream: Optional[StreamLike] = None) -> None:
        """Host ``data`` (as ``gather`` packs it) up and scattered into ``region``, in pieces as
        ``gather``, after the work queued on ``stream``; returns once it is in place."""

class PinnedBuffer:
    """Page-locked host memory from a ``CudaEngine``'s pool (what ``DeviceKvCache.gather`` returns
    without ``out``). ``numpy.asarray(buf)`` is a writable ``uint8`` view of it, no copy (and
    ``torch.from_numpy`` of that view too); ``bytes(buf)`` copies it. The memory goes back to the
    pool once nothing holds it."""

    def __len__(self) -> int: ...
    def __bytes__(self) -> bytes: ...
    @property
    def __array_interface__(self) -> dict: ...

class RecoveryFeed:
    """What whoever feeds a pipeline (it alone holds the requests' tokens) watches: the recoveries
    the controller at ``controller`` ("host:port", its ``--listen``) carries out itself (a
    controller started with ``--stages``), each with where every sequence resumes. Several
    controllers on etcd are named comma-separated ("10.0.0.1:7400,10.0.0.2:7400"): the feed
    follows whichever leads, trying the others in turn when the one that answered last cannot be
    reached. ``secret`` is the cluster's (``--secret-file``; by default the one of a cluster
    started without one).

    A feeder keeps the epoch of the last recovery it handled, waits for the next one, feeds every
    sequence of it again from its resume token on (through the whole pipeline, as the first
    time), and acknowledges it::

        feed = dejavu.RecoveryFeed("10.0.0.1:7400", secret)
        handled = 0
        while True:
            recovery = feed.watch(handled, timeout=5.0)
            if recovery is None:
                continue
            for (microbatch, slots), token in recovery["resume"].items():
                ...  # feed these sequences again from `token`
            feed.acknowledge(recovery["epoch"])
            handled = recovery["epoch"]
    """

    def __init__(self, controller: str, secret: Optional[Union[str, bytes]] = None) -> None: ...
    def watch(self, after: int = 0, timeout: float = 5.0) -> Optional[dict]:
        """The recovery of the first epoch after ``after`` in which the controller fenced a stage,
        once every stage it fenced has its replacement in place (a new engine joined the stage's
        sidecar; a replaced sidecar was restored), or ``None`` if none is ready within
        ``timeout`` seconds (10 at most per call). A dict: ``epoch``; ``resume``, mapping
        ``(microbatch, (first slot, end slot))`` to the first token to feed again (a sequence
        not in it starts again from its first token); ``stages``, one dict per failed stage
        (``stage``, ``loss``: "engine" or "worker", ``source``: where it restores from, "own",
        "successor" or "lost", ``restored_from``: that sidecar's stage or ``None``, ``marks``: as
        ``resume``, for that stage alone). ``ControllerError`` if the controller cannot be
        reached or carries out no recoveries."""
    def acknowledge(self, epoch: int) -> None:
        """Tells the controller that every sequence of the recovery of ``epoch`` was fed again
        (``dejavu_controller_recoveries_acknowledged_total`` counts them)."""

class Store:
    """Where chunks go: a file directory, host memory, a remote peer or the local sidecar."""

    @staticmethod
    def file(path: Union[str, PathLike]) -> "Store": ...
    @staticmethod
    def host() -> "Store": ...
    @staticmethod
    def peer(address: str, secret: bytes, node: int = 0, epoch: int = 0) -> "Store":
        """Chunks on a ``PeerServer`` at "host:port", over TCP with the cluster's HMAC handshake."""
    @staticmethod
    def sidecar(
        path: Union[str, PathLike], successor: str, epoch: Optional[int] = 0, member: bool = False
    ) -> "Store":
        """The engine's own ``dejavud sidecar`` at its local socket ``path``: chunks cross shared
        memory; the sidecar keeps them and forwards them to the sidecar at ``successor``
        ("host:port"). A newer ``epoch`` takes the sidecar over; an older one is refused."""
    @staticmethod
    def sidecar_reader(path: Union[str, PathLike]) -> "Store":
        """A reader of the sidecar at its local socket ``path``, beside the engine's own
        connection: ``recovery()`` lists what the sidecar keeps for its stage and ``fetch`` reads
        it; anything else is refused. For a scheduler in another process than its engine's
        workers (vLLM's)."""
    def epoch(self) -> int:
        """The engine's epoch on its sidecar connection (sidecar stores only): the one given, or,
        with ``epoch=None``, the one the sidecar gave it."""
    def serving(self) -> dict:
        """What the sidecar serves as (sidecar stores only; ``TypeError`` otherwise): ``stage``,
        ``epoch`` and ``successor`` (or None); an error from a spare not assigned yet."""
    def recovery(self) -> dict:
        """What the sidecar tells a (re)started engine (sidecar stores only; ``TypeError``
        otherwise): ``stage``, ``epoch``, ``successor`` (or None), ``chunks`` (how many of the
        stage's own it keeps) and ``resume``, one dict per sequence with ``destination``,
        ``microbatch``, ``slots``, ``layers``, ``heads``, ``tokens`` (KV held for tokens
        ``0..tokens``: compute from there) and ``chunks`` (the ``KvRegion``s to ``fetch``)."""
    def restore(self, worker: Tuple[int, int], caches: Dict[int, KvCache]) -> List[dict]:
        """What a restarted engine does first (sidecar stores only): fetches each sequence of
        ``worker`` the sidecar keeps into ``caches[microbatch]`` (a microbatch not in it is listed,
        not fetched) through shared memory; returns one dict per sequence, as ``recovery()``'s
        ``resume`` lists them, with ``fetched``."""
    def release(self, worker: Tuple[int, int], microbatch: int, slots: Union[range, Tuple[int, int]]) -> int:
        """Releases the finished sequence in ``slots`` of ``microbatch`` for ``worker``: drops
        every chunk of it (a sidecar store also has its successor drop the replica). Returns the
        chunks this store dropped; releasing again drops nothing. File stores raise
        ``StoreError``."""

class PeerServer:
    """A peer that keeps chunks flushed to it, serving clients that know the cluster secret."""

    def __init__(self, secret: bytes, bind: str = "127.0.0.1:0", node: int = 0) -> None: ...
    @property
    def address(self) -> str: ...
    @property
    def chunks(self) -> int: ...
    def set_epoch(self, epoch: int) -> None:
        """Refuses requests from older epochs from now on."""
    def close(self) -> None: ...

class Setup:
    """A pipeline: KV spec, stages ``[(layers, tp), ...]``, slots per microbatch, microbatches."""

    def __init__(self, spec: KvSpec, stages: Sequence[Tuple[RangeLike, int]], microbatch_slots: int, microbatches: int) -> None: ...
    def workers(self) -> List[Worker]: ...
    def local_spec(self, worker: Worker) -> KvSpec:
        """The spec of the layers and heads ``worker`` holds, to build its caches with."""
    def holding(self, worker: Worker) -> dict:
        """``{"layers": (a, b), "heads": (a, b), "primary": bool}`` in global coordinates."""

class Completion:
    """One job handed to a ``Streamer``."""

    def wait(self, timeout: Optional[float] = None) -> dict:
        """Waits (GIL released) for the job; ``{"bytes", "copy_seconds", "io_seconds"}``, or raises its
        error; ``TimeoutError`` after ``timeout`` seconds (the job goes on)."""

class Streamer:
    """A background thread that gathers and flushes KV regions while the engine computes."""

    def __init__(self, store: Store, queue_depth: int = 64, cpus: Optional[str] = None, puts_in_flight: int = 1) -> None:
        """``cpus`` (such as ``"4-7"``) puts the thread on those CPUs, away from the engine's compute.
        With a sidecar store, ``puts_in_flight`` puts cross to the successor while the next chunk
        is gathered (0: each awaited); a completion still comes only once its chunk is replicated."""
    def layer_ready(self, a: Setup, source: Worker, b: Setup, cache: KvCache, microbatch: int, layer: int, tokens: RangeLike) -> List[Completion]:
        """Local ``layer`` of ``microbatch`` is written: queue its part of every transfer toward ``b``."""
    def device_layer_ready(self, a: Setup, source: Worker, b: Setup, cache: DeviceKvCache, stream: StreamLike, microbatch: int, layer: int, tokens: RangeLike) -> List[Completion]:
        """The engine has just queued the kernels writing local ``layer`` of ``microbatch`` of the
        GPU ``cache`` on ``stream``: marks that point (no waiting) and queues the layer's part of
        every transfer toward ``b``; each copy waits on the GPU for the mark."""
    def region_ready(self, cache: KvCache, region: KvRegion, source: Worker = (0, 0), destination: Worker = (0, 0), microbatch: int = 0) -> Completion:
        """``region`` of ``cache`` is written: queues it as the one chunk ``flush`` would write (a
        sidecar store keeps it and forwards it). Keep ``region`` unchanged until the completion
        is waited for."""
    def device_region_ready(self, cache: DeviceKvCache, stream: StreamLike, region: KvRegion, source: Worker = (0, 0), destination: Worker = (0, 0), microbatch: int = 0) -> Completion:
        """The GPU path of ``region_ready``: the kernels writing ``region`` are queued on ``stream``;
        marks that point (no waiting) and queues the chunk, whose copies wait on the GPU for it."""
    def shutdown(self, cancel: bool = False) -> dict:
        """Runs (or cancels) queued jobs, stops the thread; ``{"completed", "failed", "cancelled", "bytes"}``."""

def flush(store: Store, cache: KvCache, region: KvRegion, source: Worker = (0, 0), destination: Worker = (0, 0), microbatch: int = 0) -> int:
    """Flushes ``region`` as one checksummed chunk; returns the bytes flushed."""

def fetch(store: Store, cache: KvCache, region: KvRegion, source: Worker = (0, 0), destination: Worker = (0, 0), microbatch: int = 0, keep_in: Optional[Store] = None) -> int:
    """Fetches and verifies the chunk ``flush`` wrote, scatters it into ``region``. With ``keep_in``,
    a sidecar store, that sidecar keeps the chunk as the engine's own and forwards it nowhere (KV
    restored from a peer's replica becomes the local copy again)."""

def fetch_chunks(store: Store, cache: KvCache, regions: Sequence[KvRegion], source: Worker = (0, 0), destination: Worker = (0, 0), microbatch: int = 0, keep_in: Optional[Store] = None) -> dict:
    """Fetches the chunk ``flush`` wrote for each of ``regions`` in turn into ``cache``, until one is
    not there; from a peer store up to 64 fetches in flight together. With ``keep_in``, a sidecar
    store, that sidecar keeps them as the engine's own, many per request. Returns ``{"fetched":
    regions restored (a prefix), "bytes": their payload bytes, "error": why it stopped early if
    not for a missing chunk, or None}``."""

def stream_out(a: Setup, source: Worker, b: Setup, caches: Sequence[KvCache], tokens: RangeLike, store: Store) -> dict:
    """Streams ``tokens`` of worker ``source`` of setup ``a`` toward the workers of setup ``b``."""

def stream_in(a: Setup, b: Setup, destination: Worker, caches: Sequence[KvCache], tokens: RangeLike, store: Store) -> dict:
    """Receives into worker ``destination`` of setup ``b`` what ``stream_out`` sent it."""
