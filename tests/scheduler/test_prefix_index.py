"""The prefix index's lazy runs: registered blocks are indexed only when a lookup reaches
them, found exactly as eagerly indexed ones are, and a run nobody looks up leaves
nothing behind once its blocks are handed out again."""

from __future__ import annotations

import pytest

from scheduler_svc.core import BlockManager
from scheduler_svc.core.kv_events import KVEventLog


def _registered(bm: BlockManager, seq_id: int, tokens: list[int]) -> list[int]:
    """``tokens`` computed and registered for ``seq_id``; returns its hash cache."""
    hashes: list[int] = []
    bm.grow(seq_id, len(tokens))
    bm.register_full_blocks(seq_id, tokens, hashes, len(tokens), [])
    return hashes


def test_a_registered_run_waits_unindexed_then_a_lookup_finds_all_of_it():
    bm = BlockManager(num_blocks=16, block_size=4)
    tokens = list(range(100, 112))  # three full blocks
    hashes = _registered(bm, 1, tokens)
    table = list(bm.block_table(1))
    index = bm._pool.index
    assert len(hashes) == 1  # only the run's first block was hashed, as its key
    assert not index.by_hash and len(index.pending) == 1
    bm.free(1)
    assert bm.num_cached_free_blocks == 3  # kept, as indexed blocks are
    bm.assert_invariants()
    hits, _ = bm.num_cached_prefix(tokens + [1], [], [])
    assert hits == table and not index.pending and len(index.by_hash) == 3
    bm.assert_invariants()


def test_a_continuation_is_found_through_two_runs_and_a_forged_one_is_not():
    """A follow-up turn (prompt + answer + more) hits the prompt's run and the answer's,
    each indexed as the lookup reaches it; the same hashes with other tokens do not."""
    bm = BlockManager(num_blocks=32, block_size=4)
    prompt, answer = list(range(10, 18)), list(range(50, 58))
    hashes: list[int] = []
    chunks: list[tuple] = []
    bm.extend_hashes(prompt, hashes, 2, chunks)
    bm.grow(1, 8)
    bm.register_full_blocks(1, prompt, hashes, 8, chunks)  # as prefill registers it
    history = prompt + answer
    bm.grow(1, 16)
    bm.register_full_blocks(1, history, hashes, 16, chunks)  # as the sequence leaves
    table = list(bm.block_table(1))
    bm.free(1)
    index = bm._pool.index
    # The answer's first hash is not computed: its run is found by the prompt's last.
    assert len(index.pending) == 1 and len(index.following) == 1 and len(hashes) == 2
    forged = list(range(10, 18)) + [0] * 8 + [1]
    assert bm.num_cached_prefix(forged, list(hashes[:2]), None)[0] == table[:2]
    assert bm.num_cached_prefix(history + [9, 9, 9], [], [])[0] == table
    bm.assert_invariants()


def test_an_answer_grows_its_prompts_run_and_a_follow_up_finds_both():
    """As a real sequence does it (one token list that grows): the answer's blocks join
    the prompt's run while it is still lazy, one run instead of two; a follow-up turn
    finds prompt and answer, a forged answer only the prompt, and once the answer's last
    blocks are handed out again the rest is still found."""
    bm = BlockManager(num_blocks=8, block_size=4)
    tokens, hashes, chunks = list(range(10, 18)), [], []
    bm.extend_hashes(tokens, hashes, 2, chunks)
    bm.grow(1, 8)
    bm.register_full_blocks(1, tokens, hashes, 8, chunks)  # as prefill registers it
    tokens += range(50, 58)  # the answer, appended to the same list
    bm.grow(1, 16)
    bm.register_full_blocks(1, tokens, hashes, 16, chunks)  # as the sequence leaves
    index = bm._pool.index
    assert len(index.pending) == 1 and not index.following and len(hashes) == 2
    table = list(bm.block_table(1))
    bm.free(1)
    bm.assert_invariants()
    forged = tokens[:8] + [0] * 8 + [1]
    assert bm.num_cached_prefix(forged, [], [], count=False)[0] == table[:2]
    assert bm.num_cached_prefix(tokens + [9], [], [])[0] == table
    bm.assert_invariants()
    # Again, lazily, and then the pool hands out the answer's two blocks (the LRU's oldest:
    # a table is released tail first): the prompt's are still found.
    bm = BlockManager(num_blocks=6, block_size=4)
    tokens, hashes, chunks = list(range(10, 18)), [], []
    bm.extend_hashes(tokens, hashes, 2, chunks)
    bm.grow(1, 8)
    bm.register_full_blocks(1, tokens, hashes, 8, chunks)
    tokens += range(50, 58)
    bm.grow(1, 16)
    bm.register_full_blocks(1, tokens, hashes, 16, chunks)
    table = list(bm.block_table(1))
    bm.free(1)
    bm.grow(2, 16)  # two free blocks, then the answer's two cached-free ones
    assert set(table[2:]) <= set(bm.block_table(2))
    bm.assert_invariants()
    assert bm.num_cached_prefix(tokens + [9], [], [])[0] == table[:2]
    bm.assert_invariants()


