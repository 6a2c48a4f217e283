"""GPU <-> host rows of bench-report, from Python: the library's gather and scatter through the
`dejavu` package over per-layer [B][H][S][D] torch tensors, against one plain copy of the same
bytes on the same card, and what an engine would write without the library.

Run by `bench-report` (benches/src/gpu_host.rs) on the workload's geometry; prints one JSON row a
line. Exits with status 2 (and says why on stderr) where there is no CUDA device.
"""

import argparse
import json
import statistics
import sys
import time

WARM_UP = 10  # the first pinned copies of a sitting run slower
RUNS = 21
HEAD_DIM = 128


def timed(torch, f):
    """Median seconds of `f` followed by a device synchronisation, after `WARM_UP` untimed runs."""
    for _ in range(WARM_UP):
        f()
    torch.cuda.synchronize()
    times = []
    for _ in range(RUNS):
        start = time.perf_counter()
        f()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    for name in ("layers", "heads", "slots", "max-tokens", "decode-token", "prompt-tokens"):
        parser.add_argument(f"--{name}", type=int, required=True)
    a = parser.parse_args()
    try:
        import numpy as np
        import torch

        import dejavu
    except ImportError as e:
        print(f"skipped: {e}", file=sys.stderr)
        sys.exit(2)
    if not torch.cuda.is_available():
        print("skipped: no CUDA device", file=sys.stderr)
        sys.exit(2)
    print(f"device: {torch.cuda.get_device_name()}", file=sys.stderr)
    engine = dejavu.CudaEngine()
    spec = dejavu.KvSpec(layers=a.layers, kv_heads=a.heads, head_dim=HEAD_DIM, dtype="float16")
    layout = dejavu.KvLayout.per_layer(spec, a.slots, a.max_tokens, "bhsd")
    shape = (a.slots, a.heads, a.max_tokens, HEAD_DIM)
    tensors = [torch.randn(shape, dtype=torch.float16, device="cuda") for _ in layout.buffer_sizes]
    cache = engine.wrap(layout, tensors)
    t = a.decode_token
    cases = [
        (
            "decode step",
            dejavu.KvRegion(range(a.layers), range(a.slots), range(a.heads), range(t, t + 1)),
            lambda x: x[:, :, t],
        ),
        (
            f"{a.prompt_tokens}-token prompt",
            dejavu.KvRegion(range(a.layers), range(1), range(a.heads), range(a.prompt_tokens)),
            lambda x: x[0:1, :, : a.prompt_tokens],
        ),
    ]
    for name, region, piece in cases:
        for row in case_rows(np, torch, cache, tensors, name, region, piece):
            print(json.dumps(row), flush=True)


def case_rows(np, torch, cache, tensors, name, region, piece):
    n = cache.packed_len(region)
    device = torch.empty(n, dtype=torch.uint8, device="cuda")
    pinned = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    pageable_array = np.zeros(n, dtype=np.uint8)
    pageable = torch.from_numpy(pageable_array)
    plain_down = timed(torch, lambda: pinned.copy_(device, non_blocking=True))
    plain_up = timed(torch, lambda: device.copy_(pinned, non_blocking=True))
    plain_down_pageable = timed(torch, lambda: pageable.copy_(device))
    plain_up_pageable = timed(torch, lambda: device.copy_(pageable))

    gather_pinned = timed(torch, lambda: cache.gather(region, pinned))
    gather_pooled = timed(torch, lambda: cache.gather(region))
    gather_pageable = timed(torch, lambda: cache.gather(region, pageable_array))
    scatter_pinned = timed(torch, lambda: cache.scatter(region, pinned))
    scatter_pageable = timed(torch, lambda: cache.scatter(region, pageable_array))

    # Without the library: one stack of the step's slices then one pinned copy; or one pinned
    # copy per tensor.
    sample = piece(tensors[0])
    stacked_view = pinned.view(torch.float16).view(len(tensors), *sample.shape)

    def stack_then_copy():
        stacked_view.copy_(torch.stack([piece(x) for x in tensors]), non_blocking=True)

    def copy_per_tensor():
        for i, x in enumerate(tensors):
            stacked_view[i].copy_(piece(x), non_blocking=True)

    stacked = timed(torch, stack_then_copy)
    per_tensor = timed(torch, copy_per_tensor)

    gbps = lambda seconds: n / seconds / 1e9  # noqa: E731
    down = "one plain pinned device-to-host copy of the same bytes (torch)"
    up = "one plain pinned host-to-device copy of the same bytes (torch)"
    down_pageable = "one plain device-to-host copy of the same bytes into pageable memory (torch)"
    up_pageable = "one plain host-to-device copy of the same bytes from pageable memory (torch)"

    def row(what, seconds, limit_name, limit_seconds, target):
        return {
            "name": f"GPU per-layer BHSD {name}, {what} (Python)",
            "value": gbps(seconds),
            "limit_name": limit_name,
            "limit": gbps(limit_seconds),
            "target": target,
        }

    return [
        row("gather into a pinned torch tensor", gather_pinned, down, plain_down, 0.9),
        row("gather with no buffer (pooled pinned memory)", gather_pooled, down, plain_down, 0.9),
        row("scatter from a pinned torch tensor", scatter_pinned, up, plain_up, 0.9),
        row("gather into a pageable numpy array", gather_pageable, down_pageable, plain_down_pageable, 0.0),
        row("scatter from a pageable numpy array", scatter_pageable, up_pageable, plain_up_pageable, 0.0),
        row("gather into a pageable numpy array", gather_pageable, down, plain_down, 0.0),
        row("without the library: torch.stack + one pinned copy", stacked, down, plain_down, 0.0),
        row("without the library: one pinned copy per tensor", per_tensor, down, plain_down, 0.0),
    ]


if __name__ == "__main__":
    main()
