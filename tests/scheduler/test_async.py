"""Scheduling ahead (async scheduling): the scheduler builds step N+1 while step N runs.

A stand-in executor keeps its own token histories, as the real one does (decode plans carry
no token ids), and receives the plans as bytes on the wire. The driver keeps up to two plans
unanswered, the way the engine loop does with ``--async-scheduling``: it builds N+1, then
applies N's result. Whatever happens in between (stop tokens, length limits, preemption by
recompute or swap, aborts racing a step, executor restarts, refused plans), every client
must see exactly the tokens of an uninterrupted run, once, and every block must come back.
"""

from __future__ import annotations

import collections
import dataclasses

import hypothesis.strategies as st
from hypothesis import HealthCheck, given, settings

from protos import wire
from scheduler_svc.core import CostModel, FinishReason, Request, Scheduler, SchedulerConfig
from scheduler_svc.plan import PlanBuilder
from tests.scheduler.factories import EOS, TICKING_CLOCK_CONFIG, Clock, make_model

BLOCK_SIZE = 4
SYSTEM_PROMPT = [3 + (7 * i) % 90 for i in range(2 * BLOCK_SIZE)]
SWAP_COST = CostModel(prefill_tokens_per_s=10.0, swap_bytes_per_s=1e9, block_bytes=1000)


def sampled(seq_id: int, pos: int, eos_pos: int | None) -> int:
    """The stand-in's sample: a pure function of (request, position), like seeded sampling."""
    return EOS if pos == eos_pos else 100 + (seq_id * 7919 + pos * 104729) % 800


class FakeExecutor:
    """Executes plans in order from their wire bytes, with its own per-sequence state;
    refuses (changing nothing) a plan naming a sequence it does not hold or asking for
    a token it lacks (as after a refused plan, for the plans sent behind it)."""

    def __init__(self, eos_at: dict[int, int]) -> None:
        self.eos_at = eos_at  # seq_id → absolute position of its EOS sample
        self.seqs: dict[int, list] = {}  # seq_id → [token ids, num computed]

    def execute(self, frame: bytes) -> tuple[list[int], list[int]] | None:
        _, plan = wire.decode_from_scheduler(frame)
        finished = set(plan.finished_seq_ids)
        cached = wire.plan_cached_seq_ids(plan)
        for seq_id, n in zip(cached, plan.cached_num_scheduled_tokens, strict=True):
            state = self.seqs.get(seq_id)
            if seq_id in finished or state is None or state[1] + n > len(state[0]):
                return None  # refused, like executor_svc/plan_check.py
        for seq_id in plan.finished_seq_ids:
            self.seqs.pop(seq_id, None)
        work = []
        for new in plan.new_seqs:
            self.seqs[new.seq_id] = [list(new.token_ids), new.num_computed_tokens]
            work.append((new.seq_id, new.num_scheduled_tokens))
        work += zip(cached, plan.cached_num_scheduled_tokens, strict=True)
        seq_ids, tokens = [], []
        for seq_id, n in work:
            state = self.seqs[seq_id]
            state[1] += n
            assert state[1] <= len(state[0]), "a plan computes a token the executor lacks"
            if state[1] == len(state[0]):
                token = sampled(seq_id, len(state[0]), self.eos_at.get(seq_id))
                state[0].append(token)
                seq_ids.append(seq_id)
                tokens.append(token)
        return seq_ids, tokens


@dataclasses.dataclass
class Client:
    req: Request
    eos_pos: int | None
    tokens: list[int] = dataclasses.field(default_factory=list)
    finishes: list[FinishReason] = dataclasses.field(default_factory=list)
    pool_limited: bool = False  # ended (LENGTH, no token) because it outgrew the KV pool

    def expected(self) -> list[int]:
        req, out = self.req, []
        pos = req.num_prompt_tokens
        while True:
            token = sampled(req.seq_id, pos, self.eos_pos)
            out.append(token)
            pos += 1
            if token == EOS or pos >= req.num_prompt_tokens + req.max_tokens:
                return out


