"""A stage process: one ``TorchStage`` beside its ``dejavud sidecar``, driven over its standard
input and output (``python -m dejavu.torch_engine stage``).

The process builds its model first and says ``("standby",)``: a replacement can be started ahead
of a failure and wait warm. ``("join", restore)`` then connects it to its sidecar (an engine that
joins after a failure gets the epoch the controller fenced its predecessor in, which cuts the
predecessor off) and, with ``restore``, fetches the KV the sidecar keeps into the stage's tensors.
It answers ``("ready", epoch, resume, seconds)``, ``resume`` mapping ``(microbatch, (first slot,
end slot))`` to the next token each restored sequence computes, and ``seconds`` the time the join
took to connect to the sidecar, fetch from it and load into the stage's tensors.

Then, per request (each a pickled tuple; each answer too):

- ``("step", microbatch, (first slot, end slot), start, inputs, replicate)`` runs the step (``TorchStage.forward``)
  and answers ``("out", outputs, seconds)``: CPU tensors, and the seconds from the request's
  arrival to the outputs on the host (the stage's own share of the step). With ``replicate``, the step's KV goes to the
  sidecar in the background (``Streamer.region_ready``; on a GPU ``device_region_ready``, whose
  copies wait on the GPU for the step's kernels): the sidecar keeps it and forwards it to its ring
  successor. A step is *acknowledged* once both hold it. At most ``lag`` steps are not acknowledged
  yet: a step waits for the acknowledgement of the step ``lag`` before it.
- ``("drain",)`` waits until every step is answered: ``("drained", steps acknowledged)``.
- ``("stats",)``: ``("stats", {"swapped_bytes", "prefetches", "acknowledged", "unforwarded"})``, the
  bytes swapped out and in, the swaps started ahead of their step, the steps acknowledged, and the
  steps the sidecar kept but could not forward.
- ``("release", microbatch, (first slot, end slot))``: the sequences finished; the sidecar and its successor
  drop their KV. ``("released", chunks)``.

A request the stage cannot carry out (shapes that do not match the model, slots or tokens out of
range) is answered ``("error", kind, message)`` and changes nothing. A sidecar that is gone ends the
process (exit status ``SIDECAR_GONE``) after saying so on standard error: what it acknowledged is
held by the sidecar's successor, from which the controller restores a replacement sidecar; what
it had not is recomputed by the replacement engine. A step the sidecar kept but could not forward
(its successor is down) is not acknowledged, and the stage goes on: the controller re-seeds the
successor's replacement from this sidecar.
"""

from __future__ import annotations

import argparse
import os
import pickle
import sys
import time
from collections import deque
from typing import BinaryIO, Callable, Deque, Dict, Iterable, Iterator, Optional, Tuple

import torch

import dejavu

from .model import ModelShape, TorchStage

#: Exit status of a stage whose sidecar is gone.
SIDECAR_GONE = 17


class SidecarGone(Exception):
    """The stage's sidecar is gone (or cut this engine off): its steps cannot be acknowledged."""


