"""Which parts of the PyTorch engine's step give other bits when run again on the same inputs.

Recovery is bit-identical only where recomputing a step reproduces it. Run on the device the
engine uses; each part runs five times on the same inputs, and every run is compared with the
first:

    python3 benches/python/torch_determinism.py --device cuda

Parts: the projections and the MLP at a decode step's and a prompt's batch, the RMS norm, the
attention with each of PyTorch's SDPA backends (decode and prompt), a whole stage's decode step,
and a whole greedy generation. Needs torch, transformers and the dejavu package.
"""

import argparse
import statistics
import sys
import time
from dataclasses import replace

import torch
import torch.nn.functional as F

from dejavu.torch_engine import model
from dejavu.torch_engine.model import SEVEN_B, ModelShape, TorchStage, generate

RUNS = 5


def repeats(run):
    """How many of RUNS - 1 further runs of ``run`` differ from its first, or why it cannot run."""
    try:
        first = run()
        return sum(not torch.equal(run(), first) for _ in range(RUNS - 1))
    except RuntimeError as e:
        return f"cannot run: {str(e).splitlines()[0][:80]}"


def main(argv) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    ModelShape.add_arguments(p, replace(SEVEN_B, layers=4))
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument(
        "--deterministic-algorithms", action="store_true",
        help="also turn torch.use_deterministic_algorithms on (the engine leaves it off)",
    )
    args = p.parse_args(argv)
    if args.deterministic_algorithms:
        torch.use_deterministic_algorithms(True, warn_only=True)
    shape = ModelShape.from_arguments(args)
    device, dtype = torch.device(args.device), shape.torch_dtype
    stage = TorchStage(shape, range(0, shape.layers), args.batch, args.prompt + 16, args.device)
    layer = stage.blocks[0]
    g = torch.Generator(device=device).manual_seed(7)
    decode = torch.randn(args.batch, 1, shape.hidden, device=device, dtype=dtype, generator=g)
    prompt = torch.randn(args.batch, args.prompt, shape.hidden, device=device, dtype=dtype, generator=g)
    rows = []
    with torch.inference_mode():
        for name, x in (("decode", decode), ("prompt", prompt)):
            rows.append((f"q projection, {name}", repeats(lambda: layer.self_attn.q_proj(x))))
            rows.append((f"MLP, {name}", repeats(lambda: layer.mlp(x))))
            rows.append((f"RMS norm, {name}", repeats(lambda: layer.input_layernorm(x))))
        from torch.nn.attention import SDPBackend, sdpa_kernel

        kv = torch.randn(args.batch, shape.heads, args.prompt, shape.head_dim, device=device, dtype=dtype, generator=g)
        # A decode step's key count is seldom a multiple of 8 (the prompt's plus the steps so far).
        for keys in (args.prompt, args.prompt + 1):
            kv = torch.randn(args.batch, shape.heads, keys, shape.head_dim, device=device, dtype=dtype, generator=g)
            for name, count in (("decode", 1), ("prompt", keys)):
                q = torch.randn(args.batch, shape.heads, count, shape.head_dim, device=device, dtype=dtype, generator=g)
                positions = torch.arange(keys - count, keys, device=device)
                allowed = torch.arange(keys, device=device).unsqueeze(0) <= positions.unsqueeze(1)
                for masked in (True, False):
                    how = "boolean mask" if masked else ("no mask" if count == 1 else "is_causal")
                    for backend in (None, SDPBackend.MATH, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION):
                        def attend(backend=backend, q=q, kv=kv, allowed=allowed, masked=masked, count=count):
                            mask, causal = (allowed, False) if masked else (None, count > 1)
                            if backend is None:
                                return F.scaled_dot_product_attention(q, kv, kv, attn_mask=mask, is_causal=causal)
                            with sdpa_kernel(backend):
                                return F.scaled_dot_product_attention(q, kv, kv, attn_mask=mask, is_causal=causal)

                        label = "default backend" if backend is None else backend.name
                        rows.append((f"attention {label}, {name}, {keys} keys, {how}", repeats(attend)))
        tokens = torch.randint(0, shape.vocab, (args.batch, args.prompt), generator=torch.Generator().manual_seed(1))
        stage.forward(tokens, range(args.batch), 0)
        step = tokens[:, :1]
        decode_step = lambda: stage.forward(step, range(args.batch), args.prompt, logits=True)  # noqa: E731
        rows.append(("a stage's decode step", repeats(decode_step)))
        rows.append(("greedy generation, 8 tokens", repeats(lambda: generate([stage], tokens, 8))))
        # The same with cuDNN's attention allowed, and with a boolean mask on every step.
        backends = model.ATTENTION_BACKENDS
        model.ATTENTION_BACKENDS = backends + [SDPBackend.CUDNN_ATTENTION]
        rows.append(("a stage's decode step, cuDNN attention allowed", repeats(decode_step)))
        rows.append(("greedy generation, 8 tokens, cuDNN attention allowed", repeats(lambda: generate([stage], tokens, 8))))
        model.ATTENTION_BACKENDS = backends
        unmasked = stage._attention_mask

        def always_masked(start, count):
            end = start + count
            positions = torch.arange(start, end, device=device)
            return torch.arange(end, device=device).unsqueeze(0) <= positions.unsqueeze(1)

        stage._attention_mask = always_masked
        rows.append(("a stage's decode step, boolean mask", repeats(decode_step)))
        rows.append(("greedy generation, 8 tokens, boolean mask", repeats(lambda: generate([stage], tokens, 8))))
        stage._attention_mask = unmasked
        again = TorchStage(shape, range(0, shape.layers), args.batch, args.prompt + 16, args.device)
        same = all(torch.equal(a, b) for a, b in zip(stage.blocks.parameters(), again.blocks.parameters()))
        rows.append(("the weights built again differ", "no" if same else "yes"))
        del again
        times = []
        for _ in range(20):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            began = time.perf_counter()
            decode_step().cpu()
            times.append(time.perf_counter() - began)
        rows.append((f"a stage's decode step ({shape.layers} layers), median ms of 20", f"{statistics.median(times) * 1e3:.2f}"))
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"{name}, torch {torch.__version__}: runs of {RUNS} on the same inputs differing from the first")
    for what, differing in rows:
        print(f"| {what} | {differing} |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
