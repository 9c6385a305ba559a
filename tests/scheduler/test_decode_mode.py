"""Decode mode (core/decode_mode.py): most decodes advance by a shared clock
instead of one by one. These tests hold it to the plans one-by-one scheduling makes,
and to the edges where a sequence must leave it."""

from __future__ import annotations

import pytest

from scheduler_svc.core import Event, FinishReason
from scheduler_svc.core import decode_mode as decode_mode_module
from tests.scheduler.factories import (
    EOS,
    fake_execute,
    make_request,
    make_scheduler,
    run_to_completion,
    step,
)


def workload(n: int = 24) -> list:
    """Prompts of 3–40 tokens, outputs of 1–60, three tiers, some EOS."""
    reqs = []
    for i in range(n):
        r = make_request(prompt_len=3 + (i * 7) % 38, max_tokens=1 + (i * 13) % 60,
                         priority_tier=i % 3, tenant=f"t{i % 2}")
        r.token_ids[:] = [20 + (i * 31 + j * 7) % 900 for j in range(r.num_prompt_tokens)]
        reqs.append(r)
    return reqs


def eos_positions(reqs) -> dict[str, int]:
    return {r.request_id: 5 + i % 17 for i, r in enumerate(reqs) if i % 4 == 0}


def run(decode_mode: bool, monkeypatch, num_blocks: int, **config):
    with monkeypatch.context() as m:
        if not decode_mode:
            m.setattr(decode_mode_module, "MIN_BLOCK_SIZE", 1 << 30)
        sched = make_scheduler(num_blocks=num_blocks, block_size=4, **config)
        reqs = workload()
        # The same names in both runs: fake tokens depend on (request id, position).
        for i, r in enumerate(reqs):
            r.request_id = f"w{i}"
            sched.add_request(r)
        eos = eos_positions(reqs)
        names = {r.seq_id: r.request_id for r in reqs}  # seq ids differ between runs
        plans, bulk = [], 0
        while sched.has_work():
            out = sched.schedule()
            sched.assert_invariants(out)
            # What each sequence gets: tokens and new blocks (which ids the pool hands
            # out first is its choice; they must be the tail of the sequence's table).
            offset, per_seq = 0, {}
            for req, n, k in zip(out.cached, out.cached_num_tokens,
                                 out.cached_num_new_blocks, strict=True):
                new = out.cached_new_block_ids[offset:offset + k]
                table = sched.block_manager.block_table(req.seq_id)
                assert not k or table[len(table) - k:] == new, req.request_id
                per_seq[req.request_id] = (n, k)
                offset += k
            per_seq.update({r.request_id: (n, "new") for r, n in out.new})
            plans.append((per_seq, sorted(names[s] for s in out.finished_seq_ids)))
            bulk += out.num_bulk
            sched.update(out, *fake_execute(out, eos_at=eos))
            sched.assert_invariants()
            assert len(plans) < 5000
        outputs = {r.request_id: (r.token_ids[r.num_prompt_tokens:], r.finish_reason)
                   for r in reqs}
        assert sched.block_manager.num_free_blocks == num_blocks
        return plans, outputs, bulk


def test_decode_mode_makes_the_plans_one_by_one_scheduling_makes(monkeypatch):
    """Enough blocks for everyone: every step gives every sequence the same tokens and
    as many new blocks with decode mode as without (only the order differs)."""
    config = dict(max_num_seqs=16, max_num_batched_tokens=64, chunk_size=16)
    plans, outputs, bulk = run(True, monkeypatch, 400, **config)
    ref_plans, ref_outputs, ref_bulk = run(False, monkeypatch, 400, **config)
    assert ref_bulk == 0 and bulk > 0.5 * sum(len(p) for p, _ in plans)
    assert outputs == ref_outputs
    assert len(plans) == len(ref_plans)
    for i, (got, want) in enumerate(zip(plans, ref_plans, strict=True)):
        assert got == want, f"step {i + 1} differs"


def test_decode_mode_under_kv_pressure_delivers_the_same_outputs(monkeypatch):
    config = dict(max_num_seqs=12, max_num_batched_tokens=48, chunk_size=16)
    _, outputs, bulk = run(True, monkeypatch, 40, **config)
    _, ref_outputs, _ = run(False, monkeypatch, 40, **config)
    assert bulk > 0
    assert outputs == ref_outputs
    assert all(reason in (FinishReason.STOP, FinishReason.LENGTH)
               for _, reason in outputs.values())


