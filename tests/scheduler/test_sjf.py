"""The sjf policy (core/policy.py): an ordering policy added through the policy seam
alone. Shortest remaining prompt first within a tier; aging still bounds every wait."""

from __future__ import annotations

from continuum.cli import build_parser
from scheduler_svc.core.policy import POLICIES, ShortestFirstPolicy
from tests.scheduler.factories import (
    TICKING_CLOCK_CONFIG,
    Clock,
    fake_execute,
    make_request,
    make_scheduler,
)


def _first_admitted(policy: str) -> list[str]:
    """Request ids in the order they start, one slot, three prompts queued at once."""
    sched = make_scheduler(num_blocks=256, policy=policy, max_num_seqs=1,
                           max_num_batched_tokens=64, chunk_size=64, async_scheduling=False)
    for rid, n in (("long", 40), ("mid", 20), ("short", 6)):
        sched.add_request(make_request(prompt_len=n, max_tokens=1, request_id=rid))
    started = []
    while sched.has_work():
        out = sched.schedule()
        started += [req.request_id for req, _ in out.new]
        sched.update(out, *fake_execute(out))
        sched.assert_invariants(out)
    return started


def test_sjf_starts_the_shortest_prompt_first_where_chunked_keeps_arrival_order():
    assert _first_admitted("chunked") == ["long", "mid", "short"]
    assert _first_admitted("sjf") == ["short", "mid", "long"]


def test_under_a_stream_of_shorter_prompts_aging_still_starts_the_long_one():
    aging_s = 10.0
    clock = Clock(0.0)
    sched = make_scheduler(num_blocks=256, clock=clock, policy="sjf", max_num_seqs=1,
                           max_num_batched_tokens=64, chunk_size=64, async_scheduling=False,
                           aging_s=aging_s, **TICKING_CLOCK_CONFIG)
    long = make_request(prompt_len=40, max_tokens=1, request_id="long")
    sched.add_request(long)
    started_at = None
    for step in range(200):
        clock.now = float(step)
        # Two shorter prompts arrive every second: the queue always holds shorter ones.
        for k in range(2):
            sched.add_request(make_request(prompt_len=4, max_tokens=1,
                                           request_id=f"s{step}.{k}"))
        out = sched.schedule()
        if any(req is long for req, _ in out.new):
            started_at = clock.now
            break
        sched.update(out, *fake_execute(out))
        sched.assert_invariants(out)
    # Not before the shorter ones (it waits), but as soon as it is starving: a standard
    # request starves after (tier + 1) × aging_s, then nothing overtakes it.
    assert started_at is not None, "the long prompt starved"
    assert 2 * aging_s <= started_at <= 2 * aging_s + 1


def test_a_registered_policy_is_a_serve_choice_without_editing_the_cli():
    parser, _ = build_parser()
    args = parser.parse_args(["serve", "--policy", "sjf"])
    assert args.policy == "sjf" and POLICIES["sjf"] is ShortestFirstPolicy
    for name in POLICIES:  # every spelling the registry has, and the old ones
        assert parser.parse_args(["serve", "--policy", name]).policy == name
