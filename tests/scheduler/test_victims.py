"""Who is preempted when the pool runs out: a stream mid-answer is protected from a
neighbour's long prompt (core/preemption.py ``victim_key``), and admission keeps a
block free for every running decode's next one."""

from __future__ import annotations

import random

from scheduler_svc.core.preemption import in_victim_order, pick_victim, victim_key
from tests.scheduler.factories import make_request, make_scheduler, run_to_completion, step


def test_a_prompt_still_prefilling_is_preempted_before_a_stream_mid_answer():
    # B (a long prompt) was admitted first, A (short) after it and decodes while B is
    # still prefilling in 4-token chunks; together they outgrow the 16-block pool.
    sched = make_scheduler(num_blocks=16, block_size=4, max_num_batched_tokens=8,
                           chunk_size=4, max_num_seqs=4)
    b = make_request(52, 1, request_id="long-prompt")
    a = make_request(4, 30, request_id="stream")
    sched.add_request(b)
    sched.add_request(a)
    gaps, last_len, steps = [], len(a.token_ids), 0
    while not a.is_finished:
        step(sched)
        steps += 1
        if len(a.token_ids) > a.num_prompt_tokens:
            gaps.append(len(a.token_ids) - last_len)
        last_len = len(a.token_ids)
        assert steps < 500
    assert a.num_preemptions == 0, "the stream mid-answer was preempted"
    assert b.num_preemptions >= 1, "the pool never ran out: the test proves nothing"
    assert all(g == 1 for g in gaps[1:]), "the stream stalled"
    run_to_completion(sched)
    assert b.is_finished and b.finish_reason is not None


def test_the_tier_still_comes_first():
    """Among candidates: lower tier first; within a tier, a silent one (no token out,
    none resumed) before a stream mid-answer; then the most recently admitted."""
    def running(rid, tier, admit_seq, outputs=0, resumed=0):
        req = make_request(8, 4, request_id=rid, priority_tier=tier,
                           num_resumed_output_tokens=resumed)
        req.token_ids += [7] * outputs
        req.admit_seq = admit_seq
        return req

    vip_prompt = running("vip-prompt", 0, 9)
    std_stream = running("std-stream", 1, 1, outputs=3)
    std_prompt = running("std-prompt", 1, 0)
    continuation = running("continuation", 1, 5, resumed=2)
    assert pick_victim([vip_prompt, std_stream, std_prompt], vip_prompt, 0) is std_prompt
    assert pick_victim([vip_prompt, std_stream], vip_prompt, 0) is std_stream
    assert pick_victim([std_stream, continuation], std_stream, 0) is continuation
    be_stream = running("be-stream", 2, 0, outputs=1)
    assert pick_victim([std_prompt, be_stream], std_prompt, 0) is be_stream


def test_the_lazy_victim_order_is_the_sorted_one():
    """Priority hold walks the running set in victim order without sorting it: for any
    running set in priority order and any start, the order read is the key's."""
    rng = random.Random(7)
    for trial in range(300):
        reqs = []
        for admit_seq in range(rng.randrange(0, 24)):
            req = make_request(8, 4, request_id=f"r{trial}-{admit_seq}",
                               priority_tier=rng.randrange(3),
                               num_resumed_output_tokens=rng.choice((0, 0, 0, 2)))
            req.token_ids += [7] * rng.choice((0, 0, 3))
            req.admit_seq = admit_seq
            reqs.append(req)
        reqs.sort(key=lambda r: (r.priority_tier, r.admit_seq))
        lo = rng.randrange(len(reqs) + 1)
        expected = sorted(reqs[lo:], key=victim_key, reverse=True)
        assert list(in_victim_order(reqs, lo)) == expected
        # Any other key is sorted by.
        assert list(in_victim_order(reqs, lo, key=lambda r: -r.admit_seq)) == sorted(
            reqs[lo:], key=lambda r: r.admit_seq)


def test_admission_keeps_a_block_for_each_running_decode():
    """A prompt that would take every free block waits while a decode runs, instead of
    being admitted and preempting the stream at its next block boundary."""
    sched = make_scheduler(num_blocks=16, block_size=4, max_num_batched_tokens=64,
                           chunk_size=64, max_num_seqs=4)
    a = make_request(4, 40, request_id="stream")
    sched.add_request(a)
    step(sched)  # a runs: 2 blocks (prompt + its first sample's position soon)
    free = sched.block_manager.num_free_blocks
    big = make_request(free * 4, 1, request_id="fills-the-pool")
    sched.add_request(big)
    step(sched)
    assert big.status.name == "WAITING"
    run_to_completion(sched)
    assert a.num_preemptions == 0 and big.is_finished
