"""The daemons beside engine processes on one machine: a ``dejavud controller`` told the ring's
size and one ``dejavud sidecar`` per stage on loopback, each stage's ring successor the next
stage's sidecar (docs/deployment.md).

Each daemon picks its own port at its first start and says which (no port is chosen before it
is bound, so none can be taken meanwhile); ``restart_sidecar`` starts a dead sidecar again on the
same port, where its ring predecessor sends, and ``wait_for`` with ``restores`` waits until the
controller has restored it from its neighbours. Each daemon's log is ``<name>.log`` in the
working directory.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Callable, List, Optional, Tuple


def find_dejavud(given: Optional[str] = None) -> str:
    """``given``, else ``$DEJAVUD``, else ``dejavud`` on the ``PATH``."""
    path = given or os.environ.get("DEJAVUD") or shutil.which("dejavud")
    if not path:
        raise FileNotFoundError("no dejavud: pass its path, set DEJAVUD, or put it on the PATH")
    return path


class DaemonCluster:
    """A controller and ``stages`` sidecars (each ``region_bytes`` of shared memory) in ``workdir``
    (a new temporary directory by default)."""

    def __init__(
        self,
        stages: int,
        dejavud: Optional[str] = None,
        workdir: Optional[Path] = None,
        region_bytes: int = 64 << 20,
    ):
        if stages < 2:
            raise ValueError("a ring of sidecars needs at least 2 stages")
        self.dejavud = find_dejavud(dejavud)
        self.stages, self.region_bytes = stages, region_bytes
        self._tmp = None if workdir else tempfile.TemporaryDirectory(prefix="dejavu-")
        self.workdir = Path(workdir or self._tmp.name)
        self.ports: List[int] = [0] * stages
        self.processes: List[subprocess.Popen] = []
        try:
            self.controller = self._start_controller()
            self.sidecars = [self._start_sidecar(i) for i in range(stages)]
        except BaseException:
            self.stop()
            raise

    def socket(self, index: int) -> Path:
        return self.workdir / f"s{index}.sock"

    def successor(self, index: int) -> str:
        return f"127.0.0.1:{self.ports[(index + 1) % self.stages]}"

    def kill_sidecar(self, index: int) -> None:
        process = self.sidecars[index]
        process.kill()
        process.wait()

    def restart_sidecar(self, index: int, memory_bytes: Optional[int] = None) -> None:
        """Starts sidecar ``index`` again with the same command (its predecessor is dead); with
        ``memory_bytes``, keeping at most that many bytes of copies in memory and spilling the rest
        to ``spill_dir(index)``."""
        self.sidecars[index] = self._start_sidecar(index, memory_bytes)

    def spill_dir(self, index: int) -> Path:
        """Where sidecar ``index`` spills, when it was restarted with a memory budget."""
        return self.workdir / f"s{index}.spill"

    def metric(self, name: str) -> float:
        page = urllib.request.urlopen(f"http://{self.metrics}/metrics", timeout=5).read().decode()
        return next(float(line.split()[-1]) for line in page.splitlines() if line.startswith(name + " "))

    def wait_for(self, condition: Callable[[], bool], what: str, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            if time.monotonic() > deadline:
                raise TimeoutError(f"waited {timeout:.0f} s: never {what}")
            time.sleep(0.01)

    def fences(self) -> float:
        return self.metric("dejavu_controller_fences_total")

    def restores(self) -> float:
        return self.metric("dejavu_controller_recovery_seconds_count")

    def stop(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.kill()
            process.wait()
        if self._tmp is not None:
            self._tmp.cleanup()

    def __enter__(self) -> "DaemonCluster":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def _spawn(self, name: str, *args: str) -> subprocess.Popen:
        """Starts ``args``, its standard error appended to ``<name>.log``."""
        with open(self.workdir / f"{name}.log", "a") as log:
            process = subprocess.Popen(list(args), stdout=subprocess.PIPE, stderr=log, text=True)
        self.processes.append(process)
        return process

    def _listening(self, name: str, process: subprocess.Popen) -> Tuple[str, Optional[str]]:
        """The address ``process`` says it listens at, and where it serves metrics (if it does)."""
        metrics = None
        for line in process.stdout:
            if line.startswith("metrics "):
                metrics = line.split()[1]
            elif line.startswith("listening "):
                return line.split()[1], metrics
        process.wait()
        log = (self.workdir / f"{name}.log").read_text()[-2000:]
        raise RuntimeError(f"{name} did not start (exit status {process.returncode}):\n{log}")

    def _start_controller(self) -> subprocess.Popen:
        process = self._spawn(
            "controller", self.dejavud, "controller", "--listen=127.0.0.1:0",
            f"--state={self.workdir / 'controller.state'}", f"--stages={self.stages}", "--metrics=127.0.0.1:0",
        )
        self.controller_address, self.metrics = self._listening("controller", process)
        return process

    def _start_sidecar(self, index: int, memory_bytes: Optional[int] = None) -> subprocess.Popen:
        name = f"sidecar{index}"
        spill = [] if memory_bytes is None else [f"--spill-dir={self.spill_dir(index)}", f"--memory-bytes={memory_bytes}"]
        process = self._spawn(
            name, self.dejavud, "sidecar", f"--join={index}", f"--listen=127.0.0.1:{self.ports[index]}",
            f"--heartbeat={self.controller_address}", f"--local={self.socket(index)}",
            f"--shm-dir={self.workdir}", f"--region-bytes={self.region_bytes}", *spill,
        )
        self.ports[index] = int(self._listening(name, process)[0].rsplit(":", 1)[1])
        return process
