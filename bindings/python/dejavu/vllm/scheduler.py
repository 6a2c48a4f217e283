"""The connector's scheduler side: which of a new request's tokens the sidecar holds, and each
step's plan of loads, saves and releases for the workers.

Every request saves into a sidecar sequence of its own, from token 0: a request that loaded a
prefix saves that prefix again into its own sequence in its first step, so that each sequence
stands alone whatever happens to the one it loaded from. A prompt is saved in pieces that end on
vLLM's block boundaries, so that a later request sharing only part of it still loads whole
pieces; a decode step saves its one token.

A sequence no request of this engine owns or keeps, left by an engine that died, stays for its
request to come back and load it, for ``orphan_seconds``; then it is dropped. The sidecar is
looked over for such sequences every quarter of that time (at most every minute).

Listing what the sidecar keeps costs time in proportion to its chunks (a decode step adds two
per request), and the scheduler waits for it. It lists at most once per scheduling pass, and no
sooner after the last listing than ten times what that one took (``ListingPace``): with many
sequences held, listing takes a tenth of the scheduler's time at most. A request matched
against a listing a little old misses at most the tokens saved since, which vLLM computes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Dict, List, Optional, Set

from vllm.logger import init_logger

from .._dejavu import Error, Store
from .config import ConnectorConfig
from .plan import DejaVuMetadata, LoadJob, SaveJob
from .sequences import Kept, Match, Orphans, SequenceIndex, fresh_id

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

# Under vLLM's own logger, so that its messages show as vLLM's do.
logger = init_logger(f"vllm.{__name__}")

#: Scheduling passes after the one that releases a sequence by which its workers dropped it: they
#: drop it at the end of the step after that pass's (once that step's saves are in), and with
#: vLLM's asynchronous scheduling a pass is planned while the step before it runs.
RELEASE_LAG = 3


class ListingPace:
    """When the scheduler lists the sidecar again: no sooner after the end of the last listing
    than ``1 / share`` times what it took, so that listing takes at most ``share`` of the time."""

    def __init__(self, share: float = 0.1) -> None:
        self.share = share
        self._next: Optional[float] = None

    def due(self, now: float) -> bool:
        """Whether a listing may start at ``now``."""
        return self._next is None or now >= self._next

    def listed(self, started: float, ended: float) -> None:
        """A listing ran from ``started`` to ``ended``."""
        self._next = ended + (ended - started) / self.share


@dataclass
class Plan:
    """A request's sidecar sequence, whether and how far it is saved, and the load it was
    granted."""

    sequence: int
    save: bool = True
    saved: int = 0
    blocks: Optional[List[int]] = None
    load: Optional[Match] = None
    first: int = 0


class SchedulerSide:
    """The scheduler's half of the connector, reading the sidecar through a reader connection."""

    def __init__(
        self, config: ConnectorConfig, block_size: int, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._config = config
        self._clock = clock
        self._orphans = Orphans(config.orphan_seconds)
        self._sweep_every = min(60.0, config.orphan_seconds / 4)
        self._next_sweep = clock()
        self._block_size = block_size
        self._requests: Dict[str, "Request"] = {}
        self._plans: Dict[str, Plan] = {}
        self._releases: List[int] = []
        # Sequences released, with the scheduling pass that sent the release: not matched until a
        # listing taken once their workers dropped them (RELEASE_LAG passes on).
        self._gone: Dict[int, int] = {}
        self._passes = 0
        self._kept = Kept(config.keep_finished)
        self._index: Optional[SequenceIndex] = None
        # Whether the index was listed since the last step was planned: what the sidecar keeps
        # changes only as steps run, so one listing serves every request scheduled in between.
        self._listed = False
        self._pace = ListingPace()
        try:
            self._index = SequenceIndex(Store.sidecar_reader(config.sidecar))
        except Error as e:
            logger.error("DejaVu: no sidecar at %s (%s): serving without its copies", config.sidecar, e)

    def matched(self, request: "Request", computed: int) -> int:
        """Tokens after ``computed`` whose KV the request loads from the sidecar instead of
        computing them: the longest prefix of its token ids a sequence holds, in whole chunks,
        short of its last token (vLLM computes that one for the next token's logits)."""
        self._requests[request.request_id] = request
        plan = self._plan(request.request_id)
        plan.save = wants_copies(request)
        plan.load = None
        if self._index is None:
            return 0
        try:
            if not self._listed and self._pace.due(self._clock()):
                self._list()
                self._listed = True
        except Error as e:
            logger.error("DejaVu: the sidecar cannot be read (%s): request %s computes its prompt", e, request.request_id)
            return 0
        match = self._index.longest(
            list(request.all_token_ids), limit=request.num_tokens - 1, leave_out=self._leaving()
        )
        if match is None or match.tokens <= computed:
            return 0
        # A chunk across `computed` would overwrite blocks vLLM's own prefix cache shares.
        if any(c.tokens[0] < computed < c.tokens[1] for c in match.chunks):
            return 0
        plan.load, plan.first = match, computed
        return match.tokens - computed

    def allocated(self, request: "Request", external: int) -> None:
        """vLLM allocated blocks for ``external`` loaded tokens (0: it loads none)."""
        if external == 0:
            self._plan(request.request_id).load = None

    def build(self, output: "SchedulerOutput") -> DejaVuMetadata:
        """This step's loads, saves and releases."""
        self._passes += 1
        self._sweep()
        meta = DejaVuMetadata(releases=self._releases, preempted=bool(output.preempted_req_ids))
        self._releases = []
        self._listed = False
        for new in output.scheduled_new_reqs:
            plan = self._plan(new.req_id)
            plan.blocks = list(new.block_ids[0])
            self._load(meta, new.req_id, plan)
            self._save(meta, new.req_id, plan, new.num_computed_tokens + output.num_scheduled_tokens[new.req_id])
        cached = output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            plan = self._plans.get(req_id)
            if plan is None:
                continue
            blocks = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids and blocks is not None:
                plan.blocks = list(blocks[0])  # preempted: a new block table
            elif blocks is not None:
                plan.blocks.extend(blocks[0])
            self._load(meta, req_id, plan)
            self._save(meta, req_id, plan, cached.num_computed_tokens[i] + output.num_scheduled_tokens[req_id])
        self._gone.update((sequence, self._passes) for sequence in meta.releases)
        return meta

    def finished(self, request: "Request") -> None:
        """The request is done: its sequence goes, unless it is among the latest
        ``keep_finished`` (the oldest kept one goes instead)."""
        plan = self._plans.pop(request.request_id, None)
        self._requests.pop(request.request_id, None)
        if plan is not None:
            self._release(self._kept.add(plan.sequence))

    def _sweep(self) -> None:
        """Releases the sequences left unclaimed for ``orphan_seconds``, when a look is due."""
        now = self._clock()
        if self._index is None or now < self._next_sweep:
            return
        self._next_sweep = now + self._sweep_every
        try:
            self._list()
        except Error as e:
            logger.error("DejaVu: the sidecar cannot be read (%s): orphaned sequences stay for now", e)
            return
        # Claimed: owned, kept, being released, or about to be loaded by a request.
        claimed = {p.sequence for p in self._plans.values()} | self._leaving()
        claimed |= {p.load.sequence for p in self._plans.values() if p.load is not None}
        claimed |= {s for s in self._index.held if s in self._kept}
        expired = self._orphans.expired(self._index.held, claimed, now)
        if expired:
            logger.info("DejaVu: dropping %d sequences no request came back for in %.0f s",
                        len(expired), self._config.orphan_seconds)
            self._release(expired)

    def _list(self) -> None:
        """Lists the sidecar again; forgets the releases its workers have carried out since."""
        started = self._clock()
        self._index.refresh()
        self._pace.listed(started, self._clock())
        self._gone = {s: p for s, p in self._gone.items() if p + RELEASE_LAG > self._passes}

    def _release(self, sequences: List[int]) -> None:
        """Has the workers drop ``sequences`` in the next step; they are not matched meanwhile."""
        self._releases += sequences

    def _leaving(self) -> Set[int]:
        """Sequences released, or to be released by the next step, that a listing may still show."""
        return set(self._gone) | set(self._releases)

    def _plan(self, req_id: str) -> Plan:
        plan = self._plans.get(req_id)
        if plan is None:
            # Every id a listing may not show yet is taken too: kept, or released but not dropped.
            taken = {p.sequence for p in self._plans.values()} | self._leaving() | set(self._kept)
            if self._index is not None:
                taken |= set(self._index.held)
            plan = self._plans[req_id] = Plan(sequence=fresh_id(taken))
        return plan

    def _load(self, meta: DejaVuMetadata, req_id: str, plan: Plan) -> None:
        match = plan.load
        if match is None:
            return
        plan.load = None
        chunks = [(tuple(c.layers), tuple(c.tokens)) for c in match.chunks if c.tokens[0] >= plan.first]
        meta.loads.append(LoadJob(req_id, match.sequence, plan.first, match.tokens, chunks, list(plan.blocks)))
        owned = {p.sequence for p in self._plans.values()}
        if match.sequence not in owned and match.sequence not in self._kept:
            # Left by an engine that died: this request's own sequence holds the prefix once its
            # first save is in, after which the worker drops the old one.
            meta.releases.append(match.sequence)

    def _save(self, meta: DejaVuMetadata, req_id: str, plan: Plan, end: int) -> None:
        start = plan.saved
        if end <= start or not plan.save:
            return
        ids = list(self._requests[req_id].all_token_ids[start:end])
        bs = self._block_size
        piece = start
        while piece < end:
            stop = min(end, (piece // bs + 1) * bs)
            meta.saves.append(SaveJob(plan.sequence, piece, stop, ids[piece - start : stop - start], plan.blocks))
            piece = stop
        plan.saved = end


def wants_copies(request: "Request") -> bool:
    """Whether the request's KV is to be kept: unless it says otherwise, in its
    ``kv_transfer_params`` (``SamplingParams(extra_args={"kv_transfer_params": {"dejavu_save":
    False}})``), for a request not worth protecting."""
    params = request.kv_transfer_params or {}
    return bool(params.get("dejavu_save", True))