class Replication:
    """A stage's KV handed to its sidecar step by step, at most ``lag`` steps unacknowledged."""

    def __init__(
        self,
        stage: TorchStage,
        socket: str,
        successor: str,
        lag: int,
        epoch: Optional[int] = None,
        stage_index: Optional[int] = None,
        member: bool = True,
        cpus: Optional[str] = None,
    ):
        """``epoch``, ``stage_index`` and ``member`` go to the ``SidecarClient`` (by default the
        sidecar gives the epoch and the stage, and the engine is a member through it); ``cpus``
        puts the streamer thread on those CPUs."""
        if lag < 1:
            raise ValueError("lag must be at least 1 step")
        self.stage, self.lag = stage, lag
        self.client = dejavu.SidecarClient(socket, successor, epoch, stage_index, member=member)
        self.streamer = dejavu.Streamer(self.client.store, cpus=cpus)
        #: The steps not acknowledged yet, oldest first, each with its microbatch.
        self.pending: Deque[Tuple[int, dejavu.Completion]] = deque()
        #: Steps kept by the sidecar and its successor; steps the sidecar kept alone.
        self.acknowledged = 0
        self.unforwarded = 0
        # A swap must not reuse a set the streamer may still be reading.
        stage.before_swap_out = self.settle

    @property
    def epoch(self) -> int:
        return self.client.epoch

    def restore(self) -> Tuple[Dict[Tuple[int, Tuple[int, int]], int], Dict[str, float]]:
        """Fetches the KV the sidecar keeps into the stage's tensors, one microbatch at a time
        (through the host mirror where ``TorchStage.restores_through_mirror``). Returns where each sequence
        resumes, and the seconds spent fetching from the sidecar and loading into the stage."""
        stage = self.stage
        through_mirror = stage.restores_through_mirror
        mirror, tensors = stage.host_mirror() if through_mirror else (None, [])
        resume: Dict[Tuple[int, Tuple[int, int]], int] = {}
        seconds = {"fetch": 0.0, "load": 0.0}
        for microbatch in range(stage.microbatches):
            target = mirror if through_mirror else stage.kv(microbatch).cache
            began = time.perf_counter()
            restored = []
            for point in self.client.store.restore(self.client.worker, {microbatch: target}):
                if point["fetched"] and point["microbatch"] == microbatch:
                    first, end = point["slots"]
                    resume[(microbatch, (first, end))] = point["tokens"]
                    restored.append((range(first, end), point["tokens"]))
            loaded = time.perf_counter()
            seconds["fetch"] += loaded - began
            if through_mirror:
                stage.load_mirror(microbatch, tensors, restored)
            else:
                stage.restored(microbatch, restored)
            seconds["load"] += time.perf_counter() - loaded
        stage.drop_mirror()
        return resume, seconds

    def step(self, microbatch: int, slots: range, tokens: range) -> None:
        """Queues the step's KV (its kernels are queued, on a GPU, or done, on the CPU)."""
        region = self.stage.region(slots, tokens)
        worker = self.client.worker
        cache = self.stage.kv(microbatch).cache
        try:
            if self.stage.engine is None:
                completion = self.streamer.region_ready(cache, region, worker, worker, microbatch)
            else:
                stream = torch.cuda.current_stream(self.stage.device)
                completion = self.streamer.device_region_ready(cache, stream, region, worker, worker, microbatch)
        except dejavu.Error as e:
            raise SidecarGone(str(e)) from e
        self.pending.append((microbatch, completion))
        while len(self.pending) > self.lag:
            self._acknowledge()

    def drain(self) -> int:
        while self.pending:
            self._acknowledge()
        return self.acknowledged

    def settle(self, microbatch: int) -> None:
        """Waits until no step of ``microbatch`` is pending (with the steps queued before them):
        the streamer no longer reads its KV, which a swap may then replace."""
        while any(m == microbatch for m, _ in self.pending):
            self._acknowledge()

    def release(self, microbatch: int, slots: range) -> int:
        self.drain()
        try:
            return self.client.release(microbatch, slots)
        except dejavu.Error as e:
            raise SidecarGone(str(e)) from e

    def _acknowledge(self) -> None:
        try:
            self.pending.popleft()[1].wait()
        except dejavu.Error as e:
            if not self._sidecar_answers():
                raise SidecarGone(str(e)) from e
            # The sidecar kept the step, but its successor does not hold it (the successor is
            # down, or the forward waits behind one that failed): not acknowledged. The
            # controller re-seeds the successor's replacement from this sidecar.
            if self.unforwarded == 0:
                print(f"the sidecar keeps steps its successor does not hold: {e}", file=sys.stderr)
            self.unforwarded += 1
            return
        self.acknowledged += 1

    def _sidecar_answers(self) -> bool:
        try:
            self.client.store.serving()
            return True
        except dejavu.Error:
            return False


class StageServer:
    """The request loop of a stage process."""

    def __init__(self, stage: TorchStage, replication: Optional[Replication]):
        self.stage, self.replication = stage, replication

    def handle(self, request: tuple) -> tuple:
        op = request[0]
        try:
            if op == "step":
                began = time.perf_counter()
                _, microbatch, (first, end), start, inputs, replicate = request
                slots = range(first, end)
                out = self.stage.forward(inputs, slots, start, microbatch=microbatch)
                if replicate and self.replication is not None:
                    self.replication.step(microbatch, slots, range(start, start + inputs.shape[1]))
                out = out.cpu()
                return ("out", out, time.perf_counter() - began)
            if op == "drain":
                return ("drained", self.replication.drain() if self.replication else 0)
            if op == "stats":
                replication = self.replication
                return ("stats", {
                    "swapped_bytes": self.stage.swapped_bytes,
                    "prefetches": self.stage.prefetches,
                    "acknowledged": replication.acknowledged if replication else 0,
                    "unforwarded": replication.unforwarded if replication else 0,
                })
            if op == "release":
                _, microbatch, (first, end) = request
                return ("released", self.replication.release(microbatch, range(first, end)) if self.replication else 0)
            return ("error", "ValueError", f"unknown request {op!r}")
        except ValueError as e:
            return ("error", "ValueError", str(e))


