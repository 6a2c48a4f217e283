"""What the scheduler side tells the worker side each step: the KV to load into a request's
blocks, the KV to save from them, and the sequences the sidecar may drop. Plain data, so that it
crosses from vLLM's engine-core process to its worker processes as vLLM sends it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Tuple

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

Span = Tuple[int, int]


@dataclass
class LoadJob:
    """Fetch ``chunks`` (layer and token spans) of sidecar sequence ``sequence`` into ``blocks``
    (the request's block table): tokens ``first..tokens`` of KV that vLLM does not compute."""

    request: str
    sequence: int
    first: int
    tokens: int
    chunks: List[Tuple[Span, Span]]
    blocks: List[int]


@dataclass
class SaveJob:
    """Save tokens ``start..end`` of the request in ``blocks`` into sidecar sequence ``sequence``,
    each layer as vLLM writes it, and their token ids ``ids`` beside them."""

    sequence: int
    start: int
    end: int
    ids: List[int]
    blocks: List[int]


@dataclass
class DejaVuMetadata(KVConnectorMetadata):
    """One step's loads, saves and releases, and whether it preempts requests (whose blocks go
    to others at once, so every save under way must be in first)."""

    loads: List[LoadJob] = field(default_factory=list)
    saves: List[SaveJob] = field(default_factory=list)
    releases: List[int] = field(default_factory=list)
    preempted: bool = False
