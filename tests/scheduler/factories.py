"""Factories for scheduler tests: no model, no network."""

from __future__ import annotations

import itertools

from scheduler_svc.core import ModelInfo, Request, Scheduler, SchedulerConfig, SchedulerOutput

EOS = 2
_ids = itertools.count(1)


def make_model(num_blocks: int = 64, block_size: int = 4, max_model_len: int = 512) -> ModelInfo:
    return ModelInfo(block_size, num_blocks, max_model_len, 1000, frozenset({EOS}))


def make_scheduler(num_blocks: int = 64, block_size: int = 4, **config) -> Scheduler:
    sched = Scheduler(SchedulerConfig(**config), clock=itertools.count().__next__)
    sched.attach_executor(make_model(num_blocks, block_size))
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


def fake_execute(out: SchedulerOutput, eos_at: dict[str, int] | None = None) -> dict[int, int]:
    """A stand-in executor: samples for every sequence the plan completes."""
    eos_at = eos_at or {}
    sampled = {}
    for s in out.scheduled:
        if s.samples:
            req = s.request
            at_eos = eos_at.get(req.request_id) == req.num_output_tokens
            sampled[req.seq_id] = EOS if at_eos else fake_token(req)
    return sampled


def run_to_completion(sched: Scheduler, max_steps: int = 10_000, **kw) -> list[SchedulerOutput]:
    outputs = []
    while sched.has_work():
        out = sched.schedule()
        sched.assert_invariants([out])
        sched.update(out, fake_execute(out, **kw))
        sched.assert_invariants()
        outputs.append(out)
        assert len(outputs) < max_steps, "no progress"
    return outputs
