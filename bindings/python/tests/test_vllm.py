"""The vLLM connector (``dejavu.vllm``) against real vLLM on the CPU, with real daemons: the
demo's four runs (``python -m dejavu.vllm.demo``), checked.

Set ``DEJAVU_REQUIRE_VLLM=1`` (CI does) to fail instead of skipping where vLLM is not installed.
"""

import os

import pytest

if not os.environ.get("DEJAVU_REQUIRE_VLLM"):
    pytest.importorskip("vllm")

from dejavu.vllm.demo import Workload, run  # noqa: E402
from test_dejavu import dejavud  # noqa: E402


def test_in_flight_requests_survive_an_engine_crash_then_a_node_loss_with_identical_output(tmp_path):
    # Prompts within one block of 128 tokens and across two and three.
    w = Workload(prompts=[40, 200, 300], new_tokens=256, kill_after=16)
    report = run(w, dejavud(), tmp_path)

    # Every request's tokens, across the two failures, equal the failure-free run's.
    assert report.identical == [True, True, True]
    # Each resumption loaded its KV from the sidecar, from token 0: after the crash from the
    # engine's own sidecar, after the node loss from the sidecar the controller restored from its
    # successor's copies. vLLM computes the last token itself, for the next token's logits. The
    # token before it was computed in the step whose output the router saw last; that step's
    # saves are acknowledged only at the end of the next step, which the crash may have cut
    # short, so it may be computed again too. Every earlier token was acknowledged and is loaded.
    assert report.after_crash and report.after_node_loss
    for r in report.after_crash + report.after_node_loss:
        assert r.loaded is not None and r.loaded[0] == 0, r
        assert r.prompt_tokens - 2 <= r.loaded[1] <= r.prompt_tokens - 1, r
    # A repeated prompt loads its whole blocks from the finished request that had it.
    assert report.prefix_reuse.loaded == (0, 256)
    # Once the copies it would load were damaged on disk, the load fails its checksum, vLLM
    # computes the blocks instead, and the tokens are those computed without any sidecar.
    damaged = report.damaged
    assert damaged.pieces_damaged >= 1, damaged
    assert damaged.load_failed and damaged.loaded is None, damaged
    assert damaged.identical_to_computed, damaged
    # An engine whose connector finds no sidecar says so and serves on, computing the same
    # requests from their prompts to their end. (Their tokens may differ from the failure-free
    # run's: vLLM's prefill of a prompt does not give the bits its decode steps gave, which is
    # why the resumptions above load the KV instead.)
    assert report.no_sidecar_logged
    assert report.recomputed_complete == [True, True, True]
    assert report.decode_step_seconds > 0 and report.decode_step_seconds_without > 0


def test_a_match_keeps_only_whole_chunks_that_run_from_token_zero_in_every_layer():
    from dejavu import KvRegion
    from dejavu.vllm.sequences import whole_chunks

    def chunk(layers, tokens):
        return KvRegion(layers=layers, slots=(0, 1), heads=(0, 2), tokens=tokens)

    # A prompt saved layer by layer, then decode steps of every layer at once, one missing.
    prompt = [chunk((layer, layer + 1), (0, 40)) for layer in range(4)]
    steps = [chunk((0, 4), (40, 41)), chunk((0, 4), (41, 42)), chunk((0, 4), (43, 44))]
    chunks, end = whole_chunks(prompt + steps, 100)
    assert end == 42 and chunks == prompt + steps[:2]
    assert whole_chunks(prompt + steps, 41) == (prompt + steps[:1], 41)
    # A prompt chunk reaching past the request's end cannot be scattered into it.
    assert whole_chunks(prompt + steps, 39) == ([], 0)
    # A layer whose prompt chunk is missing holds nothing, so no token is held in every layer.
    assert whole_chunks(prompt[1:] + [chunk((0, 1), (10, 40))] + steps, 100)[1] == 0


#: Two layers' names, as vLLM gives them to the connector.
LAYERS = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]


def layer_tensor(backend):
    """One layer's KV tensor as vLLM allocates it for ``backend``, filled with noise: logically
    ``[num_blocks][kv_heads][block_size][2 * head_dim]``; for its GPU backends stored with each
    block's tokens outside its heads (``LBNHC``, vLLM's default) or inside them (``LBHNC``)."""
    import torch

    if backend == "FLASH_ATTN/LBNHC":
        return torch.randn(8, 32, 2, 128).to(torch.bfloat16).transpose(1, 2)
    return torch.randn(8, 2, 32, 128).to(torch.bfloat16)


