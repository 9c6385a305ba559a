"""``continuum serve``: start the executor, scheduler and gateway and keep them up.

Start order: resolve the model (converting a GGUF once), then the scheduler (it binds
the ipc channel), the executor (connects and says Hello) and the gateway; "ready" once
the gateway's readiness probe passes. A dead executor is restarted (the scheduler resumes
its sequences by recompute); a dead scheduler or gateway stops the whole server with a
clear message. SIGINT/SIGTERM stop all three cleanly.

The crash-loop guard (continuum/serve/restart_guard.py): more than
``--max-executor-restarts`` executor deaths within ``--restart-window-s`` stop the
server with a line naming both flags. A standby takeover counts like a cold restart:
the executor still died, and a loop of deaths is a crash loop whether or not a
standby hides each one from the clients.

``--standby-executors 1``: once serving, a second executor is started with ``--standby``:
loaded, warmed up, registered with the scheduler and idle. When the executor dies or hangs
the scheduler switches to it on the next step by itself (no process start, no model load:
a recompute is what is left); here it then takes the executor's role and,
STANDBY_START_DELAY_S later (the takeover's recompute goes first on a small CPU), a new
standby starts. A standby that keeps dying is given up (serving goes on without one); when
both die, the executor is started cold as without a standby.

The internal planes (scheduler gRPC, executor Hello) need a secret: the one in
serve's own environment (``CONTINUUM_INTERNAL_SECRET[_FILE]``) if set, else a
fresh one per run. Children get it through their environment, never on argv (argv is
world-readable in ``ps``); a fresh one is also kept, mode 0600, for this user's
``continuum config`` while serve runs (continuum/serve/local_state.py). The executor's ipc
socket lives in a private directory (mode 0700) unless ``--ipc`` names another, which
must not be writable by others.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time

import grpc

from continuum.serve import local_state, tls
from continuum.serve.config import Configs, ServeConfigError, connect_host
from continuum.serve.procs import http_ready, port_is_free, spawn, stop_all
from continuum.serve.restart_guard import RestartGuard
from protos.continuum.v1 import scheduler_pb2, scheduler_pb2_grpc
from runtime import internal_auth

STANDBY_START_DELAY_S = 3.0
EXECUTORS = ("executor", "standby")
# Once the executor is ready, how long the gateway may take to see its scheduler healthy.
READY_TIMEOUT_S = 60.0


def standby_count(configs: Configs) -> int:
    """--standby-executors, or by default: one on a CPU-only host with 4+ cores (tp 1).
    On a smaller CPU a standby's load would take cores from the executor in service; on
    a GPU the two would have to split its memory (--gpu-memory-utilization each)."""
    if configs.serve.standby_executors is not None:
        return configs.serve.standby_executors
    device = configs.executor.device
    on_cpu = device == "cpu" or (device == "auto" and not _has_gpu())
    return int(on_cpu and configs.executor.tp_size == 1 and len(os.sched_getaffinity(0)) >= 4)


def _has_gpu() -> bool:
    return os.path.exists("/dev/nvidiactl")  # without importing torch (seconds)


class ServeError(Exception):
    """Ends ``serve`` with one line on stderr and exit code 2."""


def resolve_model(path: str | None) -> str:
    """The HF-format dir for ``path`` (None: bundled); converts a GGUF once."""
    args = [path] if path else []
    proc = spawn("executor_svc.model_files", args, stdout=subprocess.PIPE, text=True)
    out, _ = proc.communicate()
    if proc.returncode != 0:
        raise ServeError("cannot load the model (see the message above)")
    return out.strip().splitlines()[-1]


def served_name(path: str | None) -> str:
    """The model name clients see: the source file's or directory's name."""
    if not path:
        return "SmolLM2-135M-Instruct"
    name = os.path.basename(os.path.normpath(path))
    return name[: -len(".gguf")] if name.endswith(".gguf") else name


def internal_secret(environ: dict[str, str]) -> tuple[bytes | None, dict[str, str]]:
    """The secret for this run and the environment the children get.

    A configured secret (or the explicit opt-out) is used as is; otherwise a
    fresh one is generated. Raises ServeError when the configured one is unusable."""
    configured = environ.get(internal_auth.ENV_SECRET) or environ.get(internal_auth.ENV_SECRET_FILE)
    if configured or environ.get(internal_auth.ENV_INSECURE) == "1":
        try:
            return internal_auth.load_secret(environ), dict(environ)
        except internal_auth.SecretError as exc:
            raise ServeError(str(exc)) from exc
    secret = internal_auth.new_secret()
    return secret.encode("ascii"), {**environ, internal_auth.ENV_SECRET: secret}


def check_ipc_dir(ipc: str) -> None:
    """Refuses an ``ipc://`` path whose directory others may write: anyone who can
    create files there could take the socket's place. A missing one is fine: the
    scheduler creates it private."""
    if not ipc.startswith("ipc://"):
        return
    directory = os.path.dirname(os.path.abspath(ipc.removeprefix("ipc://")))
    try:
        mode = os.stat(directory).st_mode
    except FileNotFoundError:
        return  # the scheduler creates it, with mode 0700
    except OSError as exc:
        raise ServeError(f"--ipc {ipc}: cannot use its directory ({exc.strerror})") from exc
    if mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise ServeError(f"--ipc {ipc}: the directory {directory} is writable by other users "
                         f"(mode {stat.S_IMODE(mode):o}); use a private one (chmod 700) "
                         "or omit --ipc")


class Supervisor:
    def __init__(self, args: argparse.Namespace) -> None:
        self.model = getattr(args, "model", None)
        self.model_name = served_name(self.model)
        if getattr(args, "ipc", None):
            check_ipc_dir(args.ipc)
        self.workdir = tempfile.mkdtemp(prefix="continuum-")  # mode 0700
        ipc = getattr(args, "ipc", None) or f"ipc://{os.path.join(self.workdir, 'executor.sock')}"
        try:
            self.configs = Configs.of(args, ipc=ipc, model_name=self.model_name)
        except ServeConfigError as exc:
            shutil.rmtree(self.workdir, ignore_errors=True)
            raise ServeError(str(exc)) from None
        self.gateway, self.scheduler = self.configs.gateway, self.configs.scheduler
        if (tls_problem := tls.problem(self.scheduler, self.gateway)) is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)
            raise ServeError(tls_problem)
        self.secret, self.child_env = internal_secret(dict(os.environ))
        # Generated here (none configured): kept for this user's `continuum config`.
        self._generated = self.child_env.get(internal_auth.ENV_SECRET) != os.environ.get(
            internal_auth.ENV_SECRET)
        self._metadata = internal_auth.metadata(self.secret)
        self.procs: dict[str, subprocess.Popen] = {}
        self._stop = False
        self.num_standby = standby_count(self.configs)
        self._standby_due: float | None = None  # when to start the next standby
        self._registered_pids: set[int] = set()  # executors the scheduler holds (last poll)
        budget = (self.configs.serve.max_executor_restarts, self.configs.serve.restart_window_s)
        self.executor_deaths = RestartGuard(*budget)  # every death: restarts and takeovers
        self._standby_deaths = RestartGuard(*budget)

    def run(self) -> int:
        g, s = self.gateway, self.scheduler
        ports = {(g.host, g.port): "--port",
                 (s.scheduler_host, s.scheduler_port): "--scheduler-port"}
        if g.http_port > 0:
            ports[g.host, g.http_port] = "--http-port"
        for (host, port), flag in ports.items():
            if not port_is_free(host, port):
                raise ServeError(f"port {port} on {host} is already in use; pass {flag}")
        started = time.monotonic()
        self.configs = self.configs.with_model(resolve_model(self.model))
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        published = (local_state.published_secret(self.child_env[internal_auth.ENV_SECRET],
                                                  s.scheduler_port)
                     if self._generated else contextlib.nullcontext())
        try:
            with published:
                self._start("scheduler")
                self._start("executor")
                self._start("gateway")
                self._wait_ready(started)
                if self.num_standby and not self._stop:
                    self._start("standby")
                return self._watch()
        finally:
            self._shutdown()
            shutil.rmtree(self.workdir, ignore_errors=True)

    def _on_signal(self, *_) -> None:
        if self._stop:  # a second Ctrl-C: stop waiting for the drain
            for proc in self.procs.values():
                if proc.poll() is None:
                    proc.kill()
        self._stop = True

    def _shutdown(self) -> None:
        """Drain order: gateway and scheduler finish in-flight work (they still
        need the executor for it), then the executor stops."""
        grace = self.scheduler.grace_period + 5
        front = [self.procs[n] for n in ("gateway", "scheduler") if n in self.procs]
        stop_all(front, grace_s=grace)
        stop_all([self.procs[n] for n in EXECUTORS if n in self.procs], grace_s=10)

    def _start(self, name: str) -> None:
        module = {"scheduler": "scheduler_svc", "executor": "executor_svc",
                  "standby": "executor_svc", "gateway": "gateway"}[name]
        self.procs[name] = spawn(module, self.configs.argv(name), env=self.child_env)

    def _dead(self) -> str | None:
        return next((n for n, p in self.procs.items() if p.poll() is not None), None)

    def _wait_ready(self, started: float) -> None:
        """Returns once the scheduler has an executor and the gateway answers."""
        with tls.scheduler_channel(self.gateway, self.gateway.scheduler_address) as ch:
            stub = scheduler_pb2_grpc.SchedulerStub(ch)
            while not self._stop:
                dead = self._dead()
                if dead:
                    code = self.procs[dead].returncode
                    raise ServeError(f"the {dead} exited with code {code} while starting "
                                     "(see its message above)")
                try:
                    if stub.Stats(scheduler_pb2.StatsRequest(), timeout=1,
                                  metadata=self._metadata).executor_ready:
                        break
                except grpc.RpcError:
                    pass
                time.sleep(0.2)
        if not self._stop:
            self._wait_gateway()
            g = self.gateway
            scheme = "https" if g.tls_cert_file else "http"
            http = (f", {scheme}://{g.host}:{g.http_port}/v1 (OpenAI)"
                    if g.http_port >= 0 else "")
            print(f"continuum: serving {self.model_name} on "
                  f"{g.host}:{g.port} (gRPC){http}, ready in "
                  f"{time.monotonic() - started:.1f} s", file=sys.stderr, flush=True)
            print("ready", flush=True)

    def _wait_gateway(self) -> None:
        """Until the gateway's port answers and, where its HTTP API is plain HTTP, its
        readiness (/health) says it sees a healthy scheduler: "ready" means a request is
        served and a readiness probe passes, not that one still fails for a moment."""
        g = self.gateway
        with tls.gateway_probe(g) as ready:
            while not self._stop and not ready(0.5):
                self._check_gateway_alive()
        if g.http_port <= 0 or g.tls_cert_file:
            return
        url = f"http://{connect_host(g.host)}:{g.http_port}/health"
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not self._stop:
            ready, said = http_ready(url)
            if ready:
                return
            self._check_gateway_alive()
            if time.monotonic() > deadline:
                raise ServeError(f"the gateway is up but not ready after {READY_TIMEOUT_S:.0f} "
                                 f"s: its /health says {said}")
            time.sleep(0.05)

    def _check_gateway_alive(self) -> None:
        if self.procs["gateway"].poll() is not None:
            raise ServeError("the gateway exited while starting (see its message above)")

    def _watch(self) -> int:
        with tls.scheduler_channel(self.gateway, self.gateway.scheduler_address) as ch:
            stub = scheduler_pb2_grpc.SchedulerStub(ch)
            while not self._stop:
                time.sleep(0.5)
                self._kill_hung_executor(stub)
                now = time.monotonic()
                dead = self._dead()
                code = None if dead is None else self.procs[dead].returncode
                if dead == "standby":
                    self._standby_died(code, now)
                elif dead is not None:
                    if dead != "executor":
                        print(f"continuum: the {dead} exited with code {code}; stopping",
                              file=sys.stderr, flush=True)
                        return 1
                    if not self.executor_deaths.record(now):
                        print(f"continuum: {self.executor_deaths.tripped(code)}",
                              file=sys.stderr, flush=True)
                        return 1
                    self._executor_died(code, now)
                if self._standby_due is not None and now >= self._standby_due:
                    self._standby_due = None
                    self._start("standby")
        return 0

    def _executor_died(self, code: int, now: float) -> None:
        """The standby (if any) has the executor's role now: the scheduler switched to
        it on its own, or takes it when it registers if it is still starting (a standby
        started after the last one died, both killed at once): sooner than a process
        started now. Otherwise a cold start, as without standbys."""
        standby = self.procs.pop("standby", None)
        count = self.executor_deaths.progress()
        if standby is not None and standby.poll() is None:
            self.procs["executor"] = standby
            warm = "" if standby.pid in self._registered_pids else ", still starting"
            print(f"continuum: executor exited with code {code}; the standby (pid "
                  f"{standby.pid}{warm}) takes over (death {count})", file=sys.stderr,
                  flush=True)
        else:
            print(f"continuum: executor exited with code {code}; restarting (death {count})",
                  file=sys.stderr, flush=True)
            self._start("executor")
        if self.num_standby and self._standby_due is None:
            self._standby_due = now + STANDBY_START_DELAY_S

    def _standby_died(self, code: int, now: float) -> None:
        del self.procs["standby"]
        if not self._standby_deaths.record(now):
            self.num_standby = 0
            print(f"continuum: the standby executor exited {self._standby_deaths.count} times "
                  f"in {self._standby_deaths.window_s:g} s (last code {code}); serving on "
                  "without one", file=sys.stderr, flush=True)
            return
        print(f"continuum: the standby executor exited with code {code}; starting another",
              file=sys.stderr, flush=True)
        self._standby_due = now

    def _kill_hung_executor(self, stub) -> None:
        """Reads the scheduler's view of our executors: notes which ones it holds,
        and kills one it declared dead or hung (the one in service, or an unanswering
        standby) while the process lives (SIGSTOP, a deadlock), so the restart path
        replaces it."""
        try:
            stats = stub.Stats(scheduler_pb2.StatsRequest(), timeout=2,
                               metadata=self._metadata)
        except grpc.RpcError:
            return
        lost_pid = stats.last_lost_executor_pid
        # A standby registered is warm; the scheduler may already have promoted it.
        self._registered_pids = {stats.executor_pid, stats.standby_executor_pid}
        for name in EXECUTORS:
            proc = self.procs.get(name)
            if proc is not None and lost_pid == proc.pid and proc.poll() is None:
                print(f"continuum: the scheduler lost its {name} but the process lives "
                      "(hung); killing it", file=sys.stderr, flush=True)
                proc.kill()
                proc.wait()

