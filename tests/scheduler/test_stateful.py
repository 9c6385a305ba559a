"""Property-based (stateful) test of the scheduler core against the contract of docs/design.md §2–3.

A hypothesis state machine drives random arrivals (three priority tiers, four tenants, a shared
"system prompt" prefix, EOS / ignore_eos / min_tokens), steps, cancellations (also racing a
step), executor restarts (also racing a step), refused plans (``resync``) and virtual time, on
small KV pools with and without a host pool, so that recompute and swap preemption, prefix-cache
eviction and aging all happen.

Three independent oracles watch it:

* a stand-in **executor** that keeps its own block tables from the plans' deltas and a model of
  the KV memory (what each device / host slot holds: a hash of the token prefix ending at that
  position). It checks that every sequence it computes reads exactly the context it should from
  its block table (shared prefix blocks, swapped-in blocks and recomputed ones included), and it
  samples a token that is a pure function of (request, position), EOS at a planned position;
* the **client's view**: every event is recorded; at the end each request's delivered tokens are
  ``token_ids[num_prompt_tokens:]``, equal to what an uninterrupted run would produce, with
  exactly one finishing event;
* per-step **contract checks**: budgets and chunk caps, decode-first, no partial resume,
  victim choice and protection (``pick_victim`` is wrapped while a machine runs), no admission
  in a step that preempts, resumed before fresh, aging order and the wait bound of queue.py.

The plain tests at the end pin the two bugs the machine found in the core (a resync that
trusted what a refused plan never wrote; a requeued context larger than the usable pool that
blocked the queue forever).
"""

from __future__ import annotations

import dataclasses
import os
import sys

import hypothesis.strategies as st
from hypothesis import HealthCheck, settings
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from scheduler_svc.core import (
    CostModel,
    Event,
    FinishReason,
    QueueFull,
    Request,
    RequestStatus,
    Scheduler,
    SchedulerConfig,
    SchedulerOutput,
)
from scheduler_svc.core import preemption as preemption_module
from scheduler_svc.core.config import queue_time_bound
from scheduler_svc.core.policy import POLICIES, make_policy
from scheduler_svc.core.preemption import priority_key, victim_key
from tests.scheduler.factories import (
    EOS,
    Clock,
    fake_execute,
    make_model,
    make_request,
    make_scheduler,
    run_to_completion,
    step,
)

BLOCK_SIZE = 4
TENANTS = ("acme", "blue", "cyan", "dune")
SYSTEM_PROMPT = [3 + (7 * i) % 90 for i in range(3 * BLOCK_SIZE)]  # three full blocks
SWAP_COST = CostModel(prefill_tokens_per_s=10.0, swap_bytes_per_s=1e9, block_bytes=1000)
STEP_DT = 1.0  # virtual seconds per step
MAX_DRAIN_STEPS = 3000


def sampled_token(num: int, pos: int, eos_pos: int | None) -> int:
    """The stand-in executor's sample: a pure function of (request, position), like seeded
    sampling, so recompute and swap resumes must reproduce an uninterrupted run exactly."""
    if pos == eos_pos:
        return EOS
    return 100 + (num * 7919 + pos * 104729) % 800


@dataclasses.dataclass
class Track:
    """What the test knows about one request, independently of the scheduler."""

    req: Request
    num: int
    eos_pos: int | None  # absolute position of the planned EOS sample, if any
    delivered: list[int] = dataclasses.field(default_factory=list)
    finish_events: list[FinishReason] = dataclasses.field(default_factory=list)
    pool_length_finish: bool = False
    chain: list[int] = dataclasses.field(default_factory=list)  # prefix hashes
    # preemption bookkeeping
    seen_preemptions: int = 0
    preempt_times: list[float] = dataclasses.field(default_factory=list)
    expect_protected: bool = False
    forced: int = 0  # preempted by pick_victim while already protected
    lifecycle: int = 0  # preempted by an executor restart or a resync
    # aging bookkeeping (fresh requests only)
    starved_seen: bool = False
    slack_s: float = 0.0
    slack_from: float | None = None

    def prefix_hash(self, pos: int) -> int:
        tokens, chain = self.req.token_ids, self.chain
        while len(chain) <= pos:
            i = len(chain)
            chain.append(hash((chain[-1] if chain else 0, tokens[i])))
        return chain[pos]

    def expected_output(self) -> list[int]:
        """The full output of an uninterrupted run (what a STOP/LENGTH finish must deliver)."""
        req = self.req
        limit = req.num_prompt_tokens + req.max_tokens  # max_model_len (512) is never lower
        out: list[int] = []
        pos = req.num_prompt_tokens
        while True:
            tok = sampled_token(self.num, pos, self.eos_pos)
            out.append(tok)
            pos += 1
            if tok == EOS and not req.ignore_eos and len(out) >= req.min_tokens:
                return out
            if pos >= limit:
                return out


def _num_priority_preemptions(sched) -> int:
    return sum(n for k, n in sched.preemptions_by_reason.items() if k.startswith("priority:"))