#: The backends whose layouts the worker side is tested with: vLLM's CPU backend, and its GPU
#: backends' layout, here in host memory (the library's own GPU tests run the same layouts on a GPU).
BACKENDS = ["CPU_ATTN", "FLASH_ATTN/LBNHC", "FLASH_ATTN/LBHNC"]


def cpu_worker(config, backend="CPU_ATTN"):
    """A worker side over two layers of ``backend``'s layout, filled with noise."""
    from dejavu.vllm.worker import WorkerSide

    worker = WorkerSide(config, block_size=32)
    worker.register({name: layer_tensor(backend) for name in LAYERS}, backend.split("/")[0])
    return worker


def save_a_request(worker, sequence=5):
    """A step that writes tokens 0..40 of a request in blocks 3 and 6, saved layer by layer, then
    acknowledged at the end of the next step."""
    from dejavu.vllm.plan import DejaVuMetadata, SaveJob

    step = DejaVuMetadata(saves=[SaveJob(sequence=sequence, start=0, end=40, ids=list(range(40)), blocks=[3, 6])])
    worker.bind(step)
    for name in LAYERS:
        worker.save_layer(name)
    worker.wait_for_save(step)
    worker.wait_for_save(DejaVuMetadata())


@pytest.mark.parametrize("backend", BACKENDS[1:])
def test_the_gpu_backends_tensors_are_read_as_their_kernels_split_them(backend):
    import torch

    from dejavu import KvCache, KvRegion
    from dejavu.vllm.tensors import paged_tensors

    tensors = [layer_tensor(backend) for _ in LAYERS]
    described = paged_tensors(tensors, "FLASH_ATTN", block_size=32)
    assert described.order == ("nhd" if backend.endswith("LBNHC") else "hnd")
    cache = KvCache.wrap(described.layout([6, 3]), described.buffers)
    # Token 40 of the sequence is row 8 of its second block, physical block 3. vLLM's GPU
    # backends split a layer's tensor as `kv_cache.transpose(1, 2).split(head_dim, dim=-1)`.
    key, value = tensors[1].transpose(1, 2).split(64, dim=-1)
    one = KvRegion(layers=(1, 2), slots=(0, 1), heads=(0, 2), tokens=(40, 41))
    expected = torch.cat([key[3, 8].flatten(), value[3, 8].flatten()])
    assert bytes(cache.gather(one)) == expected.view(torch.uint8).numpy().tobytes()
    # What the library has no layout for is refused, not misread.
    with pytest.raises(NotImplementedError, match="FLASHINFER"):
        paged_tensors(tensors, "FLASHINFER", block_size=32)
    # vLLM's block-major layouts (BLNHC: [num_blocks][layers][block_size][H][2 * D]) leave a
    # layer's tensor non-contiguous.
    block_major = torch.zeros(8, len(LAYERS), 32, 2, 128, dtype=torch.bfloat16)
    per_layer = [block_major[:, layer].transpose(1, 2) for layer in range(len(LAYERS))]
    with pytest.raises(NotImplementedError, match="LBNHC and LBHNC"):
        paged_tensors(per_layer, "FLASH_ATTN", 32)


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_worker_side_saves_to_its_sidecar_loads_elsewhere_and_reports_a_failed_load(tmp_path, backend):
    from dejavu.vllm.config import ConnectorConfig
    from dejavu.vllm.plan import DejaVuMetadata, LoadJob
    from test_dejavu import running_sidecar

    with running_sidecar(tmp_path, index=0) as (socket, successor):
        worker = cpu_worker(ConnectorConfig(sidecar=str(socket), successor=successor.address), backend)
        save_a_request(worker)
        assert successor.chunks == 3  # two layers' KV and the token ids, copied on

        # Loaded into other blocks (noise until then), as a new engine's request would: the same
        # bytes.
        chunks = [((0, 1), (0, 40)), ((1, 2), (0, 40))]
        region = worker._region((0, 2), (0, 39))
        assert bytes(worker._view([1, 2]).gather(region)) != bytes(worker._view([3, 6]).gather(region))
        worker.start_load(DejaVuMetadata(loads=[LoadJob("again", 5, 0, 39, chunks, [1, 2])]))
        assert worker.load_errors() == set()
        # Compared through the library's view of both places, in the order vLLM's kernels keep K.
        assert bytes(worker._view([1, 2]).gather(region)) == bytes(worker._view([3, 6]).gather(region))

        # A load of KV the sidecar does not hold reports the blocks it was to fill.
        missing = LoadJob("other", 77, 0, 39, chunks, [4, 7])
        worker.start_load(DejaVuMetadata(loads=[missing]))
        assert worker.load_errors() == {4, 7}
        worker.shutdown()


