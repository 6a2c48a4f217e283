"""A vLLM KV connector whose in-flight requests survive a crash of the engine.

``DejaVuConnector`` keeps every token's KV of every running request in the ``dejavud sidecar``
beside the vLLM worker, which copies it to its ring successor's sidecar before the step that
computed it ends. When the engine dies mid-decode, a new engine is started on the same sidecar, and
whoever routes requests submits each unfinished one again: its prompt followed by the tokens it
had generated. The connector finds the request's KV by its token ids (an exact match, held beside
the KV in the sidecar), vLLM loads it instead of computing it, and greedy decoding goes on to the
same tokens as without the crash. A later request sharing a prefix with a running one (or with one of
the latest ``keep_finished`` finished ones) loads that prefix too.

Configure vLLM with::

    from vllm.config import KVTransferConfig
    KVTransferConfig(
        kv_connector="DejaVuConnector",
        kv_connector_module_path="dejavu.vllm",
        kv_role="kv_both",
        kv_load_failure_policy="recompute",   # a failed load is computed, not an error
        kv_connector_extra_config={"sidecar": "/run/dejavu/s0.sock", "successor": "10.0.0.2:7100"},
    )

Supported: one worker per engine, with vLLM's CPU attention backend or its GPU backends
(FlashAttention, Triton, FlexAttention) in its layer-major KV layouts (``LBNHC``, the default,
and ``LBHNC``): ``dejavu.vllm.tensors`` says how each backend's tensors are read. The connector's
tests run real vLLM on the CPU; vLLM was not run on a GPU with it, whose tensors it hands to the
library's CUDA copy kernels, in layouts the package's GPU tests check against the CPU copies
(the per-token layouts of vLLM's GPU backends have not run on a GPU yet). ``python -m
dejavu.vllm.run`` serves a list of requests with it, step by step.
"""

from .connector import DejaVuConnector

__all__ = ["DejaVuConnector"]
