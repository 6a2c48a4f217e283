"""The Python package against the library: every layout, resharding, file flush/fetch, errors."""

import contextlib
import gc
import os
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

import dejavu

SPEC = dejavu.KvSpec(layers=3, kv_heads=3, head_dim=40, dtype="float16")  # odd heads, unaligned sizes
SLOTS, TOKENS = 2, 48


def layouts():
    blocks = [[5, 0, 3], [1, 4, 2]]  # 3 blocks of 16 tokens per sequence, out of order
    return {
        "faster_transformer": dejavu.KvLayout.faster_transformer(SPEC, SLOTS, TOKENS),
        "per_layer_bhsd": dejavu.KvLayout.per_layer(SPEC, SLOTS, TOKENS, "bhsd"),
        "per_layer_bshd": dejavu.KvLayout.per_layer(SPEC, SLOTS, TOKENS, "bshd"),
        "paged_nhd": dejavu.KvLayout.paged(SPEC, SLOTS, 16, 6, "nhd", False, blocks),
        "paged_hnd_interleaved": dejavu.KvLayout.paged(SPEC, SLOTS, 16, 6, "hnd", True, blocks),
        "paged_hnd_per_head": dejavu.KvLayout.paged(SPEC, SLOTS, 16, 6, "hnd", "head", blocks),
        "paged_nhd_per_token": dejavu.KvLayout.paged(SPEC, SLOTS, 16, 6, "nhd", "token", blocks),
        "paged_hnd_per_token": dejavu.KvLayout.paged(SPEC, SLOTS, 16, 6, "hnd", "token", blocks),
    }