def test_a_load_through_host_memory_of_each_chunks_size_puts_every_token_in_its_block(tmp_path):
    # The GPU path's load, here with the GPU backends' layout in host memory: each chunk is
    # fetched into host memory of its own blocks, then uploaded packed (on a GPU by the copy
    # kernels, here by the CPU's scatter).
    import threading

    from dejavu.vllm.config import ConnectorConfig
    from dejavu.vllm.plan import DejaVuMetadata, LoadJob, SaveJob
    from test_dejavu import running_sidecar

    with running_sidecar(tmp_path, index=0) as (socket, successor):
        worker = cpu_worker(ConnectorConfig(sidecar=str(socket), successor=successor.address), "FLASH_ATTN/LBNHC")
        save_a_request(worker)
        # A decode step's token 40, in the request's second block (physical block 6), every layer.
        step = DejaVuMetadata(saves=[SaveJob(sequence=5, start=40, end=41, ids=[40], blocks=[3, 6])])
        worker.bind(step)
        for name in LAYERS:
            worker.save_layer(name)
        worker.wait_for_save(step)
        worker.wait_for_save(DejaVuMetadata())

        chunks = [((0, 1), (0, 40)), ((1, 2), (0, 40)), ((0, 2), (40, 41))]
        region = worker._region((0, 2), (0, 41))
        target = worker._view([4, 7])
        assert bytes(target.gather(region)) != bytes(worker._view([3, 6]).gather(region))
        job = LoadJob("staged", 5, 0, 41, chunks, [4, 7])
        worker._fetch(target, job, lambda r, data: target.scatter(r, data), threading.Event())
        assert bytes(worker._view([4, 7]).gather(region)) == bytes(worker._view([3, 6]).gather(region))

        # A load given up on stops before its next chunk.
        given_up = threading.Event()
        given_up.set()
        uploaded = []
        worker._fetch(target, job, lambda r, data: uploaded.append(r), given_up)
        assert uploaded == []
        worker.shutdown()


def test_the_latest_finished_requests_are_kept_and_the_oldest_goes():
    from dejavu.vllm.sequences import Kept

    kept = Kept(2)
    assert kept.add(10) == [] and kept.add(11) == []
    assert kept.add(12) == [10]
    assert 10 not in kept and 11 in kept and 12 in kept
    # None kept: a finished request's sequence goes at once.
    assert Kept(0).add(7) == [7]


def test_a_sequence_no_request_claims_is_dropped_after_its_grace_and_not_before():
    from dejavu.vllm.sequences import Orphans

    orphans = Orphans(10.0)
    assert orphans.expired([1, 2, 3], claimed=[2], now=0.0) == []
    # 3 is claimed for a while (a request loads it): its time starts again once it is not.
    assert orphans.expired([1, 2, 3], claimed=[2, 3], now=5.0) == []
    assert orphans.expired([1, 2, 3], claimed=[2], now=9.5) == []
    assert orphans.expired([1, 2, 3], claimed=[2], now=10.0) == [1]
    assert orphans.expired([2, 3], claimed=[2], now=19.25) == []
    assert orphans.expired([2, 3], claimed=[2], now=19.5) == [3]
    # One the sidecar no longer holds is forgotten: seen again, its time starts anew.
    assert orphans.expired([2], claimed=[], now=20.0) == []
    assert orphans.expired([], claimed=[], now=21.0) == []
    assert orphans.expired([2], claimed=[], now=22.0) == []
    assert orphans.expired([2], claimed=[], now=31.75) == []
    assert orphans.expired([2], claimed=[], now=32.0) == [2]


