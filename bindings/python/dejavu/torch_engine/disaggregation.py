"""Disaggregated serving with the PyTorch engine: prompt stages compute each sequence's prompt, then
hand its KV to token stages split another way (``stream_out`` / ``stream_in`` through a store),
which decode from there without computing the prompt again.

The stages' caches must be host memory (``TorchStage`` on the CPU): ``stream_out`` and
``stream_in`` take host caches.
"""

from __future__ import annotations

from typing import List

import torch

import dejavu

from .model import TorchStage


def setup_of(stages: List[TorchStage]) -> dejavu.Setup:
    """The ``dejavu.Setup`` of a pipeline of ``stages`` (each one worker, one microbatch of all its
    slots): the layers each holds."""
    shape = stages[0].shape
    spec = dejavu.KvSpec(shape.layers, shape.kv_heads, shape.head_dim, shape.dtype)
    slots = stages[0].slots
    if any(s.shape != shape or s.slots != slots for s in stages):
        raise ValueError("the stages of a pipeline share one model shape and one slot count")
    return dejavu.Setup(spec, [(s.layers, 1) for s in stages], microbatch_slots=slots, microbatches=1)


def hand_over(prompt_stages: List[TorchStage], token_stages: List[TorchStage], tokens: range, store: dejavu.Store) -> int:
    """Streams ``tokens`` of every sequence's KV from the prompt stages into the token stages,
    resharded to their layers, through ``store``; returns the bytes received."""
    a, b = setup_of(prompt_stages), setup_of(token_stages)
    for index, stage in enumerate(prompt_stages):
        dejavu.stream_out(a, (index, 0), b, [stage.cache], tokens, store)
    received = 0
    for index, stage in enumerate(token_stages):
        received += dejavu.stream_in(a, b, (index, 0), [stage.cache], tokens, store)["bytes"]
    return received


def generate_disaggregated(
    prompt_stages: List[TorchStage],
    token_stages: List[TorchStage],
    prompts: torch.Tensor,
    new_tokens: int,
    store: dejavu.Store,
) -> torch.Tensor:
    """Greedy generation with the prompt on ``prompt_stages`` and every later token on
    ``token_stages``: ``[batch, new_tokens]`` token ids, as ``model.generate`` on either split."""
    batch, prompt = prompts.shape
    slots = range(batch)
    x = prompts
    for stage in prompt_stages:
        x = stage.forward(x, slots, 0)
    hand_over(prompt_stages, token_stages, range(0, prompt), store)
    tokens, start = [x.cpu()], prompt
    while len(tokens) < new_tokens:
        x = tokens[-1].unsqueeze(1)
        for stage in token_stages:
            x = stage.forward(x, slots, start)
        tokens.append(x.cpu())
        start += 1
    return torch.stack(tokens, dim=1)
