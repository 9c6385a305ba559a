"""The servers tests and benchmarks start, and what they read from their processes: the
one place that starts ``continuum serve``, a replica or a gateway and waits for it.

``start_serve`` runs ``continuum serve`` whole (what a user runs); ``start_replica`` /
``start_gateway`` start the processes one by one, for what serve cannot express (two
replicas behind one gateway, two gateways on one replica, a host swap pool). A ``Replica``
supervises its executor as serve does, so executor faults recover alike in both layouts.
Every process inherits the internal secret (``ensure_secret``) and every Stats call sends it."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import os
import pathlib
import signal
import subprocess
import sys
import threading
import time

import grpc

from continuum.serve.procs import free_port, spawn
from protos.continuum.v1 import generation_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc
from runtime import internal_auth

READY_TIMEOUT_S = 240.0
ROLES = ("gateway", "scheduler_svc", "executor_svc")
GUARD_FLAG = "--max-executor-restarts"  # serve's crash-loop line names it


class ServerError(RuntimeError):
    """A server did not start, or died where the row needed it alive."""


def ensure_secret() -> None:
    """Give this process (and so every server it starts) an internal secret if none is set."""
    env = os.environ
    if not (env.get(internal_auth.ENV_SECRET) or env.get(internal_auth.ENV_SECRET_FILE)
            or env.get(internal_auth.ENV_INSECURE) == "1"):
        env[internal_auth.ENV_SECRET] = internal_auth.new_secret()


def internal_metadata() -> tuple[tuple[str, str], ...]:
    try:
        return internal_auth.metadata(internal_auth.load_secret())
    except internal_auth.SecretError:
        return ()


def model_dir() -> pathlib.Path:
    from executor_svc.model_files import resolve_model
    from executor_svc.settings import Switches  # $CONTINUUM_CACHE_DIR, as the executor's

    return pathlib.Path(resolve_model(None, Switches.from_env().cache_dir))


def scheduler_stats(port: int, timeout: float = 5.0) -> scheduler_pb2.StatsResponse:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        return scheduler_pb2_grpc.SchedulerStub(ch).Stats(
            scheduler_pb2.StatsRequest(), timeout=timeout, metadata=internal_metadata())


def wait_idle(port: int, timeout_s: float = 60.0) -> scheduler_pb2.StatsResponse:
    """Stats once nothing runs or waits (or the last Stats when ``timeout_s`` passes)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            stats = scheduler_stats(port)
            if (stats.num_running == 0 and stats.num_waiting == 0) or \
                    time.monotonic() > deadline:
                return stats
        except grpc.RpcError:
            if time.monotonic() > deadline:
                raise
        time.sleep(0.2)


def rss_kib(pid: int) -> int:
    """VmRSS of ``pid`` in KiB (0 if it is gone)."""
    with contextlib.suppress(OSError):
        for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def num_fds(pid: int) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return 0


def cpu_seconds(pids: dict[str, int]) -> collections.Counter:
    """utime + stime of each role's process (/proc/PID/stat), in seconds: what a phase
    or a run cost each process, however busy the machine was."""
    used: collections.Counter = collections.Counter()
    for role, pid in pids.items():
        try:
            fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        used[role] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return used


def children_by_role(parent: int) -> dict[str, int]:
    """{role: pid} of ``parent``'s children that are Continuum services."""
    found: dict[str, int] = {}
    for entry in pathlib.Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except (OSError, ValueError, IndexError):
            continue
        if ppid != parent:
            continue
        for role in ROLES:
            if role.encode() in argv:
                found[role] = int(entry.name)
    return found


def _collect(proc: subprocess.Popen, lines: list[str]) -> None:
    threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True).start()


