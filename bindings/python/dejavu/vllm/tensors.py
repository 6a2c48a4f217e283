"""vLLM's per-layer KV tensors as the library's paged layouts, used in place.

vLLM 0.32 gives every attention layer one tensor, logically ``[num_blocks][H][block_size][2 * D]``.
What its last axis holds depends on the attention backend that reads it:

- its GPU backends (FlashAttention, Triton, FlexAttention) split it into a token's K vector of a
  head and then its V vector: the library's per-token interleave. The tensor's strides say whether
  a block stores its tokens outside its heads (vLLM's default ``LBNHC`` layout, the library's NHD
  order) or inside them (``LBHNC``, HND);
- its CPU backend reads each block and head as K for all the block's tokens, then V: the
  library's per-head interleave, K in pieces its kernels choose (``cpu_k_chunk``).

Nothing here runs on a GPU or needs one: the same description serves ``KvCache.wrap`` for CPU
tensors and ``CudaEngine.wrap`` for CUDA ones.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch

from .._dejavu import KvCache, KvLayout, KvRegion, KvSpec

DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}

#: vLLM's attention backends that split the last axis of a layer's tensor into K and V.
PER_TOKEN_BACKENDS = frozenset({"FLASH_ATTN", "TRITON_ATTN", "FLEX_ATTENTION"})

#: vLLM's CPU attention backend, which keeps each block's heads as K rows then V rows.
CPU_BACKEND = "CPU_ATTN"


@dataclass(frozen=True)
class PagedTensors:
    """vLLM's KV tensors described as one of the library's paged layouts: ``buffers`` (views of
    vLLM's own memory, C-contiguous, one per layer) in that layout's order."""

    spec: KvSpec
    block_size: int
    num_blocks: int
    order: str
    interleaved: str
    k_chunk: Optional[int]
    buffers: List[torch.Tensor]

    def layout(self, blocks: Sequence[int]) -> KvLayout:
        """The layout of one sequence whose blocks are ``blocks``."""
        return KvLayout.paged(
            self.spec,
            1,
            self.block_size,
            self.num_blocks,
            order=self.order,
            interleaved=self.interleaved,
            block_tables=[list(blocks)],
            k_chunk=self.k_chunk,
        )


def paged_tensors(tensors: Sequence[torch.Tensor], backend: str, block_size: int) -> PagedTensors:
    """Describes vLLM's per-layer tensors (in layer order) as read by ``backend`` (its
    ``get_name()``). ``NotImplementedError`` for a backend, shape, dtype or stride order the
    library has no layout for."""
    first = tensors[0]
    if first.dim() != 4 or first.dtype not in DTYPES or first.shape[2] != block_size:
        raise NotImplementedError(
            f"DejaVuConnector: KV tensors {tuple(first.shape)} of {first.dtype} are not "
            f"[num_blocks][kv_heads][{block_size}][2 * head_dim] of bfloat16, float16 or float32"
        )
    if any(t.shape != first.shape or t.dtype != first.dtype for t in tensors):
        raise NotImplementedError("DejaVuConnector: the layers' KV tensors differ in shape or dtype")
    num_blocks, heads, _, twice_dim = first.shape
    spec = KvSpec(layers=len(tensors), kv_heads=heads, head_dim=twice_dim // 2, dtype=DTYPES[first.dtype])
    if backend == CPU_BACKEND:
        if not all(t.is_contiguous() for t in tensors):
            raise NotImplementedError("DejaVuConnector: vLLM's CPU KV tensors are not contiguous")
        k_chunk = cpu_k_chunk(first.dtype, block_size, heads, twice_dim // 2)
        if k_chunk is None:
            raise NotImplementedError("DejaVuConnector: vLLM's CPU kernels keep K in an order not known here")
        return PagedTensors(spec, block_size, num_blocks, "hnd", "head", k_chunk, list(tensors))
    if backend in PER_TOKEN_BACKENDS:
        order, buffers = per_token_order(tensors)
        return PagedTensors(spec, block_size, num_blocks, order, "token", None, buffers)
    raise NotImplementedError(
        f"DejaVuConnector: the {backend} attention backend's KV is not supported; use one of "
        f"{sorted(PER_TOKEN_BACKENDS | {CPU_BACKEND})}"
    )


def per_token_order(tensors: Sequence[torch.Tensor]) -> Tuple[str, List[torch.Tensor]]:
    """The block order the tensors' strides give, and each as a C-contiguous view of its memory:
    tokens outside heads ("nhd", vLLM's LBNHC) or inside them ("hnd", LBHNC). A layout whose
    blocks interleave layers (vLLM's block-major ones) or whose heads lie outside its blocks
    (LHBNC) is refused."""
    if all(t.transpose(1, 2).is_contiguous() for t in tensors):
        return "nhd", [t.transpose(1, 2) for t in tensors]
    if all(t.is_contiguous() for t in tensors):
        return "hnd", list(tensors)
    raise NotImplementedError(
        f"DejaVuConnector: KV tensors of strides {tensors[0].stride()} are in neither of the layouts "
        "it reads, vLLM's LBNHC and LBHNC (its block-major layouts and LHBNC are not supported); "
        "set VLLM_KV_CACHE_LAYOUT=NHD"
    )


def cpu_k_chunk(dtype: torch.dtype, block_size: int, heads: int, head_dim: int) -> Optional[int]:
    """How vLLM's CPU attention kernels lay out a token's K in a block, found by having them write
    one: the elements of its vector they keep together (``k_chunk`` of the library's per-head paged
    layout; 1 for the portable kernels, which keep K transposed). ``None`` if no such layout
    holds what they wrote, V included."""
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    isa = _get_attn_isa(dtype, block_size, head_dim)
    block = torch.zeros(1, heads, block_size, 2 * head_dim, dtype=dtype)
    keys, values = block.view(1, heads, 2 * block_size, head_dim).chunk(2, dim=2)
    key = (torch.arange(heads * head_dim) % 251 + 1).reshape(1, heads, head_dim).to(dtype)
    token = 1
    ops.cpu_attn_reshape_and_cache(key, -key, keys, values, torch.tensor([token]), isa)
    written = torch.cat([key.flatten(), -key.flatten()]).view(torch.uint8).numpy().tobytes()
    spec = KvSpec(layers=1, kv_heads=heads, head_dim=head_dim, dtype=DTYPES[dtype])
    region = KvRegion(layers=(0, 1), slots=(0, 1), heads=(0, heads), tokens=(token, token + 1))
    for k_chunk in (d for d in range(1, head_dim + 1) if head_dim % d == 0):
        layout = KvLayout.paged(spec, 1, block_size, 1, "hnd", "head", [[0]], k_chunk=k_chunk)
        if bytes(KvCache.wrap(layout, [block]).gather(region)) == written:
            return k_chunk
    return None

