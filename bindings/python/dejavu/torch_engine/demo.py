"""The PyTorch engine's demo: a pipeline of stage processes beside a controller and a ring of
sidecars, run failure-free, with one stage's engine killed mid-decode, with a whole worker
(engine and sidecar) killed, and restarted from scratch after the same failure; it reports the
replication overhead per decode step, each run's time against the failure-free one, and whether
every run's output equals the failure-free run's.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from typing import Dict, List, Optional, Tuple

import torch

from .cluster import DaemonCluster
from .model import ModelShape
from .pipeline import Generation, Pipeline, StageProcess, StepTime


@dataclass
class Workload:
    """The model, its split and the batch a demo generates."""

    shape: ModelShape
    stages: int = 2
    batch: int = 4
    prompt: int = 16
    new_tokens: int = 32
    device: str = "cpu"
    lag: int = 2
    #: Microbatches of ``batch`` sequences, and how many of them each stage keeps on its device
    #: (fewer: microbatch swapping; default: all).
    microbatches: int = 1
    resident: Optional[int] = None

    def __post_init__(self) -> None:
        if not 2 <= self.stages <= self.shape.layers:
            raise ValueError(f"{self.stages} stages for {self.shape.layers} layers: use 2 to {self.shape.layers}")
        if self.batch < 1 or self.prompt < 1 or self.new_tokens < 1 or self.microbatches < 1:
            raise ValueError("batch, prompt, new_tokens and microbatches must each be at least 1")
        if self.resident is not None and not 1 <= self.resident <= self.microbatches:
            raise ValueError(f"resident {self.resident}: give 1 to {self.microbatches} (the microbatches)")

    @property
    def max_tokens(self) -> int:
        return self.prompt + self.new_tokens

    def layers(self, index: int) -> range:
        """Stage ``index``'s layers: the model's split as evenly as it goes."""
        per, extra = divmod(self.shape.layers, self.stages)
        first = index * per + min(index, extra)
        return range(first, first + per + (index < extra))

    def prompts(self) -> torch.Tensor:
        generator = torch.Generator().manual_seed(self.shape.seed + 1)
        return torch.randint(0, self.shape.vocab, (self.microbatches * self.batch, self.prompt), generator=generator)


class Run:
    """One run's cluster and stage processes, and a warm replacement standing by for stage
    ``spare``, if given."""

    def __init__(self, workload: Workload, dejavud: Optional[str], restore: bool = True, spare: Optional[int] = None):
        self.workload = workload
        self.cluster = DaemonCluster(workload.stages, dejavud, region_bytes=self._region_bytes())
        self.standby: Dict[int, StageProcess] = {}
        try:
            # Every process imports torch and builds its layers at the same time.
            stages = [self._start(i) for i in range(workload.stages)]
            if spare is not None:
                self.standby[spare] = self._start(spare)
            for stage in stages:
                stage.join(restore=True)
            for stage in self.standby.values():
                stage.standby()
            self.pipeline = Pipeline(stages, self._replace, restore=restore)
        except BaseException:
            self.stop()
            raise

    def _region_bytes(self) -> int:
        w = self.workload
        step = w.batch * w.prompt * w.shape.kv_bytes_per_token(max(len(w.layers(i)) for i in range(w.stages)))
        # Room for the prompt's chunk twice over (a sidecar's region holds chunks in flight).
        return max(64 << 20, 1 << (2 * step).bit_length())

    def _start(self, index: int) -> StageProcess:
        w = self.workload
        command = self.cluster.stage_command(
            index, w.shape, w.layers(index), w.batch, w.max_tokens, w.device, w.lag,
            microbatches=w.microbatches, resident=w.resident,
        )
        return StageProcess(index, command)

    def _replace(self, index: int) -> StageProcess:
        # It joins in the epoch the controller fences the dead engine in (its sidecar waits for
        # the fence), which cuts the dead one off for good.
        return self.standby.pop(index, None) or self._start(index)

    def generate(self, **kwargs) -> Generation:
        w = self.workload
        return self.pipeline.generate(w.prompts(), w.new_tokens, microbatches=w.microbatches, **kwargs)

    def swapped_bytes(self) -> int:
        """Bytes the stages swapped out and in so far."""
        return self._stat("swapped_bytes")

    def prefetches(self) -> int:
        """Swaps the stages started ahead of their step so far."""
        return self._stat("prefetches")

    def _stat(self, name: str) -> int:
        return sum(stage.request(("stats",), "stats")[1][name] for stage in self.pipeline.stages)

    def stop(self) -> None:
        running = self.pipeline.stages if hasattr(self, "pipeline") else []
        for stage in [*running, *self.standby.values()]:
            stage.kill()
        self.cluster.stop()


def decode_steps(generation: Generation, replicated: Optional[bool] = None) -> List[StepTime]:
    """The first run of each decode step (not the prompt, not recomputed ones)."""
    seen, out = set(), []
    for step in generation.steps:
        key = (step.microbatch, step.step)
        if step.step >= 1 and key not in seen and replicated in (None, step.replicated):
            out.append(step)
        seen.add(key)
    return out


def median_ms(steps: List[StepTime], inside: bool = False) -> float:
    return statistics.median(s.in_stages if inside else s.seconds for s in steps) * 1e3 if steps else float("nan")


def kill_engine(run: Run, stage: int, at: int):
    """Kills stage ``stage``'s engine before step ``at``."""

    def before_step(step: int, pipeline: Pipeline) -> None:
        if step == at:
            pipeline.stages[stage].kill()

    return before_step