class Driver:
    """The engine loop's protocol without processes: up to ``depth`` plans unanswered."""

    def __init__(self, sched: Scheduler, clients: dict[str, Client], depth: int,
                 plans: PlanBuilder) -> None:
        self.sched, self.clients, self.depth, self.plans = sched, clients, depth, plans
        self.model = sched.model
        self.executor = self._new_executor()
        self.inflight: collections.deque = collections.deque()
        self.void: collections.deque = collections.deque()  # sent before a resync
        self.steps = 0

    def _new_executor(self) -> FakeExecutor:
        return FakeExecutor({c.req.seq_id: c.eos_pos for c in self.clients.values()
                             if c.eos_pos is not None})

    def hear(self, events) -> None:
        for req, token, reason, _ in events:
            client = self.clients[req.request_id]
            assert not client.finishes, f"{req.request_id}: an event after its finish"
            if token is not None:
                client.tokens.append(token)
            if reason is not None:
                client.finishes.append(reason)
                client.pool_limited = reason == FinishReason.LENGTH and token is None

    def fill(self) -> None:
        while len(self.inflight) < self.depth:
            out = self.sched.schedule()
            self.sched.assert_invariants(out)
            self.hear(self.sched.take_events())
            if out.is_empty:
                return
            frame = self.plans.message(out, "inc", self.sched.block_manager).SerializeToString()
            self.inflight.append((out, frame))

    def step(self, incident: str | None = None, abort: str | None = None) -> None:
        self.steps += 1
        self.fill()
        while self.void:  # the executor still runs what was sent before a resync
            self.executor.execute(self.void.popleft())
        if not self.inflight:
            return
        if abort is not None:  # a client cancels while the step runs
            event = self.sched.abort(abort)
            if event is not None:
                self.hear([event])
        if incident == "restart":  # the executor dies; nothing in flight answers
            self.inflight.clear()
            self.sched.detach_executor()
            self.sched.attach_executor(self.model)
            self.executor = self._new_executor()
            return
        out, frame = self.inflight.popleft()
        result = None if incident == "refuse" else self.executor.execute(frame)
        if result is None:  # refused: resync; later plans are void (their answers ignored)
            self.void.extend(frame for _, frame in self.inflight)
            self.inflight.clear()
            self.sched.resync()
        else:
            self.hear(self.sched.update(out, *result))
        self.sched.assert_invariants()

def run(requests, config: dict, num_blocks: int, host: int, depth: int,
        incidents: dict[int, tuple[str | None, int | None]]):
    model = make_model(num_blocks, BLOCK_SIZE, num_host_blocks=host,
                       cost=SWAP_COST if host else CostModel())
    sched = Scheduler(SchedulerConfig(watermark=0.0, **{**TICKING_CLOCK_CONFIG, **config}),
                      clock=Clock(1.0))
    sched.attach_executor(model)
    clients: dict[str, Client] = {}
    plans = PlanBuilder()
    for i, (prompt_len, max_tokens, eos_at, shared, tier) in enumerate(requests):
        prompt = [5 + (i * 13 + j * 3) % 90 for j in range(prompt_len)]
        if shared:
            prompt = SYSTEM_PROMPT + prompt
        req = Request(f"r{i}", i + 1, prompt, len(prompt), max_tokens, priority_tier=tier)
        if i % 2:  # half prepared on arrival, as the scheduler process does; half lazily
            plans.prepare(req)
        eos_pos = None if eos_at is None else len(prompt) + eos_at
        clients[req.request_id] = Client(req, eos_pos)
    driver = Driver(sched, clients, depth, plans)
    pending = list(clients.values())
    step = 0
    while pending or sched.has_work() or driver.inflight:
        if pending:  # two arrivals a step
            for client in pending[:2]:
                sched.add_request(client.req)
            pending = pending[2:]
        incident, victim = incidents.get(step, (None, None))
        abort = None
        if victim is not None and sched.requests:
            abort = sorted(sched.requests)[victim % len(sched.requests)]
        driver.step(incident, abort)
        step += 1
        assert step < 5000, "no progress"
    driver.step()  # flush the last drop list
    while driver.void:
        driver.executor.execute(driver.void.popleft())
    return clients, sched, driver


def check(clients: dict[str, Client], sched: Scheduler, driver: Driver) -> None:
    bm = sched.block_manager
    assert not sched.requests and not sched.running and not sched.waiting
    assert bm.num_free_blocks == bm.num_blocks, "device blocks leaked"
    assert bm.num_free_host_blocks == bm.num_host_blocks, "host blocks leaked"
    assert not driver.executor.seqs, "the executor still holds sequences"
    for rid, client in clients.items():
        assert len(client.finishes) == 1, f"{rid}: {client.finishes}"
        expected = client.expected()
        if client.finishes[0] == FinishReason.ABORT or client.pool_limited:
            assert client.tokens == expected[:len(client.tokens)], f"{rid}: wrong tokens"
        else:
            assert client.tokens == expected, f"{rid}: lost, duplicated or extra tokens"
            assert client.finishes[0] == (
                FinishReason.STOP if expected[-1] == EOS else FinishReason.LENGTH)