def test_the_scheduler_drops_what_a_dead_engine_left_once_no_request_came_back_for_it(tmp_path):
    """A sequence saved by a worker of an engine that then died stays in the sidecar for
    ``orphan_seconds`` of the next engine's scheduler, then its workers drop it."""
    from types import SimpleNamespace

    from dejavu import Store
    from dejavu.vllm.config import ConnectorConfig
    from dejavu.vllm.scheduler import SchedulerSide
    from dejavu.vllm.sequences import SequenceIndex
    from test_dejavu import running_sidecar

    def idle_step():
        cached = SimpleNamespace(req_ids=[], new_block_ids=[], resumed_req_ids=set(), num_computed_tokens=[])
        return SimpleNamespace(scheduled_new_reqs=[], scheduled_cached_reqs=cached, preempted_req_ids=set(),
                               num_scheduled_tokens={})

    def run_step(worker, meta):
        worker.bind(meta)
        worker.wait_for_save(meta)

    with running_sidecar(tmp_path, index=0) as (socket, successor):
        config = ConnectorConfig(sidecar=str(socket), successor=successor.address, orphan_seconds=100.0)
        dead = cpu_worker(config)
        save_a_request(dead, sequence=5)
        dead.shutdown()
        reader = SequenceIndex(Store.sidecar_reader(str(socket)))
        reader.refresh()
        assert set(reader.held) == {5}

        # The next engine: its scheduler looks over the sidecar every 25 s of its clock.
        now = [1000.0]
        scheduler = SchedulerSide(config, block_size=32, clock=lambda: now[0])
        worker = cpu_worker(config)
        for t in (1000.0, 1025.0, 1050.0, 1075.0, 1099.0):
            now[0] = t
            meta = scheduler.build(idle_step())
            assert meta.releases == [], t
            run_step(worker, meta)
        now[0] = 1100.0
        meta = scheduler.build(idle_step())
        assert meta.releases == [5]
        # The workers drop it at the end of the next step, once that step's saves are in.
        run_step(worker, meta)
        run_step(worker, scheduler.build(idle_step()))
        reader.refresh()
        assert reader.held == {}
        worker.shutdown()


def test_the_sidecar_is_listed_again_no_sooner_than_ten_times_what_the_last_listing_took():
    from dejavu.vllm.scheduler import ListingPace

    pace = ListingPace(share=0.1)
    assert pace.due(0.0), "never listed"
    pace.listed(100.0, 100.5)  # half a second: many chunks held
    assert not pace.due(100.6) and not pace.due(105.4)
    assert pace.due(105.5)
    pace.listed(200.0, 200.001)  # a millisecond: listed again at the next pass
    assert not pace.due(200.005) and pace.due(200.02)


def test_a_released_sequence_is_not_matched_again_from_a_listing_older_than_its_release(tmp_path):
    from types import SimpleNamespace

    from dejavu.vllm.config import ConnectorConfig
    from dejavu.vllm.scheduler import RELEASE_LAG, SchedulerSide
    from test_dejavu import running_sidecar

    def request(name):
        # The dead engine's request: its 40 tokens, then the one vLLM computes for the logits.
        ids = list(range(40)) + [7]
        return SimpleNamespace(request_id=name, all_token_ids=ids, num_tokens=len(ids), kv_transfer_params=None)

    def step(new=()):
        new = [SimpleNamespace(req_id=name, block_ids=(blocks,), num_computed_tokens=40) for name, blocks in new]
        cached = SimpleNamespace(req_ids=[], new_block_ids=[], resumed_req_ids=set(), num_computed_tokens=[])
        return SimpleNamespace(scheduled_new_reqs=new, scheduled_cached_reqs=cached, preempted_req_ids=set(),
                               num_scheduled_tokens={r.req_id: 1 for r in new})

    with running_sidecar(tmp_path, index=0) as (socket, successor):
        config = ConnectorConfig(sidecar=str(socket), successor=successor.address)
        dead = cpu_worker(config)
        save_a_request(dead, sequence=5)
        dead.shutdown()

        # Each listing takes a second of this clock, so the next is due ten seconds after it.
        now = [1000.0]
        scheduler = SchedulerSide(config, block_size=32, clock=lambda: now[0])
        refresh, listings = scheduler._index.refresh, []

        def slow_refresh():
            refresh()
            now[0] += 1.0
            listings.append(now[0])

        scheduler._index.refresh = slow_refresh
        first = request("first")
        assert scheduler.matched(first, 0) == 40, "the dead engine's sequence"
        scheduler.allocated(first, 40)
        meta = scheduler.build(step([("first", [1, 2])]))
        assert [job.sequence for job in meta.loads] == [5]
        assert 5 in meta.releases, "left by a dead engine: the request's own sequence takes over"
        assert len(listings) == 2  # the first match's, and the first pass's look for orphans

        # A pass later, a request with the same tokens comes before another listing is due: the
        # last listing still shows sequence 5, whose release is under way, and it is not matched.
        scheduler.build(step())
        assert scheduler.matched(request("second"), 0) == 0
        assert len(listings) == 2, "not listed again yet"

        # Once a listing is taken RELEASE_LAG passes after the release, the workers have dropped
        # it (none runs here, so the sidecar still lists it, and it is matched again).
        now[0] += 20.0
        for _ in range(RELEASE_LAG - 1):
            scheduler.build(step())
        assert scheduler.matched(request("third"), 0) == 40
        assert len(listings) == 3
