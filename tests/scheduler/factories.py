"""Factories for scheduler tests: no model, no network."""

from __future__ import annotations

import itertools

from scheduler_svc.core import (
    CostModel,
    ModelInfo,
    Request,
    Scheduler,
    SchedulerConfig,
    SchedulerOutput,
)

EOS = 2
_ids = itertools.count(1)
NO_COST = CostModel()  # no swap bandwidth measured: always recompute


def make_model(num_blocks: int = 64, block_size: int = 4, max_model_len: int = 512,
               num_host_blocks: int = 0, cost: CostModel = NO_COST,
               kv_window: int = 0) -> ModelInfo:
    return ModelInfo(block_size, num_blocks, max_model_len, 1000, frozenset({EOS}),
                     num_host_blocks, cost, kv_window)


# The default test clock ticks a second per reading, so waits are counted in readings,
# not in load: queue-time bounds (admission's refusals and shedding) would refuse by the
# tick. Tests of admission pass a clock of their own and keep the bounds.
TICKING_CLOCK_CONFIG = dict(max_queue_time_premium_s=0.0, max_queue_time_standard_s=0.0,
                            max_queue_time_best_effort_s=0.0)


class Clock:
    """A virtual clock tests advance by hand (one tick per call by default)."""

    def __init__(self, tick: float = 0.0) -> None:
        self.now, self.tick = 0.0, tick

    def __call__(self) -> float:
        self.now += self.tick
        return self.now


def make_scheduler(num_blocks: int = 64, block_size: int = 4, clock=None,
                   num_host_blocks: int = 0, cost: CostModel = NO_COST,
                   **config) -> Scheduler:
    config.setdefault("watermark", 0.0)
    if clock is None:
        config = {**TICKING_CLOCK_CONFIG, **config}
    sched = Scheduler(SchedulerConfig(**config), clock=clock or Clock(1.0))
    sched.attach_executor(make_model(num_blocks, block_size, num_host_blocks=num_host_blocks,
                                     cost=cost))
    return sched


def make_request(prompt_len: int = 8, max_tokens: int = 4, **kw) -> Request:
    seq_id = next(_ids)
    kw.setdefault("request_id", f"r{seq_id}")
    return Request(
        seq_id=seq_id,
        token_ids=[10 + i % 50 for i in range(prompt_len)],
        num_prompt_tokens=prompt_len,
        max_tokens=max_tokens,
        **kw,
    )


def fake_token(req: Request) -> int:
    """Deterministic in (request, position), like seeded sampling: never EOS."""
    return 100 + (hash((req.request_id, req.num_tokens)) % 800)


def fake_execute(out: SchedulerOutput,
                 eos_at: dict[str, int] | None = None) -> tuple[list[int], list[int]]:
    """A stand-in executor: samples for every sequence the plan completes."""
    eos_at = eos_at or {}
    seq_ids, tokens = [], []
    for req, _, _ in out.scheduled():
        if req.num_computed_tokens == req.num_tokens:
            at_eos = eos_at.get(req.request_id) == req.num_output_tokens
            seq_ids.append(req.seq_id)
            tokens.append(EOS if at_eos else fake_token(req))
    return seq_ids, tokens


def step(sched: Scheduler, **kw) -> SchedulerOutput:
    out = sched.schedule()
    sched.assert_invariants(out)
    sched.update(out, *fake_execute(out, **kw))
    sched.assert_invariants()
    return out


def run_to_completion(sched: Scheduler, max_steps: int = 10_000, **kw) -> list[SchedulerOutput]:
    outputs = []
    while sched.has_work():
        outputs.append(step(sched, **kw))
        assert len(outputs) < max_steps, "no progress"
    return outputs
