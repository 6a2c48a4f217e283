"""The connector's settings, from ``KVTransferConfig.kv_connector_extra_config``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict


@dataclass(frozen=True)
class ConnectorConfig:
    """Where the worker's sidecar is and how the connector uses it.

    ``sidecar``: the local socket of the ``dejavud sidecar`` beside this vLLM worker (its
    ``--local``). ``successor``: the ring successor's sidecar, "host:port" (its KV address), where
    the sidecar copies every saved token. ``keep_finished``: how many finished requests' KV the
    sidecar keeps, the latest, for later requests that share a prefix with them (by default none:
    the sidecar holds in-flight requests only). ``orphan_seconds``: how long a sequence no request
    of this engine owns (left by an engine that died) is kept for its request to come back and load
    it, before it is dropped. ``save_timeout`` and ``load_timeout``: seconds a step waits for its
    saves, and for a request's load, before the connector gives up on the sidecar and the engine
    goes on without it (a load not done is computed instead).
    """

    sidecar: str
    successor: str
    keep_finished: int = 0
    orphan_seconds: float = 300.0
    save_timeout: float = 30.0
    load_timeout: float = 30.0

    @classmethod
    def from_extra(cls, extra: Dict[str, Any]) -> "ConnectorConfig":
        """Reads the extra config; a missing ``sidecar`` or ``successor`` is a ``ValueError`` that
        names it."""
        missing = [key for key in ("sidecar", "successor") if not extra.get(key)]
        if missing:
            raise ValueError(
                f"DejaVuConnector needs kv_connector_extra_config {missing}: the local socket of "
                "the worker's dejavud sidecar and its ring successor's address"
            )
        known = {"sidecar", "successor", "keep_finished", "orphan_seconds", "save_timeout", "load_timeout"}
        unknown = set(extra) - known
        if unknown:
            raise ValueError(f"DejaVuConnector: unknown kv_connector_extra_config keys {sorted(unknown)}")
        if float(extra.get("orphan_seconds", 0.0)) < 0:
            raise ValueError(f"DejaVuConnector: orphan_seconds must be 0 or more, not {extra['orphan_seconds']}")
        return cls(
            sidecar=str(extra["sidecar"]),
            successor=str(extra["successor"]),
            keep_finished=int(extra.get("keep_finished", 0)),
            orphan_seconds=float(extra.get("orphan_seconds", 300.0)),
            save_timeout=float(extra.get("save_timeout", 30.0)),
            load_timeout=float(extra.get("load_timeout", 30.0)),
        )
