"""docs/deployment.md followed with real processes and Python engines, without the demo's driver.

A controller told the ring's size, two sidecars started with ``--join`` on fixed ports (each the
other's successor), and a Python engine per stage that computes each token's KV from the KV of
the tokens before it (so a restore that lost or changed a byte changes every later output). One
at a time: an engine is killed and started again; a whole worker (sidecar and engine) is killed
and started again with the same commands; a sidecar alone is killed and started again, its engine
joining it again; the controller is killed and started again on its state. Every engine's outputs
equal a failure-free run's.
"""

import signal
import socket as sockets
import subprocess
import sys
import textwrap
import time
import urllib.request
from pathlib import Path

import dejavu

ENGINE = textwrap.dedent(
    """
    import sys, time, zlib
    import numpy as np
    import dejavu

    stage, socket, successor = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    spec = dejavu.KvSpec(layers=2, kv_heads=2, head_dim=8, dtype="float16")
    cache = dejavu.KvCache(dejavu.KvLayout.per_layer(spec, 1, 64, "bhsd"))
    region = lambda tokens: dejavu.KvRegion(layers=range(2), slots=range(1), heads=range(2), tokens=tokens)
    client = None
    if socket != "-":
        client = dejavu.SidecarClient(socket, successor)
        client.register(cache, microbatch=0)
        nxt = client.restore().get((0, (0, 1)), 0)
        print(f"ready {client.epoch} {nxt}", flush=True)
    else:
        nxt = 0
        print("ready - 0", flush=True)
    for _ in sys.stdin:
        t = nxt
        # This token's KV depends on every earlier token's.
        seed = zlib.crc32(bytes(cache.gather(region(range(t))))) if t else 0
        kv = np.random.default_rng(seed * 7 + stage).integers(0, 256, cache.packed_len(region(range(t, t + 1))), dtype=np.uint8)
        cache.scatter(region(range(t, t + 1)), kv)
        while client is not None:
            try:
                client.step_done(0, range(0, 1), range(t, t + 1))
                break
            except Exception:
                # Its sidecar died: join the replacement (its KV is still in this cache).
                time.sleep(0.05)
                try:
                    client = dejavu.SidecarClient(socket, successor)
                    client.register(cache, microbatch=0)
                except Exception:
                    pass
        nxt = t + 1
        print(f"token {t} {zlib.crc32(bytes(cache.gather(region(range(nxt)))))}", flush=True)
    """
)


def free_port():
    with sockets.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Walkthrough:
    def __init__(self, tmp_path, dejavud):
        self.tmp, self.dejavud = tmp_path, dejavud
        self.engine_file = tmp_path / "engine.py"
        self.engine_file.write_text(ENGINE)
        self.controller_port, self.ports = free_port(), [free_port(), free_port()]
        self.heartbeat = f"127.0.0.1:{self.controller_port}"
        self.processes = []

    def spawn(self, *args):
        process = subprocess.Popen(
            list(args), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
        )
        self.processes.append(process)
        return process

    def controller(self):
        process = self.spawn(
            self.dejavud, "controller", f"--listen={self.heartbeat}", f"--state={self.tmp / 'state'}",
            "--stages=2", "--metrics=127.0.0.1:0",
        )
        self.metrics = process.stdout.readline().split()[1]
        assert process.stdout.readline().startswith("listening ")
        return process

    def sidecar(self, stage):
        process = self.spawn(
            self.dejavud, "sidecar", f"--join={stage}", f"--listen=127.0.0.1:{self.ports[stage]}",
            f"--heartbeat={self.heartbeat}", f"--local={self.tmp / f's{stage}.sock'}", f"--shm-dir={self.tmp}",
        )
        assert process.stdout.readline().startswith("listening ")
        return process

    def engine(self, stage, reference=False):
        socket = "-" if reference else str(self.tmp / f"s{stage}.sock")
        successor = f"127.0.0.1:{self.ports[1 - stage]}"
        process = self.spawn(sys.executable, str(self.engine_file), str(stage), socket, successor)
        _, epoch, resume = process.stdout.readline().split()
        return process, epoch, int(resume)

    def gauge(self, name):
        page = urllib.request.urlopen(f"http://{self.metrics}/metrics").read().decode()
        return next(float(l.split()[-1]) for l in page.splitlines() if l.startswith(name + " "))

    def wait_for(self, condition, what):
        deadline = time.monotonic() + 30
        while not condition():
            assert time.monotonic() < deadline, f"never {what}"
            time.sleep(0.01)

    def stop(self):
        for process in self.processes:
            if process.poll() is None:
                process.kill()
            process.wait()


def steps(engine, n):
    """Has `engine` compute `n` tokens; returns its outputs."""
    outputs = []
    for _ in range(n):
        engine.stdin.write("step\n")
        engine.stdin.flush()
        word, token, output = engine.stdout.readline().split()
        assert word == "token"
        outputs.append((int(token), int(output)))
    return outputs


