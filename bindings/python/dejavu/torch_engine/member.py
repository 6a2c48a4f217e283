"""The PyTorch engine as the engine process of a ``dejavud stage`` (``python -m
dejavu.torch_engine member``): ``dejavud stage ... -- python3 -m dejavu.torch_engine member
--shape JSON`` runs it under the daemon's stage host.

A spare stage (``dejavud spare ... -- ENGINE``) starts it ahead: it imports what it needs and
stands by until its stage is known. The stage host keeps the chain between stages, the heartbeats and the fencing; this process
computes each step with a ``TorchStage`` and keeps its KV with the stage's ``dejavud sidecar``
(``Streamer.region_ready``, one chunk per step, as the reference engine does), and restores a
sequence's KV when told to: from its own sidecar, or from a peer's after its sidecar died with
its worker. They speak the engine protocol (docs/protocol.md, "Engine processes") on this
process's standard input and output: a little-endian ``u32`` length, then a kind byte and its
fields.

Each step is one sequence (a slot of a microbatch), as the stage host sends them. A request the
engine cannot carry out (a slot, a position or a shape out of range) is refused with the reason,
and changes nothing. A sidecar that is gone ends the process (exit status ``SIDECAR_GONE``): its
stage host stops, and the controller replaces the stage.
"""

from __future__ import annotations

import argparse
import os
import struct
import sys
from dataclasses import dataclass
from typing import BinaryIO, Dict, NoReturn, Optional

import numpy as np
import torch

import dejavu

from .model import ModelShape, TorchStage
from .stage import SIDECAR_GONE, Replication, SidecarGone, add_engine_arguments, serve

# Message kinds (docs/protocol.md): from the stage host, then to it.
START, STEP, RESTORE, READ, WRITE = 1, 2, 3, 4, 5
READY, OUTPUT, RESTORED, REFUSED, STANDBY, SWAPPED, KV = 1, 2, 3, 4, 5, 6, 7

#: The longest message either side sends.
MAX_MESSAGE = 1 << 30


class ProtocolError(Exception):
    """The stage host said something that is not the protocol."""


@dataclass
class Start:
    """The stage this process is to be."""

    index: int
    epoch: int
    layers: range
    slots: int
    microbatches: int
    resident: int
    max_tokens: int
    sidecar: str
    successor: str
    copy_cpus: str
    secret: bytes


class Fields:
    """Reads a message's fields in order."""

    def __init__(self, body: bytes):
        self.body, self.at = body, 0

    def take(self, n: int) -> bytes:
        if self.at + n > len(self.body):
            raise ProtocolError(f"a message of {len(self.body)} bytes cut short")
        taken = self.body[self.at : self.at + n]
        self.at += n
        return taken

    def u8(self) -> int:
        return self.take(1)[0]

    def u32(self) -> int:
        return struct.unpack("<I", self.take(4))[0]

    def u64(self) -> int:
        return struct.unpack("<Q", self.take(8))[0]

    def bytes(self) -> bytes:
        return self.take(self.u32())

    def text(self) -> str:
        return self.bytes().decode()

    def rest(self) -> bytes:
        rest = self.body[self.at :]
        self.at = len(self.body)
        return rest

    def end(self) -> None:
        if self.at != len(self.body):
            raise ProtocolError(f"{len(self.body) - self.at} bytes after the last field")


def read_message(stream: BinaryIO) -> Optional[bytes]:
    """One message's body, or ``None`` at the end of the input."""
    length = stream.read(4)
    if not length:
        return None
    if len(length) < 4:
        raise ProtocolError("the input ended inside a message's length")
    (n,) = struct.unpack("<I", length)
    if not 0 < n <= MAX_MESSAGE:
        raise ProtocolError(f"a message of {n} bytes")
    body = stream.read(n)
    if len(body) < n:
        raise ProtocolError("the input ended inside a message")
    return body


def write_message(stream: BinaryIO, body: bytes) -> None:
    # Two writes to the buffered stream, not a concatenation: a read's KV is large.
    stream.write(struct.pack("<I", len(body)))
    stream.write(body)
    stream.flush()


def parse_start(body: bytes) -> Start:
    f = Fields(body)
    if f.u8() != START:
        raise ProtocolError("the first message is not a start")
    index, epoch = f.u32(), f.u64()
    first, end = f.u32(), f.u32()
    start = Start(
        index, epoch, range(first, end), f.u32(), f.u32(), f.u32(), f.u32(),
        f.text(), f.text(), f.text(), f.bytes(),
    )
    f.end()
    return start


