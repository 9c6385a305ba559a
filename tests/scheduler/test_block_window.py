"""The block manager under a sliding window on every layer: blocks wholly behind the
window of the earliest query a sequence can still make go back to the pool (a hashed one
stays cached), the rest of the table is untouched, and swap, freeing, registration and the
invariants count only what the sequence still owns."""

from __future__ import annotations

from protos.continuum.v1 import executor_pb2 as pb
from scheduler_svc.core import SchedulerConfig
from scheduler_svc.core.block_manager import BlockManager
from scheduler_svc.core.request import FinishReason
from scheduler_svc.core.scheduler import Scheduler
from scheduler_svc.executors import ExecutorInfo
from tests.scheduler.factories import TICKING_CLOCK_CONFIG, Clock, make_model, make_request, step

BS, WINDOW, STEP = 4, 10, 8


def _tokens(n: int, seed: int = 0) -> list[int]:
    return [100 + (i * 7 + seed) % 50 for i in range(n)]


def _prefill(bm: BlockManager, seq: int, tokens: list[int], hashes: list[int]) -> None:
    """Chunks of STEP tokens, registered as the scheduler does after each."""
    done = 0
    while done < len(tokens):
        n = min(STEP, len(tokens) - done)
        bm.grow(seq, done + n, n)
        done += n
        bm.register_full_blocks(seq, tokens, hashes, done)
        bm.assert_invariants()


