"""Serving under tensor parallelism: rank 0's Runner front, the other ranks' loop, and the
samplers that keep every rank's sequences identical.

Rank 0 alone talks to the scheduler; before it executes a plan or forgets sequences it
broadcasts the command (tp_comm.Command), and the other ranks run the same Runner code in
lockstep. Only rank 0 samples and broadcasts the tokens, so every rank appends the same ids.

A failed step under tp cannot be resynchronized in-process (the collectives no longer pair
up): rank 0 raises RankLost, another rank exits EXIT_RANK_LOST, the executor restarts whole
(docs/design.md §5). A refused plan is refused identically by every rank first.
"""

from __future__ import annotations

import logging
import time

import torch

from executor_svc.runner import Runner
from executor_svc.sampler import SampleOutput, Sampler, SampleRow
from executor_svc.tp_comm import Command, TPComm
from protos.continuum.v1 import executor_pb2 as pb

log = logging.getLogger("executor.tp")
EXIT_RANK_LOST = 3  # exit status of any rank once the group is broken


class RankLost(RuntimeError):
    """The tensor-parallel group is broken; the executor must restart."""


class BroadcastingSampler(Sampler):
    """Rank 0: samples from the whole logits, then hands the tokens to the other ranks."""

    def __init__(self, eos_token_ids: tuple[int, ...], comm: TPComm) -> None:
        super().__init__(eos_token_ids)
        self.comm = comm

    def sample(self, logits: torch.Tensor, rows: list[SampleRow]) -> SampleOutput:
        out = super().sample(logits, rows)
        self.comm.broadcast_tokens(out.token_ids, len(rows))
        return out


class ReceivingSampler(Sampler):
    """Other ranks: take rank 0's tokens; their logits (a vocabulary slice) go unused."""

    def __init__(self, eos_token_ids: tuple[int, ...], comm: TPComm) -> None:
        super().__init__(eos_token_ids)
        self.comm = comm

    def sample(self, logits: torch.Tensor, rows: list[SampleRow]) -> SampleOutput:
        return SampleOutput(self.comm.broadcast_tokens(None, len(rows)))


def make_sampler(eos_token_ids: tuple[int, ...], comm: TPComm) -> Sampler:
    cls = BroadcastingSampler if comm.rank == 0 else ReceivingSampler
    return cls(eos_token_ids, comm)


class TPRunner:
    """Rank 0's Runner as ServeLoop sees it: each command goes to the other ranks, then runs
    here. ``keepalive`` must be called while idle (an idle rank waits in a collective, and
    collectives time out)."""

    def __init__(self, runner: Runner, comm: TPComm, keepalive_s: float) -> None:
        self.runner, self.comm = runner, comm
        self.keepalive_s = keepalive_s
        self._last_sent = time.monotonic()

    @property
    def last_step_id(self) -> int:
        return self.runner.last_step_id

    @property
    def seqs(self) -> dict:
        return self.runner.seqs  # read only (heartbeats report how many)

    def reset(self) -> None:
        self._send(Command.RESET)
        self.runner.reset()

    def execute(self, plan: pb.BatchPlan) -> pb.StepResult:
        self._send(Command.PLAN, plan.SerializeToString())
        result = self.runner.execute(plan)
        if result.error_code == pb.STEP_ERROR_CODE_INTERNAL:
            raise RankLost(f"step {plan.step_id} failed under tensor parallelism: "
                           f"{result.error_message}")
        return result

    def keepalive(self) -> None:
        if time.monotonic() - self._last_sent >= self.keepalive_s:
            self._send(Command.NOOP)

    def stop(self) -> None:
        """Asks the other ranks to leave; they exit 0."""
        self._send(Command.STOP)

    def _send(self, command: Command, payload: bytes = b"") -> None:
        try:
            self.comm.send_command(command, payload)
        except RuntimeError as exc:  # gloo: a peer closed its connection or timed out
            raise RankLost(f"cannot reach the other ranks: {exc}") from exc
        self._last_sent = time.monotonic()


def serve_worker(runner: Runner, comm: TPComm) -> int:
    """Ranks 1..N-1: follow rank 0's commands until STOP (0) or a failure (EXIT_RANK_LOST)."""
    while True:
        try:
            command, payload = comm.receive_command()
        except RuntimeError as exc:
            log.error("rank %d lost rank 0: %s", comm.rank, exc)
            return EXIT_RANK_LOST
        if command == Command.STOP:
            return 0
        if command == Command.RESET:
            runner.reset()
        elif command == Command.PLAN:
            result = runner.execute(pb.BatchPlan.FromString(payload))
            if result.error_code == pb.STEP_ERROR_CODE_INTERNAL:
                log.error("rank %d: %s", comm.rank, result.error_message)
                return EXIT_RANK_LOST