class Member:
    """A stage's engine: its ``TorchStage`` and its KV's replication."""

    def __init__(self, stage: TorchStage, start: Start, replication: Optional[Replication]):
        self.stage, self.start, self.replication = stage, start, replication
        self.peers: Dict[str, dejavu.Store] = {}
        self._swaps_said: Optional[tuple] = None

    def swapped(self) -> Optional[bytes]:
        """The ``swapped`` message of the stage's swap totals, if they changed since it was last
        made: the host publishes them as the stage's swap metrics."""
        stage = self.stage
        if not stage.swapping:
            return None
        totals = (stage.swap_ins, stage.bytes_in, stage.swap_outs, stage.bytes_out, stage.host_bytes())
        if totals == self._swaps_said:
            return None
        self._swaps_said = totals
        return bytes([SWAPPED]) + struct.pack("<5Q", *totals)

    def step(self, microbatch: int, slot: int, position: int, count: int, replicate: bool, data: bytes) -> bytes:
        """Runs one step of one sequence; returns its output as the protocol carries it."""
        stage = self.stage
        if not 0 <= microbatch < stage.microbatches:
            raise ValueError(f"microbatch {microbatch} of {stage.microbatches}")
        if stage.first:
            ids = np.frombuffer(data, dtype="<u4")
            if ids.size != count:
                raise ValueError(f"{ids.size} token ids for {count} tokens")
            if ids.size and int(ids.max()) >= stage.shape.vocab:
                raise ValueError(f"token id {int(ids.max())} beyond the vocabulary of {stage.shape.vocab}")
            inputs = torch.from_numpy(ids.astype(np.int64)).view(1, count)
        else:
            hidden = stage.shape.hidden
            values = np.frombuffer(data, dtype="<f4")
            if values.size != count * hidden:
                raise ValueError(f"{values.size} values for {count} tokens of {hidden}")
            inputs = torch.from_numpy(values.copy()).view(1, count, hidden)
        slots = range(slot, slot + 1)
        out = stage.forward(inputs, slots, position, microbatch=microbatch)
        if replicate and self.replication is not None:
            self.replication.step(microbatch, slots, range(position, position + count))
        if stage.last:
            return struct.pack("<I", int(out[0]))
        return out.to(torch.float32).cpu().contiguous().numpy().tobytes()

    def restore(self, microbatch: int, slot: int, prompt_len: int, kv_tokens: int, source: str) -> int:
        """Fetches the sequence's chunks (its prompt's, then one per token up to ``kv_tokens``)
        from its own sidecar, or from the sidecar at ``source`` (with many fetches in flight),
        in order while they are there.
        What comes from a peer, its own sidecar keeps again without forwarding it (the peer holds
        the replica; a prompt's chunk forwarded there would start the sequence over). Returns the
        tokens restored."""
        stage, replication = self.stage, self.replication
        if replication is None or prompt_len == 0:
            return 0
        if not (0 <= microbatch < stage.microbatches and 0 <= slot < stage.slots):
            raise ValueError(f"no sequence in slot {slot} of microbatch {microbatch}")
        own = replication.client.store
        store = self._peer(source) if source else own
        worker = replication.client.worker
        through_mirror = stage.restores_through_mirror
        target, tensors = stage.host_mirror() if through_mirror else (stage.kv(microbatch).cache, [])
        slots = range(slot, slot + 1)
        chunks = [(0, prompt_len)] + [(t, t + 1) for t in range(prompt_len, min(kv_tokens, stage.max_tokens))]
        regions = [stage.region(slots, range(first, end)) for first, end in chunks]
        outcome = dejavu.fetch_chunks(store, target, regions, worker, worker, microbatch, keep_in=own if source else None)
        if outcome["error"] is not None:
            print(f"stage {self.start.index}: restore stopped after {outcome['fetched']} chunks: {outcome['error']}",
                  file=sys.stderr)
        restored = chunks[outcome["fetched"] - 1][1] if outcome["fetched"] else 0
        if restored:
            if through_mirror:
                stage.load_mirror(microbatch, tensors, [(slots, restored)])
            else:
                stage.restored(microbatch, [(slots, restored)])
        return restored

    def _sequence(self, microbatch: int, slot: int, tokens: range) -> dejavu.KvRegion:
        """The region of a sequence's ``tokens``, or ``ValueError`` naming what is out of range."""
        stage = self.stage
        if not (0 <= microbatch < stage.microbatches and 0 <= slot < stage.slots):
            raise ValueError(f"no sequence in slot {slot} of microbatch {microbatch}")
        if not 0 <= tokens.start < tokens.stop <= stage.max_tokens:
            raise ValueError(f"tokens {tokens.start}..{tokens.stop} do not fit the stage's {stage.max_tokens}")
        return stage.region(range(slot, slot + 1), tokens)

    def read(self, microbatch: int, slot: int, tokens: range) -> bytearray:
        """The ``kv`` answer with the sequence's KV of ``tokens``, packed (a prompt stage's host
        hands it over), gathered in place after the kind byte."""
        region = self._sequence(microbatch, slot, tokens)
        cache = self.stage.kv(microbatch).cache
        answer = bytearray(1 + cache.packed_len(region))
        answer[0] = KV
        cache.gather(region, np.frombuffer(answer, dtype=np.uint8)[1:])
        return answer

    def write(self, microbatch: int, slot: int, tokens: range, replicate: bool, kv: bytes) -> int:
        """Takes the sequence's KV of ``tokens`` (packed) in place of computing it: a prompt
        handed over by a prompt pipeline, which the token stage's host loaded from the sidecar.
        Replicated, it goes to the sidecar as a prompt computed here. Returns the end token."""
        region = self._sequence(microbatch, slot, tokens)
        stage = self.stage
        cache = stage.kv(microbatch).cache
        if len(kv) != cache.packed_len(region):
            raise ValueError(f"{len(kv)} bytes of KV for tokens {tokens.start}..{tokens.stop}, which take {cache.packed_len(region)}")
        cache.scatter(region, kv)
        slots = range(slot, slot + 1)
        stage.restored(microbatch, [(slots, tokens.stop)])
        if replicate and self.replication is not None:
            self.replication.step(microbatch, slots, tokens)
        return tokens.stop

    def _peer(self, address: str) -> dejavu.Store:
        """The sidecar at ``address``, over TCP with the cluster secret (one connection each)."""
        if address not in self.peers:
            self.peers[address] = dejavu.Store.peer(address, self.start.secret, self.start.index, self.start.epoch)
        return self.peers[address]

    def handle(self, body: bytes) -> bytes:
        """Carries out one request; returns the answer's body."""
        f = Fields(body)
        kind = f.u8()
        try:
            if kind == STEP:
                microbatch, slot, position, count, replicate = f.u32(), f.u32(), f.u32(), f.u32(), f.u8()
                out = self.step(microbatch, slot, position, count, replicate == 1, f.rest())
                return bytes([OUTPUT]) + out
            if kind == RESTORE:
                microbatch, slot, prompt_len, kv_tokens = f.u32(), f.u32(), f.u32(), f.u32()
                source = f.text()
                f.end()
                tokens = self.restore(microbatch, slot, prompt_len, kv_tokens, source)
                return bytes([RESTORED]) + struct.pack("<I", tokens)
            if kind == READ:
                microbatch, slot, first, end = f.u32(), f.u32(), f.u32(), f.u32()
                f.end()
                return self.read(microbatch, slot, range(first, end))
            if kind == WRITE:
                microbatch, slot, first, end, replicate = f.u32(), f.u32(), f.u32(), f.u32(), f.u8()
                tokens = self.write(microbatch, slot, range(first, end), replicate == 1, f.rest())
                return bytes([RESTORED]) + struct.pack("<I", tokens)
        except (ValueError, IndexError) as e:
            return bytes([REFUSED]) + str(e).encode()
        raise ProtocolError(f"message kind {kind} to an engine")