def kill_worker(run: Run, stage: int, at: int):
    """Kills stage ``stage``'s engine and sidecar before step ``at``; starts the sidecar again and
    waits until the controller has restored it."""

    def before_step(step: int, pipeline: Pipeline) -> None:
        if step == at:
            restores, fences = run.cluster.restores(), run.cluster.fences()
            pipeline.stages[stage].kill()
            run.cluster.kill_sidecar(stage)
            run.cluster.wait_for(lambda: run.cluster.fences() > fences, f"worker {stage} fenced")
            run.cluster.restart_sidecar(stage)
            run.cluster.wait_for(lambda: run.cluster.restores() > restores, f"sidecar {stage} restored")

    return before_step


def measure(workload: Workload, dejavud: Optional[str] = None, fail_at: Optional[int] = None, stage: int = 0, block: int = 4, log=print) -> dict:
    """Runs the demo; returns its figures (also logged line by line through ``log``)."""
    fail_at = workload.new_tokens // 2 if fail_at is None else fail_at
    report: dict = {"workload": asdict(workload), "fail_at": fail_at, "failed_stage": stage}
    report["device"] = torch.cuda.get_device_name(torch.device(workload.device)) if workload.device.startswith("cuda") else platform.processor() or platform.machine()
    w = workload
    swapping = f", {w.resident} kept on the device (swapping)" if w.resident and w.resident < w.microbatches else ""
    log(
        f"model: Llama, {w.shape.layers} layers, hidden {w.shape.hidden}, {w.shape.heads} heads "
        f"({w.shape.kv_heads} KV heads of {w.shape.head_dim}), {w.shape.dtype}, seed {w.shape.seed}; "
        f"{w.stages} stages on {w.device} ({report['device']}); {w.microbatches} microbatch(es) of {w.batch} "
        f"sequences{swapping}, prompt {w.prompt}, {w.new_tokens} new tokens; KV "
        f"{w.shape.kv_bytes_per_token() * w.batch} bytes per microbatch's decode step"
    )

    def one(restore: bool = True, inject=None, **kwargs) -> Tuple[Generation, int]:
        """A run on a fresh cluster: its generation, and the bytes its stages swapped (failures
        replace stages, whose counts start again: 0 for runs with a failure)."""
        run = Run(workload, dejavud, restore=restore, spare=stage if inject else None)
        try:
            generation = run.generate(before_step=inject(run, stage, fail_at) if inject else None, **kwargs)
            swapped = run.swapped_bytes() if inject is None else 0
        finally:
            run.stop()
        return generation, swapped

    reference, swapped_bytes = one()
    base = reference.seconds
    tokens = reference.tokens.numel()
    report["failure_free_seconds"] = base
    report["tokens_per_second"] = tokens / base
    steps = decode_steps(reference)
    report["decode_step_ms"] = {"median": median_ms(steps), "in_stages": median_ms(steps, inside=True)}
    report["swapped_bytes"] = swapped_bytes
    swapped = f"; {swapped_bytes / 1e6:.1f} MB swapped out and in" if swapped_bytes else ""
    log(
        f"failure-free: {base:.3f} s, {tokens / base:.0f} tokens/s, decode step median {median_ms(steps):.2f} ms "
        f"(in the stages {median_ms(steps, inside=True):.2f} ms){swapped}"
    )

    run = Run(workload, dejavud)
    try:
        generation = run.generate(replicate=lambda k: (k // block) % 2 == 0)
    finally:
        run.stop()
    on, off = decode_steps(generation, True), decode_steps(generation, False)
    overhead = median_ms(on) / median_ms(off) - 1
    report["replication_overhead"] = overhead
    report["alternating_step_ms"] = {"replicated": median_ms(on), "not_replicated": median_ms(off)}
    log(
        f"replication overhead per decode step: {overhead * 100:+.2f}% (median {median_ms(on):.3f} ms "
        f"replicated, {median_ms(off):.3f} ms not, alternating blocks of {block} steps in one run)"
    )
    identical = True
    for name, restore, inject in (
        ("engine killed", True, kill_engine),
        ("worker killed", True, kill_worker),
        ("restart from scratch", False, kill_engine),
    ):
        generation, _ = one(restore=restore, inject=inject)
        same = torch.equal(generation.tokens, reference.tokens)
        identical &= same
        recovery = generation.recoveries[0]
        failed, resumed, joined = recovery.failed_step, recovery.resumed_step, recovery.join_seconds
        ratio = generation.seconds / base
        parts = recovery.join_parts
        report[name.replace(" ", "_")] = {
            "seconds": generation.seconds, "ratio": ratio, "recomputed_from_step": resumed,
            "join_seconds": joined, "join_parts": parts, "identical": same,
        }
        within = ", ".join(f"{part} {seconds * 1e3:.0f} ms" for part, seconds in parts.items())
        log(
            f"{name} at step {failed} (stage {stage}): {generation.seconds:.3f} s, {ratio:.2f}x failure-free; "
            f"replacement joined in {joined * 1e3:.0f} ms ({within}), recomputed from step {resumed}; "
            f"output identical: {'yes' if same else 'NO'}"
        )
    report["identical"] = identical
    return report


def parse(argv) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m dejavu.torch_engine demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--dejavud", help="the dejavud executable (default: $DEJAVUD, or dejavud on the PATH)")
    p.add_argument("--stages", type=int, default=2)
    ModelShape.add_arguments(p)
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    p.add_argument("--batch", type=int, default=4, help="sequences per microbatch, decoded in lockstep")
    p.add_argument("--microbatches", type=int, default=1, help="microbatches, their steps taken in turn")
    p.add_argument(
        "--resident", type=int,
        help="microbatches each stage keeps on its device; fewer than --microbatches swaps the others "
        "to host memory (default: all)",
    )
    p.add_argument("--prompt", type=int, default=16, help="prompt tokens per sequence")
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--fail-at", type=int, help="the decode step the failures happen before (default: half way)")
    p.add_argument("--fail-stage", type=int, default=0)
    p.add_argument("--block", type=int, default=4, help="steps per block of the alternating overhead measure")
    p.add_argument("--json", help="also write the figures to this file")
    return p.parse_args(argv)


def main(argv) -> int:
    args = parse(argv)
    # The driver's own torch work is a few small tensors: its idle threads would only spin.
    torch.set_num_threads(1)
    try:
        shape = ModelShape.from_arguments(args)
        workload = Workload(
            shape, args.stages, args.batch, args.prompt, args.new_tokens, args.device,
            microbatches=args.microbatches, resident=args.resident,
        )
        if not 0 <= args.fail_stage < args.stages:
            raise ValueError(f"--fail-stage {args.fail_stage}: the pipeline has stages 0 to {args.stages - 1}")
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    started = time.perf_counter()
    report = measure(workload, args.dejavud, args.fail_at, args.fail_stage, args.block)
    print(f"done in {time.perf_counter() - started:.1f} s; output identical in every run: {'yes' if report['identical'] else 'NO'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0 if report["identical"] else 1
