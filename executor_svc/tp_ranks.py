"""Rank 0's worker processes: started bound to its life, watched, stopped.

Ranks 1..N-1 run ``python -m executor_svc --config-json DOC`` (rank 0's config, resolved
model directory and the worker's rank), each with PR_SET_PDEATHSIG so no orphan outlives
rank 0. A worker exiting non-zero (0 only on rank 0's STOP) has broken the group, so a
watcher thread kills the rest and exits EXIT_RANK_LOST at once, wherever the main thread
is blocked; the executor restarts and the scheduler recomputes (docs/design.md §5).
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import logging
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

from executor_svc.settings import ExecutorConfig
from executor_svc.tp_serve import EXIT_RANK_LOST
from runtime import config_flags

log = logging.getLogger("executor.tp")
_PR_SET_PDEATHSIG = 1
_ROOT = str(pathlib.Path(__file__).resolve().parent.parent)  # holds executor_svc/, protos/


def _die_with_parent(parent_pid: int) -> None:
    # In the child between fork and exec. If the parent died before prctl took effect, the
    # signal will never come: leave now.
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass
    if os.getppid() != parent_pid:
        os._exit(EXIT_RANK_LOST)


class WorkerRanks:
    """Spawns ranks 1..tp_size-1 on construction; ``stop`` (always call it) reaps them."""

    def __init__(self, config: ExecutorConfig, incarnation: str, model_dir: str) -> None:
        self._dir = tempfile.mkdtemp(prefix="continuum-tp-")
        self.init_method = f"file://{self._dir}/rendezvous"
        self._lock = threading.Lock()  # orders "stopping" against the watcher's exit
        self._stopping = False
        # The workers load the directory rank 0 resolved (a GGUF is converted once, by rank 0).
        worker = dataclasses.replace(config, model=model_dir, tp_init_method=self.init_method,
                                     incarnation=incarnation)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            p for p in (_ROOT, os.environ.get("PYTHONPATH")) if p)}
        self.procs = [
            subprocess.Popen(
                [sys.executable, "-m", "executor_svc", config_flags.DOCUMENT_FLAG,
                 config_flags.document(dataclasses.replace(worker, tp_rank=rank))],
                env=env, stdin=subprocess.DEVNULL,
                preexec_fn=functools.partial(_die_with_parent, os.getpid()),
            )
            for rank in range(1, config.tp_size)
        ]
        self._watcher = threading.Thread(target=self._watch, name="tp-watch", daemon=True)
        self._watcher.start()

    def _watch(self) -> None:
        while not self._stopping:
            for rank, proc in enumerate(self.procs, start=1):
                code = proc.poll()
                if code is None or code == 0:  # 0: it obeyed rank 0's STOP
                    continue
                with self._lock:
                    if self._stopping:
                        return
                    log.error("tensor-parallel rank %d exited with status %d; exiting %d so "
                              "the executor restarts whole", rank, code, EXIT_RANK_LOST)
                    self._kill()
                    shutil.rmtree(self._dir, ignore_errors=True)
                    os._exit(EXIT_RANK_LOST)
            time.sleep(0.1)

    def stop(self, told: bool, grace_s: float = 10.0) -> bool:
        """Reaps the workers: ``told`` (STOP was broadcast) waits up to ``grace_s`` for them to
        leave; otherwise (not serving yet, or the group broke) kills them at once: they hold
        nothing worth saving, and a hung one may not heed SIGTERM. Kills what is left after
        the grace. True when every worker exited 0."""
        with self._lock:
            self._stopping = True
        if not told:
            self._kill()
        clean = True
        for proc in self.procs:
            try:
                clean &= proc.wait(timeout=grace_s) == 0
            except subprocess.TimeoutExpired:
                clean = False
                proc.kill()
                proc.wait()
        shutil.rmtree(self._dir, ignore_errors=True)
        return clean

    def _kill(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
