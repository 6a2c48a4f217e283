"""A vLLM request's KV as the sidecar keeps it: one sidecar sequence per request, its token ids
beside it, and the index a scheduler matches new requests against.

Each request the connector saves gets a sequence of its own in the sidecar (microbatch
``id``, slot 0): its KV per layer, token range by token range, from token 0. Beside it, in
microbatch ``id | TOKENS``, the sequence's token ids, as a one-layer, one-head region whose K
holds each token's id (an int32) and whose V is zero. A request whose token ids begin with a
sequence's loads that sequence's KV instead of computing it, for the tokens both hold: the match is
exact, on the ids themselves, not on a hash. Nothing here needs vLLM.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

import numpy as np

from .._dejavu import KvCache, KvLayout, KvRegion, KvSpec, Store, fetch

#: Microbatch bit of a sequence's token ids; a sequence's own KV has it clear.
TOKENS = 1 << 31

#: The token-id log's element: 4 bytes (an int32 id) per token in K, 4 zero bytes in V.
TOKEN_SPEC = KvSpec(layers=1, kv_heads=1, head_dim=2, dtype="float16")


def token_region(start: int, end: int) -> KvRegion:
    """The region of tokens ``start..end`` in a token-id log."""
    return KvRegion(layers=(0, 1), slots=(0, 1), heads=(0, 1), tokens=(start, end))


def token_log(ids: np.ndarray) -> KvCache:
    """A token-id log holding ``ids`` (token ``i``'s id at ``i``)."""
    layout = KvLayout.per_layer(TOKEN_SPEC, slots=1, max_tokens=max(len(ids), 1))
    keys = np.zeros(max(len(ids), 1), dtype=np.int32)
    keys[: len(ids)] = ids
    values = np.zeros_like(keys)
    return KvCache.wrap(layout, [keys, values])


def fresh_id(taken: Iterable[int]) -> int:
    """A sequence id not in ``taken``, drawn at random (engines restarted on the same sidecar do not
    reuse their predecessors' ids)."""
    taken = set(taken)
    while True:
        candidate = int.from_bytes(os.urandom(4), "little") & (TOKENS - 1)
        if candidate not in taken:
            return candidate


@dataclass
class Held:
    """One sequence the sidecar keeps: how many tokens of KV, from token 0, and their ids."""

    kv_tokens: int = 0
    kv_chunks: List[KvRegion] = field(default_factory=list)
    ids: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int32))

    @property
    def tokens(self) -> int:
        """Tokens whose KV and ids are both held."""
        return min(self.kv_tokens, len(self.ids))


@dataclass
class Match:
    """KV a request can load: ``tokens`` tokens of sequence ``sequence``, in ``chunks``."""

    sequence: int
    tokens: int
    chunks: List[KvRegion]


