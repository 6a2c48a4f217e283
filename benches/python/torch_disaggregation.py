"""Disaggregation with the PyTorch engine, a prompt-heavy mix: each request's time colocated
(prompt and decode on the same stages) against disaggregated (the prompt on prompt stages, its KV
handed over, resharded, to token stages split by other layers and another TP degree, which
decode), and the hand-over's rate against a copy of the same bytes.

    python3 benches/python/torch_disaggregation.py [--device cuda] [--rounds 3]

Everything runs in this process, on one device, one stage after another: what is measured is the
work of each part and the hand-over's cost, not the gain of prompt and token stages computing at
once on devices of their own. The hand-over goes through a ``HostStore``: ``stream_out`` packs
each prompt rank's KV into the store and ``stream_in`` unpacks it into the token ranks (on a GPU
by the stages' pinned host mirrors, one copy each way more); one store serves every round, its
chunks replaced, as a serving system's would. Its limit row copies the same bytes twice in host
memory (out, then in). A first round warms up and is not counted; every round must give the same
tokens. Needs torch, transformers and the dejavu package.
"""

import argparse
import statistics
import time

import torch

import dejavu
from dejavu.torch_engine.disaggregation import hand_over
from dejavu.torch_engine.model import TorchStage
from torch_bench import add_common_arguments, parse, split


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def run(stages, prompts, new_tokens, device, token_stages=None, store=None):
    """Greedy tokens ``[batch, new_tokens]`` and the seconds of the prompt, the hand-over (0
    without ``token_stages``) and the decode."""
    slots = range(prompts.shape[0])
    began = time.perf_counter()
    x = prompts
    for stage in stages:
        x = stage.forward(x, slots, 0)
    synchronize(device)
    prompted = time.perf_counter()
    if token_stages is not None:
        hand_over(stages, token_stages, range(0, prompts.shape[1]), store)
        stages = token_stages
    synchronize(device)
    handed = time.perf_counter()
    tokens, position = [x.cpu()], prompts.shape[1]
    while len(tokens) < new_tokens:
        x = x.unsqueeze(1)
        for stage in stages:
            x = stage.forward(x, slots, position)
        tokens.append(x.cpu())
        position += 1
    decoded = time.perf_counter()
    return torch.stack(tokens, dim=1), (prompted - began, handed - prompted, decoded - handed)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_arguments(parser)
    parser.add_argument("--batch", type=int, default=4, help="sequences")
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--colocated-stages", type=int, default=2)
    parser.add_argument("--prompt-stages", type=int, default=2)
    parser.add_argument("--prompt-tp", type=int, default=2)
    parser.add_argument("--token-stages", type=int, default=3)
    parser.add_argument("--token-tp", type=int, default=1)
    args, shape = parse(parser)
    max_tokens = args.prompt + args.new_tokens
    prompts = torch.randint(0, shape.vocab, (args.batch, args.prompt), generator=torch.Generator().manual_seed(7))

    def stages(count, tp):
        return [TorchStage(shape, layers, args.batch, max_tokens, args.device, tp=tp) for layers in split(shape, count)]

    colocated = stages(args.colocated_stages, 1)
    prompt_stages = stages(args.prompt_stages, args.prompt_tp)
    token_stages = stages(args.token_stages, args.token_tp)
    kv_bytes = shape.kv_bytes_per_token() * args.batch * args.prompt
    # A copy of the hand-over's bytes out, then one in, in host memory: its limit.
    source, target = torch.ones(kv_bytes, dtype=torch.uint8), torch.empty(kv_bytes, dtype=torch.uint8)
    store = dejavu.HostStore()
    times = {"colocated": [], "disaggregated": []}
    copies = []
    expected = {}
    for round in range(args.rounds + 1):
        tokens, colocated_seconds = run(colocated, prompts, args.new_tokens, args.device)
        expected.setdefault("colocated", tokens)
        assert torch.equal(tokens, expected["colocated"]), "colocated: other tokens than the first round"
        tokens, disaggregated_seconds = run(prompt_stages, prompts, args.new_tokens, args.device, token_stages, store)
        expected.setdefault("disaggregated", tokens)
        assert torch.equal(tokens, expected["disaggregated"]), "disaggregated: other tokens than the first round"
        began = time.perf_counter()
        target.copy_(source)
        source.copy_(target)
        copied = time.perf_counter() - began
        if round > 0:
            times["colocated"].append(colocated_seconds)
            times["disaggregated"].append(disaggregated_seconds)
            copies.append(copied)
    same = torch.equal(expected["colocated"], expected["disaggregated"])
    print(f"{shape.layers} layers, hidden {shape.hidden}, {shape.heads} heads, {shape.kv_heads} KV heads of {shape.head_dim}, "
          f"{shape.dtype}, on {args.device}; {args.batch} sequences, prompt {args.prompt}, {args.new_tokens} new tokens; "
          f"colocated: {args.colocated_stages} stages at TP 1; disaggregated: {args.prompt_stages} prompt stages at TP "
          f"{args.prompt_tp} into {args.token_stages} token stages at TP {args.token_tp}; median of {args.rounds} rounds")
    medians = {name: [statistics.median(s[i] for s in rounds) for i in range(3)] for name, rounds in times.items()}
    for name, (prompt, handed, decode) in medians.items():
        total = prompt + handed + decode
        print(f"{name:>14}: {total * 1e3:9.1f} ms a request batch: prompt {prompt * 1e3:8.1f} ms, hand-over "
              f"{handed * 1e3:7.1f} ms, decode {decode * 1e3:8.1f} ms")
    (c_prompt, _, c_decode), (d_prompt, handed, d_decode) = medians["colocated"], medians["disaggregated"]
    copy = statistics.median(copies)
    print(f"disaggregated against colocated: {(d_prompt + handed + d_decode) / (c_prompt + c_decode):.3f}x the time")
    print(f"hand-over: {kv_bytes / 1e6:.1f} MB of KV at {kv_bytes / handed / 1e9:.2f} GB/s, {handed / d_prompt:.3f}x "
          f"the prompt's compute; a copy of the same bytes out and in: {kv_bytes / copy / 1e9:.2f} GB/s "
          f"(the hand-over at {copy / handed:.2f}x of its rate)")
    print(f"the same tokens as colocated: {same} (TP {args.prompt_tp} sums in another order than TP 1)")


if __name__ == "__main__":
    main()
