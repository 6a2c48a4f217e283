"""``DejaVuConnector``: vLLM's ``KVConnectorBase_V1``, its scheduler half in ``scheduler`` and
its worker half in ``worker``."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, Optional, Tuple

import torch
from vllm.distributed.kv_transfer.kv_connector.utils import get_current_attn_backends
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from .config import ConnectorConfig
from .plan import DejaVuMetadata
from .scheduler import SchedulerSide
from .worker import WorkerSide

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request


class DejaVuConnector(KVConnectorBase_V1):
    """Keeps every in-flight request's KV in the worker's ``dejavud sidecar``, copied to the ring
    successor's, token by token; a request submitted again after a crash (its prompt and the
    tokens generated so far) loads it instead of computing it. See ``dejavu.vllm``."""

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config: "KVCacheConfig" = None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        config = ConnectorConfig.from_extra(self._kv_transfer_config.kv_connector_extra_config or {})
        parallel = vllm_config.parallel_config
        if parallel.tensor_parallel_size * parallel.pipeline_parallel_size != 1:
            raise NotImplementedError("DejaVuConnector runs one worker per engine (no tensor or pipeline parallelism)")
        block_size = vllm_config.cache_config.block_size
        self._scheduler: Optional[SchedulerSide] = None
        self._worker: Optional[WorkerSide] = None
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = SchedulerSide(config, block_size)
        else:
            self._worker = WorkerSide(config, block_size)

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: Dict[str, Any]) -> bool:
        # Each layer's save is queued from save_kv_layer, which a replayed full CUDA graph skips:
        # vLLM then captures graphs piecewise, running the connector's calls between the pieces.
        return True

    # Worker side.

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self._worker is not None:
            self._worker.bind(self._metadata())

    def register_kv_caches(self, kv_caches: Dict[str, torch.Tensor]) -> None:
        backends = {b.get_name() for b in get_current_attn_backends(self._vllm_config, list(kv_caches))}
        if len(backends) != 1:
            raise NotImplementedError(f"DejaVuConnector: layers under several attention backends {sorted(backends)}")
        self._worker.register(kv_caches, backends.pop())

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        # vLLM calls it before the forward pass when a load is due (a synchronous load), after
        # it otherwise.
        self._worker.start_load(self._metadata())

    def wait_for_layer_load(self, layer_name: str) -> None:
        # Loads finish in start_load_kv, before the forward pass.
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        self._worker.save_layer(layer_name)

    def wait_for_save(self) -> None:
        if self.has_connector_metadata():
            self._worker.wait_for_save(self._metadata())

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        if isinstance(kv_connector_metadata, DejaVuMetadata) and kv_connector_metadata.preempted:
            self._worker.wait_for_every_save()

    def get_finished(self, finished_req_ids: set) -> Tuple[Optional[set], Optional[set]]:
        return self._worker.finished(finished_req_ids), None

    def get_block_ids_with_load_errors(self) -> set:
        return self._worker.load_errors()

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()

    # Scheduler side.

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> Tuple[int, bool]:
        return self._scheduler.matched(request, num_computed_tokens), False

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int) -> None:
        self._scheduler.allocated(request, num_external_tokens)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        return self._scheduler.build(scheduler_output)

    def request_finished(self, request: "Request", block_ids: list) -> Tuple[bool, Optional[dict]]:
        self._scheduler.finished(request)
        # Its blocks are freed once the worker reports its last saves in (get_finished), which it
        # does for every finished request, saved or not.
        return True, None

    def _metadata(self) -> DejaVuMetadata:
        meta = self._get_connector_metadata()
        assert isinstance(meta, DejaVuMetadata)
        return meta
