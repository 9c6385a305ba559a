"""One rank's end of the tensor-parallel group: the collectives of the sharded forward, and
the commands rank 0 sends the other ranks.

gloo for CPU tensors, NCCL for device ones (``cpu:gloo,cuda:nccl``); commands and sampled
tokens stay on gloo. After a generous join, every collective has ``--tp-timeout-s``: a hung
or dead peer raises, and the group is then unusable (callers treat it as fatal).
Collectives pair up by call order, so every rank makes the same calls; the only
rank-dependent branches are in this class. Commands go through a shared-memory ring
(runtime/shm_ring.py; a gloo broadcast costs a TCP send per rank); where no ring can be
set up every rank falls back to the broadcast together and logs it.
"""

from __future__ import annotations

import datetime
import logging
import os
import tempfile
from enum import IntEnum

import numpy as np
import torch
import torch.distributed as dist

from executor_svc.tp_shard import ShardLayout
from runtime import shm_ring

log = logging.getLogger("executor.tp")

_JOIN_TIMEOUT_S = 1800.0  # a rank that dies meanwhile is caught sooner (tp_ranks.py)
_HEADER = 4096  # bytes per command broadcast: kind, length, then the payload's first bytes
_INLINE = _HEADER - 16  # a plan that fits (any decode-only plan of ~200 sequences) costs one


class Command(IntEnum):
    """What rank 0 asks the other ranks to do next."""

    NOOP = 0  # keepalive: an idle rank waits in a collective, and collectives time out
    PLAN = 1  # payload: a serialized BatchPlan to execute
    RESET = 2  # forget every sequence (a Hello went out)
    STOP = 3  # leave the group and exit 0


