"""The PyTorch engine (``dejavu.torch_engine``): a ``transformers`` Llama with seeded random
weights split into stage processes beside real ``dejavud`` sidecars and a controller. Needs torch
and transformers (CI installs both); the GPU case runs only where CUDA is."""

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from dejavu.torch_engine import ModelShape, StageError, TorchStage  # noqa: E402
from dejavu.torch_engine.demo import Run, Workload  # noqa: E402
from dejavu.torch_engine.model import generate  # noqa: E402
from dejavu.torch_engine.stage import SIDECAR_GONE  # noqa: E402

SHAPE = ModelShape(layers=4, hidden=128, heads=4, kv_heads=2, intermediate=256, vocab=512, seed=3)


def ids(batch, tokens, seed=0):
    return torch.randint(0, SHAPE.vocab, (batch, tokens), generator=torch.Generator().manual_seed(seed))


def split_matches_the_whole_model(device, tp=1):
    model = SHAPE.build(device)
    stages = [TorchStage(SHAPE, range(0, 1), 2, 32, device, tp=tp), TorchStage(SHAPE, range(1, 4), 2, 32, device, tp=tp)]
    prompt = ids(2, 12).to(device)
    with torch.inference_mode():
        expected = model(prompt).logits[:, -1]
    # The prompt's first 8 tokens in one step, then one token per step.
    x = stages[1].forward(stages[0].forward(prompt[:, :8], range(2), 0), range(2), 0, logits=True)
    for t in range(8, 12):
        x = stages[1].forward(stages[0].forward(prompt[:, t : t + 1], range(2), t), range(2), t, logits=True)
    torch.testing.assert_close(x, expected, rtol=1e-4, atol=1e-4)
    assert x.abs().max() > 0


def test_stages_built_apart_compute_what_the_whole_model_computes():
    split_matches_the_whole_model("cpu")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: the GPU stage is not tested here")
def test_stages_on_a_gpu_compute_what_the_whole_model_computes():
    split_matches_the_whole_model("cuda")
    split_matches_the_whole_model("cuda", tp=2)


def test_tensor_parallel_stages_compute_what_the_whole_model_computes_each_rank_keeping_its_heads():
    split_matches_the_whole_model("cpu", tp=2)
    whole, ranks = TorchStage(SHAPE, range(0, 4), 2, 16), TorchStage(SHAPE, range(0, 4), 2, 16, tp=2)
    prompt = ids(2, 9, seed=4)
    whole.forward(prompt, range(2), 0)
    ranks.forward(prompt, range(2), 0)
    shards = ranks.kv(0).shards
    assert [s.keys[0].shape[1] for s in shards] == [1, 1] and ranks.rank_heads(1) == (1, 2)
    for layer in range(4):
        # Layer 0's KV is computed from the embeddings alone, each rank's heads as the whole
        # model's; the later layers' inputs went through the ranks' sums.
        for name in ("keys", "values"):
            joined = torch.cat([getattr(s, name)[layer] for s in shards], dim=1)
            torch.testing.assert_close(joined, getattr(whole, name)[layer], rtol=1e-5, atol=1e-5)
    assert len(ranks.caches(0)) == 2
    with pytest.raises(ValueError, match="split among 2 tensor-parallel ranks: use shards"):
        ranks.cache
    with pytest.raises(ValueError, match="use host_mirrors"):
        ranks.host_mirror()
    with pytest.raises(ValueError, match=r"TP 4 does not divide the model's kv_heads \(2\)"):
        TorchStage(SHAPE, range(0, 4), 2, 16, tp=4)
    with pytest.raises(ValueError, match="a TP degree of 0"):
        TorchStage(SHAPE, range(0, 4), 2, 16, tp=0)


