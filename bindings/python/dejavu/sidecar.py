"""The engine's client of its sidecar: the ``dejavud sidecar`` (alias ``worker``) process beside
an engine worker."""

from __future__ import annotations

from os import PathLike
from typing import Dict, Optional, Tuple, Union

from ._dejavu import KvCache, KvRegion, Store, flush

Span = Union[range, Tuple[int, int], int]


class SidecarClient:
    """An engine worker's connection to its sidecar at the local socket ``socket``.

    The engine registers its KV caches (used in place, one per microbatch) and reports each
    step complete; the step's KV crosses shared memory in one chunk, and the sidecar keeps it and
    forwards it to the ring successor's sidecar at ``successor`` ("host:port": the next stage's,
    the last stage's being the first's) before ``step_done`` returns. ``"none"`` keeps the local
    copy only, which survives the engine but not its worker (a ring of one stage has no other
    sidecar); naming the engine's own sidecar is refused (``dejavu.Error``). After a restart (a newer ``epoch``: the older engine is cut off),
    ``restore`` follows the sidecar's recovery instructions: it fetches the KV the sidecar keeps
    into the registered caches and says where each sequence resumes.

    ``stage`` and ``rank`` name the worker; by default the stage is the one the sidecar serves
    (a spare's engine learns the stage it was assigned).

    Without an ``epoch``, the sidecar gives the engine one (``client.epoch``): the stage's first
    engine's, or, for a replacement, the epoch the controller fenced its predecessor in.

    The engine is a member of the cluster through its sidecar: while this client is connected,
    the sidecar reports the engine alive to the controller (when it has one), and the engine's
    death closes the connection, which the controller sees at once. ``member=False`` leaves the
    engine's liveness to the engine itself.
    """

    def __init__(
        self,
        socket: Union[str, PathLike],
        successor: str,
        epoch: Optional[int] = None,
        stage: Optional[int] = None,
        rank: int = 0,
        member: bool = True,
    ) -> None:
        self.store = Store.sidecar(socket, successor, epoch, member)
        #: The engine's epoch: the one given, or, by default, the one its sidecar gave it (a
        #: replacement's is the epoch the controller fenced the stage's engine in).
        self.epoch = self.store.epoch()
        if stage is None:
            stage = self.store.serving()["stage"]
        self.worker = (stage, rank)
        self._caches: Dict[int, Tuple[KvCache, Span, Span]] = {}

    def register(
        self, cache: KvCache, microbatch: int = 0, layers: Optional[Span] = None, heads: Optional[Span] = None
    ) -> None:
        """Registers ``cache`` as ``microbatch``'s KV; ``step_done`` and ``restore`` move its
        ``layers`` and ``heads`` (ranges; all of the cache's by default)."""
        spec = cache.layout.spec
        layers = range(spec.layers) if layers is None else layers
        heads = range(spec.kv_heads) if heads is None else heads
        self._caches[microbatch] = (cache, layers, heads)

    def step_done(self, microbatch: int, slots: Span, tokens: Span) -> int:
        """Reports the KV of ``tokens`` (a range: a prompt, or one decode step) of the sequences in
        ``slots`` of ``microbatch`` computed: once this returns, the sidecar keeps it and its
        successor holds a replica. Returns the bytes sent."""
        cache, layers, heads = self._registered(microbatch)
        region = KvRegion(layers=layers, slots=slots, heads=heads, tokens=tokens)
        return flush(self.store, cache, region, self.worker, self.worker, microbatch)

    def release(self, microbatch: int, slots: Span) -> int:
        """Reports the sequences in ``slots`` of ``microbatch`` finished: the sidecar drops their
        KV, and its successor the replica, so that a sidecar holds only sequences still running.
        Returns the chunks the sidecar dropped; releasing again drops nothing."""
        return self.store.release(self.worker, microbatch, slots)

    def recovery(self) -> dict:
        """The sidecar's recovery instructions, as ``Store.recovery`` returns them."""
        return self.store.recovery()

    def restore(self) -> Dict[Tuple[int, Tuple[int, int]], int]:
        """Fetches every sequence's KV the sidecar keeps for this worker into the registered
        caches (up to the first gap) and returns ``{(microbatch, (slot_start, slot_end)): tokens}``:
        the next token each sequence computes. Microbatches not registered are left out."""
        caches = {microbatch: cache for microbatch, (cache, _, _) in self._caches.items()}
        return {
            (point["microbatch"], tuple(point["slots"])): point["tokens"]
            for point in self.store.restore(self.worker, caches)
            if point["fetched"]
        }

    def _registered(self, microbatch: int) -> Tuple[KvCache, Span, Span]:
        try:
            return self._caches[microbatch]
        except KeyError:
            raise ValueError(f"no KV cache registered for microbatch {microbatch}") from None
