"""The driver of a pipeline of stage processes: it feeds each step through the stages in order,
keeps every step's inputs, and, when a stage process dies, joins a replacement and recomputes the
steps after the replacement's resume point.

The sequences of a microbatch move in lockstep: step 0 is the prompt (tokens ``0..prompt``), step
``k`` the token at ``prompt + k - 1``; the steps go round the microbatches. Each step's KV is one chunk, so a stage
resumes at a step boundary. A recomputed step runs exactly as the first time (the same stages,
shapes and inputs), so its outputs must equal the tokens already generated; a difference raises
``RecoveryDiverged``.
"""

from __future__ import annotations

import pickle
import subprocess
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch


class StageGone(Exception):
    """A stage process died or closed its pipe (``stage``: its index, ``status``: its exit status)."""

    def __init__(self, stage: int, status: Optional[int]):
        super().__init__(f"stage {stage} is gone (exit status {status})")
        self.stage, self.status = stage, status


class StageError(Exception):
    """A stage refused a request (``kind``: the exception it raised)."""

    def __init__(self, stage: int, kind: str, message: str):
        super().__init__(f"stage {stage}: {kind}: {message}")
        self.stage, self.kind = stage, kind


class RecoveryDiverged(Exception):
    """A recomputed step gave other tokens than the first time."""


