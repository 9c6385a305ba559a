"""The fast paths of schedule() (decodes that need no preemption) and update() (an
answer that is exactly the expected samples) change nothing but speed: the same
workload run with both disabled gives the same events, preemptions and block tables,
with and without scheduling ahead, with a roomy and a tight pool (stop tokens, length
limits, aborts and preemptions all happen)."""

from __future__ import annotations

import itertools
import random

import pytest

from scheduler_svc.core import QueueFull, Request, Scheduler, SchedulerOutput
from tests.scheduler.factories import EOS, make_scheduler


def _run(seed: int, ahead: bool, num_blocks: int, fast: bool,
         monkeypatch: pytest.MonkeyPatch) -> tuple[list, int, dict, int]:
    num_fast = 0
    apply_samples = Scheduler._apply_samples

    def counting(self, *args):
        nonlocal num_fast
        num_fast += 1
        return apply_samples(self, *args)

    monkeypatch.setattr(Scheduler, "_apply_samples", counting)
    if not fast:  # the general decode loop, and no expected samples for update()
        monkeypatch.setattr(Scheduler, "_schedule_decodes_fast", lambda *args: None)
    rng = random.Random(seed)
    sched = make_scheduler(num_blocks=num_blocks, block_size=4, max_num_seqs=16,
                           max_num_batched_tokens=128, chunk_size=32)
    ids = itertools.count(1)
    log: list = []
    unanswered: list[SchedulerOutput] = []

    def answer(out: SchedulerOutput) -> None:
        sampled = [r for r, _, _ in out.scheduled() if r.num_computed_tokens >= r.num_tokens]
        tokens = [rng.choice([EOS, 3, 5, 7, 9, 11]) for _ in sampled]
        events = sched.update(out, [r.seq_id for r in sampled], tokens)
        log.extend((r.request_id, t, f) for r, t, f in events)

    for _ in range(300):
        if rng.random() < 0.5:
            i = next(ids)
            prompt = [1, 1, 1, 1, 5, 5] + [rng.randrange(3, 20) for _ in range(rng.randint(1, 30))]
            try:
                sched.add_request(Request(f"r{i}", i, prompt, len(prompt),
                                          max_tokens=rng.randint(1, 30),
                                          ignore_eos=rng.random() < 0.5))
            except QueueFull:
                pass
        if rng.random() < 0.03 and sched.running:
            sched.abort(rng.choice(sched.running).request_id)
        out = sched.schedule()
        sched.assert_invariants(out)
        if not out.is_empty:
            unanswered.append(out)
            if len(unanswered) > (1 if ahead else 0):
                answer(unanswered.pop(0))
        log.extend((r.request_id, t, f) for r, t, f in sched.take_events())
    while unanswered:
        answer(unanswered.pop(0))
    sched.assert_invariants()
    tables = {r.seq_id: sched.block_manager.block_table(r.seq_id) for r in sched.running}
    return log, sched.num_preemptions, tables, num_fast


@pytest.mark.parametrize("ahead", [False, True])
@pytest.mark.parametrize("num_blocks", [240, 30])
@pytest.mark.parametrize("seed", range(3))
def test_fast_paths_change_nothing(seed: int, ahead: bool, num_blocks: int,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    *fast, num_fast = _run(seed, ahead, num_blocks, True, monkeypatch)
    *slow, num_slow_fast = _run(seed, ahead, num_blocks, False, monkeypatch)
    assert num_fast > 100 and num_slow_fast == 0  # the paths compared did run
    assert num_blocks > 100 or fast[1] > 0  # the tight pool preempts
    assert fast == slow