REQUESTS = st.lists(st.tuples(
    st.integers(1, 30),  # prompt length
    st.integers(1, 12),  # max_tokens
    st.one_of(st.none(), st.integers(0, 11)),  # output index of an EOS
    st.booleans(),  # shared system prompt
    st.sampled_from([0, 1, 2]),  # priority tier
), min_size=1, max_size=12)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(requests=REQUESTS,
       num_blocks=st.sampled_from([12, 16, 24, 64]),
       host=st.sampled_from([0, 0, 32]),
       max_num_seqs=st.integers(1, 6),
       budget=st.integers(6, 32),
       incidents=st.dictionaries(
           st.integers(0, 30),
           st.tuples(st.sampled_from([None, "restart", "refuse"]),
                     st.one_of(st.none(), st.integers(0, 20))),
           min_size=1, max_size=6))
def test_scheduling_ahead_delivers_what_an_uninterrupted_run_would(
        requests, num_blocks, host, max_num_seqs, budget, incidents):
    budget = max(budget, max_num_seqs)
    config = dict(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                  chunk_size=min(16, budget), max_num_waiting=64)
    for depth in (1, 2):
        clients, sched, driver = run(requests, config, num_blocks, host, depth, incidents)
        check(clients, sched, driver)


def test_a_stop_token_ends_the_stream_though_the_next_decode_was_already_sent():
    config = dict(max_num_seqs=4, max_num_batched_tokens=16, chunk_size=16)
    requests = [(6, 10, 2, False, 1), (5, 10, None, False, 1)]
    clients, sched, driver = run(requests, config, 64, 0, 2, {})
    check(clients, sched, driver)
    assert clients["r0"].finishes == [FinishReason.STOP]
    assert clients["r0"].tokens[-1] == EOS and len(clients["r0"].tokens) == 3


def test_ahead_plans_decode_without_waiting_for_the_result():
    """With one step unanswered, every sequence that step samples is scheduled again
    (one token, no token ids: the executor has it) unless that sample is its last."""
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32, chunk_size=32,
                                      watermark=0.0, **TICKING_CLOCK_CONFIG),
                      clock=Clock(1.0))
    sched.attach_executor(make_model(64, BLOCK_SIZE))
    a = Request("a", 1, list(range(10, 16)), 6, max_tokens=8)
    last = Request("last", 2, list(range(20, 25)), 5, max_tokens=1)
    sched.add_request(a)
    sched.add_request(last)
    first = sched.schedule()  # both prefill and sample
    ahead = sched.schedule()  # built before the first answers
    assert [r.request_id for r in ahead.cached] == ["a"]  # "last" ends with its sample
    assert ahead.cached_num_tokens == [1] and a.num_computed_tokens == 7
    events = sched.update(first, [1, 2], [500, 501])
    assert [(r.request_id, t, f) for r, t, f, _ in events] == [
        ("a", 500, None), ("last", 501, FinishReason.LENGTH)]
    sched.assert_invariants()
    assert sched.update(ahead, [1], [502])[0][1] == 502
    assert a.token_ids[6:] == [500, 502] and a.num_computed_tokens == 7


def test_a_sequence_preempted_while_its_sample_is_pending_keeps_that_sample():
    sched = Scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=16, chunk_size=16,
                                      watermark=0.0, **TICKING_CLOCK_CONFIG),
                      clock=Clock(1.0))
    sched.attach_executor(make_model(4, BLOCK_SIZE))  # 16 token slots
    hi = Request("hi", 1, list(range(10, 18)), 8, max_tokens=10, priority_tier=0)
    lo = Request("lo", 2, list(range(30, 37)), 7, max_tokens=10, priority_tier=2)
    sched.add_request(hi)
    sched.add_request(lo)
    first = sched.schedule()  # 2 blocks each: the pool is full
    ahead = sched.schedule()  # hi's 9th token needs a block: lo is preempted
    assert [r.request_id for r in ahead.cached] == ["hi"] and lo.num_computed_tokens == 0
    events = sched.update(first, [1, 2], [600, 601])
    assert [(r.request_id, t) for r, t, _, _ in events] == [("hi", 600), ("lo", 601)]
    assert lo.token_ids[-1] == 601 and lo in list(sched.waiting)
    sched.assert_invariants()