class StageProcess:
    """The driver's end of one stage process, started with ``argv`` (it builds its model, then
    stands by until it joins)."""

    def __init__(self, index: int, argv: Sequence[str], env: Optional[Dict[str, str]] = None):
        self.index = index
        self.process = subprocess.Popen(list(argv), stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
        self.standing_by = False

    def standby(self) -> "StageProcess":
        """Waits until the stage has built its model."""
        if not self.standing_by:
            self._expect("standby")
            self.standing_by = True
        return self

    def join(self, restore: bool) -> "StageProcess":
        """Connects the stage to its sidecar, restoring the KV the sidecar keeps if ``restore``."""
        self.standby()
        _, self.epoch, self.resume, self.join_seconds = self._call(("join", restore), "ready")
        return self

    def request(self, message: tuple, answer: str):
        """Sends ``message``; returns the answer named ``answer`` (its fields)."""
        return self._call(message, answer)

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()

    def close(self) -> Optional[int]:
        """Closes the stage's input (it drains and exits); returns its exit status."""
        try:
            self.process.stdin.close()
        except OSError:
            pass
        return self.process.wait()

    def _call(self, message: tuple, answer: str):
        try:
            pickle.dump(message, self.process.stdin, protocol=pickle.HIGHEST_PROTOCOL)
            self.process.stdin.flush()
        except (BrokenPipeError, OSError):
            raise StageGone(self.index, self.process.wait()) from None
        return self._expect(answer)

    def _expect(self, answer: str):
        try:
            reply = pickle.load(self.process.stdout)
        except (EOFError, OSError, pickle.UnpicklingError):
            raise StageGone(self.index, self.process.wait()) from None
        if reply[0] == "error":
            raise StageError(self.index, reply[1], reply[2])
        if reply[0] != answer:
            raise StageError(self.index, "Protocol", f"answered {reply[0]!r} where {answer!r} was due")
        return reply


@dataclass
class Step:
    """One step's inputs to the first stage."""

    start: int
    inputs: torch.Tensor


@dataclass
class StepTime:
    """One run of a step."""

    step: int
    replicated: bool
    #: Its time in the driver, and the part of it spent in the stages.
    seconds: float
    in_stages: float
    microbatch: int = 0


@dataclass
class Recovery:
    """One failure the driver recovered from."""

    #: The stage whose process died, and its exit status (negative: the signal that ended it).
    stage: int
    status: Optional[int]
    #: The step that found it dead, and the step recomputed from.
    failed_step: int
    resumed_step: int
    #: Seconds from the failure being found to the replacement joined and restored, and the
    #: replacement's own account of its join: connecting to its sidecar (which waits for the
    #: controller to fence the dead engine), fetching the KV and loading it ("connect", "fetch",
    #: "load").
    join_seconds: float
    join_parts: Dict[str, float] = field(default_factory=dict)


@dataclass
class Generation:
    """What ``Pipeline.generate`` produced and how long it took."""

    tokens: torch.Tensor
    seconds: float
    #: Every step run, recomputed ones too.
    steps: List["StepTime"] = field(default_factory=list)
    recoveries: List[Recovery] = field(default_factory=list)


class Pipeline:
    """Stage processes in pipeline order. ``replace(index)`` returns a stage process standing by
    to take over stage ``index`` after a failure (after, say, the cluster's sidecar of that stage
    is back); ``restore`` says whether it restores from its sidecar or recomputes from scratch."""

    #: Replacements tried for one failure before giving up (one that cannot join its sidecar, not
    #: back yet after a worker's death, is followed by another after ``JOIN_PAUSE`` seconds).
    JOIN_ATTEMPTS = 5
    JOIN_PAUSE = 0.5

    def __init__(self, stages: List[StageProcess], replace: Callable[[int], StageProcess], restore: bool = True):
        self.stages, self.replace, self.restore = stages, replace, restore

    def step(self, microbatch: int, slots: range, step: Step, replicate: bool) -> Tuple[torch.Tensor, float]:
        """Runs ``step`` of ``microbatch`` through every stage: its outputs, and the seconds the
        stages spent on it (the rest of the step's time is the driver's and the pipes')."""
        x, inside = step.inputs, 0.0
        for stage in self.stages:
            request = ("step", microbatch, (slots.start, slots.stop), step.start, x, replicate)
            (_, x, seconds) = stage.request(request, "out")
            inside += seconds
        return x, inside

    def generate(
        self,
        prompts: torch.Tensor,
        new_tokens: int,
        microbatches: int = 1,
        replicate: Callable[[int], bool] = lambda step: True,
        before_step: Optional[Callable[[int, "Pipeline"], None]] = None,
    ) -> Generation:
        """Generates ``new_tokens`` tokens for each prompt (``[sequences, prompt]`` token ids),
        the sequences split into ``microbatches`` equal microbatches, each in the first slots of
        its own; the steps go round the microbatches (step ``k`` of each, then step ``k + 1``).
        ``replicate(k)`` says whether step ``k``'s KV is replicated; ``before_step(k, pipeline)``
        runs once per step, before its first run (where a test or the demo injects a failure)."""
        sequences, prompt = prompts.shape
        if microbatches < 1 or sequences % microbatches:
            raise ValueError(f"{sequences} sequences do not split into {microbatches} equal microbatches")
        batch = sequences // microbatches
        slots = range(batch)
        steps = [[Step(0, prompts[m * batch : (m + 1) * batch])] for m in range(microbatches)]
        tokens: List[List[torch.Tensor]] = [[] for _ in range(microbatches)]
        next_step = [0] * microbatches
        result = Generation(tokens=torch.empty(0), seconds=0.0)
        began, announced = time.perf_counter(), -1
        while min(len(t) for t in tokens) < new_tokens:
            # The microbatch furthest behind goes next (round robin, and after a recovery the
            # ones recomputing catch up first).
            m = min(range(microbatches), key=lambda m: (next_step[m], m))
            k = next_step[m]
            if k > announced:
                announced = k
                if before_step is not None:
                    before_step(k, self)
            t0 = time.perf_counter()
            try:
                out, inside = self.step(m, slots, steps[m][k], replicate(k))
            except StageGone as gone:
                t0 = time.perf_counter()
                resumed = self._recover(gone, prompt, slots)
                next_step = [min(next_step[m], resumed.get(m, 0)) for m in range(microbatches)]
                recovery = Recovery(
                    gone.stage, gone.status, k, min(next_step), time.perf_counter() - t0,
                    self.stages[gone.stage].join_seconds,
                )
                result.recoveries.append(recovery)
                continue
            result.steps.append(StepTime(k, replicate(k), time.perf_counter() - t0, inside, m))
            if k < len(tokens[m]):
                if not torch.equal(out, tokens[m][k]):
                    raise RecoveryDiverged(
                        f"step {k} of microbatch {m} recomputed gave {out.tolist()}, first {tokens[m][k].tolist()}"
                    )
            else:
                tokens[m].append(out)
                steps[m].append(Step(prompt + k, out.unsqueeze(1)))
            next_step[m] = k + 1
        result.seconds = time.perf_counter() - began
        result.tokens = torch.cat([torch.stack(t, dim=1) for t in tokens], dim=0)
        return result

    def _recover(self, gone: StageGone, prompt: int, slots: range) -> Dict[int, int]:
        """Joins a replacement for the stage that is gone; returns, per microbatch it restored,
        the step to recompute from (the others start again from step 0)."""
        index = gone.stage
        self.stages[index].kill()
        for attempt in range(1, self.JOIN_ATTEMPTS + 1):
            candidate = self.replace(index)
            try:
                stage = candidate.join(self.restore)
                break
            except StageGone:
                candidate.kill()
                if attempt == self.JOIN_ATTEMPTS:
                    raise
                time.sleep(self.JOIN_PAUSE)
        self.stages[index] = stage
        resumed: Dict[int, int] = {}
        if self.restore:
            for (microbatch, held), tokens in stage.resume.items():
                if tuple(held) == (slots.start, slots.stop):
                    # Token `tokens` is the first one without KV: the step that starts there.
                    resumed[microbatch] = 0 if tokens < prompt else tokens - prompt + 1
        return resumed
