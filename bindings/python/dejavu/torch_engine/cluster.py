"""The daemons beside a pipeline of PyTorch stage processes (``dejavu.daemons.DaemonCluster``),
and the command of a stage process beside sidecar ``index`` (``DaemonCluster.stage_command``).
"""

from __future__ import annotations

import os
import sys
from typing import List, Optional

from .. import daemons
from .model import ModelShape


class DaemonCluster(daemons.DaemonCluster):
    """A controller and a ring of sidecars, one per stage process."""

    def stage_command(
        self,
        index: int,
        shape: ModelShape,
        layers: range,
        slots: int,
        max_tokens: int,
        device: str = "cpu",
        lag: int = 2,
        replicate: bool = True,
        threads: Optional[int] = None,
        microbatches: int = 1,
        resident: Optional[int] = None,
    ) -> List[str]:
        """The command of stage ``index``'s process (without a sidecar if not ``replicate``). Its
        torch CPU threads: ``threads``, by default one on a GPU (its CPU work is launching
        kernels) and this machine's CPUs shared among the stages on the CPU."""
        if threads is None:
            threads = 1 if device.startswith("cuda") else max(1, (os.cpu_count() or 1) // self.stages)
        command = [
            sys.executable, "-m", "dejavu.torch_engine", "stage", f"--shape={shape.to_json()}",
            f"--layers={layers.start}:{layers.stop}", f"--slots={slots}", f"--max-tokens={max_tokens}",
            f"--device={device}", f"--lag={lag}", f"--threads={threads}", f"--microbatches={microbatches}",
        ]
        if resident is not None:
            command.append(f"--resident={resident}")
        if replicate:
            command += [f"--socket={self.socket(index)}", f"--successor={self.successor(index)}"]
        return command