@dataclasses.dataclass
class Serve:
    """One ``continuum serve``: gateway (gRPC + HTTP), scheduler and executor. ``log``:
    its stderr lines as they come; ``workdir``: its socket (and whatever else the caller
    put there, such as a telemetry store)."""

    proc: subprocess.Popen
    port: int
    scheduler_port: int
    http_port: int
    ipc: str
    workdir: pathlib.Path
    log: list[str]

    @property
    def addr(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def base_url(self) -> str:
        """The OpenAI-compatible API's base URL (what `openai.OpenAI(base_url=...)` takes)."""
        return f"http://127.0.0.1:{self.http_port}/v1"

    def generation_stub(self, channel: grpc.Channel) -> generation_pb2_grpc.GenerationStub:
        return generation_pb2_grpc.GenerationStub(channel)

    def stats(self, timeout: float = 10.0) -> scheduler_pb2.StatsResponse:
        return scheduler_stats(self.scheduler_port, timeout)

    def pid(self, role: str) -> int:
        pid = children_by_role(self.proc.pid).get(role)
        if pid is None:
            raise ServerError(f"no {role} child of continuum serve {self.proc.pid}")
        return pid

    def cpu_seconds(self) -> collections.Counter:
        """CPU seconds so far of serve's processes, by role (``cpu_seconds``)."""
        return cpu_seconds(children_by_role(self.proc.pid))

    def stop(self, grace_s: float = 30.0) -> int | None:
        return stop(self.proc, grace_s)

    def why_stopped(self, exc: grpc.RpcError, wait_s: float = 15.0) -> str:
        """One message for a call the server refused: the crash-loop guard's line when that
        is what stopped it, the exit code when something else did, else the call's error."""
        deadline = time.monotonic() + wait_s
        exited_at = None
        while (guard := self._guard_line()) is None and time.monotonic() < deadline:
            if self.proc.poll() is not None:
                exited_at = exited_at or time.monotonic()
                if time.monotonic() - exited_at > 1:  # its last lines have been read by now
                    break
            time.sleep(0.1)
        if guard is not None:
            return (f"the server stopped: its crash-loop guard tripped before the run was done "
                    f"({guard}). Rerun with a larger {GUARD_FLAG}.")
        if self.proc.poll() is not None:
            return (f"the server exited with code {self.proc.returncode} mid-run (its last "
                    f"lines are above); a call got {exc.code().name}")
        return f"a call to the server failed: {exc.code().name}: {exc.details()}"

    def _guard_line(self) -> str | None:
        return next((line.strip() for line in self.log
                     if GUARD_FLAG in line and "crash loop" in line), None)


def stop(proc: subprocess.Popen, grace_s: float = 30.0) -> int | None:
    """SIGINT (serve's clean stop), SIGKILL after ``grace_s``; the exit code."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGCONT)  # a row may have left it stopped
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


def start_serve(tmp: pathlib.Path, *extra: str, model: pathlib.Path | str | None = None,
                env: dict[str, str] | None = None, http: bool = True,
                timeout_s: float = READY_TIMEOUT_S) -> Serve:
    """``continuum serve`` on free loopback ports; returns once it printed ``ready``.

    ``extra``: serve's flags (default: a 96 MiB KV pool); ``model``: default the bundled
    one; ``env``: serve's environment (default this process's, given an internal secret);
    ``http=False``: no OpenAI HTTP port. Raises ServerError with its last log lines."""
    ensure_secret()
    tmp.mkdir(parents=True, exist_ok=True)
    port, sched_port, http_port = free_port(), free_port(), free_port() if http else -1
    ipc = f"ipc://{tmp}/executor.sock"
    cmd = [sys.executable, "-m", "continuum", "serve", "--model", str(model or model_dir()),
           "--port", str(port), "--scheduler-port", str(sched_port), "--ipc", ipc,
           "--http-port", str(http_port), *(extra or ("--kv-cache-bytes", str(96 << 20)))]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env)
    lines: list[str] = []
    _collect(proc, lines)
    ready = threading.Event()
    threading.Thread(target=lambda: ready.set() if proc.stdout.readline() else None,
                     daemon=True).start()
    deadline = time.monotonic() + timeout_s
    while not ready.wait(0.5):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise ServerError("continuum serve did not become ready:\n" + "".join(lines[-40:]))
    return Serve(proc, port, sched_port, http_port, ipc, tmp, lines)


@dataclasses.dataclass
class Replica:
    """A scheduler and its executor, started one by one; restarts its executor like serve."""

    scheduler: subprocess.Popen
    executor: subprocess.Popen
    port: int
    ipc: str
    executor_argv: list[str]
    log: list[str]
    num_restarts: int = 0
    _stop: threading.Event = dataclasses.field(default_factory=threading.Event)

    @property
    def addr(self) -> str:
        return f"127.0.0.1:{self.port}"

    def stats(self) -> scheduler_pb2.StatsResponse:
        return scheduler_stats(self.port)

    def supervise(self) -> None:
        """Background: a dead executor is restarted; one the scheduler lost while it lives
        (hung) is killed first. Stops when ``close`` is called or the scheduler dies."""
        def watch() -> None:
            while not self._stop.wait(0.5):
                if self.scheduler.poll() is not None:
                    continue
                with contextlib.suppress(grpc.RpcError):
                    lost = self.stats().last_lost_executor_pid
                    if lost == self.executor.pid and self.executor.poll() is None:
                        self.executor.kill()
                        self.executor.wait()
                if self.executor.poll() is not None and not self._stop.is_set():
                    self.num_restarts += 1
                    self.executor = spawn("executor_svc", self.executor_argv,
                                          stderr=subprocess.DEVNULL)
        threading.Thread(target=watch, daemon=True).start()

    def close(self) -> None:
        self._stop.set()
        for proc in (self.scheduler, self.executor):
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGCONT)
            if proc.poll() is None:
                proc.kill()
            proc.wait()


def launch_replica(tmp: pathlib.Path, scheduler_flags: tuple[str, ...] = (),
                   executor_flags: tuple[str, ...] = (), port: int | None = None) -> Replica:
    """Spawns a scheduler and its executor without waiting (``ready`` waits). Call it
    from the thread that will outlive them: children die with the thread that spawned
    them (PR_SET_PDEATHSIG), so a worker thread must not start a replica.

    ``port``: the scheduler's (a replacement for a dead replica takes its port, so the
    gateways that know the address find it again)."""
    ensure_secret()
    tmp.mkdir(parents=True, exist_ok=True)
    port, ipc = port or free_port(), f"ipc://{tmp}/executor.sock"
    scheduler = spawn("scheduler_svc", ["--ipc", ipc, "--scheduler-port", str(port),
                                         *scheduler_flags],
                      stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    _collect(scheduler, lines)
    argv = ["--model", str(model_dir()), "--ipc", ipc, "--device", "cpu",
            "--kv-cache-bytes", str(96 << 20), *executor_flags]
    executor = spawn("executor_svc", argv, stderr=subprocess.DEVNULL)
    return Replica(scheduler, executor, port, ipc, argv, lines)


def ready(replica: Replica) -> Replica:
    """Waits until the scheduler has its executor, then starts supervising it."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    while True:
        with contextlib.suppress(grpc.RpcError):
            if replica.stats().executor_ready:
                break
        if replica.scheduler.poll() is not None or replica.executor.poll() is not None or \
                time.monotonic() > deadline:
            replica.close()
            raise ServerError("replica did not become ready:\n" + "".join(replica.log[-30:]))
        time.sleep(0.3)
    replica.supervise()
    return replica


