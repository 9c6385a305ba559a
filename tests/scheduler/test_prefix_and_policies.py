"""Prefix caching, priorities with aging, tenant fairness and batching policies."""

from __future__ import annotations

from scheduler_svc.core import BlockManager
from tests.scheduler.factories import Clock, make_request, make_scheduler, run_to_completion, step


def shared_prompt(suffix: int, prefix_len: int = 16) -> list[int]:
    return [7] * prefix_len + [100 + suffix] * 5


def test_shared_prefix_blocks_are_reused_and_only_the_rest_is_computed():
    sched = make_scheduler(num_blocks=64, block_size=4, chunk_size=32, max_num_batched_tokens=32,
                           max_num_seqs=4)
    a = make_request(prompt_len=21, max_tokens=2)
    a.token_ids[:] = shared_prompt(1)
    sched.add_request(a)
    run_to_completion(sched)
    b = make_request(prompt_len=21, max_tokens=2)
    b.token_ids[:] = shared_prompt(2)
    sched.add_request(b)
    out = step(sched)
    ((req, n),) = out.new
    assert req is b and n == 21 - 16  # 4 cached blocks of 4 tokens
    assert sched.block_manager.num_cache_hits >= 4
    run_to_completion(sched)
    sched.block_manager.assert_invariants()


def test_cached_blocks_are_shared_by_running_sequences_and_evicted_lru():
    sched = make_scheduler(num_blocks=12, block_size=4, chunk_size=32, max_num_batched_tokens=32,
                           max_num_seqs=4)
    a, b = make_request(prompt_len=21, max_tokens=30), make_request(prompt_len=21, max_tokens=30)
    a.token_ids[:], b.token_ids[:] = shared_prompt(1), shared_prompt(2)
    sched.add_request(a)
    step(sched)
    sched.add_request(b)
    step(sched)
    shared = sched.block_manager.block_table(a.seq_id)[:4]
    assert sched.block_manager.block_table(b.seq_id)[:4] == shared
    run_to_completion(sched)  # pressure forces preemption and eviction along the way
    assert sched.block_manager.num_free_blocks == 12


def test_premium_is_admitted_before_earlier_best_effort():
    sched = make_scheduler(max_num_seqs=1, max_num_batched_tokens=16, chunk_size=16)
    blocker = make_request(max_tokens=3)
    sched.add_request(blocker)
    step(sched)
    late_best_effort = make_request(priority_tier=2)
    premium = make_request(priority_tier=0)
    sched.add_request(late_best_effort)
    sched.add_request(premium)
    run_to_completion(sched)
    assert premium.first_scheduled_time < late_best_effort.first_scheduled_time


def test_aging_lifts_best_effort_to_standard_but_not_past_premium_until_it_starves():
    clock = Clock(0.0)
    sched = make_scheduler(clock=clock, max_num_seqs=1, max_num_batched_tokens=16,
                           chunk_size=16, aging_s=5.0)
    blocker = make_request(max_tokens=1)
    sched.add_request(blocker)
    step(sched)  # the only slot is taken: everything below waits in the queue
    best_effort = make_request(priority_tier=2)
    sched.add_request(best_effort)
    clock.now += 12.0  # waited 2 x aging_s: lifted two tiers, but stops at standard
    standard, premium = make_request(priority_tier=1), make_request(priority_tier=0)
    sched.add_request(standard)
    sched.add_request(premium)
    q = sched.waiting
    assert q.peek(clock.now) is premium
    q.remove(premium)
    assert q.peek(clock.now) is best_effort  # as standard, and it arrived first
    q.remove(best_effort)
    q.push(best_effort)
    q.push(premium)
    clock.now += 4.0  # 16 s > (2 + 1) x 5 s: starving, so it goes before premium too
    assert q.peek(clock.now) is best_effort


