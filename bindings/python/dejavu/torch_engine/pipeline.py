"""The driver of a pipeline of stage processes: it feeds each step through the stages in order,
keeps every step's inputs, and, when a stage process dies, joins a replacement and recomputes the
steps after the replacement's resume point.

A batch of sequences in one microbatch moves in lockstep: step 0 is the prompt (tokens
``0..prompt``), step ``k`` the token at ``prompt + k - 1``. Each step's KV is one chunk, so a stage
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
        _, self.epoch, self.resume = self._call(("join", restore), "ready")
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


@dataclass
class Recovery:
    """One failure the driver recovered from."""

    #: The stage whose process died, and its exit status (negative: the signal that ended it).
    stage: int
    status: Optional[int]
    #: The step that found it dead, and the step recomputed from.
    failed_step: int
    resumed_step: int
    #: Seconds from the failure being found to the replacement joined and restored.
    join_seconds: float


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

    def step(self, slots: range, step: Step, replicate: bool) -> Tuple[torch.Tensor, float]:
        """Runs ``step`` through every stage: its outputs, and the seconds the stages spent on it
        (the rest of the step's time is the driver's and the pipes')."""
        x, inside = step.inputs, 0.0
        for stage in self.stages:
            (_, x, seconds) = stage.request(("step", (slots.start, slots.stop), step.start, x, replicate), "out")
            inside += seconds
        return x, inside

    def generate(
        self,
        prompts: torch.Tensor,
        new_tokens: int,
        slots: Optional[range] = None,
        replicate: Callable[[int], bool] = lambda step: True,
        before_step: Optional[Callable[[int, "Pipeline"], None]] = None,
    ) -> Generation:
        """Generates ``new_tokens`` tokens for each prompt (``[batch, prompt]`` token ids) in
        ``slots`` (by default the first ``batch``). ``replicate(step)`` says whether a step's KV is
        replicated; ``before_step(step, pipeline)`` runs once per step, before its first run (where
        a test or the demo injects a failure)."""
        batch, prompt = prompts.shape
        slots = range(batch) if slots is None else slots
        steps = [Step(0, prompts)]
        tokens: List[torch.Tensor] = []
        result = Generation(tokens=torch.empty(0), seconds=0.0)
        began = time.perf_counter()
        k, announced = 0, -1
        while len(tokens) < new_tokens:
            if k > announced:
                announced = k
                if before_step is not None:
                    before_step(k, self)
            t0 = time.perf_counter()
            try:
                out, inside = self.step(slots, steps[k], replicate(k))
            except StageGone as gone:
                k = self._recover(gone, k, prompt, slots, result)
                continue
            result.steps.append(StepTime(k, replicate(k), time.perf_counter() - t0, inside))
            if k < len(tokens):
                if not torch.equal(out, tokens[k]):
                    raise RecoveryDiverged(f"step {k} recomputed gave {out.tolist()}, first {tokens[k].tolist()}")
            else:
                tokens.append(out)
                steps.append(Step(prompt + k, out.unsqueeze(1)))
            k += 1
        result.seconds = time.perf_counter() - began
        result.tokens = torch.stack(tokens, dim=1)
        return result

    def _recover(self, gone: StageGone, failed_step: int, prompt: int, slots: range, result: Generation) -> int:
        """Joins a replacement for the stage that is gone; returns the step to recompute from."""
        t0 = time.perf_counter()
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
        resumed = stage.resume.get((0, (slots.start, slots.stop)), 0) if self.restore else 0
        # Token `resumed` is the first one without KV: the step that starts there.
        step = 0 if resumed < prompt else resumed - prompt + 1
        step = min(step, failed_step)
        result.recoveries.append(Recovery(index, gone.status, failed_step, step, time.perf_counter() - t0))
        return step
