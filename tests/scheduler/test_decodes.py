"""The decodes of a step (core/decodes.py): every running sequence rides the step clock
and the decoding ones are the plan's bulk. These tests hold each step to what scheduling
one sequence at a time would give (every sequence with a token to decode gets exactly
one, and the blocks its positions need), every output to the one the fake model makes
token by token, and the edges: a block start, a last sample by length, a missing
sample, a stop token."""

from __future__ import annotations

import pytest

from scheduler_svc.core import Event, FinishReason
from tests.scheduler.factories import (
    EOS,
    fake_execute,
    fake_token,
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
        r.request_id = f"w{i}"
        reqs.append(r)
    return reqs


def eos_positions(reqs) -> dict[str, int]:
    return {r.request_id: 5 + i % 17 for i, r in enumerate(reqs) if i % 4 == 0}


def expected_output(req, eos: dict[str, int], max_model_len: int):
    """What the fake executor generates for ``req`` one token at a time (its tokens
    depend on the request and the position only, as seeded sampling does)."""
    limit = min(req.num_prompt_tokens + req.max_tokens, max_model_len)
    out: list[int] = []
    while True:
        k = len(out)
        token = EOS if eos.get(req.request_id) == k else \
            100 + hash((req.request_id, req.num_prompt_tokens + k)) % 800
        out.append(token)
        if token == EOS:
            return out, FinishReason.STOP
        if req.num_prompt_tokens + len(out) >= limit:
            return out, FinishReason.LENGTH


def answer(samplers, eos: dict[str, int]) -> tuple[list[int], list[int]]:
    """A plan's samples, each at the position its history has reached when it is
    answered (the executor knows the token it sampled last)."""
    return [r.seq_id for r in samplers], [
        EOS if eos.get(r.request_id) == r.num_output_tokens else fake_token(r)
        for r in samplers]


def run(num_blocks: int, ahead: bool = False, **config):
    """The workload to its end, every plan checked against one-at-a-time scheduling;
    ``ahead``: each step is built before the last one's answer (two in flight)."""
    sched = make_scheduler(num_blocks=num_blocks, block_size=4, **config)
    reqs = workload()
    for r in reqs:
        sched.add_request(r)
    eos = eos_positions(reqs)
    expected = {r.request_id: (r.num_prompt_tokens, r.max_tokens) for r in reqs}
    num_bulk = num_scheduled = 0
    pending = None
    while sched.has_work() or pending is not None:
        # Before the plan: who has exactly one token to decode (synchronous steps only).
        decoders = {r for r in sched.running if len(r.token_ids) - r.num_computed_tokens == 1}
        out = sched.schedule()
        sched.assert_invariants(out)
        bm = sched.block_manager
        offset = 0
        for i, (req, k) in enumerate(zip(out.cached, out.cached_num_new_blocks, strict=True)):
            new = out.cached_new_block_ids[offset:offset + k]
            table = bm.block_table(req.seq_id)
            assert not k or table[len(table) - k:] == new, req.request_id
            if i < out.num_bulk:  # a decode holds what its positions need (a resume, more)
                assert len(table) == -(-req.num_computed_tokens // 4), req.request_id
            offset += k
        bulk = out.cached[:out.num_bulk]
        assert all(n == 1 for n in out.cached_num_tokens[:out.num_bulk])
        if not ahead and not out.finished_seq_ids:  # nobody preempted this step
            assert set(bulk) == decoders, "a decode missing, or one too many"
        num_bulk += out.num_bulk
        num_scheduled += len(out.cached) + len(out.new)
        if ahead:  # the executor samples what the plan completes, when it runs it
            samplers = [r for r, _, _ in out.scheduled() if r.num_computed_tokens >= r.num_tokens]
            if pending is not None:
                sched.update(pending[0], *answer(pending[1], eos))
            pending = None if out.is_empty else (out, samplers)
        else:
            sched.update(out, *fake_execute(out, eos_at=eos))
        sched.assert_invariants()
        assert num_scheduled < 50_000
    assert bm.num_free_blocks == num_blocks
    for r in reqs:
        assert (r.token_ids[r.num_prompt_tokens:], r.finish_reason) == \
            expected_output(r, eos, sched.model.max_model_len), r.request_id
        assert r.num_prompt_tokens == expected[r.request_id][0]
    return num_bulk, num_scheduled


def test_each_step_decodes_every_sequence_with_a_token_to_decode_and_only_those():
    """Enough blocks for everyone: every step's bulk is exactly the running sequences
    with one token to decode, each with the blocks its positions need, and every output
    is the one the model makes token by token."""
    num_bulk, num_scheduled = run(400, max_num_seqs=16, max_num_batched_tokens=64,
                                  chunk_size=16)
    assert num_bulk > 0.5 * num_scheduled


def test_under_kv_pressure_the_outputs_are_the_models():
    num_bulk, _ = run(40, max_num_seqs=12, max_num_batched_tokens=48, chunk_size=16)
    assert num_bulk > 0


@pytest.mark.parametrize("num_blocks", [400, 40])
def test_scheduling_ahead_never_decodes_past_a_last_sample(num_blocks):
    """Each step built before the last one's answer: a sequence whose pending sample is
    its last by length is not decoded again (its answer ends it from the bulk), and
    every output is the model's, none longer than its max_tokens."""
    num_bulk, _ = run(num_blocks, ahead=True, max_num_seqs=12, max_num_batched_tokens=48,
                      chunk_size=16)
    assert num_bulk > 0


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
    decode for a token it does not have (it waits)."""
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


def test_prefills_continue_in_priority_order():
    """Two running prefills and budget for one chunk and a bit: the better tier's chunk
    goes first, though it started after the other."""
    sched = make_scheduler(num_blocks=64, block_size=4, max_num_seqs=4,
                           max_num_batched_tokens=16, chunk_size=12)
    low = make_request(prompt_len=60, max_tokens=4, priority_tier=2)
    sched.add_request(low)
    step(sched)  # low's first chunk
    high = make_request(prompt_len=60, max_tokens=4, priority_tier=0)
    sched.add_request(high)
    out = step(sched)  # low continues; high is admitted with what is left
    assert dict((r.request_id, n) for r, n, _ in out.scheduled()) == {
        low.request_id: 12, high.request_id: 4}
    out = step(sched)
    assert dict((r.request_id, n) for r, n, _ in out.scheduled()) == {
        high.request_id: 12, low.request_id: 4}
