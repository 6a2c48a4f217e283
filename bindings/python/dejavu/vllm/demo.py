"""In-flight vLLM requests that survive an engine crash, then the loss of their whole node, with
the same output as a failure-free run; against recomputing them from their prompts.

    python -m dejavu.vllm.demo [--prompts 40,200,300] [--new-tokens 256] [--dejavud PATH]

It makes a Llama with seeded random weights (``transformers``, no download), starts a controller
and two sidecars (vLLM's worker is stage 0's engine; stage 1's sidecar keeps the copies), and
starts vLLM's CPU engine five times, each a separate ``python -m dejavu.vllm.run``:

1. with the connector: the prompts served to the end (the failure-free run), then the same
   prompts again, the engine crashing (it kills its own processes) once every request has
   returned ``--kill-after`` tokens;
2. with the connector, on the same sidecar: each request submitted again as a router would (its
   prompt and the tokens it returned); killed in flight together with its sidecar (the node
   lost). The sidecar's command starts it again, and the controller restores it
   from its successor's copies;
3. with the connector, on the restored sidecar: each request submitted again and served to its
   end; then the last prompt once more (prefix reuse: this engine keeps finished requests);
   then other prompts in batches that alternate between saving and not (``"dejavu_save": False``
   in a request's ``kv_transfer_params``), for a decode step's cost with copies against without,
   in one run;
4. with the connector, after a copy was damaged on disk: the node's sidecar is killed again and
   started with no memory for copies, so that the copies its successor hands back all go to its
   spill files, and one byte of each sequence's first piece of KV is flipped there. The repeated
   prompt is submitted once more: its load fails the checksum, the connector reports the blocks
   (``get_block_ids_with_load_errors``) and vLLM computes them instead;
5. with the connector but no sidecar (it says so, and the engine serves on without copies): run
   3's requests, computed from their prompts, and the repeated prompt.

It prints whether every request's tokens equal the failure-free run's, how many tokens each
resumption loaded instead of computing, each one's time to first token against computing it,
whether the damaged load was computed instead with the same tokens as without a sidecar, and the
decode step's time with the connector saving against without.

Requests are resubmitted together, as they ran before each failure: vLLM's CPU kernels are not
batch-invariant, and a request decoding beside other requests than in the failure-free run can
end up with other tokens whether its KV was loaded or computed again (with 16 layers of 1024,
each of three requests did, at the same token either way, after tens of tokens).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from ..daemons import DaemonCluster
from ..torch_engine.model import ModelShape


#: The demo's model: small, so that four engine starts take a minute on two CPUs, with weights
#: wide enough that greedy decoding does not repeat one token.
SMALL = ModelShape(layers=4, hidden=256, heads=4, kv_heads=2, intermediate=512, vocab=512, seed=7,
                   dtype="bfloat16", init_std=0.2)


@dataclass
class Workload:
    """The requests and the model."""

    prompts: List[int] = field(default_factory=lambda: [40, 200, 300])
    new_tokens: int = 256
    kill_after: int = 16
    shape: ModelShape = SMALL

    def prompt_ids(self, salt: int = 0) -> List[List[int]]:
        import torch

        generator = torch.Generator().manual_seed(self.shape.seed + 4 + salt)
        return [torch.randint(1, self.shape.vocab, (n,), generator=generator).tolist() for n in self.prompts]

    @property
    def max_tokens(self) -> int:
        """The most tokens a request holds: its prompt and all it generates."""
        return max(self.prompts) + self.new_tokens


def make_model(path: Path, shape: ModelShape) -> str:
    """A Llama of ``shape`` with its seeded random weights, saved for vLLM."""
    shape.build().save_pretrained(path)
    return str(path)


class Engine:
    """One run of ``python -m dejavu.vllm.run`` in a session of its own (its processes die
    together), serving ``batches`` one after the other, with the connector to ``sidecar`` (its
    local socket and its successor's address) or without it. With ``crash_after``, it crashes
    once every request of the last batch has returned that many tokens."""

    def __init__(self, workdir: Path, name: str, model: str, max_tokens: int, batches: List[List[dict]],
                 sidecar: Optional[Tuple[str, str]] = None, keep_finished: int = 0,
                 crash_after: Optional[int] = None):
        self.workdir, self.name = workdir, name
        (workdir / f"{name}-requests.json").write_text(json.dumps(batches))
        command = [sys.executable, "-m", "dejavu.vllm.run", "--model", model, "--max-model-len", str(max_tokens),
                   "--requests", str(workdir / f"{name}-requests.json"), "--out", str(self._out),
                   "--progress", str(self._progress)]
        if sidecar is not None:
            command += ["--sidecar", sidecar[0], "--successor", sidecar[1]]
        command += ["--keep-finished", str(keep_finished)]
        if crash_after is not None:
            command += ["--crash-after", str(crash_after)]
        self._log = open(workdir / f"{name}.log", "w")
        self.process = subprocess.Popen(command, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)

    @property
    def _out(self) -> Path:
        return self.workdir / f"{self.name}-out.json"

    @property
    def _progress(self) -> Path:
        return self.workdir / f"{self.name}-progress.jsonl"

    def log(self) -> str:
        return (self.workdir / f"{self.name}.log").read_text()

    def lines(self) -> List[dict]:
        """The progress lines written so far, leaving out one being written."""
        text = self._progress.read_text() if self._progress.exists() else ""
        return [json.loads(line) for line in text.split("\n")[:-1]]

    def tokens(self, ids: List[str]) -> List[List[int]]:
        """The tokens of each of ``ids`` returned so far."""
        seen: Dict[str, List[int]] = {}
        for line in self.lines():
            seen.update(line.get("tokens", {}))
        return [seen.get(i, []) for i in ids]

    def first_token_seconds(self, request: str) -> float:
        """From the request's submission to its first token."""
        lines = self.lines()
        submitted = next(line["time"] for line in lines if request in line.get("submitted", ()))
        return next(line["time"] for line in lines if request in line.get("tokens", {})) - submitted

    def decode_steps(self, ids: List[str]) -> List[float]:
        """The times between steps while every one of ``ids`` was decoding."""
        times = [line["time"] for line in self.lines() if all(i in line.get("tokens", {}) for i in ids)]
        return [b - a for a, b in zip(times, times[1:])]

    def load_failed(self, request: str) -> bool:
        """Whether the connector reported a load of ``request`` failed, from its log."""
        return any(f"loading request {request}-" in line and "failed" in line for line in self.log().splitlines())

    def loaded(self, request: str) -> Optional[tuple]:
        """The tokens the connector loaded for ``request`` (``(first, end)``), from its log."""
        for line in self.log().splitlines():
            if f"request {request}-" in line and "loaded tokens" in line:
                first, end = line.split("loaded tokens ")[1].split()[0].split("..")
                return int(first), int(end)
        return None

    def crashed(self, ids: List[str], timeout: float = 600) -> List[List[int]]:
        """Waits for the run to crash where ``crash_after`` told it to: its processes stop where
        they are (vLLM's engine core mid-step, maybe), and tokens computed after the router last
        heard from it die with them. Returns the tokens each of ``ids`` returned."""
        try:
            status = self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            raise TimeoutError(f"{self.name} never crashed:\n{self.log()[-4000:]}")
        if status != -signal.SIGKILL:
            raise RuntimeError(f"{self.name} ended ({status}) instead of crashing:\n{self.log()[-4000:]}")
        return self.tokens(ids)

    def finish(self, timeout: float = 1200) -> Dict[str, dict]:
        """Waits for the run to end; what it served."""
        try:
            status = self.process.wait(timeout)
        finally:
            if self.process.poll() is None:
                os.killpg(self.process.pid, signal.SIGKILL)
        if status != 0:
            raise RuntimeError(f"{self.name} failed ({status}):\n{self.log()[-4000:]}")
        return json.loads(self._out.read_text())


@dataclass
class Resumption:
    """One request submitted again after a failure."""

    request: str
    prompt_tokens: int
    loaded: Optional[tuple]
    first_token_seconds: float
    recomputed_first_token_seconds: float = 0.0


@dataclass
class DamagedLoad:
    """The repeated prompt submitted again after its copies were damaged on disk."""

    pieces_damaged: int
    load_failed: bool
    loaded: Optional[tuple]
    identical_to_computed: bool


@dataclass
class Report:
    """What the demo found."""

    identical: List[bool]
    #: Whether the requests computed again from their prompts (no sidecar) give the failure-free
    #: run's tokens: a matter of vLLM's kernels (a prefill's bits are not its decode steps'), not of
    #: the connector.
    recomputed_identical: List[bool]
    #: Whether each of those requests was served to its end.
    recomputed_complete: List[bool]
    no_sidecar_logged: bool
    after_crash: List[Resumption]
    after_node_loss: List[Resumption]
    prefix_reuse: Resumption
    damaged: DamagedLoad
    decode_step_seconds: float
    decode_step_seconds_without: float


def run(w: Workload, dejavud: Optional[str] = None, workdir: Optional[Path] = None, say=print) -> Report:
    """The four runs (see the module's documentation)."""
    tmp = None if workdir else tempfile.TemporaryDirectory(prefix="dejavu-vllm-")
    workdir = Path(workdir or tmp.name)
    try:
        return _run(w, dejavud, workdir, say)
    finally:
        if tmp is not None:
            tmp.cleanup()


def _run(w: Workload, dejavud: Optional[str], workdir: Path, say) -> Report:
    model = make_model(workdir / "model", w.shape)
    prompts = w.prompt_ids()
    n = len(prompts)
    ids = [f"request{i}" for i in range(n)]
    refs = [f"reference{i}" for i in range(n)]

    def batch(names, prompts_, max_tokens, save=True):
        return [{"id": i, "prompt": p, "max_tokens": m, "save": save} for i, p, m in zip(names, prompts_, max_tokens)]

    def resubmitted(so_far):
        """The requests still running, as a router submits them again: each prompt and the tokens
        it returned (a request whose last token came before the failure is done)."""
        running = [i for i in range(n) if len(so_far[i]) < w.new_tokens]
        if not running:
            raise RuntimeError("every request was done before the failure: give them more --new-tokens")
        return batch([ids[i] for i in running], [prompts[i] + so_far[i] for i in running],
                     [w.new_tokens - len(so_far[i]) for i in running])

    def returned(engine, requests, so_far):
        """``so_far`` and the tokens ``engine`` returned of each of ``requests`` since."""
        more = dict(zip((r["id"] for r in requests), engine.tokens([r["id"] for r in requests])))
        return [so_far[i] + more.get(ids[i], []) for i in range(n)]

    (workdir / "daemons").mkdir(exist_ok=True)
    with DaemonCluster(2, dejavud, workdir / "daemons", region_bytes=256 << 20) as cluster:
        ring = (str(cluster.socket(0)), cluster.successor(0))
        say(f"a controller and two sidecars up; vLLM's worker is stage 0's engine ({workdir})")
        first = Engine(workdir, "first", model, w.max_tokens, [batch(refs, prompts, [w.new_tokens] * n),
                                                 batch(ids, prompts, [w.new_tokens] * n)], ring,
                       crash_after=w.kill_after)
        before = first.crashed(ids)
        reference = first.tokens(refs)
        say(f"run 1: served {n} requests to the end; the same again, engine killed after "
            f"{[len(t) for t in before]} tokens")
        cluster.wait_for(lambda: cluster.fences() >= 1, "the engine fenced")

        again = resubmitted(before)
        second = Engine(workdir, "second", model, w.max_tokens, [again], ring, crash_after=w.kill_after)
        during = second.crashed([r["id"] for r in again])
        after_crash = [Resumption(r["id"], len(r["prompt"]), second.loaded(r["id"]),
                                  second.first_token_seconds(r["id"])) for r in again]
        cluster.kill_sidecar(0)
        say(f"run 2: resumed after the crash; engine and sidecar killed after {[len(t) for t in during]} more tokens")
        cluster.restart_sidecar(0)
        cluster.wait_for(lambda: cluster.restores() >= 1, "the sidecar restored from its successor")
        say("the controller fenced the node and restored its sidecar from its successor's copies")

        so_far = returned(second, again, before)
        last = resubmitted(so_far)
        repeat = batch(["repeat"], [prompts[-1]], [w.kill_after])
        # Then other prompts, in batches that alternate between saving and not (a request may opt
        # out of copies), for the decode step's cost in one run.
        others = w.prompt_ids(salt=1)
        alternating = [
            (save, batch([f"{save}-{k}-{i}" for i in range(n)], others, [w.new_tokens] * n, save=save))
            for k in range(2)
            for save in (True, False)
        ]
        batches = [last, repeat] + [b for _, b in alternating]
        third = Engine(workdir, "third", model, w.max_tokens, batches, ring, keep_finished=16)
        after = third.finish()
        after_node_loss = [Resumption(r["id"], len(r["prompt"]), third.loaded(r["id"]),
                                      third.first_token_seconds(r["id"])) for r in last]
        reuse = Resumption("repeat", len(prompts[-1]), third.loaded("repeat"), third.first_token_seconds("repeat"))
        steps = {True: [], False: []}
        for save, b in alternating:
            steps[save] += third.decode_steps([r["id"] for r in b])
        say("run 3: resumed after the node loss, to the end; the last prompt once more; then decode "
            "steps with copies and without, alternating")

        # The node's sidecar again, now spilling every copy its successor hands back to files, of
        # which each sequence's first piece of KV is damaged.
        cluster.kill_sidecar(0)
        cluster.restart_sidecar(0, memory_bytes=0)
        cluster.wait_for(lambda: cluster.restores() >= 2, "the sidecar restored again")
        pieces = damage_first_pieces(cluster.spill_dir(0))
        fourth = Engine(workdir, "damaged", model, w.max_tokens, [repeat], ring)
        from_damaged = fourth.finish()
        say(f"run 4: the last prompt again, {pieces} pieces of its copies damaged on disk")

    # Its connector finds no sidecar: the engine serves on without copies.
    gone = (str(workdir / "no-sidecar.sock"), ring[1])
    baseline = Engine(workdir, "baseline", model, w.max_tokens, [last, repeat], gone)
    recomputed = baseline.finish()
    for r in after_node_loss:
        r.recomputed_first_token_seconds = baseline.first_token_seconds(r.request)
    reuse.recomputed_first_token_seconds = baseline.first_token_seconds("repeat")
    say("run 5: no sidecar for the connector; the same requests computed from their prompts")

    final = [so_far[i] + after.get(ids[i], {"tokens": []})["tokens"] for i in range(n)]
    again_computed = [so_far[i] + recomputed.get(ids[i], {"tokens": []})["tokens"] for i in range(n)]
    return Report(
        identical=[final[i] == reference[i] for i in range(n)],
        recomputed_identical=[again_computed[i] == reference[i] for i in range(n)],
        recomputed_complete=[len(again_computed[i]) == len(reference[i]) for i in range(n)],
        no_sidecar_logged=baseline.log().count("DejaVu: no sidecar at") == 2,
        after_crash=after_crash,
        after_node_loss=after_node_loss,
        prefix_reuse=reuse,
        damaged=DamagedLoad(
            pieces_damaged=pieces,
            load_failed=fourth.load_failed("repeat"),
            loaded=fourth.loaded("repeat"),
            identical_to_computed=from_damaged["repeat"]["tokens"] == recomputed["repeat"]["tokens"],
        ),
        decode_step_seconds=statistics.median(steps[True]),
        decode_step_seconds_without=statistics.median(steps[False]),
    )


def damage_first_pieces(spill_dir: Path) -> int:
    """Flips the last byte of each spilled sequence's first piece of KV (its chunks from token 0;
    not its token ids, kept in sequences with the top bit set) in ``spill_dir``; returns how many
    were damaged. A sidecar's read of one fails its checksum."""
    damaged = 0
    for path in sorted(spill_dir.glob("*.djv")):
        fields = dict((part[0], part[1:]) for part in path.stem.split("-")[1:])
        if int(fields["m"]) < 1 << 31 and fields["t"].startswith("0_"):
            data = bytearray(path.read_bytes())
            data[-1] ^= 0xFF
            path.write_bytes(bytes(data))
            damaged += 1
    return damaged


def print_report(w: Workload, report: Report) -> None:
    print()
    print(f"requests of {w.prompts} prompt tokens, {w.new_tokens} new tokens each (greedy)")
    print(f"output equal to the failure-free run's: {all(report.identical)} ({report.identical})")
    print(f"  and when recomputed from the prompts instead: {all(report.recomputed_identical)}")
    served = report.no_sidecar_logged and all(report.recomputed_complete)
    print(f"without a sidecar, the connector said so and the engine served every request: {served}")
    print()
    print("| resumed | prompt tokens | loaded | first token | computed instead |")
    print("| --- | --- | --- | --- | --- |")
    for what, rows in (("after the crash", report.after_crash), ("after the node loss", report.after_node_loss)):
        for r in rows:
            loaded = f"{r.loaded[1] - r.loaded[0]}" if r.loaded else "none"
            instead = f"{r.recomputed_first_token_seconds * 1000:.1f} ms" if r.recomputed_first_token_seconds else ""
            print(f"| {r.request} {what} | {r.prompt_tokens} | {loaded} | {r.first_token_seconds * 1000:.1f} ms | {instead} |")
    r = report.prefix_reuse
    loaded = f"{r.loaded[1] - r.loaded[0]}" if r.loaded else "none"
    print(f"| a repeated prompt (prefix reuse) | {r.prompt_tokens} | {loaded} | {r.first_token_seconds * 1000:.1f} ms | "
          f"{r.recomputed_first_token_seconds * 1000:.1f} ms |")
    d = report.damaged
    print(f"a repeated prompt whose copies were damaged on disk ({d.pieces_damaged} pieces): load failed "
          f"{d.load_failed}, loaded {d.loaded or 'nothing'}, computed instead with the same tokens as "
          f"without a sidecar: {d.identical_to_computed}")
    print()
    with_, without = report.decode_step_seconds, report.decode_step_seconds_without
    print(f"decode step of {len(w.prompts)} requests (median, alternating batches in one run): "
          f"{with_ * 1000:.2f} ms with copies, {without * 1000:.2f} ms without ({(with_ / without - 1) * 100:+.1f}%)")


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m dejavu.vllm.demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", default="40,200,300", help="prompt lengths, comma-separated (default 40,200,300)")
    parser.add_argument("--new-tokens", type=int, default=256, help="tokens each request generates (default 256)")
    parser.add_argument("--kill-after", type=int, default=16, help="tokens each request returns before a failure")
    ModelShape.add_arguments(parser, SMALL)
    parser.add_argument("--dejavud", help="the daemon binary (default: $DEJAVUD, then the PATH)")
    parser.add_argument("--workdir", help="keep the runs' logs here (default: a temporary directory)")
    args = parser.parse_args(argv)
    w = Workload(
        prompts=[int(p) for p in args.prompts.split(",")],
        new_tokens=args.new_tokens,
        kill_after=args.kill_after,
        shape=ModelShape.from_arguments(args),
    )
    if w.kill_after * 2 >= w.new_tokens:
        parser.error("--new-tokens must exceed twice --kill-after: requests are still running at each failure")
    workdir = Path(args.workdir) if args.workdir else None
    if workdir is not None:
        workdir.mkdir(parents=True, exist_ok=True)
    print_report(w, run(w, args.dejavud, workdir))


if __name__ == "__main__":
    main()
