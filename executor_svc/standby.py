"""``python -m executor_svc --standby``: a warm standby executor.

It loads and warms up like any executor, then says a Hello marked ``standby``: the
scheduler keeps it aside (scheduler_svc/link.py) until it loses its executor, then sends
it the next plan, which resumes every sequence by recompute. Idle, it blocks in a poll
(no CPU); it costs about one more executor's resident memory (weights and KV pool are
its own, only the page cache is shared).
"""

from __future__ import annotations

import logging

import torch

from executor_svc.runner import Runner
from protos.continuum.v1 import executor_pb2 as pb

log = logging.getLogger("executor.standby")


class StandbyRunner:
    """A standby's Runner: loaded on one thread (its load must not take the cores of the
    executor in service); the first plan it gets means it is in service now, so from
    then on it steps with every thread an executor would have."""

    def __init__(self, runner: Runner, serving_threads: int) -> None:
        self.runner, self._threads = runner, serving_threads

    def execute(self, plan: pb.BatchPlan) -> pb.StepResult:
        if self._threads:
            log.info("in service: %d threads", self._threads)
            torch.set_num_threads(self._threads)
            self._threads = 0
        return self.runner.execute(plan)

    def __getattr__(self, name: str):  # reset, seqs, last_step_id: the runner's
        return getattr(self.runner, name)
