"""Where a PyTorch engine's decode step spends its time: the same stages run in this process,
as stage processes without sidecars (with one torch CPU thread and with torch's default), and
as stage processes beside their sidecars (the demo's setup, replication off).

    python3 benches/python/torch_step_time.py --device cuda

Each row is the median decode step, in the driver and inside the stages. Needs torch,
transformers, the dejavu package and, for the last row, dejavud (``$DEJAVUD``).
"""

import argparse
import statistics
import sys
import time

import torch

from dejavu.torch_engine.cluster import DaemonCluster
from dejavu.torch_engine.demo import Run, Workload, decode_steps, median_ms
from dejavu.torch_engine.model import SEVEN_B, ModelShape, TorchStage
from dejavu.torch_engine.pipeline import Pipeline, StageProcess


def in_process(workload: Workload) -> float:
    """The median decode step of the stages built in this process, its tokens copied to the host."""
    w = workload
    stages = [TorchStage(w.shape, w.layers(i), w.batch, w.max_tokens, w.device) for i in range(w.stages)]
    x = w.prompts()
    times, start = [], 0
    for k in range(w.new_tokens):
        began = time.perf_counter()
        for stage in stages:
            x = stage.forward(x, range(w.batch), start)
        x = x.cpu()
        times.append(time.perf_counter() - began)
        start += 1 if k else w.prompt
        x = x.unsqueeze(1)
    del stages
    torch.cuda.empty_cache() if w.device.startswith("cuda") else None
    return statistics.median(times[1:]) * 1e3


def processes(workload: Workload, threads: int) -> tuple:
    """The median decode step of stage processes without sidecars, in the driver and inside."""
    w = workload
    with DaemonCluster(w.stages) as cluster:
        stages = [
            StageProcess(i, cluster.stage_command(
                i, w.shape, w.layers(i), w.batch, w.max_tokens, w.device, replicate=False, threads=threads,
            ))
            for i in range(w.stages)
        ]
        try:
            for stage in stages:
                stage.join(restore=False)
            generation = Pipeline(stages, replace=lambda i: None).generate(w.prompts(), w.new_tokens)
        finally:
            for stage in stages:
                stage.kill()
    steps = decode_steps(generation)
    return median_ms(steps), median_ms(steps, inside=True)


def main(argv) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    ModelShape.add_arguments(p, SEVEN_B)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=24)
    args = p.parse_args(argv)
    shape = ModelShape.from_arguments(args)
    w = Workload(shape, 2, args.batch, args.prompt, args.new_tokens, args.device)
    print(f"| setup | decode step, ms (median) | inside the stages, ms |")
    print(f"| stages in this process | {in_process(w):.2f} | |")
    for threads, label in ((1, "one torch thread"), (0, "torch's default threads")):
        outside, inside = processes(w, threads)
        print(f"| stage processes without sidecars, {label} | {outside:.2f} | {inside:.2f} |")
    run = Run(w, None)
    try:
        generation = run.generate(replicate=lambda k: False)
    finally:
        run.stop()
    steps = decode_steps(generation)
    print(f"| stage processes beside sidecars, replication off | {median_ms(steps):.2f} | {median_ms(steps, inside=True):.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
