"""Overload is refused at Submit, from measured throughput, before anyone waits.

A request that cannot start within its tier's queue-time bound is refused at once
(QueueFull -> RESOURCE_EXHAUSTED / HTTP 429 with a retry hint). For a tier-t request:

    ahead = requests waiting in tiers 0..t     (premium counts only premium;
                                                best effort counts all)
    free  = max_num_seqs - running, or 0 while the last admission step left
            requests waiting (the KV pool, slots or prefill budget hold them back)
    wait  = 0                                  if ahead < free
            (ahead - free + 1) / departures_per_s   otherwise

``departures_per_s`` is the smaller of two estimates (core/departures.py): departures
over time measured only while saturated (so an idle spell does not read as a slow
server), and Little's law over finished requests (aborted ones do not count). With
neither (a cold start), running requests' remaining ``max_tokens`` x seconds per step
(``StepPace``) stand in; that is rough (the first steps are cheapest: 0.09 s a step
measured where 0.2 s followed), so until a rate is measured at most one more batch waits
beyond the free slots (``cold_refusal``). Before the first steps there is no estimate:
that batch is admitted *blind* and judged again at the first step that has one
(``rejudge``), not shed at twice its bound.

The estimate counts requests, not their work, so two checks on the queue close the gap:

* **head of line**: refused while the oldest request of its tier or higher has already
  waited past its bound (nobody overtakes the head);
* **shedding**: a request let in that has waited SHED_FACTOR x its bound without
  starting gets the same refusal. Only requests whose client has seen no token are shed.

Lower tiers count everything ahead of them, so they are refused first. The retry hint is
the time until the estimated wait fits the bound again. Bounds: ``max_queue_time_*_s``
(0 disables a tier's); see SchedulerConfig.
"""

from __future__ import annotations

import math

from scheduler_svc.core.block_manager import BlockManager
from scheduler_svc.core.config import SchedulerConfig, queue_time_bound
from scheduler_svc.core.departures import (  # noqa: F401 -- MIN_DEPARTURES: tests' too
    MIN_DEPARTURES,
    ServiceTimes,
    StepPace,
    ThroughputMeter,
    departure_rate,
)
from scheduler_svc.core.queue import WaitingQueue
from scheduler_svc.core.request import Request, RequestStatus
from scheduler_svc.core.running import RunningSet

MAX_RETRY_AFTER_S = 60.0
# A queued request is shed after waiting this many times its tier's bound: the bound
# is what admission promised from an estimate; twice it is a promise broken.
SHED_FACTOR = 2.0
SHED_CHECK_S = 0.25  # how often the queue is scanned for requests to shed


def estimated_wait(ahead: int, free_slots: int, rate: float) -> float:
    """Seconds until a request with ``ahead`` requests before it is admitted."""
    if ahead < free_slots:
        return 0.0
    if rate <= 0:
        return math.inf
    return (ahead - free_slots + 1) / rate


def overload_refusal(tier: int, bound_s: float, ahead: int, free_slots: int,
                     rate: float | None) -> tuple[str, float] | None:
    """(message, retry-after seconds) when a tier-``tier`` request would wait longer
    than ``bound_s``; None to accept (also with no bound or no measurement yet)."""
    if bound_s <= 0 or rate is None:
        return None
    wait = estimated_wait(ahead, free_slots, rate)
    if wait <= bound_s:
        return None
    retry = MAX_RETRY_AFTER_S if math.isinf(wait) else min(MAX_RETRY_AFTER_S,
                                                             max(1.0, wait - bound_s))
    shown = "an unbounded time" if math.isinf(wait) else f"about {wait:.1f} s"
    message = (f"the server is overloaded: this request would wait {shown} in the queue "
               f"(the limit for its priority tier {tier} is {bound_s:g} s, "
               f"{ahead} requests are ahead of it); retry in {retry:.0f} s")
    return message, retry


def cold_refusal(tier: int, ahead: int, free_slots: int, max_num_seqs: int
                 ) -> tuple[str, float] | None:
    """(message, retry-after seconds) when, with no measured departure rate, a
    tier-``tier`` request would wait behind a full batch beyond the free slots (a
    bounded tier only: with its bound off, the count caps alone apply)."""
    if ahead - free_slots < max_num_seqs:
        return None
    return (f"the server is overloaded: a full batch of {max_num_seqs} requests already "
            f"waits beyond the running ones (priority tier {tier}) and it has not yet "
            "measured how fast they drain; retry in 1 s"), 1.0