class VictimSpy:
    """Wraps the scheduler's ``pick_victim`` while a machine runs and checks each choice
    against docs/design.md §3 as refined in core/preemption.py: among the needy sequence and the
    running ones not yet scheduled this step, the lowest tier, then one whose client has
    seen no token, then the most recently admitted; never a protected one while another
    candidate is not."""

    def __init__(self) -> None:
        real = preemption_module.pick_victim
        self.real = real.real if isinstance(real, VictimSpy) else real
        self.forced: list[Request] = []  # protected victims (every candidate was)

    def __call__(self, running: list[Request], needy: Request, step: int,
                 key=victim_key) -> Request:
        assert needy in running and running == sorted(running, key=priority_key)
        assert key is victim_key, "every registered policy keeps the default victim order"
        victim = self.real(running, needy, step, key)
        candidates = [r for r in running if r.scheduled_step != step and r is not needy]
        candidates.append(needy)
        assert victim in candidates, "the victim was already scheduled this step"
        if victim.protected:
            assert all(r.protected for r in candidates), "a protected victim, with a choice"
            self.forced.append(victim)
        lower = [r for r in candidates if r.protected == victim.protected
                 and victim_key(r) > victim_key(victim)]
        assert not lower, f"victim {victim.request_id} outranks {lower[0].request_id}"
        return victim

    def __enter__(self) -> VictimSpy:
        preemption_module.pick_victim = self
        return self

    def __exit__(self, *exc) -> None:
        preemption_module.pick_victim = self.real


class SchedulerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.sched: Scheduler | None = None
        self.tracks: dict[str, Track] = {}
        self.num = 0
        self.total_cache_hits = 0
        self.stats: dict[str, int] = dict.fromkeys(
            ("steps", "preempt_swap", "preempt_recompute", "forced", "restarts", "resyncs",
             "race_aborts", "queue_full", "pool_length", "aging_checked"), 0)

    # -- setup ---------------------------------------------------------------------------

    @initialize(
        num_blocks=st.sampled_from([12, 16, 20, 24, 32, 40]),
        host=st.sampled_from([0, 16, 64]),
        swap_cost=st.sampled_from([True, True, False]),
        policy=st.sampled_from(["chunked", "chunked", *POLICIES]),  # every registered one
        max_num_seqs=st.integers(2, 8),
        budget=st.integers(8, 64),
        chunk=st.integers(4, 64),
        long_prefill=st.sampled_from([0, 0, 6]),
        watermark=st.sampled_from([0.0, 0.0, 0.1]),
        aging_s=st.sampled_from([3.0, 8.0]),
        max_preemptions=st.integers(1, 3),
        window=st.sampled_from([1e9, 1e9, 6.0]),
        caching=st.sampled_from([True, True, True, False]),
        max_num_waiting=st.sampled_from([12, 64]),
        per_tenant=st.sampled_from([0, 0, 6]),
        drain=st.sampled_from(["run", "run", "abort"]),
        stale_samples=st.booleans(),
        kv_window=st.sampled_from([0, 0, 0, 7, 12]),
    )
    def setup(self, num_blocks, host, swap_cost, policy, max_num_seqs, budget, chunk,
              long_prefill, watermark, aging_s, max_preemptions, window, caching,
              max_num_waiting, per_tenant, drain, stale_samples=False, kv_window=0):
        budget = max(budget, max_num_seqs)
        self.config = SchedulerConfig(
            policy=policy, max_num_batched_tokens=budget, max_num_seqs=max_num_seqs,
            chunk_size=min(chunk, budget), long_prefill_token_threshold=long_prefill,
            max_num_waiting=max_num_waiting, max_num_waiting_per_tenant=per_tenant,
            watermark=watermark, aging_s=aging_s, max_preemptions=max_preemptions,
            preemption_window_s=window, enable_prefix_caching=caching,
        )
        # kv_window: every layer of the model attends to that many trailing positions,
        # so the scheduler releases blocks behind them (the KV model reads only those).
        self.kv_window = kv_window
        self.model = make_model(num_blocks, BLOCK_SIZE, num_host_blocks=host,
                                cost=SWAP_COST if swap_cost else CostModel(),
                                kv_window=kv_window)
        self.cap = make_policy(self.config).prefill_cap()
        self.clock = Clock(0.0)
        self.drain = drain
        self.stale_samples = stale_samples  # the executor also returns samples nobody asked for
        self.sched = Scheduler(self.config, clock=self.clock)
        self.spy = VictimSpy().__enter__()  # left in teardown
        self._attach()

    def _attach(self) -> None:
        """A new executor incarnation: empty KV memory and no sequence state."""
        if self.sched.block_manager is not None:
            self.total_cache_hits += self.sched.block_manager.num_cache_hits
        self.sched.attach_executor(self.model)
        self.exec_tables: dict[int, list[int]] = {}
        self.kv: dict[int, list[int | None]] = {}
        self.host_kv: dict[int, list[int | None]] = {}

    # -- helpers -------------------------------------------------------------------------

    def live(self) -> list[str]:
        return sorted(self.sched.requests)

    def _event(self, event) -> None:
        req, token, reason, _ = event
        tr = self.tracks[req.request_id]
        assert not tr.finish_events, f"{req.request_id}: an event after its finish"
        if token is not None:
            pos = req.num_prompt_tokens + len(tr.delivered)
            assert token == sampled_token(tr.num, pos, tr.eos_pos), (
                f"{req.request_id}: token at position {pos} lost, duplicated or resampled")
            assert req.token_ids[pos] == token
            tr.delivered.append(token)
        if reason is not None:
            assert req.is_finished and req.finish_reason == reason
            tr.finish_events.append(reason)
            if reason == FinishReason.LENGTH and token is None:
                # The "alone and the pool is full" finish: the pool is its context limit.
                tr.pool_length_finish = True
                self.stats["pool_length"] += 1
                assert req.num_tokens == self.model.num_blocks * BLOCK_SIZE + 1
        else:
            assert not req.is_finished

    def _sync_preemptions(self, cause: str) -> list[Track]:
        """Notices preemptions since the last call; checks when protection sets in."""
        preempted = []
        now = self.clock.now
        cfg = self.config
        for rid in self.live():
            tr = self.tracks[rid]
            n = tr.req.num_preemptions
            if n == tr.seen_preemptions:
                continue
            assert n == tr.seen_preemptions + 1, f"{rid} preempted twice in one {cause}"
            tr.seen_preemptions = n
            if cause == "step" and tr.expect_protected:
                tr.forced += 1
                self.stats["forced"] += 1
            elif cause != "step":
                tr.lifecycle += 1
            tr.preempt_times = [t for t in tr.preempt_times
                                if now - t < cfg.preemption_window_s] + [now]
            if len(tr.preempt_times) >= cfg.max_preemptions:
                tr.expect_protected = True
            preempted.append(tr)
        for rid in self.live():
            tr = self.tracks[rid]
            assert tr.req.protected == tr.expect_protected, f"{rid}: protection is wrong"
            if cfg.preemption_window_s > 1e6:
                # The bound that holds. No constant slack over max_preemptions does: once
                # protected, a sequence is preempted again whenever every candidate is
                # protected too (max_preemptions=1 and one restart protect every running
                # sequence at once), and that recurs while the others grow (hypothesis finds
                # two such forced preemptions of one sequence). So: with an unbounded window,
                # at most max_preemptions by choice; every further one either forced with
                # every candidate protected (VictimSpy checks each) or an executor restart /
                # resync, which preempt every running sequence.
                assert tr.req.num_preemptions - tr.forced - tr.lifecycle <= cfg.max_preemptions
        return preempted

    def _starving(self, req: Request, now: float) -> bool:
        return now - req.arrival_time >= (req.priority_tier + 1) * self.config.aging_s

    # -- arrivals, cancellations, time ---------------------------------------------------

    @rule(burst=st.lists(
        st.tuples(
            st.integers(1, 80),  # prompt length
            st.integers(1, 20),  # max_tokens
            st.sampled_from([0, 1, 1, 2]),  # priority tier
            st.sampled_from(TENANTS),
            st.booleans(),  # starts with the shared system prompt
            st.sampled_from([False, False, False, True]),  # ignore_eos
            st.sampled_from([0, 0, 0, 3]),  # min_tokens
            st.one_of(st.none(), st.integers(0, 19)),  # output index of a planned EOS
        ), min_size=1, max_size=4))
    def arrive(self, burst):
        for args in burst:
            self._arrive(*args)

    def _arrive(self, prompt_len, max_tokens, tier, tenant, shared, ignore_eos, min_tokens,
                eos_at):
        sched = self.sched
        usable = self.model.num_blocks - int(self.config.watermark * self.model.num_blocks)
        prompt_len = min(prompt_len, usable * BLOCK_SIZE)
        if sched.admission_problem(prompt_len, max_tokens) is not None:
            return
        self.num += 1
        num = self.num
        if shared and prompt_len > len(SYSTEM_PROMPT):
            suffix = [200 + (num * 31 + i) % 700 for i in range(prompt_len - len(SYSTEM_PROMPT))]
            prompt = SYSTEM_PROMPT + suffix
        else:
            prompt = [5 + (num * 13 + i * 3) % 90 for i in range(prompt_len)]
        req = make_request(prompt_len, max_tokens, request_id=f"q{num}", tenant=tenant,
                           priority_tier=tier, ignore_eos=ignore_eos, min_tokens=min_tokens)
        req.token_ids[:] = prompt
        eos_pos = None if eos_at is None else prompt_len + eos_at
        waiting_before = len(sched.waiting)
        try:
            sched.add_request(req)
        except QueueFull as exc:
            cap = self.config.max_num_waiting_per_tenant
            # A count cap, or the queue-time bound (core/admission.py), which needs a
            # measured departure rate (or, cold, a measured step time for the running
            # requests' budgets) or a queue head already waiting past the bound.
            bound = queue_time_bound(self.config, req.priority_tier)
            oldest = sched.waiting.oldest_arrival_up_to(req.priority_tier)
            stuck = oldest is not None and self.clock.now - oldest > bound
            admission = sched.admission
            measured = (admission.throughput.rate is not None or admission.service.count > 0
                        or (admission.pace.step_s is not None and len(sched.running) > 0))
            # Nothing measured: one batch beyond the free slots waits, no more.
            cold = admission.cold and "full batch" in str(exc) and bound > 0
            overloaded = (measured or stuck or cold) and "overloaded" in str(exc)
            assert overloaded or waiting_before >= self.config.max_num_waiting or (
                cap and sched.waiting.num_waiting(tenant) >= cap)
            self.stats["queue_full"] += 1
            return
        assert req.arrival_time == self.clock.now
        self.tracks[req.request_id] = Track(req, num, eos_pos)

    @precondition(lambda self: self.sched is not None and self.tracks)
    @rule(data=st.data(), what=st.sampled_from([None, None, "one", "again"]))
    def cancel(self, data, what):
        """A client cancels; cancelling again, or a finished request, is a no-op."""
        done = sorted(r for r, t in self.tracks.items() if t.finish_events)
        if what is None:
            return
        if what == "again" and done:
            assert self.sched.abort(data.draw(st.sampled_from(done))) is None
            assert self.sched.abort("never-submitted") is None
        elif self.sched.requests:
            self._abort(data.draw(st.sampled_from(self.live())))

    def _abort(self, rid: str) -> None:
        event = self.sched.abort(rid)
        assert event is not None and event[2] == FinishReason.ABORT
        self._event(event)
        assert self.sched.abort(rid) is None  # idempotent
        self.sched.assert_invariants()

    # -- steps ---------------------------------------------------------------------------

    @rule(n=st.integers(1, 6), idle=st.sampled_from([0.0] * 4 + [0.5, 2.0, 6.0]),
          incident=st.sampled_from(
              [None] * 12 + ["racing_cancel", "restart", "racing_restart", "refused_plan"]),
          data=st.data())
    def steps(self, n, idle, incident, data):
        """``idle`` virtual seconds pass, then ``n`` steps; the last may meet an incident:

        * racing_cancel: a cancel between schedule() and update() is still an abort;
        * restart: an SRE restarts the executor between steps;
        * racing_restart: ... or while a step runs (its result never comes); the new
          incarnation recomputes every running sequence;
        * refused_plan: the executor refuses a plan (it changes nothing); the scheduler resyncs.
        """
        self.clock.now += idle
        for _ in range(n - 1):
            self._step()
        if incident == "racing_cancel":
            self._step(race=data)
        elif incident == "restart":
            self.stats["restarts"] += 1
            self._attach()
            self._after_lifecycle("restart")
        elif incident == "racing_restart":
            self.stats["restarts"] += 1
            self._step(outcome="restart")
        elif incident == "refused_plan":
            self.stats["resyncs"] += 1
            self._step(outcome="refused")
        else:
            self._step()

    def _after_lifecycle(self, cause: str) -> None:
        """After a restart or a resync every sequence waits to be recomputed in full."""
        sched = self.sched
        sched.assert_invariants()
        assert not sched.running
        assert all(r.status == RequestStatus.WAITING and r.num_computed_tokens == 0
                   for r in sched.waiting)
        assert sched.block_manager.num_free_host_blocks == sched.block_manager.num_host_blocks
        self._sync_preemptions(cause)

    def _step(self, race=None, outcome: str = "ok") -> SchedulerOutput:
        sched, cfg = self.sched, self.config
        self.clock.now += STEP_DT
        now = self.clock.now
        self.stats["steps"] += 1

        # -- before: what the contract promises about this step
        running_before = list(sched.running)
        remaining_before = {r.seq_id: r.num_tokens - r.num_computed_tokens
                            for r in running_before}
        protected_before = {r.request_id: r.protected for r in sched.requests.values()}
        preemptions_before = sched.num_preemptions
        priority_before = _num_priority_preemptions(sched)
        waiting_before = list(sched.waiting)
        fresh_waiting = [r for r in waiting_before if r.first_scheduled_time is None]
        starving = [r for r in waiting_before if self._starving(r, now)]
        head = None  # the oldest starving request, if it is fresh and strictly the oldest
        if starving:
            oldest = min(starving, key=lambda r: r.arrival_time)
            if oldest.first_scheduled_time is None and sum(
                    r.arrival_time <= oldest.arrival_time for r in starving) == 1:
                head = oldest

        num_forced = len(self.spy.forced)
        out = sched.schedule()
        bm = sched.block_manager
        # What the plan carries for new sequences, as built before anything else happens.
        new_tables = {r.seq_id: list(bm.block_table(r.seq_id)) for r, _ in out.new}
        for r, _ in out.new:
            if r.num_preemptions and not self.kv_window:
                # No partial resume: its whole context, or it waits (under a window, it
                # takes its window's blocks as it goes, as a fresh start does).
                assert len(new_tables[r.seq_id]) >= bm.blocks_needed(r.num_tokens)
        sched.assert_invariants(out)
        bm.assert_invariants()
        for event in sched.take_events():
            self._event(event)

        scheduled = {r.seq_id: (n, new) for r, n, new in out.scheduled()}
        assert len(scheduled) == len(out.new) + len(out.cached), "a sequence scheduled twice"
        assert out.num_batched_tokens <= cfg.max_num_batched_tokens
        assert sum(n for n, _ in scheduled.values()) == out.num_batched_tokens
        for r, n, new in out.scheduled():
            assert r.status == RequestStatus.RUNNING
            assert n >= 1 and n <= max(1, self.cap), "a prefill chunk over the policy's cap"
            assert r.num_computed_tokens <= r.num_tokens
            if not new:
                assert r.request_id in {x.request_id for x in running_before}

        # -- decodes first: every decode-ready sequence got its token unless preempted
        for r in running_before:
            if remaining_before[r.seq_id] == 1:
                if r.status == RequestStatus.RUNNING:
                    assert scheduled.get(r.seq_id, (0,))[0] == 1, (
                        f"{r.request_id} was decode-ready and got no token")
                else:
                    assert r.status in (RequestStatus.WAITING, RequestStatus.SWAPPED) or (
                        r.finish_reason == FinishReason.LENGTH)

        # -- preemption: victims, protection, no admission in a step that preempted
        preempted = self._sync_preemptions("step")
        assert len(preempted) == sched.num_preemptions - preemptions_before
        assert {id(tr.req) for tr in preempted if protected_before[tr.req.request_id]} == {
            id(r) for r in self.spy.forced[num_forced:] if not r.is_finished}
        # A better tier waiting for a slot or KV preempts before the step's decodes
        # (core/priority_hold.py) and is then admitted: only KV preemptions close admission.
        num_priority = _num_priority_preemptions(sched) - priority_before
        if len(preempted) > num_priority:
            assert not out.new, "admitted in a step that had to preempt for KV"
        if num_priority and len(preempted) == num_priority:
            assert not any(protected_before[tr.req.request_id] for tr in preempted), (
                "a protected sequence preempted for priority")
            assert min(r.priority_tier for r in waiting_before) < min(
                tr.req.priority_tier for tr in preempted), "preempted for no better tier"
        if preempted:
            for tr in preempted:
                self._check_victim(tr.req, running_before, scheduled, protected_before)
                if tr.req.status == RequestStatus.SWAPPED:
                    self.stats["preempt_swap"] += 1
                else:
                    self.stats["preempt_recompute"] += 1
                    assert tr.req.num_computed_tokens == 0
        if out.swap_out:
            assert preempted

        # -- resumed before fresh: a preempted request keeps its place at the front
        admitted = [r for r, _ in out.new]
        still_waiting = set(id(r) for r in sched.waiting)
        resumed_waiting = {(r.priority_tier, r.tenant) for r in waiting_before
                           if r.num_preemptions and id(r) in still_waiting}
        for x in admitted:
            if not x.num_preemptions:
                assert (x.priority_tier, x.tenant) not in resumed_waiting, (
                    f"fresh {x.request_id} admitted before a preempted request of its queue")

        # -- aging: once starving, only earlier-arrived starving requests go first, and
        # the resumed requests at the front of a queue holding one of those (or w itself):
        # they keep their place ahead of it
        for w in fresh_waiting:
            if id(w) not in still_waiting or not self._starving(w, now):
                continue
            for x in admitted:
                lane = (x.priority_tier, x.tenant)
                ahead_of_starving = x.num_preemptions and any(
                    (f.priority_tier, f.tenant) == lane and self._starving(f, now)
                    and f.arrival_time <= w.arrival_time for f in fresh_waiting)
                assert ahead_of_starving or (self._starving(x, now)
                                             and x.arrival_time <= w.arrival_time), (
                    f"{x.request_id} overtook the starving {w.request_id}")

        def no_capacity(w: Request) -> bool:
            prefill_reserve = sum(
                bm.num_new_blocks(r.seq_id, r.num_tokens) for r in sched.running
                if remaining_before.get(r.seq_id, 1) != 1)
            # Admission keeps free the watermark, or a block for each running decode's
            # next one (a sequence admitted this step counts as a decode), if larger.
            decodes = sum(1 for r in sched.running if remaining_before.get(r.seq_id, 1) == 1)
            keep = max(sched.admission.watermark_blocks(bm), decodes)
            # Blocks it needs without any prefix hit: at least what the scheduler needs.
            need = bm.blocks_needed(w.num_tokens) + keep
            return bool(preempted
                        or not sched.policy.admission_open(len(running_before))
                        or len(sched.running) >= cfg.max_num_seqs
                        or out.num_batched_tokens >= cfg.max_num_batched_tokens
                        or need + prefill_reserve > bm.num_free_blocks)

        if head is not None and id(head) in still_waiting:
            assert no_capacity(head), (
                f"starving head {head.request_id} not admitted though capacity allowed")
        # The bound of queue.py: a fresh request waits at most (tier + 1) × aging_s, plus the
        # time to the first step after it starves, plus the steps in which a request queued
        # before it went first or it was at the head without capacity. Any other step adds
        # nothing to its slack.
        for w in fresh_waiting:
            if not self._starving(w, now):
                continue
            tr = self.tracks[w.request_id]
            starve_at = w.arrival_time + (w.priority_tier + 1) * cfg.aging_s
            if not tr.starved_seen:
                tr.slack_s, tr.starved_seen = max(0.0, now - starve_at), True
            elif tr.slack_from is not None:
                tr.slack_s += now - tr.slack_from
            tr.slack_from = None
            if w.first_scheduled_time is not None:
                self.stats["aging_checked"] += 1
                assert w.first_scheduled_time == now
                waited = now - w.arrival_time
                assert waited <= (w.priority_tier + 1) * cfg.aging_s + tr.slack_s + 1e-9, (
                    f"{w.request_id} waited {waited}s, over the aging bound")
            elif w is not head or no_capacity(w):
                tr.slack_from = now

        # -- the executor
        if race is not None:
            victims = sorted(r.request_id for r, _, _ in out.scheduled() if not r.is_finished)
            if victims:
                self.stats["race_aborts"] += 1
                self._abort(race.draw(st.sampled_from(victims)))
        if outcome == "refused":
            sched.resync()
            self._after_lifecycle("resync")
            return out
        if outcome == "restart":
            self._attach()
            self._after_lifecycle("restart")
            return out
        seq_ids, tokens = self._execute(out, new_tables)
        events = sched.update(out, seq_ids, tokens)
        for event in events:
            self._event(event)
        sched.assert_invariants()
        for r in sched.running:
            assert r.num_tokens - r.num_computed_tokens >= 1
        self._sync_preemptions("update")
        return out

    def _check_victim(self, victim: Request, running_before, scheduled, protected_before):
        """Lowest priority first, never a protected one while another candidate is not.

        A sequence that was running at the start, still runs and got nothing this step was a
        candidate when ``victim`` was chosen (it was unscheduled throughout the step)."""
        was_protected = protected_before[victim.request_id]
        assert victim.status != RequestStatus.RUNNING
        for r in running_before:
            if r is victim or r.status != RequestStatus.RUNNING or r.seq_id in scheduled:
                continue
            if was_protected:
                assert r.protected, (
                    f"protected {victim.request_id} preempted while {r.request_id} was not")
                assert priority_key(victim) > priority_key(r)
            elif not r.protected:
                assert priority_key(victim) > priority_key(r), (
                    f"victim {victim.request_id} outranks candidate {r.request_id}")

    def _execute(self, out, new_tables) -> tuple[list[int], list[int]]:
        """The stand-in executor: applies the plan to its own state and its KV model."""
        bm, bs = self.sched.block_manager, BLOCK_SIZE
        tables = self.exec_tables
        for seq_id in out.finished_seq_ids:
            tables.pop(seq_id, None)
        offset = 0
        for req, num_new in zip(out.cached, out.cached_num_new_blocks, strict=True):
            assert req.seq_id in tables, f"delta for {req.request_id}, unknown to the executor"
            tables[req.seq_id].extend(out.cached_new_block_ids[offset:offset + num_new])
            offset += num_new
        assert offset == len(out.cached_new_block_ids)
        for req, _ in out.new:
            tables[req.seq_id] = list(new_tables[req.seq_id])
        # Block copies before the forward pass.
        copied = {h: list(self.kv.get(d, [None] * bs)) for d, h in out.swap_out}
        self.host_kv.update(copied)
        for h, d in out.swap_in:
            self.kv[d] = list(self.host_kv[h])
        # Forward: every layer writes the step's K/V first, then attends.
        work = []
        written: dict[tuple[int, int], int] = {}
        for req, n, _ in out.scheduled():
            tr = self.tracks[req.request_id]
            table = tables[req.seq_id]
            start = req.num_computed_tokens - n
            for pos in range(start, start + n):
                slot = (table[pos // bs], pos % bs)
                content = tr.prefix_hash(pos)
                assert slot not in written, "two writes to one KV slot in one step"
                written[slot] = content
                self.kv.setdefault(slot[0], [None] * bs)[slot[1]] = content
            work.append((req, tr, table, start, start + n))
        seq_ids, tokens = [], []
        for req, tr, table, start, end in work:
            first = max(0, start - self.kv_window + 1) if self.kv_window else 0
            for pos in range(first, end):
                block = self.kv.get(table[pos // bs])
                assert block is not None and block[pos % bs] == tr.prefix_hash(pos), (
                    f"{req.request_id} reads wrong KV at position {pos}")
            if end == req.num_tokens:
                seq_ids.append(req.seq_id)
                tokens.append(sampled_token(tr.num, req.num_tokens, tr.eos_pos))
            elif self.stale_samples:
                seq_ids.append(req.seq_id)
                tokens.append(EOS)
        if self.stale_samples:
            seq_ids += [*out.finished_seq_ids, -1]
            tokens += [EOS] * (len(out.finished_seq_ids) + 1)
        for req in self.sched.running:
            assert tables.get(req.seq_id) == bm.block_table(req.seq_id), (
                f"the executor's table of {req.request_id} differs from the scheduler's")
        return seq_ids, tokens

    # -- invariants and the end ----------------------------------------------------------

    @invariant()
    def pools_are_consistent(self):
        if self.sched is None:
            return
        self.sched.assert_invariants()
        bm = self.sched.block_manager
        owned = {b for r in self.sched.running
                 for b in bm.block_table(r.seq_id)[bm.num_released(r.seq_id):]}
        assert len(owned) + bm.num_free_blocks == bm.num_blocks
        assert not any(bm.block_table(r.seq_id) for r in self.sched.waiting)
        host = [b for r in self.sched.waiting for b in bm.host_table(r.seq_id)
                if r.status == RequestStatus.SWAPPED]
        assert len(set(host)) + bm.num_free_host_blocks == bm.num_host_blocks

    def teardown(self):
        if self.sched is None:
            return
        try:
            if sys.exc_info()[0] is None:  # else a rule failed: let its error through
                self.drain_and_check()
        finally:
            self.spy.__exit__()

    def drain_and_check(self):
        sched = self.sched
        if self.drain == "abort":
            for rid in self.live():
                self._abort(rid)
        steps = idle = 0
        while sched.has_work():
            out = self._step()
            steps += 1
            idle = 0 if out.num_batched_tokens else idle + 1
            assert idle < 50 and steps < MAX_DRAIN_STEPS, (
                f"no progress: the scheduler is stuck; waiting: {self._describe(sched.waiting)}"
                f" running: {self._describe(sched.running)}")
        self._step()  # flush the drop list of the last finishes
        self.check_final_state()

    def _describe(self, reqs) -> str:
        bm = self.sched.block_manager
        return "; ".join(
            f"{r.request_id} {r.status.name} tier {r.priority_tier} tokens {r.num_tokens} "
            f"computed {r.num_computed_tokens} blocks {len(bm.block_table(r.seq_id))}"
            f"+{len(bm.host_table(r.seq_id))} preempted {r.num_preemptions}"
            f"{' protected' if r.protected else ''}" for r in reqs
        ) + f" (free blocks {bm.num_free_blocks} of {bm.num_blocks})"

    def check_final_state(self):
        sched = self.sched
        bm = sched.block_manager
        assert not sched.requests and not sched.running and not sched.waiting
        assert not sched.has_work()
        assert bm.num_free_blocks == bm.num_blocks, "device blocks leaked"
        assert bm.num_free_host_blocks == bm.num_host_blocks, "host blocks leaked"
        assert not self.exec_tables, "the executor still holds sequences"
        bm.assert_invariants()
        for rid, tr in self.tracks.items():
            req = tr.req
            assert len(tr.finish_events) == 1, f"{rid}: {len(tr.finish_events)} finish events"
            assert tr.finish_events[0] == req.finish_reason
            assert tr.delivered == req.token_ids[req.num_prompt_tokens:]
            expected = tr.expected_output()
            if req.finish_reason in (FinishReason.ABORT,) or tr.pool_length_finish:
                assert tr.delivered == expected[:len(tr.delivered)]
            else:
                assert tr.delivered == expected, f"{rid}: wrong output for {req.finish_reason}"
                assert req.finish_reason == (
                    FinishReason.STOP if expected[-1] == EOS and not req.ignore_eos
                    and len(expected) >= req.min_tokens else FinishReason.LENGTH)


SchedulerMachine.TestCase.settings = settings(
    max_examples=int(os.environ.get("STATEFUL_EXAMPLES", 150)), stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestSchedulerStateful = SchedulerMachine.TestCase


def _shared_prefix_machine(num_blocks: int) -> SchedulerMachine:
    m = SchedulerMachine()
    m.setup(num_blocks=num_blocks, host=16, swap_cost=True, policy="chunked", max_num_seqs=4,
            budget=24, chunk=16, long_prefill=0, watermark=0.0, aging_s=8.0,
            max_preemptions=2, window=1e9, caching=True, max_num_waiting=64, per_tenant=0,
            drain="run")
    return m


def test_shared_prefix_workload_hits_the_prefix_cache():
    """The machine's workload, driven by hand: shared system prompts under KV pressure reuse
    cached blocks (with preemption and swap going on), and everything still drains cleanly."""
    m = _shared_prefix_machine(num_blocks=24)
    for i in range(12):
        m.arrive([(20 + 3 * i, 8, i % 3, TENANTS[i % 4], True, False, 0, None)])
        m._step()
        m._step()
    m.teardown()
    assert m.total_cache_hits + m.sched.block_manager.num_cache_hits > 0
    assert m.stats["preempt_swap"] > 0


def test_every_later_request_reuses_the_whole_cached_system_prompt():
    """In a pool with room to keep it, the three blocks of the system prompt are computed once;
    every later request starts from them (this is what the hit counters count)."""
    m = _shared_prefix_machine(num_blocks=64)
    cached = []
    for i in range(8):
        m.arrive([(20 + 3 * i, 4, i % 3, TENANTS[i % 4], True, False, 0, None)])
        for _ in range(3):
            out = m._step()
            cached += [r.num_computed_tokens - n for r, n in out.new if not r.num_preemptions]
    m.teardown()
    assert cached == [0] + [len(SYSTEM_PROMPT)] * 7
    assert m.sched.block_manager.num_cache_hits >= 7 * 3


# -- regressions the machine found -------------------------------------------------------------


def test_resync_recomputes_what_the_refused_plan_never_wrote():
    """A refused plan wrote no KV and copied no block: the blocks it was to fill must not be
    served from the prefix cache, its swap-outs hold nothing, and its drop list still counts."""
    cheap_swap = CostModel(prefill_tokens_per_s=10.0, swap_bytes_per_s=1e9, block_bytes=1000)
    sched = make_scheduler(num_blocks=6, num_host_blocks=16, cost=cheap_swap, chunk_size=16,
                           max_num_batched_tokens=16, max_num_seqs=4)
    x = make_request(prompt_len=4, max_tokens=5, request_id="x")
    x.token_ids[:] = [500, 501, 502, 503]
    sched.add_request(x)
    step(sched)
    sched.abort("x")
    a = make_request(prompt_len=9, max_tokens=2, request_id="a")
    sched.add_request(a)
    out = sched.schedule()  # drops x; registers a's two full blocks in the prefix cache
    assert out.finished_seq_ids == [x.seq_id]
    sched.resync()  # ... but the executor refused that plan
    out = sched.schedule()
    assert out.new == [(a, 9)], "served a prefix the executor never computed"
    assert sorted(out.finished_seq_ids) == sorted([x.seq_id, a.seq_id]), "x is never dropped"
    sched.update(out, *fake_execute(out))
    run_to_completion(sched)
    c = make_request(prompt_len=8, max_tokens=20, request_id="c", priority_tier=0)
    b = make_request(prompt_len=8, max_tokens=20, request_id="b", priority_tier=2)
    sched.add_request(c)
    sched.add_request(b)
    for _ in range(100):  # the pool fills up until b is swapped out
        out = sched.schedule()
        if b.status == RequestStatus.SWAPPED:
            break
        sched.update(out, *fake_execute(out))
    assert out.swap_out and b.status == RequestStatus.SWAPPED
    sched.resync()  # the plan that swapped b out is refused: b's host copy is garbage
    assert b.status == RequestStatus.WAITING and b.num_computed_tokens == 0
    assert sched.block_manager.num_free_host_blocks == 16
    run_to_completion(sched)
    assert sched.block_manager.num_free_blocks == 6


def test_a_context_that_outgrew_the_usable_pool_still_resumes():
    """A sequence may grow past the pool minus the watermark while it runs; requeued (here by
    an executor restart) it must come back once the pool drains, not block the queue forever.
    One that outgrew the whole pool ends with LENGTH, as it would had it kept running alone."""
    sched = make_scheduler(num_blocks=12, watermark=0.1, chunk_size=16,
                           max_num_batched_tokens=16, max_num_seqs=4)
    long = make_request(prompt_len=44, max_tokens=20, request_id="long", ignore_eos=True)
    other = make_request(prompt_len=4, max_tokens=2, request_id="other")
    sched.add_request(long)
    while long.num_tokens < 46:
        step(sched)
    sched.attach_executor(sched.model)  # restart: 46 tokens need 12 blocks, 11 are usable
    sched.add_request(other)
    run_to_completion(sched, max_steps=200)
    assert long.finish_reason == FinishReason.LENGTH
    assert long.num_tokens == 12 * 4 + 1  # it ran until the pool was its context limit
    assert other.finish_reason == FinishReason.LENGTH and other.num_output_tokens == 2

    sched = make_scheduler(num_blocks=12, chunk_size=16, max_num_batched_tokens=16,
                           max_num_seqs=4)
    full = make_request(prompt_len=40, max_tokens=20, request_id="full", ignore_eos=True)
    sched.add_request(full)
    while full.num_tokens < 12 * 4 + 1:
        step(sched)
    sched.attach_executor(sched.model)  # 49 tokens can never fit 12 blocks of 4
    sched.schedule()
    assert sched.take_events() == [Event(full, None, FinishReason.LENGTH)]
    assert not sched.has_work() or not sched.requests