def test_aging_bounds_the_wait_under_sustained_premium_load():
    clock = Clock(0.0)
    # Queue-time bounds off: this is about the order of an admitted queue, and the
    # premium stream would otherwise be refused once it queues past its 2 s bound.
    sched = make_scheduler(clock=clock, max_num_seqs=1, max_num_batched_tokens=16,
                           chunk_size=16, aging_s=5.0, max_queue_time_premium_s=0,
                           max_queue_time_standard_s=0, max_queue_time_best_effort_s=0)
    victim = make_request(priority_tier=2, max_tokens=1)
    sched.add_request(victim)
    sched.add_request(make_request(priority_tier=0, max_tokens=1))
    waited = None
    for _ in range(200):  # one premium request arrives per second, forever
        clock.now += 1.0
        sched.add_request(make_request(priority_tier=0, max_tokens=1))
        step(sched)
        if victim.first_scheduled_time is not None and waited is None:
            waited = victim.first_scheduled_time - victim.arrival_time
    assert waited is not None
    assert waited <= (2 + 1) * 5.0 + 1.0  # the documented bound: (tier + 1) × aging_s


def test_a_flooding_tenant_does_not_delay_another_tenant():
    # The queue-time bound off: this is about the order, not about who is admitted.
    sched = make_scheduler(clock=Clock(0.0), max_num_seqs=1, max_num_batched_tokens=16,
                           chunk_size=16, max_queue_time_standard_s=0.0)
    for _ in range(20):
        sched.add_request(make_request(tenant="noisy", max_tokens=2))
    step(sched)
    quiet = make_request(tenant="quiet", max_tokens=2)
    sched.add_request(quiet)
    order = []
    while sched.has_work():
        out = step(sched)
        order += [r.tenant for r, _ in out.new]
    # The quiet tenant gets the next free slot, not the 20th.
    assert order.index("quiet") <= 1


def test_static_policy_admits_only_when_the_batch_is_done():
    sched = make_scheduler(policy="static", max_num_seqs=4, max_num_batched_tokens=64,
                           chunk_size=64)
    first = [make_request(max_tokens=5) for _ in range(2)]
    for r in first:
        sched.add_request(r)
    step(sched)
    late = make_request(max_tokens=5)
    sched.add_request(late)
    while any(not r.is_finished for r in first):
        out = step(sched)
        assert all(r is not late for r, _ in out.new)
    run_to_completion(sched)
    assert late.is_finished


def test_continuous_policy_prefills_without_a_chunk_cap():
    sched = make_scheduler(policy="continuous", max_num_batched_tokens=64, chunk_size=8)
    sched.add_request(make_request(prompt_len=50))
    assert sched.schedule().num_batched_tokens == 50


def test_colliding_block_hashes_index_one_block_and_the_pool_stays_consistent():
    """Two blocks of one sequence with the same chain hash (a 64-bit collision, which a
    crafted prompt could force): only the first is indexed, and freeing and reusing
    both keeps every count right."""
    bm = BlockManager(num_blocks=8, block_size=4)
    bm.grow(1, 8)
    bm.register_full_blocks(1, list(range(8)), [77, 77], 8)
    bm.assert_invariants()
    assert bm.num_cached_prefix(list(range(9)), [77, 77])[0] == bm.block_table(1)[:1]
    bm.free(1)
    bm.assert_invariants()
    assert bm.num_free_blocks == 8
    bm.grow(2, 32)  # takes every block, evicting the indexed one
    bm.assert_invariants()
    bm.free(2)
    bm.assert_invariants()


def test_a_hit_is_a_prompt_whose_tokens_match_not_only_its_hashes():
    """The index stores the token tuples a request's hashes were computed from (no
    copy in a step), and a lookup still compares tokens: a crafted prompt that reuses
    another's chain hashes but not its tokens gets no hit, while the same tokens under
    a fresh cache (hashes computed anew, tuples of its own) hit."""
    bm = BlockManager(num_blocks=8, block_size=4)
    tokens = list(range(100, 108))
    hashes: list[int] = []
    chunks: list[tuple[int, ...]] = []
    bm.extend_hashes(tokens, hashes, 2, chunks)
    assert len(hashes) == len(chunks) == 2 and chunks[0] == (100, 101, 102, 103)
    bm.grow(1, 8)
    bm.register_full_blocks(1, tokens, hashes, 8, chunks)
    assert bm.num_cached_prefix(tokens + [1], [], [])[0] == bm.block_table(1)
    forged = list(range(200, 208)) + [1]
    assert bm.num_cached_prefix(forged, list(hashes), None)[0] == []
    bm.free(1)
    bm.assert_invariants()
