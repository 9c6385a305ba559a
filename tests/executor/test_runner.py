"""Runner: token-exact against transformers' greedy decoding, under any mix of chunked
prefill and decode, and bad plans refused without damage."""

from __future__ import annotations

import pytest
import torch

from harness.mini_scheduler import INCARNATION, MiniScheduler, hf_greedy, make_runner
from harness.prompts import MORE_PROMPTS, PROMPTS
from protos import seq_columns, wire
from protos.continuum.v1 import executor_pb2 as pb
from protos.continuum.v1 import sampling_pb2


def chat_prompt(tok, question: str) -> list[int]:
    system = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
    text = (f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n{question}<|im_end|>\n"
            "<|im_start|>assistant\n")
    return tok.encode(text).ids


@pytest.mark.parametrize("kv_dtype", [None, torch.float16])  # None: fp32, the model's
def test_capital_of_france(model, tok, kv_dtype):
    prompt = chat_prompt(tok, "What is the capital of France?")
    sched = MiniScheduler(make_runner(model, kv_dtype=kv_dtype), chunk_size=64)
    sched.add(1, prompt, max_new=8)
    sched.run()
    out = sched.outputs(1)
    assert tok.decode(out[:-1]) == "The capital of France is Paris."
    assert out[-1] == 2  # <|im_end|>


def test_one_request_matches_transformers(model, hf_model, tok):
    prompt = tok.encode(PROMPTS[0]).ids
    expected = hf_greedy(hf_model, prompt, 20)
    sched = MiniScheduler(make_runner(model), chunk_size=512)
    sched.add(1, prompt, max_new=20)
    sched.run()
    assert len(expected) >= 10
    assert sched.outputs(1)[: len(expected)] == expected


def test_concurrent_chunked_requests_match_transformers(model, hf_model, tok):
    texts = PROMPTS + MORE_PROMPTS
    prompts = [tok.encode(p).ids for p in texts]
    assert len(prompts) == 16 and len({len(p) for p in prompts}) >= 10
    expected = [hf_greedy(hf_model, p, 12) for p in prompts]
    # chunk 5 and 4-token blocks: prompts span several chunks and blocks, and steps mix
    # prompt chunks of some sequences with decodes of others.
    sched = MiniScheduler(make_runner(model, num_blocks=320, block_size=4), chunk_size=5)
    for i, p in enumerate(prompts):
        sched.add(i, p, max_new=12)
    mixed = 0
    while not all(s.done for s in sched.seqs.values()):
        plan_sizes = [min(len(s.tokens) - s.computed, 5) for s in sched.seqs.values() if not s.done]
        mixed += 1 in plan_sizes and any(n > 1 for n in plan_sizes)
        sched.step()
    assert mixed > 0
    for i, want in enumerate(expected):
        assert sched.outputs(i)[: len(want)] == want, texts[i]


def test_recompute_and_prefix_reuse_match_transformers(model, hf_model, tok):
    long_prompt = tok.encode(PROMPTS[2]).ids  # 18 tokens: 4 full blocks of 4
    expected = hf_greedy(hf_model, long_prompt, 10)
    sched = MiniScheduler(make_runner(model, num_blocks=64, block_size=4), chunk_size=6)
    sched.add(1, long_prompt, max_new=10)
    for _ in range(6):
        sched.step()
    # seq 2 shares seq 1's first 3 blocks as a cached prefix and computes only the rest.
    sched.add(2, long_prompt, max_new=10, prefix_of=1, num_prefix_blocks=3)
    sched.step()
    sched.preempt(1)  # recompute: sent again in full (prompt + outputs so far), in chunks
    sched.run()
    assert sched.outputs(1)[: len(expected)] == expected
    assert sched.outputs(2)[: len(expected)] == expected


def test_swap_out_and_in_matches_transformers(model, hf_model, tok):
    prompt = tok.encode(PROMPTS[2]).ids
    expected = hf_greedy(hf_model, prompt, 10)
    sched = MiniScheduler(make_runner(model, num_blocks=32, block_size=4, num_host_blocks=8),
                          chunk_size=8)
    sched.add(1, prompt, max_new=10)
    sched.add(2, tok.encode(PROMPTS[4]).ids, max_new=10)
    for _ in range(5):
        sched.step()
    sched.swap_out(1)
    sched.step()  # seq 2 runs alone; seq 1's KV sits in the host pool
    sched.swap_in(1)
    sched.run()
    assert sched.outputs(1)[: len(expected)] == expected


def test_seeded_sampling_is_independent_of_the_batch(model, tok):
    sampling = sampling_pb2.SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=1234)
    prompt = tok.encode(PROMPTS[2]).ids
    alone = MiniScheduler(make_runner(model), chunk_size=64)
    alone.add(7, prompt, max_new=10, sampling=sampling)
    alone.run()
    batch = MiniScheduler(make_runner(model), chunk_size=7)
    batch.add(1, tok.encode(PROMPTS[1]).ids, max_new=10,
              sampling=sampling_pb2.SamplingParams(temperature=1.0, seed=99))
    batch.add(7, prompt, max_new=10, sampling=sampling)
    batch.add(3, tok.encode(PROMPTS[3]).ids, max_new=10)
    batch.run()
    assert batch.outputs(7) == alone.outputs(7)
    other_seed = MiniScheduler(make_runner(model), chunk_size=64)
    other_seed.add(7, prompt, max_new=10,
                   sampling=sampling_pb2.SamplingParams(temperature=0.9, top_p=0.95, seed=1))
    other_seed.run()
    assert other_seed.outputs(7) != alone.outputs(7)


