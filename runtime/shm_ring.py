"""A shared-memory broadcast ring: one writer, N readers, one mapping in ``/dev/shm``.

Rank 0 of a tensor-parallel executor writes each command once; ranks 1..N-1 copy it out of
the same pages (docs/design.md §4), as vLLM's shm_broadcast does. A ZeroMQ PUB/SUB pair is
the doorbell for a reader that stopped spinning. runtime/plan_ring.py uses it without the
doorbell: ``reserve``/``publish`` never block, and a reader's ``sleeping`` flag tells the
writer to wake it through its own channel.

Layout (int64 words, every field naturally aligned)::

    header  [0, 64)        magic, num_readers, num_slots, slot_bytes, writer_pid, closed
    readers [64, 64 + 8R)  word 64 + 8r: reader r's pid; word 64 + 8r + 1: the last
                           message number r has consumed; word 64 + 8r + 2: 1 while r
                           sleeps (one 64-byte line per reader: no false sharing)
    slots   S x slot_bytes each: seq, total, chunk, then the chunk's bytes

Messages are numbered 1, 2, ...; message m lives in slot (m - 1) % S. A payload larger
than a slot goes as consecutive chunks, each its own message; the first says the total.
Invariants: the writer writes message m only once every reader's consumed number is at
least m - S (it never overwrites an unread slot); it writes the chunk's bytes and lengths
before ``seq`` (a reader that sees ``seq == m`` sees the bytes: x86-64 keeps stores in
order, so the ring refuses other machines and the caller keeps the gloo broadcast).

Robustness: every wait is bounded (``timeout_s``) and checks the peer's pid; a dead or
hung peer raises RingError (a RuntimeError, as gloo's: the tp code treats the group as
lost). The name is unlinked once every reader mapped it (``unlink``), so a SIGKILL then
leaks nothing; a writer dead before that is swept by the next (names carry the pid).
"""


from __future__ import annotations

import mmap
import os
import platform
import threading
import time
import uuid

import numpy as np
import zmq

__all__ = ["RingError", "RingReader", "RingWriter", "available", "fence"]

# -- the mapping: layout constants, the memory fence, the checks that a machine can host a
# ring, the sweep of rings whose writer died before every reader mapped them, and ``Ring``
# (the mapping and its views, shared by both ends)

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


# -- the two ends

_SPIN_S = 200e-6  # spin (yielding the core) this long before sleeping on the doorbell
_POLL_MS = 20  # a sleeping wait rechecks the ring and the peers' pids this often