def kill(process):
    process.send_signal(signal.SIGKILL)
    process.wait()


def test_the_walkthrough_survives_an_engine_a_worker_a_sidecar_and_the_controller(tmp_path):
    from test_dejavu import dejavud

    w = Walkthrough(tmp_path, dejavud())
    try:
        reference = [steps(w.engine(stage, reference=True)[0], 18) for stage in range(2)]
        controller = w.controller()
        sidecars = [w.sidecar(stage) for stage in range(2)]
        engines = [w.engine(stage) for stage in range(2)]
        assert [(epoch, resume) for _, epoch, resume in engines] == [("0", 0), ("0", 0)]
        outputs = [steps(engines[stage][0], 6) for stage in range(2)]
        # Whoever feeds the pipeline watches the controller's recoveries.
        feed = dejavu.RecoveryFeed(w.heartbeat)
        assert feed.watch(0, timeout=0.1) is None

        # An engine dies: fenced at once; the next one joins in the fence's epoch and restores.
        kill(engines[0][0])
        w.wait_for(lambda: w.gauge("dejavu_controller_fences_total") == 1, "engine 0 fenced")
        engine0, epoch, resume = w.engine(0)
        assert (epoch, resume) == ("1", 6)
        recovery = feed.watch(0, timeout=10)
        assert recovery["epoch"] == 1
        assert [(s["stage"], s["loss"], s["source"]) for s in recovery["stages"]] == [(0, "engine", "own")]
        assert recovery["resume"] == {(0, (0, 1)): 6} == recovery["stages"][0]["marks"]
        feed.acknowledge(1)
        outputs[0] += steps(engine0, 6)

        # A whole worker dies; the same commands start it again; the controller restores its
        # sidecar from its neighbours, and its engine resumes from there.
        kill(sidecars[1])
        kill(engines[1][0])
        w.wait_for(lambda: w.gauge("dejavu_controller_fences_total") == 2, "worker 1 fenced")
        sidecars[1] = w.sidecar(1)
        w.wait_for(lambda: w.gauge("dejavu_controller_recovery_seconds_count") == 1, "worker 1's sidecar restored")
        engine1, epoch, resume = w.engine(1)
        assert (epoch, resume) == ("2", 6)
        recovery = feed.watch(1, timeout=10)
        assert recovery["epoch"] == 2
        [stage] = recovery["stages"]
        assert (stage["stage"], stage["loss"], stage["source"], stage["restored_from"]) == (1, "worker", "successor", 0)
        assert recovery["resume"] == {(0, (0, 1)): 6}
        feed.acknowledge(2)
        outputs[1] += steps(engine1, 6)

        # A sidecar dies alone: its engine, which lives, is fenced with it (it can neither keep
        # nor forward its KV). The sidecar starts again; the controller restores it; the engine
        # joins it again and goes on from the KV in its own cache.
        kill(sidecars[0])
        w.wait_for(lambda: w.gauge("dejavu_controller_fences_total") == 3, "sidecar 0 fenced")
        sidecars[0] = w.sidecar(0)
        w.wait_for(lambda: w.gauge("dejavu_controller_recovery_seconds_count") == 2, "sidecar 0 restored")
        outputs[0] += steps(engine0, 3)
        # The feed's marks are read when it answers: here after the engine, which lived, joined
        # again and went on; its successor holds all 15 tokens, from which it goes on anyway.
        recovery = feed.watch(2, timeout=10)
        assert recovery["epoch"] == 3
        assert recovery["resume"] == {(0, (0, 1)): 15}
        feed.acknowledge(3)
        assert w.gauge("dejavu_controller_recoveries_acknowledged_total") == 3

        # The controller dies; started again on its state, it goes on, and so do the engines.
        kill(controller)
        w.controller()
        w.wait_for(lambda: w.gauge("dejavu_controller_lifelines") == 4, "every member back")
        outputs[0] += steps(engine0, 3)
        outputs[1] += steps(engine1, 6)
        assert feed.watch(3, timeout=0.2) is None

        assert outputs[0] == reference[0]
        assert outputs[1] == reference[1]
    finally:
        w.stop()


def test_a_recovery_feed_refuses_what_it_cannot_do(tmp_path):
    import pytest
    from test_dejavu import dejavud

    with pytest.raises(ValueError, match="HOST:PORT"):
        dejavu.RecoveryFeed("nowhere")
    with pytest.raises(ValueError, match='"nowhere" is not HOST:PORT'):
        dejavu.RecoveryFeed("127.0.0.1:1,nowhere")
    with pytest.raises(ValueError, match="timeout"):
        dejavu.RecoveryFeed("127.0.0.1:1").watch(0, timeout=-1)
    with pytest.raises(dejavu.ControllerError):
        dejavu.RecoveryFeed(f"127.0.0.1:{free_port()}").watch(0, timeout=0.1)
    # A controller not told the ring's size carries out no recoveries, and says how to ask it to.
    w = Walkthrough(tmp_path, dejavud())
    try:
        w.spawn(w.dejavud, "controller", f"--listen={w.heartbeat}", f"--state={tmp_path / 'state'}").stdout.readline()
        with pytest.raises(dejavu.ControllerError, match="--stages"):
            dejavu.RecoveryFeed(w.heartbeat).watch(0, timeout=0.1)
        # Named among others (controllers on etcd), it is found past one that cannot be reached.
        with pytest.raises(dejavu.ControllerError, match="--stages"):
            dejavu.RecoveryFeed(f"127.0.0.1:{free_port()},{w.heartbeat}").watch(0, timeout=0.1)
        with pytest.raises(dejavu.ControllerError):
            dejavu.RecoveryFeed(w.heartbeat, secret=b"another cluster").watch(0, timeout=0.1)
    finally:
        w.stop()