def test_runs_whose_blocks_are_handed_out_again_leave_nothing_pending():
    bm = BlockManager(num_blocks=8, block_size=4)
    for seq_id in range(1, 200):  # each takes the whole pool, evicting the last one's
        _registered(bm, seq_id, [seq_id] * 32)
        bm.assert_invariants()
        assert len(bm._pool.index.pending) == 1
        bm.free(seq_id)
    assert bm.num_free_blocks == 8
    bm.grow(999, 32)
    assert not bm._pool.index.pending and not bm._pool.index.by_hash
    bm.assert_invariants()


def test_a_duplicate_of_a_pending_run_is_indexed_after_it_and_shares_nothing_wrong():
    """Two sequences register the same content: the first one's blocks are the indexed
    ones (as eagerly), the second's stay out and go back to the free list."""
    bm = BlockManager(num_blocks=16, block_size=4)
    tokens = list(range(7, 19))
    _registered(bm, 1, tokens)
    _registered(bm, 2, tokens)
    first, second = list(bm.block_table(1)), list(bm.block_table(2))
    bm.free(2)
    bm.free(1)
    assert bm.num_cached_prefix(tokens + [0], [], [])[0] == first
    assert set(second) <= set(bm._pool.free)
    bm.assert_invariants()


def test_with_kv_events_every_block_is_indexed_and_announced_at_once():
    events = KVEventLog()
    bm = BlockManager(num_blocks=16, block_size=4, events=events)
    tokens = list(range(100, 112))
    _registered(bm, 1, tokens)
    assert len(bm._pool.index.by_hash) == 3 and not bm._pool.index.pending
    assert sum(len(e[1]) for e in events.take() if e[0] == "stored") == 3


def test_two_answers_after_one_prompt_are_each_found_by_their_own_tokens():
    """Answers registered as their sequences leave wait, unhashed, behind the prompt's
    last hash; a second answer behind the same hash is indexed at once, the first before
    it. A lookup finds each by its own tokens, and an answer nobody wrote by neither."""
    bm = BlockManager(num_blocks=32, block_size=4)
    prompt = list(range(10, 18))
    tables = {}
    for seq_id, answer in ((1, [50] * 8), (2, [60] * 8)):
        hashes: list[int] = []
        chunks: list[tuple] = []
        bm.extend_hashes(prompt, hashes, 2, chunks)  # hashed on arrival
        hits, _ = bm.num_cached_prefix(prompt + [1], list(hashes), list(chunks))
        bm.share_prefix(seq_id, hits)
        bm.grow(seq_id, 16)
        bm.register_full_blocks(seq_id, prompt, hashes, 8, chunks)
        bm.register_full_blocks(seq_id, prompt + answer, hashes, 16, chunks)
        tables[seq_id] = list(bm.block_table(seq_id))
        bm.free(seq_id)
        bm.assert_invariants()
        index = bm._pool.index
        assert len(index.following) == (1 if seq_id == 1 else 0)
    assert tables[1][:2] == tables[2][:2] and len(index.by_hash) == 6
    for seq_id, answer in ((2, [60] * 8), (1, [50] * 8)):
        assert bm.num_cached_prefix(prompt + answer + [1], [], [])[0] == tables[seq_id]
        bm.assert_invariants()
    assert bm.num_cached_prefix(prompt + [70] * 8 + [1], [], [])[0] == tables[1][:2]


@pytest.mark.parametrize("num_blocks", [16, 9000])  # a plain dict's LRU, an OrderedDict's
def test_cached_free_blocks_are_handed_out_again_least_recently_released_first(num_blocks):
    bm = BlockManager(num_blocks=num_blocks, block_size=4)
    tables = {}
    for seq_id in (1, 2, 3):
        _registered(bm, seq_id, [seq_id] * 8)  # two full blocks each, registered
        tables[seq_id] = list(bm.block_table(seq_id))
    for seq_id in (2, 1, 3):
        bm.free(seq_id)  # each table's last block first
    bm.grow(100, (num_blocks - 6) * 4)  # every free block: what is left is cached-free
    assert bm.num_cached_free_blocks == 6
    taken = [bm.grow(seq_id, 8) for seq_id in (101, 102, 103)]
    assert taken == [tables[2][::-1], tables[1][::-1], tables[3][::-1]]
    bm.assert_invariants()