def parse(argv) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m dejavu.torch_engine member", description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", required=True, help="the model's ModelShape as JSON")
    add_engine_arguments(p)
    return p.parse_args(argv)


def protocol_output() -> BinaryIO:
    """Standard output as the protocol's channel; anything else printed from now on goes to
    standard error. Called before the imports (``__main__``), which may print."""
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    return out


def main(argv, out: Optional[BinaryIO] = None) -> int:
    args = parse(argv)
    out = protocol_output() if out is None else out
    requests = sys.stdin.buffer
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    shape = ModelShape.from_json(args.shape)
    # What building the stage imports, imported while a spare stands by for its stage.
    from transformers import LlamaForCausalLM  # noqa: F401
    from transformers.models.llama import modeling_llama  # noqa: F401

    write_message(out, bytes([STANDBY]))
    body = read_message(requests)
    if body is None:
        return 0
    start = parse_start(body)
    name = f"stage {start.index} (layers {start.layers.start}..{start.layers.stop})"
    try:
        resident = start.resident if start.resident < start.microbatches else None
        stage = TorchStage(
            shape, start.layers, start.slots, start.max_tokens, args.device, start.microbatches, resident,
            prefetch=args.prefetch,
        )
    except ValueError as e:
        print(f"{name}: cannot be built: {e}", file=sys.stderr)
        leave(2)
    replication = None
    if start.sidecar:
        try:
            replication = Replication(
                stage, start.sidecar, start.successor, args.lag, epoch=start.epoch, stage_index=start.index,
                member=False, cpus=start.copy_cpus or None,
            )
        except (dejavu.Error, SidecarGone) as e:
            print(f"{name}: cannot join the sidecar at {start.sidecar}: {e}", file=sys.stderr)
            leave(SIDECAR_GONE)
    epoch = replication.epoch if replication is not None else start.epoch
    write_message(out, bytes([READY]) + struct.pack("<Q", epoch))
    member = Member(stage, start, replication)

    def answer(body: bytes) -> None:
        swapped = member.swapped()
        if swapped is not None:
            write_message(out, swapped)
        write_message(out, body)

    status = serve(iter(lambda: read_message(requests), None), member.handle, answer, replication, name, start.sidecar)
    if status != 0:
        leave(status)
    return status


def leave(status: int) -> NoReturn:
    """Exits at once with ``status``: a stage that cannot go on has nothing to clean up, and its
    stage host, which learns why from the status, stops sooner (and is replaced sooner) than after
    the interpreter's teardown of torch."""
    sys.stderr.flush()
    os._exit(status)