def test_logprobs_are_returned_when_asked(model, tok):
    sched = MiniScheduler(make_runner(model), chunk_size=64)
    sched.add(1, tok.encode(PROMPTS[3]).ids, max_new=1,
              sampling=sampling_pb2.SamplingParams(temperature=0.0, logprobs=3))
    sched.add(2, tok.encode(PROMPTS[0]).ids, max_new=1)
    result = sched.step()
    assert list(result.top_n) == [3, 0]
    assert len(result.top_token_ids) == len(result.top_logprobs) == 3
    assert result.top_token_ids[0] == result.token_ids[0]  # greedy picks the top token
    assert result.logprobs[0] == pytest.approx(result.top_logprobs[0])
    assert result.logprobs[1] != result.logprobs[1]  # NaN: not asked


def _plan(**kw) -> pb.BatchPlan:
    return pb.BatchPlan(incarnation=kw.pop("incarnation", INCARNATION), step_id=10_000, **kw)


BAD_PLANS = {
    "stale": (_plan(incarnation="old"), pb.STEP_ERROR_CODE_STALE_INCARNATION),
    "unknown-seq": (_plan(cached_seq_ids=[999], cached_num_scheduled_tokens=[1],
                          cached_num_new_blocks=[0]), pb.STEP_ERROR_CODE_UNKNOWN_SEQUENCE),
    "finished-then-cached": (_plan(finished_seq_ids=[1], cached_seq_ids=[1],
                                   cached_num_scheduled_tokens=[1], cached_num_new_blocks=[0]),
                             pb.STEP_ERROR_CODE_UNKNOWN_SEQUENCE),
    "bad-block": (_plan(new_seqs=[pb.NewSequence(seq_id=5, token_ids=[1, 2],
                                                 num_scheduled_tokens=2, block_ids=[10_000],
                                                 num_prompt_tokens=2)]),
                  pb.STEP_ERROR_CODE_BAD_BLOCK),
    "over-scheduled-new": (_plan(new_seqs=[pb.NewSequence(seq_id=5, token_ids=[1, 2],
                                                          num_scheduled_tokens=3, block_ids=[0],
                                                          num_prompt_tokens=2)]),
                           pb.STEP_ERROR_CODE_MALFORMED_PLAN),
    "ragged-arrays": (_plan(cached_seq_ids=[1], cached_num_scheduled_tokens=[1, 1],
                            cached_num_new_blocks=[0]), pb.STEP_ERROR_CODE_MALFORMED_PLAN),
    "over-scheduled-cached": (_plan(cached_seq_ids=[1], cached_num_scheduled_tokens=[5],
                                    cached_num_new_blocks=[0]), pb.STEP_ERROR_CODE_MALFORMED_PLAN),
    "no-host-pool": (_plan(swap_in_src=[0], swap_in_dst=[0]), pb.STEP_ERROR_CODE_BAD_BLOCK),
    "packed-unknown-seq": (_plan(packed_cached_seq_ids=seq_columns.pack([999]),
                                 cached_num_scheduled_tokens=[1], cached_num_new_blocks=[0]),
                           pb.STEP_ERROR_CODE_UNKNOWN_SEQUENCE),
    "packed-ragged": (_plan(packed_cached_seq_ids=seq_columns.pack([1])[:7],
                            cached_num_scheduled_tokens=[1], cached_num_new_blocks=[0]),
                      pb.STEP_ERROR_CODE_MALFORMED_PLAN),
    "packed-and-plain": (_plan(packed_cached_seq_ids=seq_columns.pack([1]), cached_seq_ids=[1],
                               cached_num_scheduled_tokens=[1], cached_num_new_blocks=[0]),
                         pb.STEP_ERROR_CODE_MALFORMED_PLAN),
}


def test_bad_plans_are_refused_and_state_survives(model, tok, hf_model):
    prompt = tok.encode(PROMPTS[3]).ids
    sched = MiniScheduler(make_runner(model), chunk_size=64)
    sched.add(1, prompt, max_new=len(BAD_PLANS) + 2)
    sched.step()  # prefill + first token; seq 1 is now held as a decode
    for name, (plan, code) in BAD_PLANS.items():
        held = {k: (v.num_computed, v.num_tokens) for k, v in sched.runner.seqs.items()}
        result = sched.runner.execute(plan)
        assert result.error_code == code, name
        assert result.error_message and not wire.result_seq_ids(result), name
        after = {k: (v.num_computed, v.num_tokens) for k, v in sched.runner.seqs.items()}
        assert after == held, name
        sched.step()  # and the executor still works
    sched.run()
    assert sched.outputs(1) == hf_greedy(hf_model, prompt, len(BAD_PLANS) + 2)
