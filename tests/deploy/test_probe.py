"""deploy/probe.py, the replica pod's exec probes, against real processes: the executor
probe passes once an executor is attached and fails when it hangs (SIGSTOP: the
scheduler detaches it after a missed heartbeat); the scheduler probe passes while the
scheduler answers, NOT_SERVING included, and fails once it is gone, when the
executor's liveness (``--unreachable-ok``) does not blame the executor."""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

from continuum.serve.procs import free_port

PROBE = pathlib.Path(__file__).resolve().parents[2] / "deploy" / "probe.py"
READY_S = 240


def probe(*args: str, cwd: str = "/") -> tuple[int, str]:
    """Runs the probe as the kubelet would: a fresh process, from another directory."""
    done = subprocess.run([sys.executable, str(PROBE), *args], capture_output=True, text=True,
                          timeout=60, cwd=cwd)
    return done.returncode, done.stdout.strip()


def wait_for_probe(args: tuple[str, ...], rc: int, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    while True:
        got, out = probe(*args)
        if got == rc or time.monotonic() > deadline:
            assert got == rc, out
            return out
        time.sleep(0.2)


def spawn_module(env: dict, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", *args], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def reap(procs: list[subprocess.Popen]) -> None:
    """Kills what still runs (a SIGSTOPped process too) and waits for every one."""
    for proc in procs:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGCONT)
            proc.kill()
        proc.wait(timeout=30)


def test_without_a_scheduler_only_the_liveness_form_passes():
    address = f"127.0.0.1:{free_port()}"
    rc, out = probe("scheduler", "--address", address, "--timeout", "1")
    assert rc == 1 and "does not answer" in out
    rc, out = probe("executor", "--address", address, "--timeout", "1")
    assert rc == 1 and "does not answer Stats" in out
    rc, out = probe("executor", "--address", address, "--timeout", "1", "--unreachable-ok")
    assert rc == 0 and "not the executor's fault" in out


@pytest.mark.integration
def test_a_hung_executor_fails_its_probe(tmp_path, model_dir):
    ipc, port = f"ipc://{tmp_path}/private/executor.sock", free_port()
    address = ("--address", f"127.0.0.1:{port}")
    env = {**os.environ, "PYTHONPATH": os.getcwd()}

    def spawn(*args: str) -> subprocess.Popen:
        return spawn_module(env, *args)

    scheduler = spawn("scheduler_svc", "--ipc", ipc, "--scheduler-port", str(port),
                      "--executor-heartbeat-timeout-s", "2")
    procs = [scheduler]
    try:
        wait_for_probe(("scheduler", *address), 0, READY_S)
        rc, out = probe("executor", *address)
        assert rc == 1 and "no executor attached" in out  # the startup probe waits
        executor = spawn("executor_svc", "--model", str(model_dir), "--ipc", ipc,
                         "--device", "cpu", "--kv-cache-bytes", "8MiB", "--warmup-tokens",
                         "16", "--threads", "2")
        procs.append(executor)
        assert "attached" in wait_for_probe(("executor", *address), 0, READY_S)
        os.kill(executor.pid, signal.SIGSTOP)  # hung: alive, answering nothing
        out = wait_for_probe(("executor", *address, "--unreachable-ok"), 1, 60)
        assert "no executor attached" in out and "1 lost" in out
        assert probe("scheduler", *address)[0] == 0  # the scheduler is fine
        scheduler.terminate()
        scheduler.wait(timeout=60)
        assert probe("scheduler", *address, "--timeout", "1")[0] == 1
        assert probe("executor", *address, "--timeout", "1", "--unreachable-ok")[0] == 0
    finally:
        reap(procs)


def wait_for_role(args: tuple[str, ...], role: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        rc, out = probe(*args)
        if (rc == 0 and role in out) or time.monotonic() > deadline:
            assert rc == 0 and role in out, out
            return
        time.sleep(0.2)


@pytest.mark.integration
def test_in_a_pod_with_a_standby_each_executor_probes_for_itself(tmp_path, model_dir):
    """The layout of deploy/k8s/overlays/cpu-standby: two executor containers, both
    ``--standby`` (whichever registers first serves; a restarted one comes back as the
    standby). When the one in service hangs the standby takes over, so "an executor is
    attached" stays true; each container's own probe (``--incarnation-file``) fails for
    the hung one only, and passes again once its restart registers as the standby."""
    ipc, port = f"ipc://{tmp_path}/private/executor.sock", free_port()
    address = ("--address", f"127.0.0.1:{port}")
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    files = {name: str(tmp_path / f"{name}.incarnation") for name in ("a", "b")}

    def spawn(*args: str) -> subprocess.Popen:
        return spawn_module(env, *args)

    def executor(name: str) -> subprocess.Popen:
        return spawn("executor_svc", "--model", str(model_dir), "--ipc", ipc, "--device",
                     "cpu", "--kv-cache-bytes", "8MiB", "--warmup-tokens", "16",
                     "--threads", "1", "--standby", "--incarnation-file", files[name])

    def own(name: str) -> tuple[str, ...]:
        return ("executor", *address, "--incarnation-file", files[name])

    procs = [spawn("scheduler_svc", "--ipc", ipc, "--scheduler-port", str(port),
                   "--executor-heartbeat-timeout-s", "2")]
    try:
        wait_for_probe(("scheduler", *address), 0, READY_S)
        procs.append(executor("a"))
        rc, out = probe(*own("a"))
        assert rc == 1 and "no Hello yet" in out  # loading: the startup probe waits
        wait_for_role(own("a"), "in service", READY_S)
        procs.append(executor("b"))
        wait_for_role(own("b"), "warm standby", READY_S)
        os.kill(procs[1].pid, signal.SIGSTOP)  # a hangs: b takes over
        wait_for_role(own("b"), "in service", 60)
        out = wait_for_probe(own("a"), 1, 60)
        assert "neither in service" in out and "1 lost" in out
        assert probe("executor", *address)[0] == 0  # the pod-wide form cannot tell
        procs[1].kill()  # the kubelet restarts a's container
        procs[1].wait(timeout=30)
        procs.append(executor("a"))
        wait_for_role(own("a"), "warm standby", READY_S)
        assert "in service" in probe(*own("b"))[1]
        procs[2].terminate()  # a clean stop removes its file
        procs[2].wait(timeout=60)
        assert not os.path.exists(files["b"])
    finally:
        reap(procs)