def head_of_line_refusal(tier: int, bound_s: float, head_waited_s: float | None
                         ) -> tuple[str, float] | None:
    """(message, retry-after seconds) when the longest-waiting request of tiers
    0..``tier`` has already waited past ``bound_s``; None to accept."""
    if bound_s <= 0 or head_waited_s is None or head_waited_s <= bound_s:
        return None
    retry = min(MAX_RETRY_AFTER_S, max(1.0, bound_s))
    return (f"the server is overloaded: the queue for priority tier {tier} is not moving "
            f"(its oldest request has waited {head_waited_s:.1f} s, the limit is "
            f"{bound_s:g} s); retry in {retry:.0f} s"), retry


def shed_message(tier: int, waited_s: float, bound_s: float) -> tuple[str, float]:
    """(message, retry-after seconds) for a queued request shed after ``waited_s``."""
    retry = min(MAX_RETRY_AFTER_S, max(1.0, bound_s))
    return (f"the server is overloaded: this request waited {waited_s:.1f} s in the queue "
            f"without starting (the limit for its priority tier {tier} is {bound_s:g} s); "
            f"retry in {retry:.0f} s"), retry


# How an over-context refusal begins: OpenAI's words, which tools match to detect it.
CONTEXT_EXCEEDED = "This model's maximum context length is"

