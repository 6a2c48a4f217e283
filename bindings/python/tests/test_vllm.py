"""The vLLM connector (``dejavu.vllm``) against real vLLM on the CPU, with real sidecars.

vLLM starts as few times as possible: once for a failure-free run followed by the same requests
killed in flight, once for their resumption. Set ``DEJAVU_REQUIRE_VLLM=1`` (CI does) to fail
instead of skipping where vLLM is not installed.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

if not os.environ.get("DEJAVU_REQUIRE_VLLM"):
    pytest.importorskip("vllm")

import torch  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from test_dejavu import dejavud  # noqa: E402

NEW_TOKENS = 256
KILL_AFTER = 16  # tokens of every request the router has seen when the engine dies
PROMPTS = (40, 200, 300)  # tokens; one within a block of 128, two across blocks


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """A 4-layer Llama with seeded random weights (2 KV heads of 64, bf16), saved for vLLM."""
    path = tmp_path_factory.mktemp("model")
    torch.manual_seed(7)
    config = LlamaConfig(
        vocab_size=512,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=2048,
        initializer_range=0.2,  # wide enough that greedy decoding does not repeat one token
    )
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(path)
    return str(path)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def ring(tmp_path):
    """Two sidecars, each the other's successor: vLLM's worker is stage 0's engine. Yields stage
    0's local socket and stage 1's address."""
    daemons, addresses = [], []
    try:
        for index in range(2):
            address = f"127.0.0.1:{free_port()}"
            daemons.append(
                subprocess.Popen(
                    [dejavud(), "sidecar", f"--index={index}", f"--local={tmp_path / f's{index}.sock'}",
                     f"--listen={address}", f"--shm-dir={tmp_path}", "--region-bytes=67108864"],
                    stdout=subprocess.PIPE,
                    stderr=subprocess.DEVNULL,
                    text=True,
                )
            )
            assert daemons[-1].stdout.readline().startswith("listening ")
            addresses.append(address)
        yield str(tmp_path / "s0.sock"), addresses[1]
    finally:
        for daemon in daemons:
            daemon.kill()
            daemon.wait()


def requests_of(prefix, prompts, max_tokens):
    return [{"id": f"{prefix}{i}", "prompt": prompt, "max_tokens": max_tokens} for i, prompt in enumerate(prompts)]


def start_engine(tmp_path, name, model, batches, ring):
    """``python -m dejavu.vllm.run`` in a session of its own (vLLM's processes die together)."""
    requests = tmp_path / f"{name}-requests.json"
    requests.write_text(json.dumps(batches))
    sidecar, successor = ring
    command = [sys.executable, "-m", "dejavu.vllm.run", "--model", model, "--requests", str(requests),
               "--out", str(tmp_path / f"{name}-out.json"), "--progress", str(tmp_path / f"{name}-progress.jsonl"),
               "--sidecar", sidecar, "--successor", successor]
    log = open(tmp_path / f"{name}.log", "w")
    return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def progress_of(tmp_path, name):
    """The steps a run wrote, leaving out a line it is writing."""
    path = tmp_path / f"{name}-progress.jsonl"
    text = path.read_text() if path.exists() else ""
    return [json.loads(line) for line in text.split("\n")[:-1]]


def crashed_so_far(tmp_path, n):
    seen = {}
    for step in progress_of(tmp_path, "first"):
        seen.update(step)
    return [seen.get(f"crashed{i}", []) for i in range(n)]


def finish(engine, tmp_path, name, timeout=600):
    """Waits for a run to end and returns what it served."""
    try:
        assert engine.wait(timeout) == 0, (tmp_path / f"{name}.log").read_text()[-4000:]
    finally:
        if engine.poll() is None:
            os.killpg(engine.pid, signal.SIGKILL)
    return json.loads((tmp_path / f"{name}-out.json").read_text())


def test_in_flight_requests_survive_a_vllm_crash_and_resume_from_the_sidecars_copies(tmp_path, model, ring):
    generator = torch.Generator().manual_seed(11)
    prompts = [torch.randint(1, 512, (n,), generator=generator).tolist() for n in PROMPTS]

    # One engine: a failure-free run to the end, then the same prompts, killed in flight.
    first = start_engine(
        tmp_path, "first", model,
        [requests_of("reference", prompts, NEW_TOKENS), requests_of("crashed", prompts, NEW_TOKENS)],
        ring,
    )
    deadline = time.monotonic() + 600
    while min(len(tokens) for tokens in crashed_so_far(tmp_path, len(prompts))) < KILL_AFTER:
        assert first.poll() is None, (tmp_path / "first.log").read_text()[-4000:]
        assert time.monotonic() < deadline, "the first engine never got that far"
        time.sleep(0.05)
    # Its processes stop where they are (mid-step, maybe), then die: tokens computed after the
    # router last heard from it are lost with it.
    os.killpg(first.pid, signal.SIGSTOP)
    os.killpg(first.pid, signal.SIGKILL)
    first.wait()
    seen = {}
    for step in progress_of(tmp_path, "first"):
        seen.update(step)
    reference = [seen[f"reference{i}"] for i in range(len(prompts))]
    generated = [seen[f"crashed{i}"] for i in range(len(prompts))]
    assert all(len(tokens) == NEW_TOKENS for tokens in reference)
    assert all(0 < len(tokens) < NEW_TOKENS for tokens in generated), [len(t) for t in generated]

    # A new engine on the same sidecar; each request comes again as a router resubmits it.
    resubmitted = [
        {"id": f"resumed{i}", "prompt": prompt + tokens, "max_tokens": NEW_TOKENS - len(tokens)}
        for i, (prompt, tokens) in enumerate(zip(prompts, generated))
    ]
    second = start_engine(tmp_path, "second", model, [resubmitted], ring)
    resumed = finish(second, tmp_path, "second")
    for i, request in enumerate(resubmitted):
        out = resumed[request["id"]]
        # Every token's KV but the last came from the sidecar: vLLM computed one token per request.
        assert out["cached"] == len(request["prompt"]) - 1, (i, out["cached"], len(request["prompt"]))
        assert generated[i] + out["tokens"] == reference[i], i
    assert len({tuple(tokens) for tokens in reference}) == len(prompts)