def start_replica(tmp: pathlib.Path, scheduler_flags: tuple[str, ...] = (),
                  executor_flags: tuple[str, ...] = (), port: int | None = None) -> Replica:
    return ready(launch_replica(tmp, scheduler_flags, executor_flags, port))


@dataclasses.dataclass
class Gateway:
    proc: subprocess.Popen
    port: int
    http_port: int

    @property
    def addr(self) -> str:
        return f"127.0.0.1:{self.port}"

    def generation_stub(self, channel: grpc.Channel) -> generation_pb2_grpc.GenerationStub:
        return generation_pb2_grpc.GenerationStub(channel)


def start_gateway(scheduler_ports: list[int],
                  model: pathlib.Path | str | None = None) -> Gateway:
    """A gateway process in front of the given scheduler replicas (gRPC and HTTP)."""
    ensure_secret()
    port, http_port = free_port(), free_port()
    proc = spawn("gateway", ["--model-dir", str(model or model_dir()), "--port", str(port),
                             "--http-port", str(http_port), "--scheduler",
                             ",".join(f"127.0.0.1:{p}" for p in scheduler_ports)],
                 stderr=subprocess.DEVNULL)
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        try:
            grpc.channel_ready_future(ch).result(timeout=READY_TIMEOUT_S)
        except grpc.FutureTimeoutError:
            proc.kill()
            raise ServerError("the gateway did not start listening") from None
    return Gateway(proc, port, http_port)
