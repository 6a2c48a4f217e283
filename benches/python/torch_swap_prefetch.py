"""Microbatch swapping with the PyTorch engine: decode throughput with every microbatch's KV kept
on the device, against two kept and the others swapped through host memory, each swap started
ahead (the default) or in turn when its step comes, and against one kept (no prefetch possible).

    python3 benches/python/torch_swap_prefetch.py [--device cuda] [--rounds 3]

The stages run in this process, one pipeline of ``--stages`` stages (``generate``: each
microbatch's prompt, then one token at a time round the microbatches); the rounds take
the four settings in turn, and every setting must give the same tokens. Prints each setting's
median decode throughput (the prompts left out) and the bytes it swapped per decode step. Needs
torch, transformers and the dejavu package.
"""

import argparse
import statistics

import torch

from dejavu.torch_engine.model import TorchStage, generate
from torch_bench import add_common_arguments, parse, split


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_arguments(parser)
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8, help="sequences per microbatch")
    parser.add_argument("--prompt", type=int, default=384)
    parser.add_argument("--new-tokens", type=int, default=12)
    args, shape = parse(parser)
    layers = split(shape, args.stages)
    max_tokens = args.prompt + args.new_tokens
    m = args.microbatches
    prompts = torch.randint(0, shape.vocab, (m * args.batch, args.prompt), generator=torch.Generator().manual_seed(7))
    settings = {
        "all kept": dict(resident=m),
        "2 kept, swaps started ahead": dict(resident=2, prefetch=True),
        "2 kept, swaps in turn": dict(resident=2, prefetch=False),
        "1 kept": dict(resident=1),
    }
    rates = {name: [] for name in settings}
    swapped = {}
    expected = None
    for _ in range(args.rounds):
        for name, setting in settings.items():
            stages = [TorchStage(shape, l, args.batch, max_tokens, args.device, microbatches=m, **setting) for l in layers]
            rounds = []
            tokens = generate(stages, prompts, args.new_tokens, m, rounds)
            seconds = sum(rounds[1:])
            expected = tokens if expected is None else expected
            assert torch.equal(tokens, expected), f"{name}: other tokens"
            rates[name].append(m * args.batch * (args.new_tokens - 1) / seconds)
            swapped[name] = sum(s.swapped_bytes for s in stages) / (m * args.new_tokens)
            del stages
    kv = shape.kv_bytes_per_token(len(layers[0])) * args.batch * max_tokens / 1e6
    print(f"{shape.layers} layers, hidden {shape.hidden}, {shape.kv_heads} KV heads of {shape.head_dim}, {shape.dtype}; "
          f"{args.stages} stages on {args.device}, {m} microbatches of {args.batch} sequences, prompt {args.prompt}, "
          f"{args.new_tokens} new tokens; a microbatch's KV per stage up to {kv:.1f} MB; {args.rounds} rounds")
    base = statistics.median(rates["all kept"])
    for name, r in rates.items():
        rate = statistics.median(r)
        print(f"{name:>30}: {rate:8.1f} decode tokens/s ({rate / base:.2f}x of all kept), "
              f"{swapped[name] / 1e6:.1f} MB swapped per step")


if __name__ == "__main__":
    main()