def serve(
    requests: Iterable, handle: Callable, answer: Callable, replication: Optional[Replication], name: str, socket: str
) -> int:
    """Answers each of ``requests`` in turn (``answer(handle(request))``) until they end, then
    waits for the replication of every step; returns the process's exit status: 0, or
    ``SIDECAR_GONE`` once the sidecar at ``socket`` is gone (``name`` says whose, to standard
    error)."""
    for request in requests:
        try:
            answer(handle(request))
        except SidecarGone as e:
            acknowledged = replication.acknowledged if replication else 0
            print(
                f"{name}: the sidecar at {socket} is gone ({e}); {acknowledged} steps were acknowledged, "
                "the rest are recomputed by a replacement",
                file=sys.stderr,
            )
            return SIDECAR_GONE
    if replication is not None:
        try:
            replication.drain()
        except SidecarGone:
            return SIDECAR_GONE
    return 0


def pickled(stream: BinaryIO) -> Iterator[tuple]:
    """The requests pickled on ``stream``, until it ends."""
    while True:
        try:
            yield pickle.load(stream)
        except EOFError:
            return


def send(out: BinaryIO, message: tuple) -> None:
    pickle.dump(message, out, protocol=pickle.HIGHEST_PROTOCOL)
    out.flush()


def parse(argv) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m dejavu.torch_engine stage", description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", required=True, help="the model's ModelShape as JSON")
    p.add_argument("--layers", required=True, help="this stage's layers, FIRST:END")
    p.add_argument("--slots", type=int, required=True, help="sequences the stage holds")
    p.add_argument("--max-tokens", type=int, required=True, help="tokens per sequence")
    p.add_argument("--microbatches", type=int, default=1, help="microbatches of --slots sequences each")
    p.add_argument(
        "--resident", type=int,
        help="microbatches whose KV stays on the device (fewer than --microbatches: swapping; default: all)",
    )
    p.add_argument("--socket", help="the sidecar's local socket (none: no replication)")
    p.add_argument("--successor", default="", help="the ring successor's sidecar, HOST:PORT")
    add_engine_arguments(p)
    return p.parse_args(argv)


def add_engine_arguments(p: argparse.ArgumentParser) -> None:
    """The options a stage process and an engine process under ``dejavud`` share."""
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    p.add_argument("--lag", type=int, default=2, help="steps that may wait for acknowledgement")
    p.add_argument(
        "--no-prefetch", dest="prefetch", action="store_false",
        help="swap a microbatch in when its step comes, not during the step before (with swapping)",
    )
    p.add_argument(
        "--threads", type=int, default=0,
        help="torch's CPU threads (0: torch's default, every CPU; idle threads of several stages on "
        "the same CPUs spin and slow each other's steps down)",
    )


def main(argv) -> int:
    args = parse(argv)
    # Standard output carries the protocol; anything else printed goes to standard error.
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    requests = sys.stdin.buffer
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    first, end = (int(x) for x in args.layers.split(":"))
    stage = TorchStage(
        ModelShape.from_json(args.shape), range(first, end), args.slots, args.max_tokens, args.device,
        args.microbatches, args.resident, prefetch=args.prefetch,
    )
    if args.socket and stage.restores_through_mirror:
        # A replacement's restore goes through a pinned host mirror: pin it while standing by.
        stage.host_mirror()
    send(out, ("standby",))
    try:
        _, restore = pickle.load(requests)
    except EOFError:
        return 0
    replication = None
    resume: Dict = {}
    epoch = None
    began = time.perf_counter()
    seconds = {"connect": 0.0, "fetch": 0.0, "load": 0.0}
    try:
        if args.socket:
            replication = Replication(stage, args.socket, args.successor, args.lag)
            epoch = replication.epoch
            seconds["connect"] = time.perf_counter() - began
            if restore:
                resume, restored = replication.restore()
                seconds.update(restored)
            else:
                stage.drop_mirror()
    except (dejavu.Error, SidecarGone) as e:
        print(f"stage {args.layers}: cannot join the sidecar at {args.socket}: {e}", file=sys.stderr)
        return SIDECAR_GONE
    send(out, ("ready", epoch, resume, seconds))
    server = StageServer(stage, replication)
    return serve(pickled(requests), server.handle, lambda answer: send(out, answer), replication,
                 f"stage {args.layers}", args.socket)
