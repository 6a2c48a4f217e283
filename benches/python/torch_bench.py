"""What the PyTorch engine's throughput benches share: their options (the device, rounds, torch
threads and the model's shape, by default a Llama of 8 layers, hidden 512, 8 KV heads of 64,
float32), and the split of the model's layers into stages."""

import argparse
from typing import List, Tuple

import torch

from dejavu.torch_engine.model import ModelShape

#: The benches' model unless the options say otherwise: small enough for two CPU cores.
BENCH_SHAPE = ModelShape(layers=8, hidden=512, heads=8, kv_heads=8, intermediate=1024, vocab=512)


def add_common_arguments(parser: argparse.ArgumentParser) -> None:
    """``--device``, ``--rounds``, ``--threads`` and the model's shape."""
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    ModelShape.add_arguments(parser, BENCH_SHAPE)


def parse(parser: argparse.ArgumentParser) -> Tuple[argparse.Namespace, ModelShape]:
    """The options and the model's shape; torch takes the threads given."""
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    return args, ModelShape.from_arguments(args)


def split(shape: ModelShape, stages: int) -> List[range]:
    """The model's layers in ``stages`` stages of equal size, the last taking what is left."""
    per = shape.layers // stages
    return [range(i * per, shape.layers if i == stages - 1 else (i + 1) * per) for i in range(stages)]