def test_mismatched_shapes_are_refused_with_a_clear_error():
    first, later = TorchStage(SHAPE, range(0, 2), 2, 16), TorchStage(SHAPE, range(2, 4), 2, 16)
    with pytest.raises(ValueError, match=r"takes token ids \[batch, tokens\]; got shape \(2, 3, 128\)"):
        first.forward(torch.zeros(2, 3, 128), range(2), 0)
    with pytest.raises(ValueError, match="3 sequences given for 2 slots"):
        first.forward(ids(3, 1), range(2), 0)
    with pytest.raises(ValueError, match="tokens 14..18 do not fit the stage's 16"):
        first.forward(ids(2, 4), range(2), 14)
    with pytest.raises(ValueError, match="slots range"):
        first.forward(ids(2, 1), range(1, 3), 0)
    with pytest.raises(ValueError, match="hidden states of 64 where the model's are 128"):
        later.forward(torch.zeros(2, 1, 64), range(2), 0)
    with pytest.raises(ValueError, match="not a multiple of heads"):
        ModelShape(hidden=130, heads=4)
    with pytest.raises(ValueError, match="layers range"):
        TorchStage(SHAPE, range(2, 6), 2, 16)


def reference(workload):
    stages = [TorchStage(SHAPE, workload.layers(i), workload.batch, workload.max_tokens) for i in range(workload.stages)]
    return generate(stages, workload.prompts(), workload.new_tokens)


def test_engines_workers_and_sidecars_killed_mid_decode_resume_bit_identical():
    from test_dejavu import dejavud

    workload = Workload(SHAPE, stages=2, batch=2, prompt=8, new_tokens=14)
    expected = reference(workload)
    run = Run(workload, dejavud())
    try:
        cluster = run.cluster

        def before_step(step, pipeline):
            if step == 3:
                # A request the stage cannot carry out is refused, and the stage goes on.
                with pytest.raises(StageError, match="hidden states of 64"):
                    pipeline.stages[1].request(("step", 0, (0, 2), 0, torch.zeros(2, 1, 64), True), "out")
                pipeline.stages[1].kill()  # an engine
            if step == 6:
                restores = cluster.restores()
                fences = cluster.fences()
                pipeline.stages[0].kill()  # a whole worker
                cluster.kill_sidecar(0)
                cluster.wait_for(lambda: cluster.fences() > fences, "worker 0 fenced")
                cluster.restart_sidecar(0)
                cluster.wait_for(lambda: cluster.restores() > restores, "sidecar 0 restored")
            if step == 10:
                restores = cluster.restores()
                cluster.kill_sidecar(1)  # a sidecar alone: its engine finds it gone
                cluster.restart_sidecar(1)
                cluster.wait_for(lambda: cluster.restores() > restores, "sidecar 1 restored")

        generation = run.generate(before_step=before_step)
    finally:
        run.stop()
    assert torch.equal(generation.tokens, expected)
    recoveries = [(r.stage, r.failed_step) for r in generation.recoveries]
    assert recoveries[:2] == [(1, 3), (0, 6)]
    engine, worker, sidecar = generation.recoveries
    # The killed engine's replacement restored from its sidecar: at most `lag` steps were not
    # acknowledged, and only those are recomputed. So for the whole worker, from its successor.
    assert engine.resumed_step >= 3 - workload.lag
    assert worker.resumed_step >= 6 - workload.lag
    # The engine whose sidecar died exits with SIDECAR_GONE within `lag` steps; every step it had
    # acknowledged survives in the successor, which the replacement sidecar was restored from.
    assert (sidecar.stage, sidecar.status) == (1, SIDECAR_GONE)
    assert 10 <= sidecar.failed_step <= 10 + workload.lag
    assert sidecar.resumed_step >= 10 - workload.lag


