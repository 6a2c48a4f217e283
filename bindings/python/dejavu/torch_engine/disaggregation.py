"""Disaggregated serving with the PyTorch engine: prompt stages compute each sequence's prompt, then
hand its KV to token stages split another way, by layers and by TP degree (``stream_out`` /
``stream_in`` through a store, each rank a worker), which decode from there without computing the
prompt again.

``stream_out`` and ``stream_in`` take host caches: a stage whose KV is on a GPU hands it over
through its host mirrors (``TorchStage.host_mirrors``, pinned), one copy each way between the device
and the mirror.
"""

from __future__ import annotations

from typing import List, Optional

import torch

import dejavu

from .model import TorchStage


def setup_of(stages: List[TorchStage]) -> dejavu.Setup:
    """The ``dejavu.Setup`` of a pipeline of ``stages`` (each one worker per tensor-parallel rank,
    one microbatch of all its slots): the layers each holds, and its TP degree."""
    shape = stages[0].shape
    spec = dejavu.KvSpec(shape.layers, shape.kv_heads, shape.head_dim, shape.dtype)
    slots = stages[0].slots
    if any(s.shape != shape or s.slots != slots for s in stages):
        raise ValueError("the stages of a pipeline share one model shape and one slot count")
    setup = dejavu.Setup(spec, [(s.layers, s.tp) for s in stages], microbatch_slots=slots, microbatches=1)
    for index, stage in enumerate(stages):
        for rank in range(stage.tp):
            if setup.holding((index, rank))["heads"] != stage.rank_heads(rank):
                raise ValueError(f"rank {rank} of stage {index} holds heads {stage.rank_heads(rank)}, not the library's split")
    return setup


def hand_over(
    prompt_stages: List[TorchStage],
    token_stages: List[TorchStage],
    tokens: range,
    store: dejavu.Store,
    through_host: Optional[bool] = None,
) -> int:
    """Streams ``tokens`` of every sequence's KV from the prompt stages into the token stages,
    resharded to their layers and tensor-parallel ranks, through ``store``; returns the bytes
    received. A stage on a GPU goes through its host mirrors, and keeps them for the next
    hand-over (pinning them takes a while; ``drop_mirror`` frees them); ``through_host`` makes
    every stage go that way (``True``) or none (``False``)."""
    a, b = setup_of(prompt_stages), setup_of(token_stages)

    def mirrored(stage: TorchStage) -> bool:
        return stage.engine is not None if through_host is None else through_host

    for index, stage in enumerate(prompt_stages):
        slots = range(stage.slots)
        caches = stage.save_mirror(0, slots, tokens) if mirrored(stage) else stage.caches(0)
        for rank, cache in enumerate(caches):
            dejavu.stream_out(a, (index, rank), b, [cache], tokens, store)
    received = 0
    for index, stage in enumerate(token_stages):
        slots = range(stage.slots)
        through = mirrored(stage)
        caches, tensors = stage.host_mirrors() if through else (stage.caches(0), [])
        for rank, cache in enumerate(caches):
            received += dejavu.stream_in(a, b, (index, rank), [cache], tokens, store)["bytes"]
        if through:
            stage.load_tokens(0, tensors, slots, tokens)
        else:
            stage.restored(0, [(slots, tokens.stop)])
    return received


def generate_disaggregated(
    prompt_stages: List[TorchStage],
    token_stages: List[TorchStage],
    prompts: torch.Tensor,
    new_tokens: int,
    store: dejavu.Store,
    through_host: Optional[bool] = None,
) -> torch.Tensor:
    """Greedy generation with the prompt on ``prompt_stages`` and every later token on
    ``token_stages``: ``[batch, new_tokens]`` token ids, as ``model.generate`` on either split
    (``through_host`` as for ``hand_over``)."""
    batch, prompt = prompts.shape
    slots = range(batch)
    x = prompts
    for stage in prompt_stages:
        x = stage.forward(x, slots, 0)
    hand_over(prompt_stages, token_stages, range(0, prompt), store, through_host)
    tokens, start = [x.cpu()], prompt
    while len(tokens) < new_tokens:
        x = tokens[-1].unsqueeze(1)
        for stage in token_stages:
            x = stage.forward(x, slots, start)
        tokens.append(x.cpu())
        start += 1
    return torch.stack(tokens, dim=1)
