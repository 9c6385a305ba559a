"""Sampler: greedy, filters, penalties, min_tokens, seeding by (seed, position), logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from executor_svc.sampler import Sampler, SampleRow, SamplingConfig
from executor_svc.sampling_ops import draw, filter_probs, row_uniform
from protos.continuum.v1 import sampling_pb2

V = 50


def row(cfg: SamplingConfig, position: int = 10, seed: int = 1, history=(), num_prompt=0):
    return SampleRow(cfg, seed, position, list(history), num_prompt)


def logits_for(*rows: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    return torch.randn(len(rows), V, generator=gen) * 3


def test_defaults_from_proto():
    cfg = SamplingConfig.from_proto(sampling_pb2.SamplingParams())
    assert (cfg.temperature, cfg.top_p, cfg.top_k, cfg.seed, cfg.logprobs) == (1.0, 1.0, 0, None,
                                                                              None)
    cfg = SamplingConfig.from_proto(sampling_pb2.SamplingParams(temperature=0.0, seed=0,
                                                                logprobs=0))
    assert cfg.greedy and cfg.seed == 0 and cfg.logprobs == 0


def test_greedy_is_argmax():
    logits = logits_for(0, 1)
    out = Sampler(()).sample(logits, [row(SamplingConfig(temperature=0.0))] * 2)
    assert out.token_ids == logits.argmax(-1).tolist()


def test_greedy_takes_the_first_maximum_and_a_nan_like_torch():
    logits = logits_for(0, 1, 2)
    logits[0, [7, 30]] = 100.0  # a tie: the first index wins
    logits[1, 12] = float("nan")  # NaN compares as the maximum
    logits[2] = float("-inf")
    want = logits.argmax(-1).tolist()
    out = Sampler(()).sample(logits, [row(SamplingConfig(temperature=0.0))] * 3)
    assert out.token_ids == want == [7, 12, 0]


def kept(probs, top_k=0, top_p=1.0, min_p=0.0) -> list[int]:
    out = filter_probs(probs[None], torch.tensor([top_k]), torch.tensor([top_p]),
                       torch.tensor([min_p]))
    return out[0].nonzero().flatten().tolist()


def test_filters():
    probs = torch.tensor([0.05, 0.4, 0.3, 0.2, 0.05])
    assert kept(probs, top_k=2) == [1, 2]
    # top_p 0.6: 0.4 alone is short of it, 0.4 + 0.3 reaches it.
    assert kept(probs, top_p=0.6) == [1, 2]
    assert kept(probs, top_p=0.4) == [1]
    assert kept(probs, min_p=0.6) == [1, 2]
    assert kept(probs) == [0, 1, 2, 3, 4]


def test_filters_batched_and_past_the_candidates():
    gen = torch.Generator().manual_seed(0)
    flat = torch.softmax(torch.randn(3, 5000, generator=gen) * 0.1, dim=-1)  # [3, V], flat
    out = filter_probs(flat, torch.tensor([0, 7, 0]), torch.tensor([0.5, 1.0, 1.0]),
                       torch.tensor([0.0, 0.0, 0.0]))
    # The nucleus of a flat row needs ~2,500 tokens: more than the 1,024 candidates.
    sorted_probs = flat[0].sort(descending=True).values
    need = int((sorted_probs.cumsum(0) - sorted_probs < 0.5 * flat[0].sum()).sum())
    assert int((out[0] > 0).sum()) == need > 1024
    assert int((out[1] > 0).sum()) == 7
    assert torch.equal(out[2], flat[2])


def test_draw_inverts_the_cdf():
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5], [0.2, 0.0, 0.0, 0.0]])
    assert draw(probs, torch.tensor([0.0, 0.999], dtype=torch.float64)).tolist() == [1, 0]
    assert draw(probs, torch.tensor([0.49, 0.5], dtype=torch.float64)).tolist() == [1, 0]
    assert draw(probs, torch.tensor([0.5, 0.0], dtype=torch.float64)).tolist() == [3, 0]


def test_seeded_draws_depend_only_on_seed_and_position():
    logits = logits_for(0, 1, 2)
    sampler = Sampler(())
    cfg = SamplingConfig(temperature=1.5)
    alone = sampler.sample(logits[1:2], [row(cfg, position=7, seed=42)]).token_ids
    batched = sampler.sample(
        logits, [row(SamplingConfig(temperature=0.0)), row(cfg, position=7, seed=42),
                 row(cfg, position=7, seed=43)],
    ).token_ids
    assert batched[1] == alone[0]
    draws = {sampler.sample(logits[1:2], [row(cfg, position=p, seed=42)]).token_ids[0]
             for p in range(40)}
    assert len(draws) > 3  # positions give different randomness
    assert row_uniform(42, 7) == row_uniform(42, 7) != row_uniform(42, 8)
    assert 0.0 <= row_uniform(2**64 - 1, 0) < 1.0


def test_sampling_follows_the_distribution():
    logits = torch.log(torch.tensor([[0.7, 0.2, 0.1]]))
    sampler = Sampler(())
    cfg = SamplingConfig(temperature=1.0)
    counts = torch.zeros(3)
    for p in range(2000):
        counts[sampler.sample(logits, [row(cfg, position=p)]).token_ids[0]] += 1
    torch.testing.assert_close(counts / counts.sum(), torch.tensor([0.7, 0.2, 0.1]), atol=0.04,
                               rtol=0)


def test_penalties_and_min_tokens():
    logits = torch.zeros(1, V)
    logits[0, 5] = 2.0
    logits[0, 6] = -2.0
    logits[0, 7] = 1.9
    sampler = Sampler(eos_token_ids=(5,))
    greedy = SamplingConfig(temperature=0.0)

    def pick(cfg, history=(), num_prompt=0) -> int:
        rows = [row(cfg, history=history, num_prompt=num_prompt)]
        return sampler.sample(logits.clone(), rows).token_ids[0]

    # EOS (5) is banned until min_tokens outputs exist.
    banned = SamplingConfig(temperature=0.0, min_tokens=2)
    assert pick(banned, history=[1, 7], num_prompt=1) == 7
    assert pick(banned, history=[1, 7, 7], num_prompt=1) == 5
    # Repetition penalty divides positive logits of seen tokens: 2.0 / 2 < 1.9.
    rep = SamplingConfig(temperature=0.0, repetition_penalty=2.0)
    assert pick(rep, history=[5], num_prompt=1) == 7
    # Frequency penalty counts output occurrences only; the prompt's 7 does not count.
    freq = SamplingConfig(temperature=0.0, frequency_penalty=0.2)
    assert pick(freq, history=[7, 5], num_prompt=1) == 7
    assert pick(greedy) == 5


def test_logprobs():
    logits = logits_for(0, 1)
    sampler = Sampler(())
    out = sampler.sample(logits, [row(SamplingConfig(temperature=0.0, logprobs=4)),
                                  row(SamplingConfig(temperature=0.0))])
    logp = torch.log_softmax(logits[0], -1)
    assert out.top_ids[0] == torch.topk(logp, 4).indices.tolist()
    assert out.logprobs[0] == pytest.approx(float(logp.max()))
    assert out.top_logprobs[0][0] == pytest.approx(out.logprobs[0])
    assert math.isnan(out.logprobs[1]) and out.top_ids[1] == []


def test_logit_bias_forces_bans_and_shifts_before_choosing():
    logits = logits_for(0, 1, 2)
    best = logits.argmax(-1).tolist()
    forced = SamplingConfig(temperature=0.0, logit_bias=((3,), (100.0,)))
    banned = SamplingConfig(temperature=0.0, logit_bias=((best[1],), (-100.0,)))
    sampled = SamplingConfig(temperature=1.0, seed=5, logit_bias=((9, 11), (100.0, 100.0)))
    out = Sampler(()).sample(logits.clone(),
                             [row(forced), row(banned), row(sampled, seed=5)])
    assert out.token_ids[0] == 3
    assert out.token_ids[1] != best[1]
    assert out.token_ids[2] in (9, 11)  # two tokens 100 up: all the mass is theirs
    proto = sampling_pb2.SamplingParams(logit_bias={4: -2.5, 7: 1.0})
    cfg = SamplingConfig.from_proto(proto)
    assert dict(zip(*cfg.logit_bias, strict=True)) == {4: -2.5, 7: 1.0}


@pytest.mark.parametrize("mass", [0.2, 0.5, 0.9, 0.99])
def test_typical_p_keeps_what_transformers_typical_warper_keeps(mass):
    """Against transformers' TypicalLogitsWarper on random logits: the same tokens kept,
    row by row, in a batch whose other rows ask for no typical_p (they stay unfiltered)
    or combine it with top_k (applied first, as transformers' warper order does)."""
    transformers = pytest.importorskip("transformers")
    gen = torch.Generator().manual_seed(int(mass * 100))
    logits = torch.randn(6, 4000, generator=gen) * torch.tensor([[0.5], [1], [2], [3], [4], [1]])
    warper = transformers.TypicalLogitsWarper(mass=mass)
    want = ~torch.isinf(warper(None, logits.clone()))  # [R, V], kept
    probs = torch.softmax(logits, dim=-1)
    typical = torch.tensor([mass] * 5 + [1.0])
    got = filter_probs(probs, torch.zeros(6, dtype=torch.int64), torch.ones(6),
                       torch.zeros(6), typical) > 0
    assert torch.equal(got[:5], want[:5])
    assert bool(got[5].all())  # typical_p 1: untouched
    top = filter_probs(probs[:1], torch.tensor([50]), torch.ones(1), torch.zeros(1),
                       typical[:1]) > 0
    top_k = transformers.TopKLogitsWarper(top_k=50)(None, logits[:1].clone())
    assert torch.equal(top, ~torch.isinf(warper(None, top_k)))


def test_typical_p_from_the_proto_and_in_a_draw():
    assert SamplingConfig.from_proto(sampling_pb2.SamplingParams()).typical_p == 1.0
    cfg = SamplingConfig.from_proto(sampling_pb2.SamplingParams(typical_p=0.3, seed=5))
    assert cfg.typical_p == pytest.approx(0.3)
    logits = logits_for(0, 1)
    probs = torch.softmax(logits, dim=-1)
    kept_ids = set((filter_probs(probs[:1], torch.zeros(1, dtype=torch.int64), torch.ones(1),
                                 torch.zeros(1), torch.tensor([0.3]))[0] > 0)
                   .nonzero().flatten().tolist())
    sampler = Sampler(())
    for position in range(40):  # every draw is one of the typical set; the other row is free
        out = sampler.sample(logits.clone(), [row(cfg, position, seed=5),
                                              row(SamplingConfig(), position)])
        assert out.token_ids[0] in kept_ids