class RingWriter:
    """Rank 0's end. ``name`` and ``doorbell`` tell the readers where to attach;
    ``doorbell_dir`` None: no doorbell (``doorbell`` is empty; the caller wakes readers)."""

    def __init__(self, num_readers: int, doorbell_dir: str | None, num_slots: int = 16,
                 slot_bytes: int = 64 << 10) -> None:
        if num_readers < 1 or num_slots < 2 or slot_bytes % 8 or slot_bytes <= SLOT_HEADER:
            raise ValueError("a ring needs >= 1 reader, >= 2 slots, 8-byte-aligned slots")
        sweep_stale()
        self.name = f"{PREFIX}{os.getpid()}-{uuid.uuid4().hex[:12]}"
        self._path = os.path.join(SHM_DIR, self.name)
        size = ring_size(num_readers, num_slots, slot_bytes)
        fd = os.open(self._path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, size)
            os.pwrite(fd, np.array([num_readers, num_slots, slot_bytes, os.getpid()],
                                   dtype=np.int64).tobytes(), 8)
            os.pwrite(fd, np.array([MAGIC], dtype=np.int64).tobytes(), 0)  # last
            self.ring = Ring(fd, size)
        except BaseException:
            os.unlink(self._path)
            raise
        self._next = 1
        self.doorbell, self._bell = "", None
        if doorbell_dir is None:
            return
        self.doorbell = f"ipc://{doorbell_dir}/{self.name}.bell"
        self._bell = zmq.Context.instance().socket(zmq.PUB)
        self._bell.setsockopt(zmq.LINGER, 0)
        self._bell.setsockopt(zmq.SNDHWM, 64)  # a reader that spins drains nothing: drop
        self._bell.bind(self.doorbell)

    def unlink(self) -> None:
        """Removes the name once every reader has mapped it: nothing left to leak."""
        try:
            os.unlink(self._path)
        except FileNotFoundError:
            pass

    def send(self, payload: bytes, timeout_s: float) -> None:
        """Broadcasts ``payload`` (any size); raises RingError when a reader stays behind
        (dead, or hung past ``timeout_s``)."""
        r = self.ring
        view = memoryview(payload)
        total, offset = len(view), 0
        while True:
            m = self._next
            self._wait_for_room(m, timeout_s)
            chunk = min(r.chunk_bytes, total - offset)
            w = r.slot_word(m)
            r.bytes[8 * w + SLOT_HEADER : 8 * w + SLOT_HEADER + chunk] = view[offset:
                                                                                 offset + chunk]
            r.words[w + 1 : w + 3] = (total, chunk)
            r.words[w] = m  # last: publishes the chunk
            self._next = m + 1
            offset += chunk
            self._ring_bell()
            if offset >= total:
                return

    @property
    def next_number(self) -> int:
        """The number the next published message gets."""
        return self._next

    def reserve(self) -> memoryview | None:
        """The next message's slot bytes (``chunk_bytes`` long) to write one payload into,
        or None when a reader has not consumed the message that slot holds (never waits).
        Nothing is visible to the readers until ``publish``."""
        r = self.ring
        m = self._next
        acks = r.words[64 + 1 : 64 + LINE * r.num_readers : LINE]
        if int(acks.min()) < m - r.num_slots:
            return None
        start = 8 * r.slot_word(m) + SLOT_HEADER
        return r.bytes[start : start + r.chunk_bytes]

    def publish(self, length: int) -> int:
        """Publishes the ``length`` bytes written into ``reserve()``'s slot as the next
        message (one chunk); returns its number. Rings no doorbell."""
        r, m = self.ring, self._next
        assert 0 < length <= r.chunk_bytes
        w = r.slot_word(m)
        r.words[w + 1 : w + 3] = (length, length)
        r.words[w] = m  # last: publishes the message
        self._next = m + 1
        return m

    def sleeping(self, index: int) -> bool:
        """Whether reader ``index`` said it sleeps (after a ``publish``: fenced, so a
        reader that goes to sleep concurrently either sees the message or is seen)."""
        fence()
        return bool(self.ring.words[64 + LINE * index + 2])

    def _ring_bell(self) -> None:
        if self._bell is None:
            return
        try:
            self._bell.send(b"", zmq.NOBLOCK)
        except zmq.Again:
            pass  # readers' queues full: they are awake and behind

    def _wait_for_room(self, m: int, timeout_s: float) -> None:
        r = self.ring
        acks = r.words[64 + 1 : 64 + LINE * r.num_readers : LINE]
        if int(acks.min()) >= m - r.num_slots:
            return
        deadline, pause = time.monotonic() + timeout_s, 20e-6
        while int(acks.min()) < m - r.num_slots:
            if time.monotonic() > deadline:
                raise RingError(f"a tensor-parallel rank read nothing for {timeout_s:g} s "
                                "(hung): the plan ring is full")
            for i in range(r.num_readers):
                pid = int(r.words[64 + LINE * i])
                if acks[i] < m - r.num_slots and pid and not alive(pid):
                    raise RingError(f"tensor-parallel rank {i + 1} (pid {pid}) is gone")
            time.sleep(pause)
            pause = min(pause * 2, 1e-3)

    def close(self) -> None:
        """Tells waiting readers (RingError "closed"), removes the name and the doorbell."""
        if self.ring.words is not None:
            self.ring.words[5] = 1
            self._ring_bell()
            self.ring.close()
        self.unlink()
        if self._bell is None:
            return
        self._bell.close()
        try:
            os.unlink(self.doorbell[len("ipc://"):])
        except OSError:
            pass


