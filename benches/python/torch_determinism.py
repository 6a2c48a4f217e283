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
import sys

import torch
import torch.nn.functional as F

from dejavu.torch_engine.model import ModelShape, TorchStage, generate

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
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=32)
    p.add_argument("--intermediate", type=int, default=11008)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--prompt", type=int, default=128)
    args = p.parse_args(argv)
    shape = ModelShape(
        layers=args.layers, hidden=args.hidden, heads=args.heads, kv_heads=args.kv_heads,
        intermediate=args.intermediate, vocab=args.vocab, dtype=args.dtype,
    )
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
        for name, count in (("decode", 1), ("prompt", args.prompt)):
            q = torch.randn(args.batch, shape.heads, count, shape.head_dim, device=device, dtype=dtype, generator=g)
            positions = torch.arange(args.prompt - count, args.prompt, device=device)
            allowed = torch.arange(args.prompt, device=device).unsqueeze(0) <= positions.unsqueeze(1)
            for backend in (SDPBackend.MATH, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION):
                def attend(backend=backend, q=q, allowed=allowed):
                    with sdpa_kernel(backend):
                        return F.scaled_dot_product_attention(q, kv, kv, attn_mask=allowed)

                rows.append((f"attention {backend.name}, {name}", repeats(attend)))
            rows.append((f"attention (default backend), {name}", repeats(lambda q=q, a=allowed: F.scaled_dot_product_attention(q, kv, kv, attn_mask=a))))
        tokens = torch.randint(0, shape.vocab, (args.batch, args.prompt), generator=torch.Generator().manual_seed(1))
        stage.forward(tokens, range(args.batch), 0)
        step = tokens[:, :1]
        rows.append(("a stage's decode step", repeats(lambda: stage.forward(step, range(args.batch), args.prompt, logits=True))))
        rows.append(("greedy generation, 8 tokens", repeats(lambda: generate([stage], tokens, 8))))
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"{name}, torch {torch.__version__}: runs of {RUNS} on the same inputs differing from the first")
    for what, differing in rows:
        print(f"| {what} | {differing} |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
