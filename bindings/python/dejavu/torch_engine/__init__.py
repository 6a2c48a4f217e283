"""A PyTorch engine for the runtime: a Hugging Face ``transformers`` Llama model with seeded random
weights (built from a config, no download), split into pipeline stages by layers, each stage a
process beside its ``dejavud sidecar``, its KV in per-layer tensors the library uses in place.

- ``model``: ``ModelShape`` (sizes, seed, dtype) and ``TorchStage`` (one stage's layers and KV).
- ``stage``: the stage process (``python -m dejavu.torch_engine stage``): standby, join, steps,
  replication to the sidecar with a bounded lag, restore after a failure.
- ``pipeline``: the driver: feeds steps through the stages, joins replacements, recomputes the
  steps after a replacement's resume point, checks recomputed tokens.
- ``disaggregation``: prompt stages hand their KV to token stages split another way.
- ``cluster``: the controller and the ring of sidecars on loopback.
- ``demo``: ``python -m dejavu.torch_engine demo``: failure-free, engine killed, worker killed and
  restart from scratch, with the replication overhead per decode step.

Needs ``torch`` and ``transformers`` (not dependencies of the ``dejavu`` package itself).
"""

from .model import ModelShape, TorchStage
from .pipeline import Pipeline, RecoveryDiverged, StageError, StageGone, StageProcess

__all__ = ["ModelShape", "Pipeline", "RecoveryDiverged", "StageError", "StageGone", "StageProcess", "TorchStage"]
