"""Times ``SidecarClient.step_done`` of decode steps of a 13B-class worker, from Python, through a
running ring of sidecars: the Python half of ``bench-report``'s "the replication path at real
sizes" rows (``benches/src/path.rs`` starts the sidecars and runs this).

The cache is per-layer BHSD numpy arrays (40 layers x 40 KV heads x 128, fp16, 32 slots), wrapped
in place. For each batch size given, it prints one JSON line: the step's bytes, the median time of
``step_done`` and the median time of ``KvCache.gather`` of the same region into a preallocated
array, both in seconds.
"""

import argparse
import json
import os
import statistics
import time

# numpy's BLAS threads, idle here, would spin on the cores the sidecars need.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import numpy as np  # noqa: E402

import dejavu  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--socket", required=True, help="the first sidecar's local socket")
    parser.add_argument("--successor", required=True, help="its successor's address (host:port)")
    parser.add_argument("--epoch", type=int, required=True, help="newer than the engine before")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    args = parser.parse_args()

    spec = dejavu.KvSpec(layers=40, kv_heads=40, head_dim=128, dtype="float16")
    layout = dejavu.KvLayout.per_layer(spec, max(args.batches), 2, "bhsd")
    rng = np.random.default_rng(7)
    # Every byte written, so that no zero page flatters a read.
    buffers = [rng.integers(0, 256, size=n, dtype=np.uint8) for n in layout.buffer_sizes]
    cache = dejavu.KvCache.wrap(layout, buffers)
    client = dejavu.SidecarClient(args.socket, args.successor, epoch=args.epoch, stage=0, member=False)
    client.register(cache)

    for batch in args.batches:
        region = dejavu.KvRegion(layers=range(40), slots=range(batch), heads=range(40), tokens=range(1, 2))
        out = np.empty(cache.packed_len(region), dtype=np.uint8)
        # One untimed step: pages touched before any clock runs.
        client.step_done(0, range(batch), range(1, 2))
        steps, gathers = [], []
        for _ in range(args.steps):
            started = time.perf_counter()
            client.step_done(0, range(batch), range(1, 2))
            steps.append(time.perf_counter() - started)
            started = time.perf_counter()
            cache.gather(region, out)
            gathers.append(time.perf_counter() - started)
        line = {"bytes": len(out), "step": statistics.median(steps), "gather": statistics.median(gathers)}
        print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