def test_the_demo_reports_each_failure_against_a_failure_free_run(tmp_path, capsys):
    from test_dejavu import dejavud

    from dejavu.torch_engine.demo import main

    report = tmp_path / "report.json"
    argv = ["--dejavud", dejavud(), "--layers=2", "--hidden=64", "--heads=2", "--kv-heads=1", "--intermediate=128",
            "--vocab=128", "--batch=2", "--prompt=4", "--new-tokens=8", "--block=2", f"--json={report}"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    for line in ("failure-free:", "replication overhead per decode step:", "engine killed at step 4",
                 "worker killed at step 4", "restart from scratch at step 4"):
        assert line in out
    import json

    figures = json.loads(report.read_text())
    assert figures["identical"] is True
    assert figures["tokens_per_second"] > 0 and figures["swapped_bytes"] == 0
    assert figures["restart_from_scratch"]["recomputed_from_step"] == 0
    # A restored engine recomputes at most the steps not acknowledged yet.
    assert figures["engine_killed"]["recomputed_from_step"] >= 4 - 2
    assert main(["--stages=3", "--layers=2"]) == 2


PROMPTS, NEW_TOKENS, SLOTS, MAX_TOKENS = ids(3, 10, seed=5), 6, 3, 16


def disaggregation_splits(device):
    """Three splits of the model on ``device``: colocated (layers 0 | 1-3), a prompt stage of all
    four layers, and token stages of two each."""
    def stage(first, end):
        return TorchStage(SHAPE, range(first, end), SLOTS, MAX_TOKENS, device)

    return [stage(0, 1), stage(1, 4)], [stage(0, 4)], [stage(0, 2), stage(2, 4)]


def disaggregated_matches_colocated(device):
    """Generates colocated and disaggregated on ``device``: the same tokens, and the token stages
    hold the prompt stage's KV bit for bit. Returns the tokens and the two disaggregated splits."""
    import dejavu
    from dejavu.torch_engine.disaggregation import generate_disaggregated

    colocated, prompt_stages, token_stages = disaggregation_splits(device)
    expected = generate(colocated, PROMPTS, NEW_TOKENS)
    tokens = generate_disaggregated(prompt_stages, token_stages, PROMPTS, NEW_TOKENS, dejavu.HostStore())
    assert torch.equal(tokens, expected)
    for stage in token_stages:
        for local, layer in enumerate(stage.layers):
            assert torch.equal(stage.keys[local][:, :, :10], prompt_stages[0].keys[layer][:, :, :10])
            assert torch.equal(stage.values[local][:, :, :10], prompt_stages[0].values[layer][:, :, :10])
    return expected, prompt_stages, token_stages


def test_prompt_stages_hand_their_kv_to_token_stages_split_another_way():
    import dejavu
    from dejavu.torch_engine.disaggregation import generate_disaggregated, hand_over

    expected, prompt_stages, token_stages = disaggregated_matches_colocated("cpu")
    # Through the stages' host mirrors (the way of stages on a GPU), in two pieces of the prompt:
    # the same KV, the same tokens.
    _, mirrored_prompt, mirrored_tokens = disaggregation_splits("cpu")
    mirrored_prompt[0].forward(PROMPTS, range(SLOTS), 0)
    store = dejavu.HostStore()
    for piece in (range(0, 4), range(4, 10)):
        received = hand_over(mirrored_prompt, mirrored_tokens, piece, store, through_host=True)
        assert received == sum(s.cache.packed_len(s.region(range(SLOTS), piece)) for s in mirrored_tokens)
    for stage, direct in zip(mirrored_tokens, token_stages):
        for ours, theirs in zip(stage.kv(0).tensors(), direct.kv(0).tensors()):
            assert torch.equal(ours[:, :, :10], theirs[:, :, :10])
        assert stage.lengths[0] == 10
    _, prompt_again, tokens_again = disaggregation_splits("cpu")
    via_host = generate_disaggregated(prompt_again, tokens_again, PROMPTS, NEW_TOKENS, dejavu.HostStore(), through_host=True)
    assert torch.equal(via_host, expected)
    # Token stages with another model shape are refused.
    other = TorchStage(ModelShape(layers=4, hidden=128, heads=4, kv_heads=4, intermediate=256, vocab=512), range(0, 4), SLOTS, MAX_TOKENS)
    with pytest.raises(ValueError, match="one model shape"):
        hand_over(prompt_stages, [other, token_stages[1]], range(0, 10), dejavu.HostStore())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: a hand-over from GPU stages is not tested here")
def test_prompt_stages_on_a_gpu_hand_their_kv_over_through_their_host_mirrors():
    disaggregated_matches_colocated("cuda")


def model_kv(stages, layer):
    """The K and V of the model's ``layer``, every head (its ranks' joined), from the stage of
    ``stages`` that holds it."""
    stage = next(s for s in stages if layer in s.layers)
    shards, local = stage.kv(0).shards, layer - stage.layers.start
    return [torch.cat([getattr(s, name)[local] for s in shards], dim=1) for name in ("keys", "values")]


def decode(stages, first, start, new_tokens):
    """Greedy tokens after ``first`` (each sequence's next token) from position ``start``."""
    tokens, x = [first], first
    for position in range(start, start + new_tokens - 1):
        x = x.unsqueeze(1)
        for stage in stages:
            x = stage.forward(x, range(SLOTS), position)
        tokens.append(x)
    return torch.stack(tokens, dim=1)


def hand_over_across_tp_degrees(device):
    """Hands a prompt's KV over from TP 2 to TP 1 and from TP 1 to TP 2, each into another layer
    split, on ``device`` (on a GPU, by the host mirrors both ways)."""
    import dejavu
    from dejavu.torch_engine.disaggregation import hand_over

    def stage(layers, tp):
        return TorchStage(SHAPE, layers, SLOTS, MAX_TOKENS, device, tp=tp)

    on_cpu = device == "cpu"
    splits = [
        # TP 2 over two stages into TP 1 over two others, by the host mirrors.
        ([stage(range(0, 2), 2), stage(range(2, 4), 2)], lambda: [stage(range(0, 1), 1), stage(range(1, 4), 1)], True if on_cpu else None),
        # One stage at TP 1 into TP 2 over three stages, straight from the stages' tensors.
        ([stage(range(0, 4), 1)], lambda: [stage(range(0, 1), 2), stage(range(1, 3), 2), stage(range(3, 4), 2)], False if on_cpu else None),
    ]
    for prompt_stages, token_split, through_host in splits:
        x = PROMPTS
        for s in prompt_stages:
            x = s.forward(x, range(SLOTS), 0)
        handed, direct = token_split(), token_split()
        received = hand_over(prompt_stages, handed, range(0, 10), dejavu.HostStore(), through_host=through_host)
        assert received == SHAPE.kv_bytes_per_token() * SLOTS * 10
        # Each rank of each token stage holds its heads of the prompt stages' KV, bit for bit.
        for layer in range(SHAPE.layers):
            for ours, theirs in zip(model_kv(handed, layer), model_kv(prompt_stages, layer)):
                assert torch.equal(ours[:, :, :10], theirs[:, :, :10])
        # And decodes what token stages given that KV by plain tensor copies decode.
        for s in direct:
            for local, layer in enumerate(s.layers):
                keys, values = model_kv(prompt_stages, layer)
                for rank, shard in enumerate(s.kv(0).shards):
                    first, end = s.rank_heads(rank)
                    shard.keys[local][:, :, :10] = keys[:, first:end, :10]
                    shard.values[local][:, :, :10] = values[:, first:end, :10]
            s.restored(0, [(range(SLOTS), 10)])
        tokens = decode(handed, x, 10, NEW_TOKENS)
        assert torch.equal(tokens, decode(direct, x, 10, NEW_TOKENS))
        assert all(s.lengths[0] == 10 + NEW_TOKENS - 1 for s in handed)


def test_prompt_stages_hand_their_kv_over_across_a_change_of_tp_degree_and_layer_split():
    hand_over_across_tp_degrees("cpu")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: a hand-over across TP degrees on a GPU is not tested here")
def test_prompt_stages_on_a_gpu_hand_their_kv_over_across_a_change_of_tp_degree():
    hand_over_across_tp_degrees("cuda")


def test_a_replacement_that_cannot_join_yet_is_followed_by_another_once_the_sidecar_is_back():
    import threading

    from test_dejavu import dejavud

    workload = Workload(SHAPE, stages=2, batch=2, prompt=8, new_tokens=10)
    expected = reference(workload)
    run = Run(workload, dejavud())
    restarted = threading.Event()
    try:
        cluster = run.cluster

        def before_step(step, pipeline):
            if step == 4:
                pipeline.stages[1].kill()
                cluster.kill_sidecar(1)

                def back():
                    cluster.restart_sidecar(1)
                    restarted.set()

                # The driver finds the stage dead at once; its sidecar comes back a second later.
                threading.Timer(1.0, back).start()

        generation = run.generate(before_step=before_step)
    finally:
        restarted.wait(10)
        run.stop()
    assert torch.equal(generation.tokens, expected)
    (recovery,) = generation.recoveries
    assert (recovery.stage, recovery.failed_step) == (1, 4)
    assert recovery.join_seconds >= 1.0


def test_microbatches_swapped_through_host_memory_give_the_tokens_of_microbatches_kept_resident():
    prompts, new_tokens = ids(6, 5, seed=9), 7

    def stages(resident):
        return [TorchStage(SHAPE, range(0, 2), 2, 16, microbatches=3, resident=resident),
                TorchStage(SHAPE, range(2, 4), 2, 16, microbatches=3, resident=resident)]

    kept, swapped = stages(3), stages(1)
    expected = generate(kept, prompts, new_tokens, microbatches=3)
    assert torch.equal(generate(swapped, prompts, new_tokens, microbatches=3), expected)
    assert all(stage.swapped_bytes == 0 for stage in kept)
    # Every step of every microbatch after the first swapped one out and one in.
    assert all(stage.swapped_bytes > 0 for stage in swapped)
    # At TP 2, each rank's KV is swapped: the same tokens as TP 2 kept, and the same bytes as TP 1.
    ranks_kept = [TorchStage(SHAPE, range(0, 4), 2, 16, microbatches=3, tp=2)]
    ranks_swapped = [TorchStage(SHAPE, range(0, 4), 2, 16, microbatches=3, resident=1, tp=2)]
    expected = generate(ranks_kept, prompts, new_tokens, microbatches=3)
    assert torch.equal(generate(ranks_swapped, prompts, new_tokens, microbatches=3), expected)
    assert ranks_swapped[0].swapped_bytes == sum(stage.swapped_bytes for stage in swapped)
    assert all(stage.prefetches == 0 for stage in kept + swapped)
    with pytest.raises(ValueError, match="microbatch 3: the stage has 3"):
        swapped[0].forward(ids(2, 1), range(2), 5, microbatch=3)
    with pytest.raises(ValueError, match="4 resident microbatches of 3"):
        TorchStage(SHAPE, range(0, 2), 2, 16, microbatches=3, resident=4)


def swaps_ahead_match_microbatches_kept_resident(device):
    prompts, new_tokens = ids(8, 5, seed=11), 9

    def stages(resident, prefetch=True):
        return [TorchStage(SHAPE, range(0, 2), 2, 16, microbatches=4, resident=resident, prefetch=prefetch, device=device),
                TorchStage(SHAPE, range(2, 4), 2, 16, microbatches=4, resident=resident, prefetch=prefetch, device=device)]

    kept, ahead, in_turn = stages(4), stages(2), stages(2, prefetch=False)
    expected = generate(kept, prompts, new_tokens, microbatches=4)
    assert torch.equal(generate(ahead, prompts, new_tokens, microbatches=4), expected)
    assert torch.equal(generate(in_turn, prompts, new_tokens, microbatches=4), expected)
    # Round the microbatches, each step's swap was started by the step before, and moved the
    # bytes the swaps in turn moved; the last step's prefetch (of microbatch 0, never stepped
    # again) swapped one more microbatch out and one in.
    assert all(stage.prefetches == 4 * new_tokens for stage in ahead)
    assert all(stage.prefetches == 0 for stage in in_turn)
    for early, late in zip(ahead, in_turn):
        microbatch = early.sets[0].cache.packed_len(early.region(range(2), range(0, 5 + new_tokens - 1)))
        assert early.swapped_bytes == late.swapped_bytes + 2 * microbatch
    # A prefetch for a microbatch the driver does not step next is undone by a later swap.
    stage = TorchStage(SHAPE, range(0, 2), 2, 16, device, microbatches=4, resident=2)
    reference = TorchStage(SHAPE, range(0, 2), 2, 16, device, microbatches=4)
    positions = [0] * 4
    for m in (0, 2, 1, 3, 0, 3, 2, 2, 1):
        x = ids(2, 1, seed=m + 10 * positions[m])
        out = stage.forward(x, range(2), positions[m], microbatch=m)
        assert torch.equal(out, reference.forward(x, range(2), positions[m], microbatch=m))
        positions[m] += 1
    assert stage.prefetches > 0


def test_microbatches_swapped_in_ahead_give_the_tokens_of_microbatches_kept_resident():
    swaps_ahead_match_microbatches_kept_resident("cpu")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: swaps ahead on a GPU are not tested here")
def test_microbatches_swapped_in_ahead_on_a_gpu_give_the_tokens_of_microbatches_kept_resident():
    swaps_ahead_match_microbatches_kept_resident("cuda")


def test_swapping_stages_killed_mid_decode_resume_bit_identical():
    from test_dejavu import dejavud

    workload = Workload(SHAPE, stages=2, batch=2, prompt=6, new_tokens=10, microbatches=3, resident=2)
    stages = [TorchStage(SHAPE, workload.layers(i), 2, workload.max_tokens, microbatches=3) for i in range(2)]
    expected = generate(stages, workload.prompts(), workload.new_tokens, microbatches=3)
    run = Run(workload, dejavud())
    try:
        cluster = run.cluster

        def before_step(step, pipeline):
            if step == 3:
                pipeline.stages[0].kill()
            if step == 6:
                restores = cluster.restores()
                pipeline.stages[1].kill()
                cluster.kill_sidecar(1)
                cluster.restart_sidecar(1)
                cluster.wait_for(lambda: cluster.restores() > restores, "sidecar 1 restored")

        generation = run.generate(before_step=before_step)
        swapped, prefetches = run.swapped_bytes(), run.prefetches()
    finally:
        run.stop()
    assert torch.equal(generation.tokens, expected)
    assert [(r.stage, r.failed_step) for r in generation.recoveries] == [(0, 3), (1, 6)]
    # Two of three microbatches kept on each stage's device: swaps are started ahead, by the
    # replacements too (the stats are theirs).
    assert swapped > 0 and prefetches > 0
    # Each replacement restored every microbatch, swapped out or not: at most `lag` steps of
    # them are recomputed.
    assert all(r.resumed_step >= r.failed_step - workload.lag - 1 for r in generation.recoveries)


#: The shape `dejavud demo --engine torch` gives the engine: the reference model's.
DEMO_SHAPE = ModelShape(layers=8, hidden=256, heads=8, kv_heads=2, intermediate=512, vocab=512, seed=0xDE1A5EED)


def test_the_daemon_runs_the_engine_under_its_stage_host_and_each_kill_resumes_bit_identical():
    """``dejavud demo --engine torch``: the daemon's stage processes run the PyTorch engine as
    engine processes (``python -m dejavu.torch_engine member``). The controller recovers from an
    engine killed alone, replaced by a spare whose engine process stood by, warm (restored from
    its own sidecar); the driver recovers from a whole worker killed (restored from its
    successor's sidecar), its stages keeping 2 of 3 microbatches on the device and swapping the
    third, each swap started a step ahead."""
    import json
    import subprocess
    import sys

    from test_dejavu import dejavud

    common = [dejavud(), "demo", "--engine=torch", f"--python={sys.executable}", "--stages=2", "--victim=1",
              "--requests=4", "--prompt-tokens=6", "--new-tokens=10", "--json"]
    reports = {}
    swapping = ["--recoveries=driver", "--requests=12", "--device-caches=2"]
    for kill, more in (("engine", ["--recoveries=controller", "--spares=1"]), ("worker", swapping)):
        run = subprocess.run(common + [f"--kill={kill}"] + more, capture_output=True, text=True, timeout=900)
        assert run.returncode == 0, run.stderr
        reports[kill] = json.loads(run.stdout)
    for report, requests in ((reports["engine"], 4), (reports["worker"], 12)):
        assert report["engine"] == "torch"
        assert report["matched"] is True and report["restart_matched"] is True
        # The replacement restored what replication kept: it recomputes the interrupted step (and
        # at most one the streamer had not finished), where a restart recomputes the 5 tokens of
        # every request before the failure.
        assert 1 <= report["recovery"]["tokens_recomputed"] <= 2
        assert report["restart_tokens_recomputed"] == 5 * requests
    assert reports["engine"]["spares_used"] == 1 and reports["worker"]["spares_used"] == 0
    # The engine processes report their swaps, which the stage hosts publish as their metrics.
    assert reports["engine"]["swapped_bytes"] == 0 and reports["worker"]["swapped_bytes"] > 0
    # What the engine processes computed is what the same model computes in one process.
    first = reports["engine"]["first_request"]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        stages = [TorchStage(DEMO_SHAPE, range(0, 4), 1, 16), TorchStage(DEMO_SHAPE, range(4, 8), 1, 16)]
        expected = generate(stages, torch.tensor([first["prompt"]]), len(first["tokens"]))
    finally:
        torch.set_num_threads(threads)
    assert len(first["tokens"]) == 10
    assert expected[0].tolist() == first["tokens"]
    assert reports["worker"]["first_request"] == first


def test_an_engine_process_that_cannot_be_the_stage_stops_it_with_the_reason():
    import subprocess
    import sys

    from test_dejavu import dejavud

    engine = [sys.executable, "-m", "dejavu.torch_engine", "member", "--shape", DEMO_SHAPE.to_json()]
    run = subprocess.run([dejavud(), "stage", "--index=0", "--epoch=0", "--layers=0..12", "--next=127.0.0.1:9",
                          "--"] + engine, capture_output=True, text=True, timeout=120)
    assert run.returncode != 0
    assert "layers range(0, 12) are not a non-empty range within the model's 8" in run.stderr
    assert "the engine process is gone (exit status: 2)" in run.stderr


def test_an_engine_process_reads_a_sequence_s_kv_out_and_writes_it_in_for_a_handoff():
    import struct

    from dejavu.torch_engine.member import KV, READ, REFUSED, RESTORED, WRITE, Member, Start

    start = Start(0, 0, range(0, 2), 2, 1, 1, 16, "", "none", "", b"")
    computed, handed = TorchStage(SHAPE, range(0, 2), 2, 16), TorchStage(SHAPE, range(0, 2), 2, 16)
    prompter, taker = Member(computed, start, None), Member(handed, start, None)
    computed.forward(ids(2, 5, seed=8), range(2), 0)
    answer = prompter.handle(bytes([READ]) + struct.pack("<4I", 0, 1, 0, 5))
    assert answer[0] == KV
    assert len(answer) - 1 == computed.cache.packed_len(computed.region(range(1, 2), range(0, 5)))
    written = taker.handle(bytes([WRITE]) + struct.pack("<4IB", 0, 1, 0, 5, 0) + answer[1:])
    assert written == bytes([RESTORED]) + struct.pack("<I", 5)
    for ours, theirs in zip(handed.kv(0).tensors(), computed.kv(0).tensors()):
        assert torch.equal(ours[1, :, :5], theirs[1, :, :5]) and theirs[1, :, :5].abs().max() > 0
        assert not ours[0].any(), "only the written slot changed"
    assert handed.lengths[0] == 5
    # The written prompt decodes as the computed one does.
    step = ids(1, 1, seed=9)
    assert torch.equal(handed.forward(step, range(1, 2), 5), computed.forward(step, range(1, 2), 5))
    for request, why in [
        (bytes([READ]) + struct.pack("<4I", 0, 2, 0, 5), "no sequence in slot 2 of microbatch 0"),
        (bytes([READ]) + struct.pack("<4I", 0, 0, 10, 20), "tokens 10..20 do not fit the stage's 16"),
        (bytes([WRITE]) + struct.pack("<4IB", 0, 0, 0, 5, 1) + answer[1:-4], f"{len(answer) - 5} bytes of KV for tokens 0..5"),
    ]:
        refused = taker.handle(request)
        assert refused[0] == REFUSED and why in refused[1:].decode(), refused