class RingReader:
    """Rank r's end (``index`` = r - 1). Attach while the writer keeps the name.
    ``doorbell`` empty: none (only ``peek``/``consume`` then, no waiting ``recv``)."""

    def __init__(self, name: str, doorbell: str, index: int) -> None:
        if not name.startswith(PREFIX) or "/" in name:
            raise ValueError(f"not a plan ring: {name!r}")
        path = os.path.join(SHM_DIR, name)
        fd = os.open(path, os.O_RDWR)
        size = os.fstat(fd).st_size
        if size < 8 * 64:
            os.close(fd)
            raise ValueError(f"ring {name!r} is not ready")
        self.ring = Ring(fd, size)
        r = self.ring
        if int(r.words[0]) != MAGIC or not 0 <= index < r.num_readers:
            r.close()
            raise ValueError(f"ring {name!r} is not ready or has no reader {index}")
        if size != ring_size(r.num_readers, r.num_slots, r.slot_bytes):
            r.close()
            raise ValueError(f"ring {name!r} has the wrong size")
        self.index = index
        self.writer_pid = int(r.words[4])
        self._line = 64 + LINE * index
        r.words[self._line] = os.getpid()
        self._next = int(r.words[self._line + 1]) + 1
        self._bell = None
        if doorbell:
            self._bell = zmq.Context.instance().socket(zmq.SUB)
            self._bell.setsockopt(zmq.LINGER, 0)
            self._bell.setsockopt(zmq.SUBSCRIBE, b"")
            self._bell.connect(doorbell)

    @property
    def next_number(self) -> int:
        """The number of the message ``peek`` looks for."""
        return self._next

    def peek(self) -> memoryview | None:
        """The next message's bytes, in place, if it is published (never waits), else
        None. A one-chunk message only: a longer one is the caller's to refuse. Valid
        until ``consume``: the writer may reuse the slot from then on."""
        r, m = self.ring, self._next
        w = r.slot_word(m)
        word = r.word
        if word[w] != m:
            return None
        length = min(word[w + 2], r.chunk_bytes)
        start = 8 * w + SLOT_HEADER
        return r.bytes[start : start + max(length, 0)]

    def consume(self) -> None:
        """Done with the message ``peek`` returned: its slot is the writer's again."""
        self.ring.word[self._line + 1] = self._next
        self._next += 1

    def set_sleeping(self, sleeping: bool) -> None:
        """Says whether this reader now waits on its caller's channel rather than spinning
        on the ring. Fenced: call ``peek`` once more after saying so, before sleeping."""
        self.ring.word[self._line + 2] = int(sleeping)
        fence()

    def recv(self, timeout_s: float) -> bytes:
        """The next payload; raises RingError after ``timeout_s`` without one, or when the
        writer died or closed the ring."""
        deadline = time.monotonic() + timeout_s
        total, data = self._chunk(deadline)
        if len(data) == total:
            return data
        parts = [data]
        got = len(data)
        while got < total:
            _, data = self._chunk(deadline)
            parts.append(data)
            got += len(data)
        return b"".join(parts)

    def _chunk(self, deadline: float) -> tuple[int, bytes]:
        r, m = self.ring, self._next
        w = r.slot_word(m)
        if int(r.words[w]) != m:
            self._wait(w, m, deadline)
        total, chunk = (int(v) for v in r.words[w + 1 : w + 3])
        start = 8 * w + SLOT_HEADER
        data = r.bytes[start : start + chunk].tobytes()
        r.words[self._line + 1] = m  # after the copy: the writer may now reuse the slot
        self._next = m + 1
        return total, data

    def _wait(self, w: int, m: int, deadline: float) -> None:
        words = self.ring.words
        spin_until = time.monotonic() + _SPIN_S
        while time.monotonic() < spin_until:  # a step's gap is often this short
            if words[w] == m:
                return
            os.sched_yield()  # an oversubscribed core runs the writer meanwhile
        while words[w] != m:
            while self._bell.poll(0):  # old doorbells: the ring is checked after them
                self._bell.recv()
            if words[w] == m:
                return
            if words[5]:
                raise RingError("the plan ring was closed by rank 0")
            now = time.monotonic()
            if now > deadline:
                raise RingError("no command from rank 0 within the timeout (hung)")
            if not alive(self.writer_pid):
                raise RingError(f"rank 0 (pid {self.writer_pid}) is gone")
            self._bell.poll(min(_POLL_MS, max(1, int((deadline - now) * 1e3))))

    def close(self) -> None:
        if self._bell is not None:
            self._bell.close()
        self.ring.close()
