"""The background writer: records go in from the step loop, rows come out in a thread.

``TelemetryWriter.put`` (the step loop's) never blocks or raises: a full bounded queue
drops and counts (``num_dropped``), since telemetry must never slow serving. The thread
writes batches (one transaction, gathered up to ``linger_s``), runs retention every
``retention.interval_s``, and drops and counts a refused batch (``num_failed``), then
reconnects: a database restart costs the records sent meanwhile, not the writer.
"""

from __future__ import annotations

import logging
import queue
import threading
import time

from telemetry import retention as retention_pass
from telemetry.records import Record
from telemetry.retention import Retention
from telemetry.store import TelemetryStore

log = logging.getLogger(__name__)

DEFAULT_MAX_QUEUE = 10_000
DEFAULT_BATCH = 512


class TelemetryWriter:
    """Owns one store connection and the thread that writes it.

    ``TelemetryWriter.open(target)`` opens (and migrates) the store in the caller,
    so a bad path or DSN fails at startup with StoreError, then starts the thread.
    ``put`` is called from one thread (the step loop). Counters are read without a
    lock (ints; approximate while running, exact after ``flush``/``close``).
    """

    def __init__(self, store: TelemetryStore, *, max_queue: int = DEFAULT_MAX_QUEUE,
                 batch_size: int = DEFAULT_BATCH, retention: Retention | None = None,
                 poll_s: float = 0.25, linger_s: float = 0.1) -> None:
        if max_queue < 1 or batch_size < 1:
            raise ValueError("max_queue and batch_size must be >= 1")
        self.retention = retention or Retention()
        self.retention.validate()
        self._store = store
        self._queue: queue.Queue[Record] = queue.Queue(maxsize=max_queue)
        self._batch_size = batch_size
        self._poll_s = poll_s
        self._linger_s = linger_s
        self._stop = threading.Event()
        self._idle = threading.Condition()
        self.num_accepted = 0
        self.num_written = 0
        self.num_dropped = 0  # queue full
        self.num_failed = 0  # taken, but the store refused the batch
        self.num_retention_passes = 0
        self._thread = threading.Thread(target=self._run, name="telemetry-writer", daemon=True)
        self._thread.start()

    @classmethod
    def open(cls, target: str, **kw) -> TelemetryWriter:
        return cls(TelemetryStore.open(target, migrate=True), **kw)

    @property
    def target(self) -> str:
        """The store's path, or its DSN without the password (for logs)."""
        return self._store.target

    # -- the caller's side (the step loop) ------------------------------------------------
    def put(self, record: Record) -> bool:
        """Queue ``record``; False (and counted in ``num_dropped``) if the queue is full."""
        try:
            self._queue.put_nowait(record)
        except queue.Full:
            self.num_dropped += 1
            return False
        self.num_accepted += 1
        return True

    @property
    def queue_depth(self) -> int:
        return self._queue.qsize()

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until every accepted record is written or failed; False on timeout."""
        deadline = time.monotonic() + timeout
        with self._idle:
            while self.num_written + self.num_failed < self.num_accepted:
                left = deadline - time.monotonic()
                if left <= 0 or not self._thread.is_alive():
                    return False
                self._idle.wait(min(left, 0.1))
        return True

    def close(self, timeout: float = 10.0) -> None:
        """Write what is queued (up to ``timeout``), stop the thread, close the store."""
        self.flush(timeout)
        self._stop.set()
        self._thread.join(timeout)
        self._store.close()

    # -- the writer thread ---------------------------------------------------------------------
    def _take_batch(self) -> list[Record]:
        try:
            batch = [self._queue.get(timeout=self._poll_s)]
        except queue.Empty:
            return []
        # Linger before draining: records arrive one per step, and waking (and
        # committing) once per record would take the GIL from the step loop each time.
        if self._linger_s and self._queue.qsize() < self._batch_size:
            self._stop.wait(self._linger_s)
        while len(batch) < self._batch_size:
            try:
                batch.append(self._queue.get_nowait())
            except queue.Empty:
                break
        return batch

    def _run(self) -> None:
        next_retention = time.monotonic()
        while not (self._stop.is_set() and self._queue.empty()):
            batch = self._take_batch()
            if batch:
                try:
                    self._store.write(batch)
                    self.num_written += len(batch)
                except Exception as exc:  # the store's fault, not the caller's: count, go on
                    self.num_failed += len(batch)
                    log.warning("telemetry: dropped %d records: %s", len(batch), exc)
                    self._reconnect()
                with self._idle:
                    self._idle.notify_all()
            if time.monotonic() >= next_retention:
                next_retention = time.monotonic() + self.retention.interval_s
                self._run_retention()

    def _reconnect(self) -> None:
        try:
            if self._store.reconnect_if_broken():
                log.warning("telemetry: reconnected to the store")
        except Exception as exc:  # still down: the next failed batch tries again
            log.warning("telemetry: reconnect failed: %s", exc)

    def _run_retention(self) -> dict:
        # Only this thread uses the store's connection; tests run retention.apply on their own.
        try:
            out = retention_pass.apply(self._store, self.retention)
        except Exception as exc:
            log.warning("telemetry: retention pass failed: %s", exc)
            return {}
        self.num_retention_passes += 1
        return out
