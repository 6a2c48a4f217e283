"""One pipeline stage of a Hugging Face ``transformers`` Llama model with seeded random weights.

The model is built from a config only (no download): the same ``ModelShape`` and seed give the
same weights in every process on the same kind of device, so a replacement stage computes exactly
what the stage it replaces did. A stage keeps the model's layers ``layers`` and its KV in one K and one V tensor per layer,
``[slots][kv_heads][max_tokens][head_dim]`` (the layout Hugging Face's static cache uses), which the
library wraps in place: ``KvCache.wrap`` on the CPU, ``CudaEngine.wrap`` on a GPU.

Attention is computed here over those tensors with the model's own projections, norms, rotary
embedding and MLPs; ``tests/test_torch_engine.py`` checks the logits against the model's own
forward pass.
"""

from __future__ import annotations

import json
import os
import threading
import time
import zlib
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import dejavu

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class ModelShape:
    """A Llama model's sizes and the seed of its random weights."""

    layers: int = 4
    hidden: int = 128
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 256
    vocab: int = 512
    seed: int = 0
    dtype: str = "float32"
    #: The standard deviation of the random weights (``transformers``' ``initializer_range``).
    init_std: float = 0.02

    def __post_init__(self) -> None:
        for name in ("layers", "hidden", "heads", "kv_heads", "intermediate", "vocab"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, not {getattr(self, name)}")
        if self.hidden % self.heads:
            raise ValueError(f"hidden ({self.hidden}) is not a multiple of heads ({self.heads})")
        if self.heads % self.kv_heads:
            raise ValueError(f"heads ({self.heads}) is not a multiple of kv_heads ({self.kv_heads})")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype {self.dtype!r}: use one of {', '.join(DTYPES)}")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    def kv_bytes_per_token(self, layers: Optional[int] = None) -> int:
        """KV bytes one token of one sequence takes in ``layers`` layers (all by default)."""
        layers = self.layers if layers is None else layers
        return 2 * layers * self.kv_heads * self.head_dim * torch.tensor([], dtype=self.torch_dtype).element_size()

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "ModelShape":
        return cls(**json.loads(text))

    @staticmethod
    def add_arguments(parser, defaults: Optional["ModelShape"] = None) -> None:
        """Adds the shape's command-line options to ``parser`` (``argparse``), defaulting to
        ``defaults`` (the tiny test model by default; ``SEVEN_B`` for a GPU)."""
        d = defaults or ModelShape()
        parser.add_argument("--layers", type=int, default=d.layers)
        parser.add_argument("--hidden", type=int, default=d.hidden)
        parser.add_argument("--heads", type=int, default=d.heads)
        parser.add_argument("--kv-heads", type=int, default=d.kv_heads)
        parser.add_argument("--intermediate", type=int, default=d.intermediate)
        parser.add_argument("--vocab", type=int, default=d.vocab)
        parser.add_argument("--dtype", default=d.dtype, help="float32, float16 or bfloat16")
        parser.add_argument("--seed", type=int, default=d.seed, help="the seed of the random weights")
        parser.add_argument("--init-std", type=float, default=d.init_std, help="their standard deviation")

    @classmethod
    def from_arguments(cls, args) -> "ModelShape":
        """The shape ``add_arguments``' options give (``ValueError`` naming a wrong one)."""
        return cls(
            layers=args.layers, hidden=args.hidden, heads=args.heads, kv_heads=args.kv_heads,
            intermediate=args.intermediate, vocab=args.vocab, seed=args.seed, dtype=args.dtype,
            init_std=args.init_std,
        )

    def config(self):
        """The model's ``transformers.LlamaConfig``."""
        from transformers import LlamaConfig

        return LlamaConfig(
            vocab_size=self.vocab,
            hidden_size=self.hidden,
            intermediate_size=self.intermediate,
            num_hidden_layers=self.layers,
            num_attention_heads=self.heads,
            num_key_value_heads=self.kv_heads,
            max_position_embeddings=1 << 16,
            tie_word_embeddings=False,
            initializer_range=self.init_std,
        )

    def build(self, device: str = "cpu", layers: Optional[range] = None) -> torch.nn.Module:
        """The model (``LlamaForCausalLM``) on ``device``, with only the modules of ``layers`` (all
        by default) given weights: the embedding with layer 0, the final norm and the head with the
        last layer; the others stay on the meta device, without memory.

        Each weight is drawn from a generator of its own, seeded by ``seed`` and the weight's name,
        so a stage gets the same weights as the whole model on the same kind of device, without
        drawing the others' (norm weights are ones, as the model's own initialization has them)."""
        from transformers import LlamaForCausalLM
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        config = self.config()
        layers = range(self.layers) if layers is None else layers
        device = torch.device(device)
        with torch.device("meta"):
            model = LlamaForCausalLM(config)
        inner = model.model
        kept = {f"model.layers.{i}": inner.layers[i] for i in layers}
        if layers.start == 0:
            kept["model.embed_tokens"] = inner.embed_tokens
        if layers.stop == self.layers:
            kept.update({"model.norm": inner.norm, "lm_head": model.lm_head})
        for prefix, module in kept.items():
            module.to_empty(device=device)
            module.to(self.torch_dtype)
            for name, weight in module.named_parameters(prefix=prefix):
                if name.endswith("norm.weight"):
                    weight.data.fill_(1.0)
                else:
                    seed = zlib.crc32(f"{self.seed}/{name}".encode())
                    generator = torch.Generator(device=device).manual_seed(seed)
                    weight.data.normal_(0.0, config.initializer_range, generator=generator)
        # Its frequencies are computed when it is made: not on the meta device.
        inner.rotary_emb = LlamaRotaryEmbedding(config).to(device)
        return model.eval()


#: A 7B-class Llama (32 layers, hidden 4096, 32 heads and KV heads of 128, bf16): the GPU
#: figures' model.
SEVEN_B = ModelShape(layers=32, hidden=4096, heads=32, kv_heads=32, intermediate=11008, vocab=32000, dtype="bfloat16")


def deterministic_cuda() -> None:
    """Makes this process's CUDA math give the same bits every time: a step recomputed after a
    failure (by a replacement process, or by a stage that lived) must give the tokens the first
    run gave, and a random model's nearly flat logits turn any difference into another token.
    cuBLAS picks its algorithms by the workspace it has unless the workspace is fixed; set before
    the process's first matrix product. (The attention's part is ``ATTENTION_BACKENDS``.)"""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")


#: The SDPA kernels the stage's attention may use. cuDNN's is left out: on an H200 (torch 2.11,
#: cuDNN 9) it gave other bits on the same inputs at key counts that are not a multiple of 8,
#: which a decode step's mostly are (``benches/python/torch_determinism.py``); the others gave
#: the same bits every time.
ATTENTION_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


class KvShard:
    """One tensor-parallel rank's KV of a microbatch on the stage's device: a K and a V tensor per
    layer, ``[slots][the rank's kv_heads][max_tokens][head_dim]``, and the library's cache over
    them (in place)."""

    def __init__(self, layout: dejavu.KvLayout, size: tuple, dtype: torch.dtype, device: torch.device, engine):
        layers = layout.spec.layers
        self.keys = [torch.zeros(size, dtype=dtype, device=device) for _ in range(layers)]
        self.values = [torch.zeros(size, dtype=dtype, device=device) for _ in range(layers)]
        buffers = self.tensors()
        self.cache = engine.wrap(layout, buffers) if engine is not None else dejavu.KvCache.wrap(layout, buffers)

    def tensors(self) -> List[torch.Tensor]:
        """K and V of each layer, in the layout's buffer order."""
        return [t for pair in zip(self.keys, self.values) for t in pair]


class KvSet:
    """One microbatch's worth of KV on the stage's device: a ``KvShard`` per tensor-parallel rank
    (one at TP 1)."""

    def __init__(self, shards: List[KvShard]):
        self.shards = shards
        #: The microbatch whose KV it holds, if any.
        self.holds: Optional[int] = None
        #: A prefetch swapping ``holds`` in, while it runs: wait for it before using the set.
        self.loading: Optional[Future] = None

    def settle(self) -> None:
        """Waits for the prefetch into this set, if one runs (raising what it raised)."""
        loading, self.loading = self.loading, None
        if loading is not None:
            loading.result()

    def _only(self) -> KvShard:
        if len(self.shards) != 1:
            raise ValueError(f"the stage's KV is split among {len(self.shards)} tensor-parallel ranks: use shards")
        return self.shards[0]

    @property
    def keys(self) -> List[torch.Tensor]:
        """The K tensors of a stage at TP 1."""
        return self._only().keys

    @property
    def values(self) -> List[torch.Tensor]:
        """The V tensors of a stage at TP 1."""
        return self._only().values

    @property
    def cache(self):
        """The library's cache of a stage at TP 1."""
        return self._only().cache

    def tensors(self) -> List[torch.Tensor]:
        """K and V of each layer of each rank in turn (each rank's in its layout's buffer order)."""
        return [t for shard in self.shards for t in shard.tensors()]


@dataclass(frozen=True)
class RankWeights:
    """One tensor-parallel rank's part of a decoder layer (Megatron's split): the rows of its query,
    key and value heads and of its share of the MLP's gate and up projections, and the matching
    columns of the attention's output projection and of the MLP's down projection. Views of the
    layer's weights, not copies."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    o: torch.Tensor
    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor

    @classmethod
    def of(cls, layer, shape: "ModelShape", rank: int, tp: int) -> "RankWeights":
        attention, mlp = layer.self_attn, layer.mlp
        for linear in (attention.q_proj, attention.k_proj, attention.v_proj, attention.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj):
            if linear.bias is not None:
                raise ValueError("a tensor-parallel stage takes a Llama without biases")
        queries = shape.heads // tp * shape.head_dim
        kv = shape.kv_heads // tp * shape.head_dim
        inner = shape.intermediate // tp
        q, k, i = slice(rank * queries, (rank + 1) * queries), slice(rank * kv, (rank + 1) * kv), slice(rank * inner, (rank + 1) * inner)
        return cls(
            q=attention.q_proj.weight[q], k=attention.k_proj.weight[k], v=attention.v_proj.weight[k],
            o=attention.o_proj.weight[:, q], gate=mlp.gate_proj.weight[i], up=mlp.up_proj.weight[i],
            down=mlp.down_proj.weight[:, i],
        )


def all_reduce(partials: List[torch.Tensor]) -> torch.Tensor:
    """The sum of the ranks' partial outputs, in rank order (what a TP engine's all-reduce gives)."""
    total = partials[0]
    for partial in partials[1:]:
        total = total + partial
    return total


class TorchStage:
    """Layers ``layers`` of the model of ``shape`` on ``device``, with the KV of ``microbatches``
    microbatches of ``slots`` sequences of up to ``max_tokens`` tokens each.

    ``forward`` takes token ids (the first stage) or hidden states (the others) of a contiguous
    range of one microbatch's slots, all at the same positions, and returns hidden states, or, from
    the last stage, each sequence's next token (greedy).

    With ``resident`` fewer than ``microbatches``, only that many microbatches' KV stay on the
    device (microbatch swapping): a step of another one first swaps the least recently used one
    out to host memory (pinned on a GPU) and its own in, each as one gather or scatter of the
    tokens written so far through the library's copies.

    With ``prefetch`` (the default) and at least two resident microbatches, a step of microbatch
    ``m`` also starts swapping ``m + 1`` in (the order both drivers step microbatches in) on a
    thread of the stage's, into the least recently used set other than ``m``'s, while ``m``
    computes; the step of ``m + 1`` waits for it. On a GPU the copies wait for the kernels queued
    on the compute stream so far (an event), and run on a stream of their own. A set's KV may
    still be read by the replication streamer: ``before_swap_out(microbatch)``, when set, is called
    before the set holding ``microbatch`` is swapped out, and returns once nothing reads it.

    With ``tp`` above 1, the stage computes as that many tensor-parallel ranks (Megatron's split:
    each rank its share of the query and KV heads and of the MLP, their partial outputs summed as
    an all-reduce sums them), in turn in this process, and each rank keeps its heads' KV in tensors
    and a cache of its own (``caches``), as the ranks of a TP engine do on their own devices: what
    a hand-over across a change of TP degree reshards. The sums' order differs from one product's,
    so the hidden states differ from a TP 1 stage's in the last bits.
    """

    def __init__(
        self,
        shape: ModelShape,
        layers: range,
        slots: int,
        max_tokens: int,
        device: str = "cpu",
        microbatches: int = 1,
        resident: Optional[int] = None,
        prefetch: bool = True,
        tp: int = 1,
    ):
        if not (0 <= layers.start < layers.stop <= shape.layers) or layers.step != 1:
            raise ValueError(f"layers {layers} are not a non-empty range within the model's {shape.layers}")
        if slots < 1 or max_tokens < 1:
            raise ValueError("a stage needs at least one slot and one token")
        resident = microbatches if resident is None else resident
        if microbatches < 1 or not 1 <= resident <= microbatches:
            raise ValueError(f"{resident} resident microbatches of {microbatches}: give 1 to {microbatches}")
        if tp < 1:
            raise ValueError(f"a TP degree of {tp}: give 1 or more")
        for name in ("heads", "kv_heads", "intermediate"):
            if getattr(shape, name) % tp:
                raise ValueError(f"TP {tp} does not divide the model's {name} ({getattr(shape, name)})")
        self.shape, self.layers, self.slots, self.max_tokens, self.tp = shape, layers, slots, max_tokens, tp
        self.microbatches = microbatches
        self.device = torch.device(device)
        if self.device.type == "cuda":
            deterministic_cuda()
        self.first, self.last = layers.start == 0, layers.stop == shape.layers
        model = shape.build(device, layers)
        inner = model.model
        self.embed = inner.embed_tokens if self.first else None
        self.blocks = inner.layers[layers.start : layers.stop]
        self.rotary = inner.rotary_emb
        self.norm = inner.norm if self.last else None
        self.head = model.lm_head if self.last else None
        #: Per layer, each rank's part of its weights.
        self.rank_weights = [[RankWeights.of(block, shape, r, tp) for r in range(tp)] for block in self.blocks]
        #: The KV heads each rank holds.
        self.rank_kv_heads = shape.kv_heads // tp
        spec = dejavu.KvSpec(len(layers), self.rank_kv_heads, shape.head_dim, shape.dtype)
        #: The layout of one rank's KV (all of it at TP 1).
        self.layout = dejavu.KvLayout.per_layer(spec, slots, max_tokens, "bhsd")
        self.engine = dejavu.CudaEngine(self.device.index or 0) if self.device.type == "cuda" else None
        size = (slots, self.rank_kv_heads, max_tokens, shape.head_dim)

        def shard() -> KvShard:
            return KvShard(self.layout, size, shape.torch_dtype, self.device, self.engine)

        self.sets = [KvSet([shard() for _ in range(tp)]) for _ in range(resident)]
        self.swapping = resident < microbatches
        if not self.swapping:
            for m, kv in enumerate(self.sets):
                kv.holds = m
        #: Per microbatch, the tokens whose KV it holds (what a swap moves).
        self.lengths = [0] * microbatches
        #: Where each microbatch's packed KV is while it is swapped out: host memory, pinned on a
        #: GPU, allocated here rather than in a step (pinning takes a while).
        self.homes: Dict[int, torch.Tensor] = {}
        if self.swapping:
            full = tp * self._packed_len(self.region(range(slots), range(0, max_tokens)))
            pin = self.engine is not None
            self.homes = {m: torch.empty(full, dtype=torch.uint8, pin_memory=pin) for m in range(microbatches)}
        self.recent: List[KvSet] = list(self.sets)
        #: Swaps so far: microbatches swapped in and their bytes, swapped out and their bytes.
        self.swap_ins = self.bytes_in = self.swap_outs = self.bytes_out = 0
        self._swapped_lock = threading.Lock()
        #: Called with a microbatch before the set holding it is swapped out (see the class).
        self.before_swap_out: Optional[Callable[[int], None]] = None
        #: The thread prefetches run on, and on a GPU their stream.
        self._prefetcher = ThreadPoolExecutor(1, "swap-in") if prefetch and self.swapping and resident > 1 else None
        self._copy_stream = torch.cuda.Stream(self.device) if self._prefetcher and self.engine is not None else None
        #: Swaps started ahead of their step so far (one started for a microbatch the driver then
        #: does not step next is undone by a later swap).
        self.prefetches = 0
        self._mirror: Optional[Tuple[List[dejavu.KvCache], List[torch.Tensor]]] = None

    @property
    def keys(self) -> List[torch.Tensor]:
        """Microbatch 0's K tensors (swapped in), at TP 1."""
        return self.kv(0).keys

    @property
    def values(self) -> List[torch.Tensor]:
        """Microbatch 0's V tensors (swapped in), at TP 1."""
        return self.kv(0).values

    @property
    def cache(self):
        """The library's cache over microbatch 0's tensors (swapped in), at TP 1."""
        return self.kv(0).cache

    def caches(self, microbatch: int = 0) -> list:
        """The library's cache over each rank's KV of ``microbatch`` (swapped in)."""
        return [shard.cache for shard in self.kv(microbatch).shards]

    def rank_heads(self, rank: int) -> Tuple[int, int]:
        """The model's KV heads ``rank`` holds, ``(first, end)``."""
        return rank * self.rank_kv_heads, (rank + 1) * self.rank_kv_heads

    def _packed_len(self, region: dejavu.KvRegion) -> int:
        """The bytes of one rank's ``region`` packed."""
        return self.sets[0].shards[0].cache.packed_len(region)

    def kv(self, microbatch: int) -> KvSet:
        """The set holding ``microbatch``'s KV on the device, swapping it in if it is not (or
        waiting for the prefetch that swaps it in)."""
        if not 0 <= microbatch < self.microbatches:
            raise ValueError(f"microbatch {microbatch}: the stage has {self.microbatches}")
        held = next((kv for kv in self.sets if kv.holds == microbatch), None)
        if held is None:
            held = min(self.sets, key=lambda kv: (kv.holds is not None, self.recent.index(kv)))
            held.settle()
            if held.holds is not None:
                self._swap_out(held)
            self._swap_in(microbatch, held)
        held.settle()
        self._used(held)
        return held

    def resident(self, microbatch: int) -> bool:
        """Whether ``microbatch``'s KV is on the device (or being swapped in ahead)."""
        return any(kv.holds == microbatch for kv in self.sets)

    def prefetch(self, microbatch: int) -> bool:
        """Starts swapping ``microbatch`` in on the stage's prefetch thread, into the least
        recently used set other than the one used last, unless it is resident already, or the
        stage does not prefetch. Returns whether a swap started."""
        if self._prefetcher is None or self.resident(microbatch):
            return False
        spare = [kv for kv in self.recent[:-1] if kv.loading is None]
        if not spare:
            return False
        kv = spare[0]
        evicted = kv.holds
        if evicted is not None and self.before_swap_out is not None:
            self.before_swap_out(evicted)
        kv.holds = microbatch
        stream = None
        if self._copy_stream is not None:
            # The copies read and write the set after the kernels queued so far, not the later ones.
            self._copy_stream.wait_event(torch.cuda.current_stream(self.device).record_event())
            stream = {"stream": self._copy_stream}
        kv.loading = self._prefetcher.submit(self._swap, kv, evicted, microbatch, stream)
        self._used(kv)
        self.prefetches += 1
        return True

    def _used(self, kv: KvSet) -> None:
        self.recent.remove(kv)
        self.recent.append(kv)

    def _swap(self, kv: KvSet, evicted: Optional[int], microbatch: int, stream: Optional[dict]) -> None:
        """Swaps ``evicted`` out of ``kv`` (if any) and ``microbatch`` into it, on ``stream``."""
        if evicted is not None:
            self._move_home(kv, evicted, stream, out=True)
        self._move_home(kv, microbatch, stream, out=False)

    def _moved(self, microbatch: int) -> Tuple[dejavu.KvRegion, int]:
        """The region of each rank a swap of ``microbatch`` moves, and its bytes per rank."""
        region = self.region(range(self.slots), range(0, self.lengths[microbatch]))
        return region, self._packed_len(region) if self.lengths[microbatch] else 0

    def _stream(self) -> dict:
        return {"stream": torch.cuda.current_stream(self.device)} if self.engine is not None else {}

    def _swap_out(self, kv: KvSet) -> None:
        microbatch, kv.holds = kv.holds, None
        if self.before_swap_out is not None:
            self.before_swap_out(microbatch)
        self._move_home(kv, microbatch, self._stream(), out=True)

    def _swap_in(self, microbatch: int, kv: KvSet) -> None:
        self._move_home(kv, microbatch, self._stream(), out=False)
        kv.holds = microbatch

    def _move_home(self, kv: KvSet, microbatch: int, stream: Optional[dict], out: bool) -> None:
        """Gathers ``microbatch``'s KV from ``kv`` into its home in host memory (``out``), or
        scatters it from there into ``kv``, rank after rank."""
        region, size = self._moved(microbatch)
        if size == 0:
            return
        home = self.homes[microbatch]
        for rank, shard in enumerate(kv.shards):
            part = home[rank * size : (rank + 1) * size]
            if out:
                shard.cache.gather(region, part, **(stream or {}))
            else:
                shard.cache.scatter(region, part, **(stream or {}))
        self._count(self.tp * size, out=out)

    def _count(self, size: int, out: bool) -> None:
        with self._swapped_lock:
            if out:
                self.swap_outs, self.bytes_out = self.swap_outs + 1, self.bytes_out + size
            else:
                self.swap_ins, self.bytes_in = self.swap_ins + 1, self.bytes_in + size

    @property
    def swapped_bytes(self) -> int:
        """Bytes swapped out and in so far."""
        return self.bytes_in + self.bytes_out

    def host_bytes(self) -> int:
        """Bytes of KV in host memory now: the microbatches swapped out."""
        return self.tp * sum(self._moved(m)[1] for m in range(self.microbatches) if not self.resident(m))

    def region(self, slots: range, tokens: range) -> dejavu.KvRegion:
        """The KV of this stage's layers (local numbers) for ``slots`` and ``tokens``: all of it at
        TP 1, or each rank's (its heads, local numbers)."""
        return dejavu.KvRegion(
            layers=range(len(self.layers)), slots=slots, heads=range(self.rank_kv_heads), tokens=tokens
        )

    def check_inputs(self, inputs: torch.Tensor, slots: range, start: int) -> Tuple[int, int]:
        """The batch size and token count of ``inputs``, or ``ValueError`` naming what is wrong."""
        if not (0 <= slots.start < slots.stop <= self.slots) or slots.step != 1:
            raise ValueError(f"slots {slots} are not a non-empty range within the stage's {self.slots}")
        expected = 2 if self.first else 3
        if inputs.dim() != expected:
            what = "token ids [batch, tokens]" if self.first else "hidden states [batch, tokens, hidden]"
            raise ValueError(f"stage {self.layers} takes {what}; got shape {tuple(inputs.shape)}")
        batch, count = inputs.shape[0], inputs.shape[1]
        if batch != len(slots):
            raise ValueError(f"{batch} sequences given for {len(slots)} slots")
        if not self.first and inputs.shape[2] != self.shape.hidden:
            raise ValueError(f"hidden states of {inputs.shape[2]} where the model's are {self.shape.hidden}")
        if count < 1 or start < 0 or start + count > self.max_tokens:
            raise ValueError(f"tokens {start}..{start + count} do not fit the stage's {self.max_tokens}")
        return batch, count

    @torch.inference_mode()
    def forward(
        self,
        inputs: torch.Tensor,
        slots: range,
        start: int,
        layer_done: Optional[Callable[[int], None]] = None,
        logits: bool = False,
        microbatch: int = 0,
    ) -> torch.Tensor:
        """Runs tokens ``start..start + n`` of the sequences in ``slots`` of ``microbatch`` through
        this stage's layers, writing their KV; ``layer_done(i)`` is called once local layer ``i``'s KV writes
        are queued. Returns hidden states ``[batch, n, hidden]``, or from the last stage the next
        token of each sequence (``[batch]``, int64; with ``logits``, the last token's logits
        ``[batch, vocab]``), on the stage's device."""
        batch, count = self.check_inputs(inputs, slots, start)
        kv = self.kv(microbatch)
        self.prefetch((microbatch + 1) % self.microbatches)
        end = start + count
        x = self.embed(inputs.to(self.device)) if self.first else inputs.to(self.device, self.shape.torch_dtype)
        positions = torch.arange(start, end, device=self.device).unsqueeze(0).expand(batch, count)
        cos, sin = self.rotary(x, positions)
        allowed = self._attention_mask(start, count)
        groups = self.shape.heads // self.shape.kv_heads
        with sdpa_kernel(ATTENTION_BACKENDS):
            for i, layer in enumerate(self.blocks):
                cached = [(shard.keys[i], shard.values[i]) for shard in kv.shards]
                x = self._layer(layer, i, x, (cos, sin), cached, slots, start, end, allowed, groups)
                if layer_done is not None:
                    layer_done(i)
        self.lengths[microbatch] = max(self.lengths[microbatch], end)
        if not self.last:
            return x
        scores = self.head(self.norm(x[:, -1]))
        return scores if logits else scores.argmax(dim=-1)

    def _attention_mask(self, start: int, count: int) -> Optional[torch.Tensor]:
        """Which cached keys each of the ``count`` new tokens at ``start`` sees: ``None`` where no
        mask is needed. A decode step's token sees every key so far, and a prompt from position 0
        is causal over itself (``is_causal``); only a chunk after others needs a mask. Without a
        mask, SDPA can use its flash kernel."""
        if count == 1 or start == 0:
            return None
        end = start + count
        positions = torch.arange(start, end, device=self.device)
        # Token j of the new ones sees the keys up to its own position.
        return torch.arange(end, device=self.device).unsqueeze(0) <= positions.unsqueeze(1)

    def _layer(self, layer, index, x, rotary, cached, slots, start, end, allowed, groups):
        """Local layer ``index`` (``layer``) over ``x``, each rank's attention over its KV
        (``cached``: each rank's K and V of the layer)."""
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        cos, sin = rotary
        scaling = layer.self_attn.scaling
        batch, count = x.shape[0], x.shape[1]
        h = layer.input_layernorm(x)
        shape = (batch, count, -1, self.shape.head_dim)
        partials = []
        for weights, (layer_keys, layer_values) in zip(self.rank_weights[index], cached):
            q = F.linear(h, weights.q).view(shape).transpose(1, 2)
            k = F.linear(h, weights.k).view(shape).transpose(1, 2)
            v = F.linear(h, weights.v).view(shape).transpose(1, 2)
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
            cache_k = layer_keys[slots.start : slots.stop]
            cache_v = layer_values[slots.start : slots.stop]
            cache_k[:, :, start:end] = k
            cache_v[:, :, start:end] = v
            keys, values = cache_k[:, :, :end], cache_v[:, :, :end]
            if groups > 1:
                keys = keys.repeat_interleave(groups, dim=1)
                values = values.repeat_interleave(groups, dim=1)
            causal = allowed is None and count > 1
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=allowed, is_causal=causal, scale=scaling)
            partials.append(F.linear(out.transpose(1, 2).reshape(batch, count, -1), weights.o))
        x = x + all_reduce(partials)
        h = layer.post_attention_layernorm(x)
        act = layer.mlp.act_fn
        partials = [F.linear(act(F.linear(h, w.gate)) * F.linear(h, w.up), w.down) for w in self.rank_weights[index]]
        return x + all_reduce(partials)

    def host_mirror(self) -> Tuple[dejavu.KvCache, List[torch.Tensor]]:
        """A host cache of one microbatch's layout and its tensors (pinned where the stage is on
        a GPU): what a stage restores into when its own tensors are on a GPU or swapped out.
        Made once and kept until ``drop_mirror``: a replacement standing by makes it before it
        joins, since pinning a microbatch's worth of memory takes a while. At TP 1; a stage of
        more ranks has one per rank (``host_mirrors``)."""
        if self.tp != 1:
            raise ValueError(f"the stage's KV is split among {self.tp} tensor-parallel ranks: use host_mirrors")
        caches, tensors = self.host_mirrors()
        return caches[0], tensors

    def host_mirrors(self) -> Tuple[List[dejavu.KvCache], List[torch.Tensor]]:
        """A host cache of each rank's layout, and the tensors of all (as ``KvSet.tensors``
        orders them); see ``host_mirror``."""
        if self._mirror is None:
            pin = self.device.type == "cuda"
            size = self.sets[0].shards[0].keys[0].shape
            caches, tensors = [], []
            for _ in range(self.tp):
                rank = [torch.zeros(size, dtype=self.shape.torch_dtype, pin_memory=pin) for _ in range(2 * len(self.layers))]
                caches.append(dejavu.KvCache.wrap(self.layout, rank))
                tensors.extend(rank)
            self._mirror = (caches, tensors)
        return self._mirror

    @property
    def restores_through_mirror(self) -> bool:
        """Whether a restore goes through the host mirror: on a GPU, or with microbatches swapped
        out; on the CPU, the library fetches straight into the stage's tensors."""
        return self.engine is not None or self.swapping

    def restored(self, microbatch: int, restored: List[Tuple[range, int]]) -> None:
        """Records that ``microbatch`` holds, of each ``(slots, tokens)`` in ``restored``, tokens
        ``0..tokens`` of those slots."""
        for _, tokens in restored:
            self.lengths[microbatch] = max(self.lengths[microbatch], tokens)

    def drop_mirror(self) -> None:
        """Frees the host mirror (after a restore)."""
        self._mirror = None

    def load_mirror(self, microbatch: int, tensors: List[torch.Tensor], restored: List[Tuple[range, int]]) -> None:
        """Copies the KV a host mirror (``host_mirror``) holds into ``microbatch``'s: of each
        ``(slots, tokens)`` in ``restored``, tokens ``0..tokens`` of those slots (the rest of the
        mirror may hold another microbatch's KV)."""
        if not restored:
            return
        self._copy(self.kv(microbatch).tensors(), tensors, [(slots, range(0, tokens)) for slots, tokens in restored])
        self.restored(microbatch, restored)

    def save_mirror(self, microbatch: int, slots: range, tokens: range) -> List[dejavu.KvCache]:
        """Copies ``tokens`` of ``slots`` of ``microbatch``'s KV into the host mirrors (made as
        ``host_mirrors`` makes them); returns each rank's mirror cache, for the library to read
        from."""
        mirrors, tensors = self.host_mirrors()
        self._copy(tensors, self.kv(microbatch).tensors(), [(slots, tokens)])
        return mirrors

    def load_tokens(self, microbatch: int, tensors: List[torch.Tensor], slots: range, tokens: range) -> None:
        """Copies ``tokens`` of ``slots`` from the host mirrors' ``tensors`` into ``microbatch``'s KV,
        which then holds the sequences up to ``tokens.stop``."""
        self._copy(self.kv(microbatch).tensors(), tensors, [(slots, tokens)])
        self.restored(microbatch, [(slots, tokens.stop)])

    def _copy(self, targets: List[torch.Tensor], sources: List[torch.Tensor], parts: List[Tuple[range, range]]) -> None:
        """Copies, of each ``(slots, tokens)`` in ``parts``, those tokens of those slots of each
        source tensor into its target, between the host and the stage's device; returns once all
        are copied (one wait for the device)."""
        for slots, tokens in parts:
            for target, source in zip(targets, sources):
                target[slots.start : slots.stop, :, tokens.start : tokens.stop].copy_(
                    source[slots.start : slots.stop, :, tokens.start : tokens.stop], non_blocking=True
                )
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def generate(
    stages: List[TorchStage],
    prompts: torch.Tensor,
    new_tokens: int,
    microbatches: int = 1,
    rounds: Optional[List[float]] = None,
) -> torch.Tensor:
    """Greedy generation through ``stages`` in this process, in the steps the pipeline driver
    takes (each microbatch's prompt, then one token at a time, round the microbatches):
    ``[sequences, new_tokens]`` token ids. The sequences split into ``microbatches`` equal ones,
    each in the first slots of its own. ``rounds``, if given, gets the seconds of each round of
    the microbatches (the first is the prompts')."""
    batch = prompts.shape[0] // microbatches
    slots = range(batch)
    inputs = [prompts[m * batch : (m + 1) * batch] for m in range(microbatches)]
    starts, tokens = [0] * microbatches, [[] for _ in range(microbatches)]
    for _ in range(new_tokens):
        began = time.perf_counter()
        for m in range(microbatches):
            x = inputs[m]
            for stage in stages:
                x = stage.forward(x, slots, starts[m], microbatch=m)
            tokens[m].append(x.cpu())
            starts[m] += inputs[m].shape[1]
            inputs[m] = x.unsqueeze(1)
        if rounds is not None:
            rounds.append(time.perf_counter() - began)
    return torch.cat([torch.stack(t, dim=1) for t in tokens], dim=0)
