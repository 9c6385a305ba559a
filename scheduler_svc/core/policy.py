"""Scheduling policies: what differs between them, behind one interface and one registry.

Each step a policy answers: the prompt tokens one sequence may compute (``prefill_cap``)
and the step may carry (``prompt_bounds``), whether new requests may join
(``admission_open``), which request of a waiting lane goes first (``pick``) and which
running sequence is preempted first (``victim_key``). ``Policy`` is the default (the
queue's order, core/queue.py; the victim order of core/preemption.py); a policy
overrides only what it changes. ``POLICIES`` is the one registry (config, CLI,
simulator, benchmarks read it). It reads the config through ``Limits``: core/config.py
imports this module for the registry.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import ClassVar, Protocol

from scheduler_svc.core import step_cost
from scheduler_svc.core.preemption import victim_key
from scheduler_svc.core.request import Request, RequestStatus


class Limits(Protocol):
    """What a policy reads of the SchedulerConfig (core/config.py documents the fields)."""

    max_num_batched_tokens: int
    chunk_size: int
    long_prefill_token_threshold: int
    max_prefill_tokens_per_step: int

    def tpot_targets(self) -> tuple[float, ...]: ...


class Policy:
    """The default answers (continuous batching with chunked prefill). A policy object
    lives as long as its config's policy name: ``configure`` gives it a new config
    between steps, and what it learned (the SLO policy's TTFT tail) stays."""

    name: ClassVar[str] = ""
    summary: ClassVar[str] = ""  # one line for --policy's help and the docs
    # The simulator and the benchmarks give such a policy a TPOT target for every tier.
    uses_tpot_targets: ClassVar[bool] = False

    def __init__(self, config: Limits) -> None:
        self.configure(config)

    @classmethod
    def for_config(cls, config: Limits) -> type[Policy]:
        """The class that serves ``config`` under this policy's name."""
        return cls

    def configure(self, config: Limits) -> None:
        self.config = config
        self.cap = self._cap(config)

    def _cap(self, config: Limits) -> int:
        cap = config.chunk_size
        if config.long_prefill_token_threshold:
            cap = min(cap, config.long_prefill_token_threshold)
        return cap

    def prefill_cap(self) -> int:
        """The most prompt tokens one sequence computes in a step."""
        return self.cap

    def prompt_bounds(self, budget: int, decodes: int, prefills: list[Request],
                      fit: step_cost.StepCost, per_tier, block_manager, waiting,
                      clock: Callable[[], float]) -> tuple[int, int]:
        """(tokens of ``budget`` held back from prompts, the per-sequence prompt cap) for
        a step with ``decodes`` decodes planned and ``prefills`` running unfinished
        prompts; ``fit`` is the online step-time fit, ``per_tier`` the running count by
        tier, ``waiting`` the queue, ``clock`` read only by a policy that needs the time.
        The default: the prefill clamp (``max_prefill_tokens_per_step``) and the cap."""
        clamp = self.config.max_prefill_tokens_per_step
        return (budget - clamp if 0 < clamp < budget else 0), self.cap

    def step_planned(self, rec, clock: Callable[[], float]) -> None:
        """The step ``rec`` (a StepRecord) is complete: what the policy learns from it."""

    def admission_open(self, num_running_at_start: int) -> bool:
        return True

    def pick(self, lane: collections.deque[Request], now: float, aging_s: float) -> Request:
        """The request of ``lane`` (one tier's waiting requests of one tenant, preempted
        ones first, then fresh ones by arrival) that goes when the queue's order ranks
        the lane first (by its head). The default: the head."""
        return lane[0]

    victim_key = staticmethod(victim_key)  # larger is preempted first


class ChunkedPolicy(Policy):
    name = "chunked"
    summary = ("continuous batching, long prompts prefill in chunks beside the decodes "
               "(the default; with a --tpot-target-*: chunked-slo)")

    @classmethod
    def for_config(cls, config: Limits) -> type[Policy]:
        # A TPOT target on "chunked" keeps meaning the SLO-aware budget.
        if cls is ChunkedPolicy and any(config.tpot_targets()):
            return ChunkedSloPolicy
        return cls


class ChunkedSloPolicy(ChunkedPolicy):
    """Chunked, with the SLO-aware budget (core/step_cost.py): with a TPOT target set for
    a tier that has running sequences, the step's prompt tokens are sized from the online
    step-time fit to hold the tightest such target, and no fixed chunk caps one prompt;
    ``ttft_guard`` rations whole-budget steps to prompts waiting into the TTFT tail.
    Without any target it is the chunked policy."""

    name = "chunked-slo"
    summary = "chunked, each step's prompt work sized to hold the --tpot-target-* (ms)"
    uses_tpot_targets = True

    def __init__(self, config: Limits) -> None:
        self.ttft_guard = step_cost.TtftGuard()
        super().__init__(config)

    def configure(self, config: Limits) -> None:
        super().configure(config)
        targets = config.tpot_targets()
        self.targets = targets if any(targets) else ()

    def prompt_bounds(self, budget: int, decodes: int, prefills: list[Request],
                      fit: step_cost.StepCost, per_tier, block_manager, waiting,
                      clock: Callable[[], float]) -> tuple[int, int]:
        targets = self.targets
        if not targets:
            return super().prompt_bounds(budget, decodes, prefills, fit, per_tier,
                                         block_manager, waiting, clock)
        boost = self.ttft_guard.boost(step_cost.oldest_wait_s(waiting, prefills, clock()))
        return step_cost.prompt_bounds(fit, targets, per_tier, decodes, block_manager,
                                       budget, self.config.max_prefill_tokens_per_step,
                                       self.cap, boost)

    def step_planned(self, rec, clock: Callable[[], float]) -> None:
        if self.targets:
            self.ttft_guard.note_prompts_done(rec, clock())


class ContinuousPolicy(Policy):
    name = "continuous"
    summary = "continuous batching, a prompt takes as much of the step's budget as it needs"

    def _cap(self, config: Limits) -> int:
        return config.max_num_batched_tokens


class StaticPolicy(ContinuousPolicy):
    name = "static"
    summary = "static batching: a batch is admitted only when the previous one has finished"

    def admission_open(self, num_running_at_start: int) -> bool:
        return num_running_at_start == 0


class ShortestFirstPolicy(ChunkedPolicy):
    """Chunked, and within a lane the shortest remaining prompt goes first (ties by
    arrival). The lane's place among the others is still its head's, and a preempted
    head or one that has waited into starvation (core/queue.py: (tier + 1) × aging_s)
    goes first as ever; every request older than a starving one is starving too, so
    the queue's bound on waiting holds: nothing starves behind a stream of short ones."""

    name = "sjf"
    summary = "chunked, shortest remaining prompt first within a tier (aging still bounds waits)"

    def pick(self, lane: collections.deque[Request], now: float, aging_s: float) -> Request:
        head = lane[0]
        if head.status != RequestStatus.WAITING or head.num_preemptions or \
                now - head.arrival_time >= (head.priority_tier + 1) * aging_s:
            return head
        return min(lane, key=_remaining_prompt)  # the first of equals: the earliest


def _remaining_prompt(req: Request) -> int:
    return len(req.token_ids) - req.num_computed_tokens


POLICIES: dict[str, type[Policy]] = {cls.name: cls for cls in (
    StaticPolicy, ContinuousPolicy, ChunkedPolicy, ChunkedSloPolicy, ShortestFirstPolicy)}


def make_policy(config, previous: Policy | None = None) -> Policy:
    """The policy ``config`` names; ``previous`` (the one in use) is kept, given the new
    config, when it is of the same class."""
    cls = POLICIES[config.policy].for_config(config)
    if type(previous) is cls:
        previous.configure(config)
        return previous
    return cls(config)
