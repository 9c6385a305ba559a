"""The mapping under runtime/shm_ring.py: its layout constants, the memory fence, the
checks that a machine can host a ring, the sweep of rings whose writer died before every
reader mapped them, and ``Ring`` (the mapping and its views, shared by both ends).
runtime/shm_ring.py's docstring gives the layout and the invariants."""

from __future__ import annotations

import mmap
import os
import platform
import threading

import numpy as np

MAGIC = 0x434F4E5452494E47  # "CONTRING"
SHM_DIR = "/dev/shm"
PREFIX = "continuum-plan-"
LINE = 8  # int64 words per reader line (64 bytes)
SLOT_HEADER = 24  # seq, total, chunk: int64 each


def fence() -> None:
    """A full memory barrier (a locked instruction: an uncontended lock's acquire). Between a
    store and a load of two different words it keeps x86-64 from reordering them, so a
    reader that says it sleeps and a writer that publishes cannot both miss the other."""
    with _FENCE:
        pass


_FENCE = threading.Lock()


class RingError(RuntimeError):
    """The ring cannot deliver: a peer died or hung past the timeout, or it was closed."""


def available() -> str | None:
    """None if this machine can host a ring, else why not (the caller keeps gloo)."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return f"{platform.machine()} is not x86-64 (the ring relies on its store order)"
    if not os.path.isdir(SHM_DIR) or not os.access(SHM_DIR, os.W_OK):
        return f"{SHM_DIR} is not a writable directory"
    return None


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, another user's: alive
        return True
    return True


def sweep_stale() -> None:
    """Removes rings whose writer pid is gone (it died before every reader mapped them)."""
    for name in os.listdir(SHM_DIR):
        if not name.startswith(PREFIX):
            continue
        pid = name[len(PREFIX):].split("-", 1)[0]
        if pid.isdigit() and not alive(int(pid)):
            try:
                os.unlink(os.path.join(SHM_DIR, name))
            except OSError:
                pass


class Ring:
    """The mapping and its views, shared by both ends."""

    def __init__(self, fd: int, size: int) -> None:
        self._map = mmap.mmap(fd, size)
        os.close(fd)
        self.words = np.frombuffer(self._map, dtype=np.int64)
        self.bytes = memoryview(self._map)
        # The same words as a memoryview: one word read or written through it runs a
        # fraction of numpy's code, which matters on a reader's first access after a
        # forward pass has flushed the CPU's caches (numpy's indexing is then ~15 us).
        self.word = self.bytes.cast("q")
        self.num_readers, self.num_slots, self.slot_bytes = (int(v) for v in self.words[1:4])
        self._slots = 64 + LINE * self.num_readers  # word where the slots start
        self.chunk_bytes = self.slot_bytes - SLOT_HEADER

    def slot_word(self, m: int) -> int:
        return self._slots + ((m - 1) % self.num_slots) * (self.slot_bytes // 8)

    def close(self) -> None:
        view, word = self.bytes, self.word
        self.words = self.bytes = self.word = None  # views go before the map
        try:
            word.release()
            view.release()
            self._map.close()
        except BufferError:  # a caller still holds a view; the map goes with the process
            pass


def ring_size(num_readers: int, num_slots: int, slot_bytes: int) -> int:
    return 8 * (64 + LINE * num_readers) + num_slots * slot_bytes