@pytest.mark.parametrize("order", ["nhd", "hnd"])
def test_the_per_token_paged_layout_is_vllms_unified_block(order):
    # vLLM's unified cache, as its GPU backends read it: a layer's logical
    # [num_blocks][H][block_size][2 * D], K then V in the last axis, stored NHD or HND.
    block_size, num_blocks, d = 16, 6, SPEC.head_dim
    layout = layouts()[f"paged_{order}_per_token"]
    assert layout.buffer_sizes == [num_blocks * SPEC.kv_heads * block_size * 2 * d * 2] * SPEC.layers
    buffers = [np.zeros(n // 2, dtype=np.float16) for n in layout.buffer_sizes]
    cache = dejavu.KvCache.wrap(layout, buffers)
    one = dejavu.KvRegion(layers=(2, 3), slots=(1, 2), heads=(1, 2), tokens=(20, 21))
    packed = np.arange(1, 2 * d + 1, dtype=np.float16)  # K then V of one head and token
    cache.scatter(one, packed)
    if order == "nhd":
        logical = buffers[2].reshape(num_blocks, block_size, SPEC.kv_heads, 2 * d).transpose(0, 2, 1, 3)
    else:
        logical = buffers[2].reshape(num_blocks, SPEC.kv_heads, block_size, 2 * d)
    block, row = 4, 20 % block_size  # slot 1's second block is physical block 4
    assert np.array_equal(logical[block, 1, row], packed)
    assert np.count_nonzero(logical) == 2 * d


def test_the_per_head_paged_layout_is_vllms_cpu_block():
    # vLLM's CPU attention backend: per layer [num_blocks][H][2 * block_size][D], each head's K rows
    # then its V rows; a decode token's K and V land where that formula says.
    block_size, num_blocks, d = 16, 6, SPEC.head_dim
    layout = layouts()["paged_hnd_per_head"]
    assert layout.buffer_sizes == [num_blocks * SPEC.kv_heads * 2 * block_size * d * 2] * SPEC.layers
    buffers = [np.zeros(n // 2, dtype=np.float16) for n in layout.buffer_sizes]
    cache = dejavu.KvCache.wrap(layout, buffers)
    one = dejavu.KvRegion(layers=(2, 3), slots=(1, 2), heads=(1, 2), tokens=(20, 21))
    packed = np.arange(1, 2 * d + 1, dtype=np.float16)  # K then V of one head and token
    cache.scatter(one, packed)
    pool = buffers[2].reshape(num_blocks, SPEC.kv_heads, 2 * block_size, d)
    block, row = 4, 20 % block_size  # slot 1's second block is physical block 4
    assert np.array_equal(pool[block, 1, row], packed[:d])
    assert np.array_equal(pool[block, 1, block_size + row], packed[d:])
    assert np.count_nonzero(pool) == 2 * d
    # Its portable kernels keep K transposed in a block: [D][block_size], one element together.
    transposed = dejavu.KvLayout.paged(SPEC, SLOTS, 16, 6, "hnd", "head", [[5, 0, 3], [1, 4, 2]], k_chunk=1)
    buffers = [np.zeros(n // 2, dtype=np.float16) for n in transposed.buffer_sizes]
    dejavu.KvCache.wrap(transposed, buffers).scatter(one, packed)
    pool = buffers[2].reshape(num_blocks, SPEC.kv_heads, 2 * block_size, d)
    keys = pool[block, 1, :block_size].reshape(d, block_size)
    assert np.array_equal(keys[:, row], packed[:d])
    assert np.array_equal(pool[block, 1, block_size + row], packed[d:])
    with pytest.raises(ValueError, match="divide"):
        dejavu.KvLayout.paged(SPEC, SLOTS, 16, 6, "hnd", "head", k_chunk=3)
    with pytest.raises(ValueError, match="HND"):
        dejavu.KvLayout.paged(SPEC, SLOTS, 16, 6, "nhd", "head")
    with pytest.raises(ValueError, match="interleaved"):
        dejavu.KvLayout.paged(SPEC, SLOTS, 16, 6, "hnd", "sideways")
    with pytest.raises(ValueError, match="token"):
        dejavu.KvLayout.paged(SPEC, SLOTS, 16, 6, "nhd", "sideways")


def engine_buffers(layout, seed):
    """The engine's own tensors, filled with noise (not zeros)."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, size=n, dtype=np.uint8) for n in layout.buffer_sizes]


REGION = dejavu.KvRegion(layers=range(3), slots=range(2), heads=range(3), tokens=range(5, 37))


@pytest.mark.parametrize("name", list(layouts()))
def test_gather_scatter_round_trip_in_place(name):
    layout = layouts()[name]
    buffers = engine_buffers(layout, 1)
    engine = dejavu.KvCache.wrap(layout, buffers)
    staged = engine.gather(REGION)
    assert isinstance(staged, bytearray) and len(staged) == engine.packed_len(REGION)

    # Into a numpy array given as the destination, without a copy on the way back.
    out = np.empty(engine.packed_len(REGION), dtype=np.uint8)
    assert engine.gather(REGION, out) is out
    assert bytes(out) == bytes(staged)

    # Scattered into another engine's tensors, the bytes land in those tensors themselves.
    other_buffers = [np.zeros(n, dtype=np.uint8) for n in layout.buffer_sizes]
    other = dejavu.KvCache.wrap(layout, other_buffers)
    other.scatter(REGION, out)
    assert sum(int(b.astype(bool).sum()) for b in other_buffers) > 0
    assert bytes(other.gather(REGION)) == bytes(staged)


@pytest.mark.parametrize("name", [n for n in layouts() if n != "faster_transformer"])
def test_flush_and_fetch_across_layouts(tmp_path, name):
    """FasterTransformer -> another layout -> FasterTransformer through chunk files: every byte back."""
    ft = layouts()["faster_transformer"]
    source = dejavu.KvCache.wrap(ft, engine_buffers(ft, 2))
    store = dejavu.FileStore(tmp_path)
    assert dejavu.flush(store, source, REGION, (0, 0), (1, 0), 0) == source.packed_len(REGION)
    middle = dejavu.KvCache(layouts()[name])
    dejavu.fetch(store, middle, REGION, (0, 0), (1, 0), 0)
    dejavu.flush(store, middle, REGION, (1, 0), (2, 0), 0)
    back = dejavu.KvCache(ft)
    dejavu.fetch(store, back, REGION, (1, 0), (2, 0), 0)
    assert bytes(back.gather(REGION)) == bytes(source.gather(REGION))


class DLPackOnly:
    """An array seen only through DLPack (as JAX or CuPy host arrays are)."""

    def __init__(self, array, device=(1, 0)):
        self.array, self.device = array, device

    def __dlpack__(self, **kwargs):
        return self.array.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self.device


class OldDLPack(DLPackOnly):
    """A producer older than DLPack 1.0: no `max_version`, no read-only flag."""

    def __dlpack__(self, stream=None):
        return self.array.__dlpack__()


def test_dlpack_tensors_are_used_in_place():
    layout = layouts()["per_layer_bshd"]
    buffers = engine_buffers(layout, 5)
    engine = dejavu.KvCache.wrap(layout, [DLPackOnly(b) for b in buffers])
    staged = engine.gather(REGION)
    assert bytes(staged) == bytes(dejavu.KvCache.wrap(layout, buffers).gather(REGION))
    # Written through DLPack: the engine's own arrays change, no copy in between.
    target = [np.zeros_like(b) for b in buffers]
    dejavu.KvCache.wrap(layout, [DLPackOnly(t) for t in target]).scatter(REGION, staged)
    assert any(t.any() for t in target)
    assert bytes(dejavu.KvCache.wrap(layout, target).gather(REGION)) == bytes(staged)
    with pytest.raises(ValueError, match="C-contiguous"):
        dejavu.KvCache.wrap(layout, [DLPackOnly(np.zeros(2 * n, dtype=np.uint8)[::2]) for n in layout.buffer_sizes])
    with pytest.raises(TypeError, match="host memory"):
        dejavu.KvCache.wrap(layout, [DLPackOnly(b, device=(2, 0)) for b in buffers])
    # A read-only tensor is refused as a destination, and read as a source.
    frozen = np.frombuffer(bytes(staged), dtype=np.uint8)
    assert not frozen.flags.writeable
    with pytest.raises(ValueError, match="read-only"):
        engine.gather(REGION, DLPackOnly(frozen))
    copy = dejavu.KvCache(layout)
    copy.scatter(REGION, DLPackOnly(frozen))
    assert bytes(copy.gather(REGION)) == bytes(staged)
    # An older producer cannot say whether it may be written: read, never written.
    with pytest.raises(ValueError, match="older than DLPack 1.0"):
        engine.gather(REGION, OldDLPack(np.zeros(len(staged), dtype=np.uint8)))
    copy.scatter(REGION, OldDLPack(np.frombuffer(bytes(staged), dtype=np.uint8).copy()))


def test_torch_cpu_tensors_are_used_in_place():
    torch = pytest.importorskip("torch")
    layout = layouts()["per_layer_bhsd"]
    tensors = [torch.zeros(n // 2, dtype=torch.float16) for n in layout.buffer_sizes]
    cache = dejavu.KvCache.wrap(layout, tensors)
    cache.scatter(REGION, bytes(range(256)) * (cache.packed_len(REGION) // 256) + bytes(cache.packed_len(REGION) % 256))
    assert any(bool(t.ne(0).any()) for t in tensors)


def assert_each_token_worker_fetches_its_layers(store, token, source):
    """Each of the 4 layers went as its own chunk, keyed in the destination's coordinates: every
    worker of `token` (2 stages of 2 layers, 2 slots, 2 heads, 16 tokens) fetches its layers and
    holds what `source` holds there."""
    for w in token.workers():
        local = dejavu.KvCache(dejavu.KvLayout.faster_transformer(token.local_spec(w), 2, 16))
        for layer in range(2):
            one = dejavu.KvRegion(range(layer, layer + 1), range(2), range(2), range(16))
            dejavu.fetch(store, local, one, source=(0, 0), destination=w, microbatch=0)
        h = token.holding(w)
        at_source = dejavu.KvRegion(range(*h["layers"]), range(2), range(2), range(16))
        at_destination = dejavu.KvRegion(range(2), range(2), range(2), range(16))
        assert bytes(local.gather(at_destination)) == bytes(source.gather(at_source)), w


def test_a_host_cache_refuses_torch_cuda_tensors_clearly():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    layout = layouts()["per_layer_bhsd"]
    tensors = [torch.zeros(n, dtype=torch.uint8, device="cuda") for n in layout.buffer_sizes]
    with pytest.raises(TypeError, match="CudaEngine"):
        dejavu.KvCache.wrap(layout, tensors)


def cuda_engine_or_skip():
    """The GPU engine, or a skip where there is none (the error must then be dejavu.CudaError)."""
    try:
        return dejavu.CudaEngine()
    except dejavu.CudaError as e:
        pytest.skip(f"no GPU: {e}")


def test_without_a_gpu_the_cuda_engine_is_a_clear_error():
    try:
        import torch

        if torch.cuda.is_available():
            pytest.skip("a GPU is present")
    except ImportError:
        pass
    if Path("/dev/nvidia0").exists():
        pytest.skip("a GPU is present")
    with pytest.raises(dejavu.CudaError, match="no CUDA"):
        dejavu.CudaEngine()


@pytest.mark.parametrize("name", list(layouts()))
def test_torch_cuda_tensors_are_used_in_place_for_every_layout(name):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    engine = cuda_engine_or_skip()
    layout = layouts()[name]
    host = engine_buffers(layout, 21)
    tensors = [torch.from_numpy(np.frombuffer(h.tobytes(), dtype=np.uint8).copy()).cuda() for h in host]
    gpu = engine.wrap(layout, tensors)
    cpu = dejavu.KvCache.wrap(layout, host)
    # Gather: the GPU's bytes are the CPU engine's.
    assert bytes(gpu.gather(REGION)) == bytes(cpu.gather(REGION))
    # Scatter new bytes: they land in the engine's own tensors, as the CPU engine puts them.
    data = np.random.default_rng(5).integers(0, 256, cpu.packed_len(REGION), dtype=np.uint8)
    gpu.scatter(REGION, data)
    cpu.scatter(REGION, data)
    for t, h in zip(tensors, host):
        assert t.cpu().numpy().tobytes() == h.tobytes()


def test_gpu_tensors_that_do_not_fit_are_refused():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    engine = cuda_engine_or_skip()
    layout = layouts()["per_layer_bhsd"]
    sizes = layout.buffer_sizes
    ok = [torch.zeros(n, dtype=torch.uint8, device="cuda") for n in sizes]
    with pytest.raises(ValueError, match="bytes where"):
        engine.wrap(layout, [torch.zeros(sizes[0] - 1, dtype=torch.uint8, device="cuda")] + ok[1:])
    with pytest.raises(ValueError, match="tensors were given"):
        engine.wrap(layout, ok[1:])
    with pytest.raises(ValueError, match="contiguous"):
        engine.wrap(layout, [torch.zeros(sizes[0], 2, dtype=torch.uint8, device="cuda")[:, 0]] + ok[1:])
    with pytest.raises(TypeError, match="cuda_array_interface"):
        engine.wrap(layout, [torch.zeros(sizes[0], dtype=torch.uint8)] + ok[1:])
    gpu = engine.wrap(layout, ok)
    with pytest.raises(ValueError, match="bytes where"):
        gpu.gather(REGION, np.zeros(gpu.packed_len(REGION) + 1, dtype=np.uint8))
    with pytest.raises(dejavu.LayoutError):
        gpu.gather(dejavu.KvRegion(range(0, 9), range(SLOTS), range(3), range(TOKENS)))


def test_gpu_gathers_and_scatters_in_pieces_to_pinned_pageable_and_pooled_host_memory():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    engine = cuda_engine_or_skip()
    # 12 layers of 2 MiB (8 slots x 8 heads x 64 tokens x 128 fp16, K and V): more pieces than
    # the engine's staging ring.
    layers, slots, heads, tokens, dim = 12, 8, 8, 64, 128
    layout = dejavu.KvLayout.per_layer(dejavu.KvSpec(layers=layers, kv_heads=heads, head_dim=dim, dtype="float16"), slots, tokens, "bhsd")
    tensors = [torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda") for n in layout.buffer_sizes]
    gpu = engine.wrap(layout, tensors)
    host = [t.cpu().numpy() for t in tensors]
    cpu = dejavu.KvCache.wrap(layout, host)
    region = dejavu.KvRegion(range(layers), range(slots), range(heads), range(tokens))
    expected = bytes(cpu.gather(region))
    assert len(expected) == 24 << 20
    # No buffer: pinned memory from the pool, seen by numpy and torch without a copy.
    pooled = gpu.gather(region)
    assert isinstance(pooled, dejavu.PinnedBuffer) and len(pooled) == len(expected)
    view = np.asarray(pooled)
    assert view.dtype == np.uint8 and view.tobytes() == expected
    as_torch = torch.from_numpy(view)
    assert as_torch.data_ptr() == view.ctypes.data
    del as_torch
    # A pinned torch tensor and a pageable numpy array given as `out`.
    pinned = torch.empty(len(expected), dtype=torch.uint8, pin_memory=True)
    assert gpu.gather(region, pinned) is pinned
    assert pinned.numpy().tobytes() == expected
    pageable = np.zeros(len(expected), dtype=np.uint8)
    assert gpu.gather(region, pageable) is pageable
    assert pageable.tobytes() == expected
    # Scatter back from each kind into a zeroed cache: the CPU engine's result.
    incoming = np.random.default_rng(9).integers(0, 256, len(expected), dtype=np.uint8)
    cpu.scatter(region, incoming)
    view[:] = incoming
    for data in (incoming, torch.from_numpy(incoming).pin_memory(), pooled):
        for t in tensors:
            t.zero_()
        gpu.scatter(region, data)
        for t, h in zip(tensors, host):
            assert t.cpu().numpy().tobytes() == h.tobytes()
    # Dropped, the pooled buffer's memory is reused by the next gather of the same size.
    address = view.ctypes.data
    del view, pooled, data
    again = gpu.gather(region)
    assert np.asarray(again).ctypes.data == address


def test_the_streamer_sends_layers_out_of_torch_cuda_tensors_after_the_torch_stream_writes_them():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    engine = cuda_engine_or_skip()
    spec = dejavu.KvSpec(layers=4, kv_heads=2, head_dim=32)
    prompt = dejavu.Setup(spec, [(range(0, 4), 1)], microbatch_slots=2, microbatches=1)
    token = dejavu.Setup(spec, [(range(0, 2), 1), (range(2, 4), 1)], microbatch_slots=2, microbatches=1)
    layout = dejavu.KvLayout.faster_transformer(spec, 2, 16)
    host = engine_buffers(layout, 13)
    written = [torch.from_numpy(np.frombuffer(h.tobytes(), dtype=np.uint8).copy()).cuda() for h in host]
    tensors = [torch.zeros_like(w) for w in written]
    torch.cuda.synchronize()
    gpu = engine.wrap(layout, tensors)
    store = dejavu.HostStore()
    streamer = dejavu.Streamer(store)
    stream = torch.cuda.current_stream()
    # The "layers": the stream is held back for a while, then writes the KV. A copy that did not
    # wait for the stream would read zeros.
    torch.cuda._sleep(200_000_000)
    for w, t in zip(written, tensors):
        t.copy_(w, non_blocking=True)
    completions = []
    for layer in range(4):
        completions += streamer.device_layer_ready(prompt, (0, 0), token, gpu, stream, 0, layer, range(0, 16))
    # The queued copies keep the tensors alive: drop every reference here, give the memory back
    # to the allocator and take it again with zeros; the copies must still read the KV.
    del gpu, tensors, t
    torch.cuda.empty_cache()
    _reuse = [torch.zeros_like(w) for w in written]  # noqa: F841 (held: it takes the freed memory)
    assert len(completions) == 4
    assert sum(c.wait(timeout=30)["bytes"] for c in completions) == spec.bytes_per_token * 2 * 16
    assert streamer.shutdown()["completed"] == 4
    assert_each_token_worker_fetches_its_layers(store, token, dejavu.KvCache.wrap(layout, host))


def test_resharding_between_two_setups_and_back():
    spec = dejavu.KvSpec(layers=4, kv_heads=4, head_dim=16, dtype="bfloat16")
    prompt = dejavu.Setup(spec, [(range(0, 2), 2), (range(2, 4), 2)], microbatch_slots=4, microbatches=1)
    token = dejavu.Setup(spec, [(range(0, 1), 1), (range(1, 4), 1)], microbatch_slots=2, microbatches=2)
    tokens = range(0, 24)

    def caches(setup, seed=None):
        out = {}
        for w in setup.workers():
            layout = dejavu.KvLayout.faster_transformer(setup.local_spec(w), 4 if setup is prompt else 2, 32)
            out[w] = [
                dejavu.KvCache.wrap(layout, engine_buffers(layout, seed + i)) if seed is not None else dejavu.KvCache(layout)
                for i in range(1 if setup is prompt else 2)
            ]
        return out

    source, middle, back = caches(prompt, seed=10), caches(token), caches(prompt)
    store = dejavu.HostStore()
    sent = sum(dejavu.stream_out(prompt, w, token, source[w], tokens, store)["bytes"] for w in prompt.workers())
    got = sum(dejavu.stream_in(prompt, token, w, middle[w], tokens, store)["bytes"] for w in token.workers())
    assert sent == got > 0
    store = dejavu.HostStore()
    for w in token.workers():
        dejavu.stream_out(token, w, prompt, middle[w], tokens, store)
    for w in prompt.workers():
        dejavu.stream_in(token, prompt, w, back[w], tokens, store)
    for w in prompt.workers():
        h = prompt.holding(w)
        region = dejavu.KvRegion(range(h["layers"][1] - h["layers"][0]), range(4), range(h["heads"][1] - h["heads"][0]), tokens)
        assert bytes(back[w][0].gather(region)) == bytes(source[w][0].gather(region)), w


def test_corrupted_and_missing_chunks_are_typed_errors(tmp_path):
    layout = layouts()["per_layer_bshd"]
    cache = dejavu.KvCache.wrap(layout, engine_buffers(layout, 3))
    store = dejavu.FileStore(tmp_path)
    dejavu.flush(store, cache, REGION)
    (chunk,) = [p for p in tmp_path.iterdir()]
    data = bytearray(chunk.read_bytes())
    data[-1] ^= 0xFF
    chunk.write_bytes(bytes(data))
    with pytest.raises(dejavu.CorruptChunkError):
        dejavu.fetch(store, dejavu.KvCache(layout), REGION)
    with pytest.raises(dejavu.NotFoundError):
        dejavu.fetch(store, dejavu.KvCache(layout), REGION, microbatch=7)
    assert issubclass(dejavu.NotFoundError, dejavu.StoreError) and issubclass(dejavu.StoreError, dejavu.Error)


def test_bad_input_raises_clear_exceptions():
    layout = layouts()["per_layer_bhsd"]
    with pytest.raises(ValueError, match="dtype"):
        dejavu.KvSpec(2, 2, 64, dtype="float64")
    with pytest.raises(ValueError, match="order"):
        dejavu.KvLayout.per_layer(SPEC, 2, 8, "shdb")
    buffers = engine_buffers(layout, 4)
    with pytest.raises(dejavu.LayoutError, match="buffers"):
        dejavu.KvCache.wrap(layout, buffers[:-1])
    with pytest.raises(dejavu.LayoutError, match="bytes"):
        dejavu.KvCache.wrap(layout, [b[:-1] for b in buffers])
    strided = [np.zeros(2 * n, dtype=np.uint8)[::2] for n in layout.buffer_sizes]
    with pytest.raises(ValueError, match="contiguous"):
        dejavu.KvCache.wrap(layout, strided)
    with pytest.raises(TypeError, match="numpy array"):
        dejavu.KvCache.wrap(layout, ["not a buffer"] * len(buffers))
    cache = dejavu.KvCache.wrap(layout, buffers)
    frozen = np.zeros(cache.packed_len(REGION), dtype=np.uint8)
    frozen.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        cache.gather(REGION, frozen)
    with pytest.raises(TypeError, match="writable"):
        cache.gather(REGION, bytes(cache.packed_len(REGION)))
    with pytest.raises(ValueError, match="needed"):
        cache.gather(REGION, np.zeros(10, dtype=np.uint8))
    past_the_end = dejavu.KvRegion(range(3), range(2), range(3), range(40, 60))
    with pytest.raises(dejavu.LayoutError):
        cache.gather(past_the_end)
    with pytest.raises(ValueError, match="before start"):
        dejavu.KvRegion((0, 3), (0, 2), (0, 3), (9, 4))
    with pytest.raises(ValueError):
        dejavu.Setup(SPEC, [(range(0, 2), 1)], 2, 1)  # stages must cover every layer


def test_copies_release_the_gil():
    """This thread keeps running Python code while a gather runs on another thread."""
    import threading
    import time

    ft = dejavu.KvLayout.faster_transformer(dejavu.KvSpec(16, 8, 128), 8, 512)
    cache = dejavu.KvCache(ft)
    region = dejavu.KvRegion(range(16), range(8), range(8), range(512))  # 134 MB
    out = np.empty(cache.packed_len(region), dtype=np.uint8)
    spans, done = [], threading.Event()

    def work():
        for _ in range(3):
            start = time.perf_counter()
            cache.gather(region, out)
            spans.append((start, time.perf_counter()))
        done.set()

    samples = []
    t = threading.Thread(target=work)
    t.start()
    while not done.is_set():
        samples.append(time.perf_counter())
    t.join()
    # Holding the GIL through a gather would leave (almost) no samples inside the gathers.
    inside = sum(1 for x in samples if any(a < x < b for a, b in spans))
    assert inside > 100, (inside, spans)


def test_layer_by_layer_streaming_on_a_background_thread():
    spec = dejavu.KvSpec(layers=4, kv_heads=2, head_dim=32)
    prompt = dejavu.Setup(spec, [(range(0, 4), 1)], microbatch_slots=2, microbatches=1)
    token = dejavu.Setup(spec, [(range(0, 2), 1), (range(2, 4), 1)], microbatch_slots=2, microbatches=1)
    layout = dejavu.KvLayout.faster_transformer(spec, 2, 16)
    engine = dejavu.KvCache.wrap(layout, engine_buffers(layout, 7))
    store = dejavu.HostStore()
    streamer = dejavu.Streamer(store, queue_depth=4)
    completions = []
    for layer in range(4):  # the engine finishes layer `layer`, the streamer takes it from there
        completions += streamer.layer_ready(prompt, (0, 0), token, engine, 0, layer, range(0, 16))
    assert len(completions) == 4
    assert sum(c.wait(timeout=10)["bytes"] for c in completions) == spec.bytes_per_token * 2 * 16
    stats = streamer.shutdown()
    assert stats["completed"] == 4 and stats["failed"] == 0
    with pytest.raises(dejavu.Error, match="shut down"):
        streamer.layer_ready(prompt, (0, 0), token, engine, 0, 0, range(0, 16))
    assert_each_token_worker_fetches_its_layers(store, token, engine)


def test_a_streamer_runs_on_the_cpus_it_is_given():
    spec = dejavu.KvSpec(layers=4, kv_heads=2, head_dim=32)
    prompt = dejavu.Setup(spec, [(range(0, 4), 1)], microbatch_slots=2, microbatches=1)
    layout = dejavu.KvLayout.faster_transformer(spec, 2, 16)
    engine = dejavu.KvCache.wrap(layout, engine_buffers(layout, 8))
    last = max(os.sched_getaffinity(0))

    def streamer_threads():
        tasks = os.listdir("/proc/self/task")
        return {t for t in tasks if Path(f"/proc/self/task/{t}/comm").read_text().strip() == "dejavu-streamer"}

    before = streamer_threads()
    streamer = dejavu.Streamer(dejavu.HostStore(), cpus=str(last))
    (tid,) = streamer_threads() - before
    assert os.sched_getaffinity(int(tid)) == {last}
    for c in streamer.layer_ready(prompt, (0, 0), prompt, engine, 0, 0, range(0, 16)):
        c.wait(timeout=10)
    assert streamer.shutdown()["completed"] == 1
    # A list that is not one, or a CPU the machine does not have: refused before anything runs.
    for bad in ["3-1", "1023"]:  # the last CPU a list can name: no machine here has it
        with pytest.raises(dejavu.Error, match="CPU"):
            dejavu.Streamer(dejavu.HostStore(), cpus=bad)


def test_flush_and_fetch_through_a_remote_peer():
    layout = layouts()["faster_transformer"]
    engine = dejavu.KvCache.wrap(layout, engine_buffers(layout, 9))
    server = dejavu.PeerServer(b"cluster secret")
    try:
        store = dejavu.Store.peer(server.address, b"cluster secret", node=2, epoch=3)
        dejavu.flush(store, engine, REGION, (0, 0), (1, 0), 0)
        assert server.chunks == 1
        replica = dejavu.KvCache(layout)
        dejavu.fetch(store, replica, REGION, (0, 0), (1, 0), 0)
        assert bytes(replica.gather(REGION)) == bytes(engine.gather(REGION))
        with pytest.raises(dejavu.NotFoundError):
            dejavu.fetch(store, replica, REGION, (0, 0), (1, 0), 5)
        # Fenced: a request from an older epoch is refused.
        server.set_epoch(4)
        with pytest.raises(dejavu.StoreError, match="epoch|fenced"):
            dejavu.flush(store, engine, REGION, (0, 0), (1, 0), 1)
        # Outside the cluster: refused before any KV is sent.
        intruder = dejavu.Store.peer(server.address, b"wrong secret", epoch=9)
        with pytest.raises(dejavu.StoreError, match="authentication"):
            dejavu.flush(intruder, engine, REGION, (0, 0), (1, 0), 2)
        assert server.chunks == 1
    finally:
        server.close()
    with pytest.raises(ValueError, match="address"):
        dejavu.Store.peer("not an address", b"s")


def dejavud():
    """The daemon binary: $DEJAVUD, or the workspace's release or debug build."""
    if os.environ.get("DEJAVUD"):
        return os.environ["DEJAVUD"]
    root = os.path.join(os.path.dirname(__file__), "..", "..", "..")
    for profile in ("release", "debug"):
        path = os.path.join(root, "target", profile, "dejavud")
        if os.access(path, os.X_OK):
            return path
    raise AssertionError("no dejavud binary: build it (cargo build --release --bin dejavud) or set DEJAVUD")


@contextlib.contextmanager
def running_sidecar(tmp_path, index):
    """A ``dejavud sidecar`` of stage ``index`` with its local socket in ``tmp_path``, forwarding to
    a ``PeerServer`` here; yields the socket and that successor, and stops both."""
    with running_sidecar_at(tmp_path, index) as (socket, successor, _):
        yield socket, successor


@contextlib.contextmanager
def running_sidecar_at(tmp_path, index):
    """As ``running_sidecar``, also yielding where the sidecar's own KV transport listens."""
    socket = tmp_path / "sidecar.sock"
    sidecar = subprocess.Popen(
        [dejavud(), "sidecar", f"--index={index}", f"--local={socket}", f"--shm-dir={tmp_path}", "--region-bytes=1048576"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    successor = dejavu.PeerServer(b"dejavu reference cluster")
    try:
        line = sidecar.stdout.readline()
        assert line.startswith("listening "), line
        yield socket, successor, line.split()[1]
    finally:
        sidecar.kill()
        sidecar.wait()
        successor.close()


def test_flush_and_fetch_through_the_local_sidecar(tmp_path):
    with running_sidecar(tmp_path, index=1) as (socket, successor):
        layout = layouts()["per_layer_bhsd"]
        engine = dejavu.KvCache.wrap(layout, engine_buffers(layout, 11))
        store = dejavu.Store.sidecar(socket, successor.address, epoch=1)
        assert repr(store) == "Store(sidecar)"
        dejavu.flush(store, engine, REGION, (1, 0), (1, 0), 0)
        # Forwarded to the successor, and kept: it comes back through shared memory.
        assert successor.chunks == 1
        restored = dejavu.KvCache(layout)
        dejavu.fetch(store, restored, REGION, (1, 0), (1, 0), 0)
        assert bytes(restored.gather(REGION)) == bytes(engine.gather(REGION))
        with pytest.raises(dejavu.NotFoundError):
            dejavu.fetch(store, restored, REGION, (1, 0), (1, 0), 7)
        # The region's file is gone once both sides mapped it.
        assert sorted(p.name for p in tmp_path.iterdir()) == ["sidecar.sock"]
        # An engine from an older epoch is refused; a newer one takes over and finds the KV.
        with pytest.raises(dejavu.Error, match="older"):
            dejavu.Store.sidecar(socket, successor.address, epoch=0)
        replacement = dejavu.Store.sidecar(socket, successor.address, epoch=2)
        dejavu.fetch(replacement, restored, REGION, (1, 0), (1, 0), 0)
        with pytest.raises(dejavu.StoreError):
            dejavu.flush(store, engine, REGION, (1, 0), (1, 0), 1)
    with pytest.raises(dejavu.Error, match="sidecar at"):
        dejavu.Store.sidecar(tmp_path / "nobody.sock", "127.0.0.1:9")


def test_a_streamer_over_the_sidecar_completes_each_step_once_replicated(tmp_path):
    with running_sidecar(tmp_path, index=1) as (socket, successor):
        layout = layouts()["per_layer_bhsd"]
        engine = dejavu.KvCache.wrap(layout, engine_buffers(layout, 17))
        store = dejavu.Store.sidecar(socket, successor.address, epoch=1)
        steps = [
            dejavu.KvRegion(layers=range(3), slots=range(2), heads=range(3), tokens=range(t, t + 1)) for t in range(8)
        ]
        for puts_in_flight, microbatch in [(1, 0), (0, 1)]:
            before = successor.chunks
            streamer = dejavu.Streamer(store, queue_depth=4, puts_in_flight=puts_in_flight)
            completions = [streamer.region_ready(engine, step, (1, 0), (1, 0), microbatch) for step in steps]
            for i, completion in enumerate(completions):
                completion.wait(timeout=30)
                # Complete means replicated: the successor holds it already.
                assert successor.chunks >= before + i + 1, (puts_in_flight, i)
            stats = streamer.shutdown()
            assert (stats["completed"], stats["failed"]) == (len(steps), 0)
            assert successor.chunks == before + len(steps)
            for step in steps:  # and kept by the sidecar, byte for byte
                restored = dejavu.KvCache(layout)
                dejavu.fetch(store, restored, step, (1, 0), (1, 0), microbatch)
                assert bytes(restored.gather(step)) == bytes(engine.gather(step))


def test_a_reader_lists_and_fetches_beside_the_engine_and_changes_nothing(tmp_path):
    with running_sidecar(tmp_path, index=1) as (socket, successor):
        layout = layouts()["per_layer_bhsd"]
        engine = dejavu.KvCache.wrap(layout, engine_buffers(layout, 13))
        store = dejavu.Store.sidecar(socket, successor.address, epoch=3)
        dejavu.flush(store, engine, REGION, (1, 0), (1, 0), 4)
        reader = dejavu.Store.sidecar_reader(socket)
        listed = reader.recovery()
        assert (listed["stage"], listed["epoch"]) == (1, 3)
        assert [(p["microbatch"], p["tokens"]) for p in listed["resume"]] == [(4, 0)]  # from token 5 on
        restored = dejavu.KvCache(layout)
        dejavu.fetch(reader, restored, REGION, (1, 0), (1, 0), 4)
        assert bytes(restored.gather(REGION)) == bytes(engine.gather(REGION))
        with pytest.raises(dejavu.StoreError, match="reader"):
            dejavu.flush(reader, engine, REGION, (1, 0), (1, 0), 5)
        with pytest.raises(dejavu.Error, match="reader"):
            reader.release((1, 0), 4, (0, 2))
        # The engine kept its place: it still flushes, and the reader sees the new chunk.
        dejavu.flush(store, engine, REGION, (1, 0), (1, 0), 6)
        assert sorted(p["microbatch"] for p in reader.recovery()["resume"]) == [4, 6]
        assert successor.chunks == 2


def test_a_sequence_is_fetched_chunk_by_chunk_from_a_peer_until_one_is_missing_and_kept_by_the_sidecar(tmp_path):
    layout = layouts()["paged_nhd"]
    engine = dejavu.KvCache.wrap(layout, engine_buffers(layout, 13))
    layers, heads = range(SPEC.layers), range(SPEC.kv_heads)

    def sequence(tokens):
        return dejavu.KvRegion(layers=layers, slots=range(0, 1), heads=heads, tokens=tokens)

    # A prompt of 8 tokens, then one chunk per token up to 20: the peer (a worker's successor)
    # holds them all but token 15's.
    chunks = [range(0, 8)] + [range(t, t + 1) for t in range(8, 20)]
    regions = [sequence(tokens) for tokens in chunks]
    peer_server = dejavu.PeerServer(b"dejavu reference cluster")
    try:
        peer = dejavu.Store.peer(peer_server.address, b"dejavu reference cluster", node=1, epoch=1)
        host = dejavu.Store.host()
        for tokens, region in zip(chunks, regions):
            if tokens.start != 15:
                for store in (peer, host):
                    dejavu.flush(store, engine, region, (1, 0), (1, 0), 0)
        held = sequence(range(0, 15))
        # In flight together from the peer, one by one from another store: the same prefix.
        for store in (peer, host):
            restored = dejavu.KvCache(layout)
            outcome = dejavu.fetch_chunks(store, restored, regions, (1, 0), (1, 0), 0)
            assert outcome == {"fetched": 8, "bytes": restored.packed_len(held), "error": None}
            assert bytes(restored.gather(held)) == bytes(engine.gather(held))
        # From a peer, into a replacement beside its new sidecar, which keeps what came as its own.
        with running_sidecar(tmp_path, index=1) as (socket, successor):
            own = dejavu.Store.sidecar(socket, successor.address, epoch=2)
            restored = dejavu.KvCache(layout)
            outcome = dejavu.fetch_chunks(peer, restored, regions, (1, 0), (1, 0), 0, keep_in=own)
            assert outcome["fetched"] == 8 and outcome["error"] is None
            # Kept, not forwarded: the sidecar's successor got none of them.
            assert successor.chunks == 0
            again = dejavu.KvCache(layout)
            assert dejavu.fetch_chunks(own, again, regions, (1, 0), (1, 0), 0)["fetched"] == 8
            assert bytes(again.gather(held)) == bytes(engine.gather(held))
            with pytest.raises(TypeError, match="sidecar store"):
                dejavu.fetch_chunks(peer, restored, regions, (1, 0), (1, 0), 0, keep_in=host)
        # A cache the chunks do not fit stops the fetch at the first, with the reason.
        smaller = dejavu.KvSpec(layers=2, kv_heads=3, head_dim=40, dtype="float16")
        outcome = dejavu.fetch_chunks(host, dejavu.KvCache(dejavu.KvLayout.per_layer(smaller, SLOTS, TOKENS, "bhsd")),
                                      regions, (1, 0), (1, 0), 0)
        assert outcome["fetched"] == 0 and outcome["bytes"] == 0 and outcome["error"]
        with pytest.raises(ValueError, match="no tokens"):
            dejavu.fetch_chunks(host, restored, [sequence(range(3, 3))])
    finally:
        peer_server.close()


def test_a_restarted_engine_restores_from_its_sidecar_as_the_recovery_instructions_say(tmp_path):
    with running_sidecar(tmp_path, index=1) as (socket, successor):
        layout = layouts()["paged_nhd"]
        engine = dejavu.KvCache.wrap(layout, engine_buffers(layout, 12))
        store = dejavu.Store.sidecar(socket, successor.address, epoch=1)
        layers, heads = range(SPEC.layers), range(SPEC.kv_heads)

        def sequence(slot, tokens):
            return dejavu.KvRegion(layers=layers, slots=range(slot, slot + 1), heads=heads, tokens=tokens)

        # Two sequences: a prompt each, then decode steps; slot 1 loses step 12.
        for slot, steps in ((0, range(8, 20)), (1, [*range(8, 12), 13])):
            dejavu.flush(store, engine, sequence(slot, range(0, 8)), (1, 0), (1, 0), 0)
            for step in steps:
                dejavu.flush(store, engine, sequence(slot, range(step, step + 1)), (1, 0), (1, 0), 0)
        del store

        # The engine restarts beside the sidecar that survived and follows its instructions.
        restarted = dejavu.Store.sidecar(socket, successor.address, epoch=2)
        recovery = restarted.recovery()
        assert (recovery["stage"], recovery["epoch"], recovery["successor"]) == (1, 2, successor.address)
        assert restarted.serving() == {"stage": 1, "epoch": 2, "successor": successor.address}
        assert recovery["chunks"] == 2 + 12 + 5
        points = recovery["resume"]
        assert [(p["slots"], p["tokens"], len(p["chunks"])) for p in points] == [((0, 1), 20, 13), ((1, 2), 12, 5)]
        restored = dejavu.KvCache(layout)
        for p in points:
            assert (p["destination"], p["microbatch"], p["layers"], p["heads"]) == ((1, 0), 0, (0, 3), (0, 3))
            for region in p["chunks"]:
                dejavu.fetch(restarted, restored, region, (1, 0), (1, 0), p["microbatch"])
            held = sequence(p["slots"][0], range(0, p["tokens"]))
            assert bytes(restored.gather(held)) == bytes(engine.gather(held))
        with pytest.raises(TypeError, match="sidecar store"):
            dejavu.Store.host().recovery()


def test_the_sidecar_client_reports_steps_and_restores_after_a_restart(tmp_path):
    with running_sidecar(tmp_path, index=2) as (socket, successor):
        layout = layouts()["faster_transformer"]
        caches = [dejavu.KvCache.wrap(layout, engine_buffers(layout, 20 + m)) for m in range(2)]
        client = dejavu.SidecarClient(socket, successor.address, epoch=1)
        assert client.worker == (2, 0), "the stage is the sidecar's"
        for m, cache in enumerate(caches):
            client.register(cache, microbatch=m)
        with pytest.raises(ValueError, match="microbatch 5"):
            client.step_done(5, range(0, 2), range(0, 8))
        # Microbatch 0: a prompt of 8 tokens for both sequences, then 6 steps; microbatch 1: the
        # prompt only. Every step is replicated before step_done returns.
        assert client.step_done(0, range(0, 2), range(0, 8)) > 0
        for token in range(8, 14):
            client.step_done(0, range(0, 2), range(token, token + 1))
        client.step_done(1, range(0, 2), range(0, 8))
        assert successor.chunks == 8
        del client

        # The engine restarts with empty caches and restores from its sidecar.
        fresh = [dejavu.KvCache(layout) for _ in range(2)]
        restarted = dejavu.SidecarClient(socket, successor.address, epoch=2)
        restarted.register(fresh[0], microbatch=0)
        restarted.register(fresh[1], microbatch=1)
        assert restarted.restore() == {(0, (0, 2)): 14, (1, (0, 2)): 8}
        for m, tokens in ((0, 14), (1, 8)):
            held = dejavu.KvRegion(layers=range(3), slots=range(2), heads=range(3), tokens=range(tokens))
            assert bytes(fresh[m].gather(held)) == bytes(caches[m].gather(held))
        # The old engine is cut off.
        with pytest.raises(dejavu.Error, match="older"):
            dejavu.SidecarClient(socket, successor.address, epoch=1)


def test_a_single_stage_names_no_successor_and_its_own_sidecar_is_refused(tmp_path):
    with running_sidecar_at(tmp_path, index=0) as (socket, successor, itself):
        # Its copies would die with it.
        with pytest.raises(dejavu.Error, match="its own successor"):
            dejavu.SidecarClient(socket, itself, epoch=1)
        layout = layouts()["faster_transformer"]
        cache = dejavu.KvCache.wrap(layout, engine_buffers(layout, 30))
        client = dejavu.SidecarClient(socket, "none", epoch=2)
        client.register(cache, microbatch=0)
        client.step_done(0, range(0, 2), range(0, 8))
        assert successor.chunks == 0, "nothing forwarded"
        del client
        # The local copy survives the engine.
        fresh = dejavu.KvCache(layout)
        restarted = dejavu.SidecarClient(socket, "none", epoch=3)
        restarted.register(fresh, microbatch=0)
        assert restarted.restore() == {(0, (0, 2)): 8}
        held = dejavu.KvRegion(layers=range(3), slots=range(2), heads=range(3), tokens=range(8))
        assert bytes(fresh.gather(held)) == bytes(cache.gather(held))


def test_a_finished_sequence_released_is_dropped_by_the_sidecar_and_at_its_successor(tmp_path):
    with running_sidecar(tmp_path, index=2) as (socket, successor):
        layout = layouts()["faster_transformer"]
        client = dejavu.SidecarClient(socket, successor.address, epoch=1)
        client.register(dejavu.KvCache.wrap(layout, engine_buffers(layout, 30)), microbatch=0)
        # Two sequences in slots 0 and 1: a prompt and two steps each.
        for slot in (0, 1):
            client.step_done(0, slot, range(0, 8))
            for token in (8, 9):
                client.step_done(0, slot, range(token, token + 1))
        assert successor.chunks == 6
        # Slot 0's sequence is finished: released here and at the successor, once.
        assert client.release(0, range(0, 1)) == 3
        assert successor.chunks == 3
        assert client.release(0, 0) == 0
        assert [p["slots"] for p in client.recovery()["resume"]] == [(1, 2)]
        with pytest.raises(dejavu.StoreError, match="cannot release"):
            dejavu.Store.file(tmp_path / "files").release((2, 0), 0, range(0, 1))


def test_an_engine_is_a_member_through_its_sidecar_and_its_death_is_seen_at_once(tmp_path):
    """The controller hears of a Python engine through its sidecar: alive while the client is
    connected, fenced as soon as the connection closes (a heartbeat timeout of a minute could not
    have done it)."""
    import urllib.request

    controller = subprocess.Popen(
        [dejavud(), "controller", "--listen=127.0.0.1:0", f"--state={tmp_path / 'state'}",
         "--timeout-ms=60000", "--metrics=127.0.0.1:0"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )
    sidecar = None
    try:
        metrics = controller.stdout.readline().split()[1]
        heartbeat = controller.stdout.readline().split()[1]
        socket = tmp_path / "s0.sock"
        sidecar = subprocess.Popen(
            [dejavud(), "sidecar", f"--heartbeat={heartbeat}", f"--local={socket}", f"--shm-dir={tmp_path}"],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        )
        assert sidecar.stdout.readline().startswith("listening ")

        def gauge(name):
            page = urllib.request.urlopen(f"http://{metrics}/metrics").read().decode()
            return next(float(l.split()[-1]) for l in page.splitlines() if l.startswith(name + " "))

        def wait_for(condition, what):
            deadline = time.monotonic() + 10
            while not condition():
                assert time.monotonic() < deadline, f"never {what}"
                time.sleep(0.01)

        wait_for(lambda: gauge("dejavu_controller_lifelines") == 1, "the sidecar's lifeline")
        client = dejavu.SidecarClient(socket, "127.0.0.1:9")
        assert client.epoch == 0, "the stage's first engine"
        wait_for(lambda: gauge("dejavu_controller_lifelines") == 2, "the engine's lifeline, held by its sidecar")
        # The engine goes: its connection to the sidecar closes.
        del client
        gc.collect()
        wait_for(lambda: gauge("dejavu_controller_fences_total") == 1, "the engine fenced")
        # Its replacement learns from the sidecar the epoch it was fenced in, and is a member.
        replacement = dejavu.SidecarClient(socket, "127.0.0.1:9")
        assert replacement.epoch == gauge("dejavu_controller_epoch") == 1
        wait_for(lambda: gauge("dejavu_controller_lifelines") == 2, "the replacement's lifeline")
    finally:
        for process in (sidecar, controller):
            if process is not None:
                process.kill()
                process.wait()