def test_a_starting_block_moves_the_sequence_to_the_bulk_tail():
    sched = make_scheduler(num_blocks=256, block_size=4, max_num_seqs=8,
                           max_num_batched_tokens=64, chunk_size=64)
    for i in range(8):
        sched.add_request(make_request(prompt_len=5 + i, max_tokens=40))
    outs = [step(sched) for _ in range(12)]
    for out in outs[3:]:
        head = out.cached_num_new_blocks[:out.num_bulk]
        k = sum(head)
        assert head == [0] * (out.num_bulk - k) + [1] * k, head
        assert len(out.cached_new_block_ids) == sum(out.cached_num_new_blocks)
        for req in out.cached[:out.num_bulk]:
            table = sched.block_manager.block_table(req.seq_id)
            assert len(table) == -(-req.num_computed_tokens // 4)  # blocks as computed
    assert sum(out.num_bulk for out in outs[3:]) >= 7 * 9


def decoding(block_size: int, prompt_len: int, warm_steps: int):
    """Three requests decoding; returns the scheduler and its next (unanswered) plan."""
    sched = make_scheduler(num_blocks=64, block_size=block_size, max_num_seqs=4,
                           max_num_batched_tokens=32, chunk_size=32)
    for _ in range(3):
        sched.add_request(make_request(prompt_len=prompt_len, max_tokens=50))
    for _ in range(warm_steps):
        step(sched)
    return sched, sched.schedule()


def test_a_missing_sample_is_not_decoded_past():
    """The executor's answer lacks one planned sample: that sequence is not given a
    decode for a token it does not have (it waits, as before decode mode)."""
    sched, out = decoding(block_size=4, prompt_len=6, warm_steps=4)
    assert out.num_bulk >= 2
    lost = out.cached[0]
    seq_ids, tokens = fake_execute(out)
    i = seq_ids.index(lost.seq_id)
    sched.update(out, seq_ids[:i] + seq_ids[i + 1:], tokens[:i] + tokens[i + 1:])
    sched.assert_invariants()
    assert lost.num_computed_tokens == len(lost.token_ids)  # its sample never came
    nxt = sched.schedule()
    sched.assert_invariants(nxt)
    assert lost not in nxt.cached
    assert all(r.num_computed_tokens <= len(r.token_ids) for r in sched.running)


def test_a_stop_token_in_the_bulk_ends_the_request_at_once():
    sched, out = decoding(block_size=8, prompt_len=3, warm_steps=3)
    victim = out.cached[0]
    assert out.num_bulk == 3
    seq_ids, tokens = fake_execute(out)
    tokens[seq_ids.index(victim.seq_id)] = EOS
    events = sched.update(out, seq_ids, tokens)
    assert Event(victim, EOS, FinishReason.STOP) in events
    assert victim.is_finished and victim not in sched.running
    assert out.finished_seq_ids == [] and sched.schedule().finished_seq_ids == [victim.seq_id]


@pytest.mark.parametrize("block_size", [4, 16])
def test_decoded_blocks_are_cached_when_the_sequence_ends(block_size):
    """A follow-up turn whose prompt is the first turn's prompt and answer reuses the
    answer's blocks too (they are indexed when the first request finishes)."""
    sched = make_scheduler(num_blocks=64, block_size=block_size, max_num_seqs=4,
                           max_num_batched_tokens=128, chunk_size=128)
    first = make_request(prompt_len=2 * block_size + 1, max_tokens=3 * block_size)
    sched.add_request(first)
    run_to_completion(sched)
    history = list(first.token_ids)
    follow = make_request(prompt_len=len(history) + 3, max_tokens=2)
    follow.token_ids[:] = history + [11, 12, 13]
    sched.add_request(follow)
    out = sched.schedule()
    ((req, n),) = out.new
    computed_before = (len(history) - 1) // block_size * block_size  # last token unsent
    assert req is follow and n == len(follow.token_ids) - computed_before


def test_prompt_blocks_are_hashed_on_arrival():
    sched = make_scheduler(num_blocks=64, block_size=4)
    req = make_request(prompt_len=18)
    sched.add_request(req)
    assert len(req.block_hashes) == 4
