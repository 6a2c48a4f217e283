"""The vLLM connector (``dejavu.vllm``) against real vLLM on the CPU, with real sidecars.

vLLM starts as few times as possible, three times in all: once for a failure-free run followed by
the same requests, killed in flight; once for their resumption, killed in flight with its node;
once for their second resumption. Set ``DEJAVU_REQUIRE_VLLM=1`` (CI does) to fail
instead of skipping where vLLM is not installed.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

if not os.environ.get("DEJAVU_REQUIRE_VLLM"):
    pytest.importorskip("vllm")

import torch  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from test_dejavu import dejavud  # noqa: E402

NEW_TOKENS = 256
KILL_AFTER = 16  # tokens of every request the router has seen from an engine when it dies
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


class Cluster:
    """A controller told the ring's size and two sidecars, each the other's successor, as
    docs/deployment.md starts them: vLLM's worker is stage 0's engine; stage 1's sidecar keeps the
    copies of stage 0's KV."""

    def __init__(self, tmp_path):
        self.tmp = tmp_path
        self.heartbeat = f"127.0.0.1:{free_port()}"
        self.addresses = [f"127.0.0.1:{free_port()}" for _ in range(2)]
        self.socket = str(tmp_path / "s0.sock")
        self.processes = []
        controller = self.spawn("controller", f"--listen={self.heartbeat}", f"--state={tmp_path / 'state'}",
                                "--stages=2", "--metrics=127.0.0.1:0")
        self.metrics = controller.stdout.readline().split()[1]
        assert controller.stdout.readline().startswith("listening ")
        self.sidecars = [self.sidecar(stage) for stage in range(2)]

    def spawn(self, *args):
        process = subprocess.Popen([dejavud(), *args], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        self.processes.append(process)
        return process

    def sidecar(self, stage):
        process = self.spawn("sidecar", f"--join={stage}", f"--listen={self.addresses[stage]}",
                             f"--heartbeat={self.heartbeat}", f"--local={self.tmp / f's{stage}.sock'}",
                             f"--shm-dir={self.tmp}", "--region-bytes=67108864")
        assert process.stdout.readline().startswith("listening ")
        return process

    @property
    def ring(self):
        """Stage 0's local socket and its successor's address."""
        return self.socket, self.addresses[1]

    def gauge(self, name):
        page = urllib.request.urlopen(f"http://{self.metrics}/metrics").read().decode()
        return next(float(line.split()[-1]) for line in page.splitlines() if line.startswith(name + " "))

    def wait_for(self, condition, what, timeout=30):
        deadline = time.monotonic() + timeout
        while not condition():
            assert time.monotonic() < deadline, f"never {what}"
            time.sleep(0.05)

    def stop(self):
        for process in self.processes:
            if process.poll() is None:
                process.kill()
            process.wait()


@pytest.fixture
def cluster(tmp_path):
    cluster = Cluster(tmp_path)
    try:
        yield cluster
    finally:
        cluster.stop()


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


def tokens_so_far(tmp_path, name, ids):
    """The tokens of each of ``ids`` that run ``name`` has returned so far."""
    seen = {}
    for step in progress_of(tmp_path, name):
        seen.update(step)
    return [seen.get(i, []) for i in ids]


def kill_when_every_request_has(engine, tmp_path, name, ids, tokens):
    """Kills run ``name`` once each of ``ids`` has returned ``tokens`` tokens. Its processes stop
    where they are (mid-step, maybe), then die: tokens computed after the router last heard from
    it die with it. Returns the tokens each request returned."""
    deadline = time.monotonic() + 600
    while min(len(t) for t in tokens_so_far(tmp_path, name, ids)) < tokens:
        assert engine.poll() is None, (tmp_path / f"{name}.log").read_text()[-4000:]
        assert time.monotonic() < deadline, f"{name} never got that far"
        time.sleep(0.05)
    os.killpg(engine.pid, signal.SIGSTOP)
    os.killpg(engine.pid, signal.SIGKILL)
    engine.wait()
    return tokens_so_far(tmp_path, name, ids)


def finish(engine, tmp_path, name, timeout=600):
    """Waits for a run to end and returns what it served."""
    try:
        assert engine.wait(timeout) == 0, (tmp_path / f"{name}.log").read_text()[-4000:]
    finally:
        if engine.poll() is None:
            os.killpg(engine.pid, signal.SIGKILL)
    return json.loads((tmp_path / f"{name}-out.json").read_text())


def test_in_flight_requests_survive_an_engine_crash_then_a_node_loss_with_identical_output(tmp_path, model, cluster):
    generator = torch.Generator().manual_seed(11)
    prompts = [torch.randint(1, 512, (n,), generator=generator).tolist() for n in PROMPTS]
    n = len(prompts)

    # One engine: a failure-free run to the end, then the same prompts, killed in flight.
    first = start_engine(
        tmp_path, "first", model,
        [requests_of("reference", prompts, NEW_TOKENS), requests_of("request", prompts, NEW_TOKENS)],
        cluster.ring,
    )
    ids = [f"request{i}" for i in range(n)]
    before = kill_when_every_request_has(first, tmp_path, "first", ids, KILL_AFTER)
    reference = tokens_so_far(tmp_path, "first", [f"reference{i}" for i in range(n)])
    assert all(len(tokens) == NEW_TOKENS for tokens in reference)
    assert len({tuple(tokens) for tokens in reference}) == n
    assert all(len(tokens) < NEW_TOKENS for tokens in before), [len(t) for t in before]
    cluster.wait_for(lambda: cluster.gauge("dejavu_controller_fences_total") == 1, "the engine fenced")

    # A new engine on the same sidecar; each request comes again as a router resubmits it: its
    # prompt and the tokens it returned. Every token's KV but the last comes from the sidecar.
    def resubmit(so_far):
        return [
            {"id": f"request{i}", "prompt": prompts[i] + so_far[i], "max_tokens": NEW_TOKENS - len(so_far[i])}
            for i in range(n)
        ]

    second = start_engine(tmp_path, "second", model, [resubmit(before)], cluster.ring)
    during = kill_when_every_request_has(second, tmp_path, "second", ids, KILL_AFTER)
    assert_loaded(tmp_path, "second", resubmit(before))

    # The whole node goes: the engine and its sidecar. The sidecar's command starts it again; the
    # controller restores it from its successor's copies; a new engine resumes from them.
    so_far = [before[i] + during[i] for i in range(n)]
    cluster.sidecars[0].kill()
    cluster.wait_for(lambda: cluster.gauge("dejavu_controller_fences_total") >= 2, "the node fenced")
    cluster.sidecars[0] = cluster.sidecar(0)
    cluster.wait_for(lambda: cluster.gauge("dejavu_controller_recovery_seconds_count") == 1, "the sidecar restored")
    third = start_engine(tmp_path, "third", model, [resubmit(so_far)], cluster.ring)
    after = finish(third, tmp_path, "third")
    loaded = assert_loaded(tmp_path, "third", resubmit(so_far))
    for i in range(n):
        assert so_far[i] + after[f"request{i}"]["tokens"] == reference[i], i
    assert loaded


def assert_loaded(tmp_path, name, requests):
    """Checks that each request of run ``name`` loaded every token's KV but its last one."""
    log = (tmp_path / f"{name}.log").read_text()
    for request in requests:
        needle = f"request {request['id']}-"
        line = next((l for l in log.splitlines() if needle in l and "loaded tokens" in l), None)
        assert line is not None, (name, request["id"], log[-4000:])
        assert line.endswith(f"loaded tokens 0..{len(request['prompt']) - 1} from the sidecar"), line
    return True