class SequenceIndex:
    """What a sidecar keeps for its stage, read through a reader connection, and the longest match
    of a request's token ids in it."""

    def __init__(self, reader: Store) -> None:
        self._reader = reader
        self.held: Dict[int, Held] = {}

    def refresh(self) -> None:
        """Lists the sidecar's sequences again and fetches the token ids it did not know yet."""
        listing = self._reader.recovery()
        stage = listing["stage"]
        seen: Dict[int, Held] = {}
        logs = {}
        for point in listing["resume"]:
            if point["destination"][0] != stage or tuple(point["slots"]) != (0, 1):
                continue
            microbatch = point["microbatch"]
            sequence = microbatch & ~TOKENS
            held = seen.setdefault(sequence, self.held.get(sequence, Held()))
            if microbatch & TOKENS:
                logs[sequence] = point
            else:
                held.kv_tokens, held.kv_chunks = point["tokens"], list(point["chunks"])
        for sequence, point in logs.items():
            held = seen[sequence]
            if point["tokens"] > len(held.ids):
                held.ids = self._read_ids(point, stage, sequence, held.ids)
        self.held = seen

    def _read_ids(self, point: dict, stage: int, sequence: int, known: np.ndarray) -> np.ndarray:
        log = token_log(np.zeros(point["tokens"], dtype=np.int32))
        for region in point["chunks"]:
            start, end = region.tokens
            if end > len(known):
                fetch(self._reader, log, region, (stage, 0), tuple(point["destination"]), sequence | TOKENS)
        ids = np.frombuffer(log.gather(token_region(0, point["tokens"])), dtype=np.int32)[: point["tokens"]]
        ids = ids.copy()
        ids[: len(known)] = known
        return ids

    def longest(
        self, ids: Sequence[int], limit: Optional[int] = None, leave_out: Iterable[int] = ()
    ) -> Optional[Match]:
        """The sequence holding the KV of the longest prefix of ``ids``, cut to whole chunks that
        end by ``limit`` (default ``len(ids)``), other than those in ``leave_out``; ``None`` if none
        holds even one chunk."""
        ids = np.asarray(ids, dtype=np.int32)
        limit = len(ids) if limit is None else limit
        leave_out = set(leave_out)
        best: Optional[Match] = None
        for sequence, held in self.held.items():
            n = min(held.tokens, len(ids))
            if n == 0 or sequence in leave_out:
                continue
            differ = np.flatnonzero(held.ids[:n] != ids[:n])
            common = int(differ[0]) if len(differ) else n
            chunks, end = whole_chunks(held.kv_chunks, min(common, limit))
            if end > 0 and (best is None or end > best.tokens):
                best = Match(sequence, end, chunks)
        return best


def whole_chunks(chunks: Sequence[KvRegion], limit: int) -> Tuple[List[KvRegion], int]:
    """The chunks that lie wholly before ``limit``, and the token their run from token 0 reaches
    in every layer (a chunk reaching past ``limit`` cannot be scattered into a request that ends
    there). Chunks may cover one layer (a prompt's, saved layer by layer) or several (a decode
    step's)."""
    reached: Dict[int, int] = {layer: 0 for r in chunks for layer in range(*r.layers)}
    kept: List[KvRegion] = []
    for region in sorted(chunks, key=lambda r: (r.tokens[0], r.layers[0])):
        start, end = region.tokens
        layers = range(*region.layers)
        if end > limit or any(start > reached[layer] for layer in layers):
            continue
        for layer in layers:
            reached[layer] = max(reached[layer], end)
        kept.append(region)
    if not reached:
        return [], 0
    end = min(reached.values())
    return [r for r in kept if r.tokens[0] < end], end


class Kept:
    """The finished requests' sequences kept for prefix reuse, at most ``limit``, the latest."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._order: "OrderedDict[int, None]" = OrderedDict()

    def __contains__(self, sequence: int) -> bool:
        return sequence in self._order

    def __iter__(self) -> Iterator[int]:
        return iter(self._order)

    def add(self, sequence: int) -> List[int]:
        """Keeps ``sequence``; returns those to drop: itself when none are kept, else the oldest
        beyond the limit."""
        if self.limit <= 0:
            return [sequence]
        self._order[sequence] = None
        dropped = []
        while len(self._order) > self.limit:
            dropped.append(self._order.popitem(last=False)[0])
        return dropped


class Orphans:
    """Sequences the sidecar holds that no request of this engine owns or keeps: left by an engine
    that died, whose requests may still come back (a router submits them again) and load them.
    Each is given up once it has gone unclaimed for ``grace`` seconds, so that what a crashed
    engine left does not stay in the sidecar for good."""

    def __init__(self, grace: float) -> None:
        self.grace = grace
        self._since: Dict[int, float] = {}

    def expired(self, held: Iterable[int], claimed: Iterable[int], now: float) -> List[int]:
        """Of the sequences ``held``, those not ``claimed`` (owned, kept or being released) since
        ``grace`` seconds before ``now``, which are forgotten as they are returned."""
        held, claimed = set(held), set(claimed)
        for sequence in [s for s in self._since if s not in held or s in claimed]:
            del self._since[sequence]
        expired = []
        for sequence in sorted(held - claimed):
            if now - self._since.setdefault(sequence, now) >= self.grace:
                expired.append(sequence)
                del self._since[sequence]
        return expired
