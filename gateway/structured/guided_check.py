"""Structured-output specs compiled against the served tokenizer before admission.

A ``Guided`` spec (``response_format``, ``guided_*``, a tool's parameters, a forced
``tool_choice``'s grammar) is compiled as the executor will (same grammar, tokenizer and
limits: protos/guided.py) and its first tokens walked (``probe``), so a spec that would fail
a step is a 400 naming llguidance's reason instead.

* Compiles run in COMPILE_WORKERS child processes (compile_worker.py), started on first
  use or from startup (``warm``).
* Verdicts are kept in an LRU of VERDICT_CACHE specs keyed by digest.
* Past COMPILE_CPU_S of CPU a compile is killed and the spec refused (a verdict, kept).
  Unfinished COMPILE_TIMEOUT_S after the request arrived, for want of CPU or a worker, it
  is killed too and the request refused as overload (``CompileBusy``: 429, not kept); a
  worker's own start does not count. A worker that dies with a spec refuses it and is
  replaced."""

from __future__ import annotations

import collections
import hashlib
import queue
import threading
import time
from collections.abc import Callable

import llguidance
import structlog

from gateway.structured.compile_worker import START_TIMEOUT_S, StartFailed, Worker, WorkerGone
from protos import guided as guided_spec
from protos.continuum.v1 import sampling_pb2

_log = structlog.get_logger("gateway")
VERDICT_CACHE = 512
COMPILE_CPU_S = 1.0
COMPILE_TIMEOUT_S = 5.0
COMPILE_WORKERS = 2


class CompileBusy(Exception):
    """No worker could compile the spec in time: overload, not the spec's fault."""


class GuidedCheck:
    """Why a Guided spec cannot be served, for one model's tokenizer; thread-safe."""

    def __init__(self, tokenizer_json: Callable[[], str], vocab_size: int,
                 eos_token_ids: tuple[int, ...], timeout_s: float = COMPILE_TIMEOUT_S,
                 cpu_budget_s: float = COMPILE_CPU_S, workers: int = COMPILE_WORKERS):
        self._tokenizer_json = tokenizer_json  # called once, on first use
        self._vocab_size = vocab_size
        self._eos_token_ids = eos_token_ids
        self.timeout_s = timeout_s
        self.cpu_budget_s = cpu_budget_s
        self.num_compiles = 0  # specs sent to a worker (not answered from the cache)
        self._num_workers = workers
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._verdicts: collections.OrderedDict[bytes, str | None] = collections.OrderedDict()
        self._idle: queue.Queue[Worker] | None = None
        self._started = False  # a worker has said it is ready once
        self._lock = threading.Lock()  # the tokenizer, the workers and the verdicts

    def problem(self, guided: sampling_pb2.Guided) -> str | None:
        """A message naming why ``guided`` cannot be served, or None to accept it;
        raises CompileBusy when no worker could answer within ``timeout_s``."""
        deadline = time.monotonic() + self.timeout_s
        data = guided.SerializeToString(deterministic=True)
        key = hashlib.sha256(data).digest()
        with self._lock:
            if key in self._verdicts:
                self._verdicts.move_to_end(key)
                return self._verdicts[key]
        verdict = self._compile(data, deadline)
        with self._lock:
            self._verdicts[key] = verdict
            while len(self._verdicts) > VERDICT_CACHE:
                self._verdicts.popitem(last=False)
        return verdict

    def _compile(self, data: bytes, deadline: float) -> str | None:
        idle = self._workers()
        # Until a worker has started once, a check waits for the start: a slow first
        # structured request after startup, not a 429 for a server that is not busy.
        wait_s = deadline - time.monotonic() if self._started else START_TIMEOUT_S
        try:
            worker = idle.get(timeout=max(0.0, wait_s))
        except queue.Empty:
            raise CompileBusy(_BUSY) from None
        try:
            if not worker.alive:  # first use, or the last one was killed
                deadline += self._start(worker)
            if time.monotonic() >= deadline:
                raise CompileBusy(_BUSY)
            self.num_compiles += 1
            outcome, verdict = worker.ask(data, deadline, self.cpu_budget_s)
        except (OSError, StartFailed) as exc:  # ours, not the spec's: not a verdict
            _log.warning("structured-output compile worker did not start", reason=str(exc))
            raise CompileBusy(_BUSY) from exc
        except WorkerGone as exc:
            _log.warning("structured-output compile worker lost", reason=str(exc))
            return "the grammar matcher failed compiling this spec; simplify it"
        finally:
            idle.put(worker)
        if outcome == "costly":
            return (f"the grammar took too long to compile (more than {self.cpu_budget_s:g} "
                    "s of CPU); simplify the schema, regex or grammar")
        if outcome == "late":
            raise CompileBusy(_BUSY)
        return verdict

    def tokenizer(self) -> llguidance.LLTokenizer:
        """llguidance's tokenizer in this process (the workers build their own)."""
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = guided_spec.load_tokenizer(
                    self._tokenizer_json(), self._vocab_size, self._eos_token_ids)
            return self._tokenizer

    def warm(self) -> None:
        """Starts the workers in the background (a check waits for one if it must)."""
        def start() -> None:
            idle = self._workers()
            for _ in range(self._num_workers):
                worker = idle.get()
                try:
                    if not worker.alive:
                        self._start(worker)
                except (OSError, StartFailed) as exc:  # the first check retries
                    _log.warning("structured-output compile worker did not start",
                                 reason=str(exc))
                finally:
                    idle.put(worker)
        threading.Thread(target=start, name="guided-workers", daemon=True).start()

    def _start(self, worker: Worker) -> float:
        """Starts ``worker``; the seconds it took (not the spec's time to compile)."""
        began = time.monotonic()
        worker.start()
        self._started = True
        return time.monotonic() - began

    def worker_pids(self) -> list[int]:
        """The running workers' process ids (idle ones; for operators and tests)."""
        with self._lock:
            workers = list(self._idle.queue) if self._idle is not None else []
        return [w.pid for w in workers if w.alive]

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, None
        while idle is not None and not idle.empty():
            idle.get_nowait().kill()

    def _workers(self) -> queue.Queue[Worker]:
        with self._lock:
            if self._idle is None:
                init = {"tokenizer": self._tokenizer_json(), "vocab_size": self._vocab_size,
                        "eos": list(self._eos_token_ids)}
                self._idle = queue.Queue()
                for _ in range(self._num_workers):
                    self._idle.put(Worker(init))
            return self._idle


_BUSY = ("the structured-output compiler is busy; retry in a second (the spec was not "
         "judged)")