class TPComm:
    """This rank's collectives; usable once ``connect`` has returned on every rank."""

    def __init__(self, layout: ShardLayout, plan_channel: str = "shm") -> None:
        """``plan_channel``: "shm" (the ring, where this machine allows) or "gloo" (the
        broadcast; benchmarks/bench_channel.py compares the two)."""
        if plan_channel not in ("shm", "gloo"):
            raise ValueError(f"plan_channel must be shm or gloo, not {plan_channel!r}")
        self.layout = layout
        self.rank = layout.rank
        self.plan_channel = plan_channel
        self._group = None  # the process group every collective uses
        self._header = torch.zeros(_HEADER, dtype=torch.uint8)
        self._timeout_s = 60.0
        self._writer: shm_ring.RingWriter | None = None  # rank 0, once the ring is up
        self._reader: shm_ring.RingReader | None = None  # other ranks

    def connect(self, init_method: str, timeout_s: float, device) -> None:
        """Joins the group: blocks until every rank has called it."""
        backend = "cpu:gloo,cuda:nccl" if torch.device(device).type == "cuda" else "gloo"
        dist.init_process_group(
            backend, init_method=init_method, rank=self.rank, world_size=self.layout.tp_size,
            timeout=datetime.timedelta(seconds=_JOIN_TIMEOUT_S),
        )
        self._group = dist.new_group(
            list(range(self.layout.tp_size)), timeout=datetime.timedelta(seconds=timeout_s),
            backend=backend,
        )
        self._timeout_s = timeout_s
        if self.plan_channel == "shm" and self.layout.tp_size > 1:
            self._open_ring(_doorbell_dir(init_method))

    def _open_ring(self, doorbell_dir: str) -> None:
        """Rank 0 makes the ring and broadcasts where it is; every rank attaches; all use it
        only if all attached (else all keep gloo). Rank 0 then unlinks its name."""
        spec, why = b"", None
        if self.rank == 0:
            why = shm_ring.available()
            if why is None:
                try:
                    self._writer = shm_ring.RingWriter(self.layout.tp_size - 1, doorbell_dir)
                    spec = f"{self._writer.name}\n{self._writer.doorbell}".encode()
                except OSError as exc:
                    why = f"cannot create it: {exc}"
            self._gloo_send(Command.NOOP, spec)
        else:
            spec = self._gloo_receive()[1]
            if spec:
                name, doorbell = spec.decode().split("\n")
                try:
                    self._reader = shm_ring.RingReader(name, doorbell, self.rank - 1)
                except (OSError, ValueError) as exc:
                    why = f"rank {self.rank} cannot attach: {exc}"
        attached = self.min_over_ranks(int(self._writer is not None or self._reader is not None))
        if self._writer is not None:
            self._writer.unlink()  # every reader has mapped it (or none will)
        if attached:
            log.info("plans reach the %d other ranks through a shared-memory ring",
                     self.layout.tp_size - 1)
            return
        log.warning("plans go by gloo broadcast: no shared-memory ring (%s)",
                    why or "another rank could not attach")
        self._close_ring()

    def _close_ring(self) -> None:
        for end in (self._writer, self._reader):
            if end is not None:
                end.close()
        self._writer = self._reader = None

    def close(self) -> None:
        self._close_ring()
        if dist.is_initialized():
            dist.destroy_process_group()

    # The forward's collectives.

    def all_reduce(self, x: torch.Tensor) -> None:
        """Sums ``x`` over the ranks, in place; every rank ends with the same bits."""
        dist.all_reduce(x, group=self._group)

    def embed(
        self,
        table: torch.Tensor,  # [V_r, H] this rank's vocabulary rows
        ids: torch.Tensor,  # [T] int64, any id < V
    ) -> torch.Tensor:  # [T, H]
        # Exactly one rank owns each id; the others contribute zeros, so the sum is exact.
        local = ids - self.layout.vocab.start
        outside = (local < 0) | (local >= len(self.layout.vocab))
        x = table[local.masked_fill(outside, 0)]
        x.masked_fill_(outside[:, None], 0.0)
        dist.all_reduce(x, group=self._group)
        return x

    def gather_logits(
        self, logits: torch.Tensor  # [S, V_r] this rank's vocabulary slice
    ) -> torch.Tensor:  # rank 0: [S, V]; other ranks: their own slice, unchanged
        if logits.shape[0] == 0:  # same S on every rank: all skip together
            return logits
        short = self.layout.max_vocab - logits.shape[1]
        padded = torch.nn.functional.pad(logits, (0, short)) if short else logits  # [S, max V_r]
        if self.rank != 0:
            dist.gather(padded, None, dst=0, group=self._group)
            return logits
        parts = [torch.empty_like(padded) for _ in range(self.layout.tp_size)]
        dist.gather(padded, parts, dst=0, group=self._group)
        return torch.cat(
            [p[:, : len(v)] for p, v in zip(parts, self.layout.vocab_by_rank, strict=True)],
            dim=1,
        )

    def min_over_ranks(self, value: int) -> int:
        """The smallest ``value`` any rank passes (a CPU tensor: gloo, on any device)."""
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self._group)
        return int(t)

    def broadcast_tokens(self, tokens: list[int] | None, n: int) -> list[int]:
        """Rank 0's ``n`` sampled tokens, on every rank (the others pass None)."""
        t = torch.tensor(tokens, dtype=torch.int64) if self.rank == 0 else torch.empty(
            n, dtype=torch.int64)
        dist.broadcast(t, src=0, group=self._group)
        return t.tolist()

    # Rank 0's commands.

    def send_command(self, command: Command, payload: bytes = b"") -> None:
        """Rank 0 only: into the ring; raises RuntimeError when a rank is lost."""
        assert self.rank == 0
        if self._writer is None:
            self._gloo_send(command, payload)
        else:
            self._writer.send(int(command).to_bytes(8, "little") + payload, self._timeout_s)

    def receive_command(self) -> tuple[Command, bytes]:
        """Other ranks: blocks for rank 0's next command (at most ``--tp-timeout-s``)."""
        if self._reader is None:
            return self._gloo_receive()
        data = self._reader.recv(self._timeout_s)
        return Command(int.from_bytes(data[:8], "little")), data[8:]

    def _gloo_send(self, command: Command, payload: bytes) -> None:
        """One broadcast, two when the payload exceeds the header's room."""
        buf = self._header.numpy()
        buf[:16].view(np.int64)[:] = (command, len(payload))
        inline = min(len(payload), _INLINE)
        buf[16 : 16 + inline] = np.frombuffer(payload, dtype=np.uint8, count=inline)
        dist.broadcast(self._header, src=0, group=self._group)
        if len(payload) > inline:
            rest = torch.from_numpy(np.frombuffer(payload, dtype=np.uint8, offset=inline).copy())
            dist.broadcast(rest, src=0, group=self._group)

    def _gloo_receive(self) -> tuple[Command, bytes]:
        dist.broadcast(self._header, src=0, group=self._group)
        buf = self._header.numpy()
        command, size = (int(v) for v in buf[:16].view(np.int64))
        inline = min(size, _INLINE)
        payload = buf[16 : 16 + inline].tobytes()
        if size > inline:
            rest = torch.empty(size - inline, dtype=torch.uint8)
            dist.broadcast(rest, src=0, group=self._group)
            payload += rest.numpy().tobytes()
        return Command(command), payload


def _doorbell_dir(init_method: str) -> str:
    """Where the ring's doorbell socket goes: beside a file:// rendezvous (rank 0's temp
    directory, removed with it: tp_ranks.py), else the temp directory."""
    if init_method.startswith("file://"):
        return os.path.dirname(init_method[len("file://"):])
    return tempfile.gettempdir()