class QueueFull(Exception):
    """Submit refused: a queue cap is reached. Retry after ``retry_after_s``."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class Admission:
    """Who may join the queue, and who is shed from it: the count caps, the refusals
    above (from ``throughput`` and ``service``, which it measures), the requests that
    can never be served, and the blocks admission keeps free (the watermark)."""

    def __init__(self, config: SchedulerConfig, waiting: WaitingQueue,
                 running: RunningSet) -> None:
        self.config = config
        self._waiting = waiting
        self._running = running
        self.throughput = ThroughputMeter()  # departures/s while saturated
        self.service = ServiceTimes()  # how long finished requests ran
        self.pace = StepPace()  # seconds per step, for the cold-start estimate
        self.num_blind = 0  # requests admitted with no estimate, not yet judged again
        self.num_shed = 0  # queued requests ended for waiting past their bound
        self._next_shed_check = 0.0
        self.now = 0.0  # the clock at the last admission step (step-granular timestamps)
        # The last admission step left requests waiting (for a slot, KV blocks or the
        # step's token budget): only then do queued requests wait for departures.
        self.blocked = False
        # When the current executor attached (Scheduler.attach_executor): queue waits for
        # shedding and the head-of-line check count from here, not through an outage.
        self.serving_since: float | None = 0.0

    def check_caps(self, req: Request) -> None:
        """Raises QueueFull when the queue, or ``req``'s tenant's share of it, is full."""
        cfg, waiting = self.config, self._waiting
        if len(waiting) >= cfg.max_num_waiting:
            raise QueueFull(f"the queue is full ({cfg.max_num_waiting} requests waiting)",
                            self.retry_after())
        cap = cfg.max_num_waiting_per_tenant
        if cap and waiting.num_waiting(req.tenant) >= cap:
            raise QueueFull(f"tenant {req.tenant!r} has {cap} requests waiting, its cap",
                            self.retry_after())

    def refuse_overload(self, req: Request, num_finished: int) -> None:
        """Raises QueueFull when ``req`` (its arrival time set) would wait past its
        tier's bound, by the throughput measured so far. Also prunes idle tenants'
        fairness counters, amortized over Submits."""
        cfg, waiting, running = self.config, self._waiting, self._running
        # While the last admission step left requests waiting for room, free slots are
        # not what holds them back (the KV pool is): a new request waits for departures
        # like the rest. Otherwise what waits starts at the next step, slots allowing.
        held = bool(waiting) and self.blocked
        free = 0 if held else cfg.max_num_seqs - len(running)
        self.throughput.sample(req.arrival_time, num_finished, held or free <= 0)
        tier = req.priority_tier
        bound = queue_time_bound(cfg, tier)
        rate = self.rate()
        ahead = waiting.num_waiting_up_to(tier)
        refusal = overload_refusal(tier, bound, ahead, free, rate)
        if refusal is None and bound > 0 and self.cold:
            refusal = cold_refusal(tier, ahead, free, cfg.max_num_seqs)
        if refusal is None and bound > 0 and waiting:
            oldest = waiting.oldest_arrival_up_to(tier)
            waited = None if oldest is None else \
                req.arrival_time - max(oldest, self.serving_since or 0.0)
            refusal = head_of_line_refusal(tier, bound, waited)
        if refusal is not None:
            raise QueueFull(*refusal)
        if rate is None and bound > 0:
            self.num_blind += 1
        if len(waiting.served) > 2 * (waiting.num_tenants + len(running.per_tenant)) + 64:
            waiting.prune(running.per_tenant)

    @property
    def cold(self) -> bool:
        """No departure rate measured yet (the running budgets stand in, if anything)."""
        return departure_rate(self.throughput.rate, self.service.rate()) is None

    def rate(self) -> float | None:
        """Departures per second: measured, or cold, from the running budgets."""
        rate = departure_rate(self.throughput.rate, self.service.rate())
        return self.pace.rate(self._running.order) if rate is None else rate

    def rejudge(self) -> list[Request]:
        """Once an estimate exists, the blind admissions it would have refused, each
        given that refusal (the caller ends them): fresh waiting requests in the order
        admission counts them (tier, then arrival), each judged with those ahead."""
        rate = self.rate() if self.num_blind else None
        if rate is None:
            return []
        self.num_blind = 0
        cfg = self.config
        free = max(0, cfg.max_num_seqs - len(self._running))
        fresh = sorted((r for r in self._waiting if r.status == RequestStatus.WAITING
                        and not r.num_preemptions and not r.num_resumed_output_tokens),
                       key=lambda r: (r.priority_tier, r.arrival_time))
        refused = []
        for ahead, req in enumerate(fresh):
            bound = queue_time_bound(cfg, req.priority_tier)
            refusal = overload_refusal(req.priority_tier, bound, ahead - len(refused), free,
                                       rate)
            if refusal is None and bound > 0 and self.cold:
                refusal = cold_refusal(req.priority_tier, ahead - len(refused), free,
                                       cfg.max_num_seqs)
            if refusal is not None:
                req.error, req.retry_after_s = refusal
                refused.append(req)
        self.num_shed += len(refused)
        return refused

    def overdue(self, now: float) -> list[Request]:
        """Queued requests that waited SHED_FACTOR x their tier's bound without starting,
        each given its refusal and retry hint (the caller ends them); scanned at most
        every SHED_CHECK_S, when admission runs."""
        if self.serving_since is None:  # the first admission step of a new executor
            self.serving_since = now
        self.pace.tick(now, len(self._running))
        if not self._waiting or now < self._next_shed_check:
            return []
        self._next_shed_check = now + SHED_CHECK_S
        cfg = self.config
        # Waits count from when the current executor started serving: requests queued
        # through an executor restart wait for it, not for the load (they are not shed).
        since = self.serving_since
        shed = self._waiting.overdue(now, lambda t: SHED_FACTOR * queue_time_bound(cfg, t),
                                     since)
        for req in shed:
            req.error, req.retry_after_s = shed_message(
                req.priority_tier, now - max(req.arrival_time, since),
                queue_time_bound(cfg, req.priority_tier))
        self.num_shed += len(shed)
        return shed

    def retry_after(self) -> float:
        # About one queue-turn: the queue drains max_num_seqs at a time.
        return min(30.0, 1.0 + len(self._waiting) / self.config.max_num_seqs)

    def problem(self, bm: BlockManager, max_model_len: int, num_prompt_tokens: int,
                max_tokens: int) -> str | None:
        """Why a request can never be served by the executor of ``bm``, or None."""
        total = num_prompt_tokens + max_tokens
        if total > max_model_len:
            return (f"{CONTEXT_EXCEEDED} {max_model_len} tokens. However, you requested "
                    f"{total} tokens ({num_prompt_tokens} in the prompt, {max_tokens} for the "
                    "completion). Please reduce the length of the prompt or of max_tokens.")
        usable = bm.num_blocks - self.watermark_blocks(bm)
        need = bm.blocks_needed(num_prompt_tokens)
        if need > usable:
            return (f"the prompt needs {need} KV blocks but the pool has {usable} usable; "
                    "shorten the prompt or give the executor more KV memory")
        return None

    def watermark_blocks(self, bm: BlockManager) -> int:
        return int(self.config.watermark * bm.num_blocks)

    def finished(self, req: Request) -> None:
        """``req`` was served to its end (not aborted): its service time counts."""
        if req.first_scheduled_time is not None:
            self.service.add(self.now - req.first_scheduled_time, len(self._running) + 1)