def test_the_compose_files_daemons_run_a_ring_that_survives_an_engine_and_a_worker(tmp_path):
    """deploy/compose.yaml's daemons, started with its commands and configuration files, and
    Python engines with its engines' environments, on loopback: each 172.28.0.x address becomes
    127.28.0.x (loopback too), and each volume a directory here."""
    import yaml
    from test_dejavu import dejavud

    deploy = Path(__file__).resolve().parents[3] / "deploy"
    services = yaml.safe_load((deploy / "compose.yaml").read_text())["services"]
    (tmp_path / "secret").write_text("the cluster secret of this test\n")

    def here(text):
        return text.replace("172.28.0.", "127.28.0.")

    def volumes(service):
        """Each of `service`'s mounts: where it is in the container, and here."""
        mounts = {}
        for volume in services[service].get("volumes", []):
            source, target = volume.split(":")[:2]
            if source.startswith("./"):
                mounts[target] = tmp_path / "secret" if source == "./secret" else deploy / source[2:]
            else:
                mounts[target] = tmp_path / source
                mounts[target].mkdir(exist_ok=True)
        return mounts

    def daemon_command(service):
        """The service's command, its configuration file read from deploy/ and written here with
        this machine's paths and addresses."""
        command = services[service]["command"]
        assert command[0] == "dejavud" and command[2] == "--config", command
        mounts = volumes(service)
        text = here(mounts.pop(command[3]).read_text())
        for target, path in sorted(mounts.items(), key=lambda m: -len(m[0])):
            text = text.replace(target, str(path))
        config = tmp_path / f"{service}.toml"
        config.write_text(text)
        return [dejavud(), command[1], "--config", str(config)]

    def engine_args(service):
        env = services[service]["environment"]
        socket = env["DEJAVU_SOCKET"]
        for target, path in volumes(service).items():
            socket = socket.replace(target, str(path))
        return [env["DEJAVU_STAGE"], socket, here(env["DEJAVU_SUCCESSOR"])]

    w = Walkthrough(tmp_path, dejavud())

    def start_daemon(service):
        process = w.spawn(*daemon_command(service))
        line = process.stdout.readline()
        if line.startswith("metrics "):
            if service == "controller":
                w.metrics = line.split()[1]
            line = process.stdout.readline()
        assert line.startswith("listening "), f"{service}: {line!r}"
        return process

    def start_engine(service, reference=False):
        stage, socket, successor = engine_args(service)
        process = w.spawn(sys.executable, str(w.engine_file), stage, "-" if reference else socket, successor)
        _, epoch, resume = process.stdout.readline().split()
        return process, epoch, int(resume)

    try:
        reference = [steps(start_engine(f"engine-{k}", reference=True)[0], 12) for k in range(2)]
        start_daemon("controller")
        sidecars = [start_daemon(f"sidecar-{k}") for k in range(2)]
        engines = [start_engine(f"engine-{k}") for k in range(2)]
        assert [(epoch, resume) for _, epoch, resume in engines] == [("0", 0), ("0", 0)]
        outputs = [steps(engines[k][0], 6) for k in range(2)]

        # An engine dies, and is started again as its container would be: it resumes from its
        # sidecar.
        kill(engines[0][0])
        w.wait_for(lambda: w.gauge("dejavu_controller_fences_total") == 1, "engine 0 fenced")
        engine0, epoch, resume = start_engine("engine-0")
        assert (epoch, resume) == ("1", 6)
        outputs[0] += steps(engine0, 6)

        # A whole worker dies; both its containers start again with the same commands; the
        # controller restores its sidecar from the ring, and its engine resumes from there.
        kill(sidecars[1])
        kill(engines[1][0])
        w.wait_for(lambda: w.gauge("dejavu_controller_fences_total") == 2, "worker 1 fenced")
        sidecars[1] = start_daemon("sidecar-1")
        w.wait_for(lambda: w.gauge("dejavu_controller_recovery_seconds_count") == 1, "worker 1 restored")
        engine1, epoch, resume = start_engine("engine-1")
        assert (epoch, resume) == ("2", 6)
        outputs[1] += steps(engine1, 6)

        assert outputs == reference
    finally:
        w.stop()