def test_a_long_prefill_holds_only_its_window_and_frees_everything_at_the_end():
    bm = BlockManager(64, BS, window=WINDOW, max_step_tokens=STEP)
    assert bm.blocks_needed(1000) == -(-(WINDOW + STEP) // BS) + 1 == 6
    tokens = _tokens(100)
    _prefill(bm, 1, tokens, [])
    table, released = bm.block_table(1), bm.num_released(1)
    assert len(table) == 25  # positions keep their indices
    # The last chunk (4 tokens) starts at 96: its window starts at 87; block 21 (84-87)
    # is kept, with one position to spare, and the 21 before it are released.
    assert released == 21
    assert 64 - bm.num_free_blocks == 4 <= bm.blocks_needed(100)
    assert bm.num_exclusive(1) == 4
    bm.free(1)
    bm.assert_invariants()
    assert bm.num_free_blocks == 64


def test_decode_releases_a_block_as_it_leaves_the_window():
    bm = BlockManager(32, BS, window=WINDOW, max_step_tokens=STEP)
    bm.grow(1, 12, 12)  # a 12-token prompt in one chunk: first query 0, nothing released
    assert bm.num_released(1) == 0
    held = []
    for pos in range(12, 40):  # decode: the token at pos needs pos + 1 positions
        bm.try_append_block(1, pos + 1)
        bm.assert_invariants()
        held.append(32 - bm.num_free_blocks)
    # Released as a block is appended: the last at 36 (window from 27, block 6 kept).
    assert bm.num_released(1) == (36 - WINDOW) // BS == 6
    assert max(held) <= 5 and len(bm.block_table(1)) == 10


def test_released_hashed_blocks_stay_cached_for_the_next_same_prompt():
    bm = BlockManager(64, BS, window=WINDOW, max_step_tokens=STEP)
    tokens, hashes = _tokens(60), []
    _prefill(bm, 1, tokens, hashes)
    assert bm.num_released(1) > 0
    hits, _ = bm.num_cached_prefix(tokens, [])
    assert len(hits) == (60 - 1) // BS  # every full block, released ones included
    bm.share_prefix(2, hits)
    bm.assert_invariants()
    # The index maps each hash to a block holding exactly that chunk's tokens.
    index = bm.indexed_blocks()
    for i, h in enumerate(hashes[:len(hits)]):
        assert index[h] == tuple(tokens[i * BS:(i + 1) * BS])


def test_decoded_blocks_registered_late_skip_released_entries():
    """Decoded blocks enter the index when the sequence leaves the running set; by then
    its early entries were released (and reused by another sequence): not registered."""
    bm = BlockManager(16, BS, window=WINDOW, max_step_tokens=STEP)
    tokens, hashes = _tokens(8), []
    _prefill(bm, 1, tokens, hashes)
    for pos in range(8, 40):
        tokens.append(300 + pos)
        bm.try_append_block(1, pos + 1)
    bm.grow(2, bm.num_free_blocks * BS)  # another sequence takes every released block
    released = bm.num_released(1)
    assert set(bm.block_table(1)[:released]) & set(bm.block_table(2))
    bm.register_full_blocks(1, tokens, hashes, 40)
    bm.assert_invariants()
    index = bm.indexed_blocks()
    for i, h in enumerate(hashes):
        if h in index:
            assert index[h] == tuple(tokens[i * BS:(i + 1) * BS])
    assert all(h not in index for h in hashes[2:released])  # decoded ones, released


def test_swap_moves_only_the_blocks_still_owned():
    bm = BlockManager(32, BS, num_host_blocks=16, window=WINDOW, max_step_tokens=STEP)
    _prefill(bm, 1, _tokens(60), [])
    released, live = bm.num_released(1), bm.block_table(1)[bm.num_released(1):]
    assert bm.can_swap_out(1)
    pairs = bm.swap_out(1)
    assert [d for d, _ in pairs] == live
    assert bm.num_free_blocks == 32 and bm.num_free_host_blocks == 16 - len(live)
    back = bm.swap_in(1)
    table = bm.block_table(1)
    assert len(table) == 15 and bm.num_released(1) == released
    assert table[released:] == [d for _, d in back]
    bm.assert_invariants()
    bm.free(1)
    assert bm.num_free_blocks == 32 and bm.num_free_host_blocks == 16


def test_without_a_window_nothing_is_released():
    bm = BlockManager(64, BS, max_step_tokens=STEP)
    assert bm.blocks_needed(1000) == 250
    _prefill(bm, 1, _tokens(100), [])
    assert bm.num_released(1) == 0 and 64 - bm.num_free_blocks == 25


def test_the_hellos_window_reaches_the_block_manager():
    hello = pb.Hello(incarnation="x", block_size=16, num_device_blocks=1024, max_model_len=8192,
                     vocab_size=1000, kv_window=4096)
    core = Scheduler(SchedulerConfig(max_num_batched_tokens=512))
    core.attach_executor(ExecutorInfo.from_hello(hello).model)
    assert core.block_manager.window == 4096
    assert core.block_manager.blocks_needed(8192) == -(-(4096 + 512) // 16) + 1


def test_a_pool_that_holds_the_window_but_not_a_whole_step_caps_the_step():
    """48 positions, a window of 7 and a 38-token budget: window + budget would need 13
    blocks, more than the pool, so one sequence computes at most 37 tokens a step and
    holds at most 12 blocks; a pool short of even one token's span caps nothing."""
    bm = BlockManager(12, BS, window=7, max_step_tokens=38)
    assert bm.step_cap == 37 and bm.blocks_needed(10_000) == 12
    assert BlockManager(2, BS, window=7, max_step_tokens=38).step_cap == 1
    assert BlockManager(12, BS, max_step_tokens=38).step_cap == 0


def test_under_a_window_the_pool_is_no_context_limit_even_across_a_restart():
    """A sequence alone in a 12-block pool decodes far past 48 positions under a window of
    7; its executor restarts (everything recomputed) and it resumes, chunked at the step
    cap, instead of ending with LENGTH because its whole context outgrew the pool."""
    sched = Scheduler(SchedulerConfig(watermark=0.0, max_num_batched_tokens=38, max_num_seqs=2,
                                      chunk_size=38, **TICKING_CLOCK_CONFIG), clock=Clock(1.0))
    sched.attach_executor(make_model(num_blocks=12, block_size=BS, kv_window=7))
    req = make_request(prompt_len=30, max_tokens=60)
    sched.add_request(req)
    for _ in range(40):
        out = step(sched)
        assert all(n <= 37 for _, n, _ in out.scheduled())
    assert req.num_tokens > 12 * BS + 1 and not req.is_finished
    sched.detach_executor()
    sched.attach_executor(make_model(num_blocks=12, block_size=BS, kv_window=7))
    while sched.has_work():
        out = step(sched)
        assert all(n <= 37 for _, n, _ in out.scheduled())
    assert req.finish_reason == FinishReason.LENGTH and req.num_output_tokens == 60


def test_early_in_a_sequence_nothing_is_counted_as_releasable():
    """Before a sequence's first query reaches past the window nothing can be released,
    and can_grow must not count anything either (a negative block index once counted
    the table's leading entries)."""
    bm = BlockManager(3, BS, window=12, max_step_tokens=2)
    bm.grow(1, 11, 11)  # 3 blocks: the whole pool
    assert bm.num_free_blocks == 0
    assert not bm.can_grow(1, 13, 0, 2)  # first query 11: nothing behind the window yet
