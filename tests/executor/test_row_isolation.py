"""A failure in one sequence's own per-row work fails that sequence alone.

The real scheduler core plans for the real executor Runner (bundled model, grammar
matchers), two plans in flight as in serving. One request's row is made to raise in each
per-row stage in turn (executor_svc/faults.py ``row_STAGE``); every step must still
succeed, the other requests' tokens and block tables must be step for step those of an
undisturbed run, nothing is recomputed, and the bad request ends alone with an error that
names the stage. In the undisturbed run the same request simply ends (its first token is
made a stop token) at the step where the bad one fails, so the pool holds the same blocks
in both runs.
"""

from __future__ import annotations

import collections

import pytest

from executor_svc.faults import ROW_STAGES, FaultInjector
from executor_svc.guided import Guides
from harness.mini_scheduler import INCARNATION, make_runner
from protos import wire
from protos.continuum.v1 import sampling_pb2
from scheduler_svc.core import ModelInfo, Request, Scheduler, SchedulerConfig
from scheduler_svc.core.request import FinishReason
from scheduler_svc.plan import build_plan

BAD_MARK = 48_000  # a token id no normal prompt holds: the fault injector's trigger
NORMAL_PROMPTS = [[1, 504, 3458, 282, 4649, 314], [1, 9690, 314, 253, 1345],
                  [1, 378, 2330, 28, 357, 1326, 416], [1, 4563, 4202, 30]]
MAX_TOKENS = 6


def _sampling(i: int) -> sampling_pb2.SamplingParams:
    """Greedy rows, one with penalties and logprobs, one drawn with a seed and every
    filter (top_k, min_p, typical_p): each stage runs for some healthy row too."""
    if i == 1:
        return sampling_pb2.SamplingParams(temperature=0.0, repetition_penalty=1.3,
                                           presence_penalty=0.5, logprobs=2)
    if i == 2:
        return sampling_pb2.SamplingParams(temperature=0.8, top_k=40, min_p=0.01,
                                           typical_p=0.9, seed=7, min_tokens=2)
    return sampling_pb2.SamplingParams(temperature=0.0)


def _bad_sampling() -> sampling_pb2.SamplingParams:
    """The bad request asks for everything a row can do, so every stage runs for it."""
    s = sampling_pb2.SamplingParams(temperature=0.0, logprobs=1, min_tokens=1,
                                    frequency_penalty=0.2)
    s.guided.regex = "[a-z ]{1,40}"
    s.logit_bias[300] = 1.0
    return s


def _requests(stop: frozenset[int]) -> list[Request]:
    reqs = [Request(f"n{i}", i + 1, list(p), len(p), MAX_TOKENS, sampling=_sampling(i))
            for i, p in enumerate(NORMAL_PROMPTS)]
    prompt = [1, BAD_MARK, 260, 1489]
    reqs.insert(2, Request("bad", 99, prompt, len(prompt), MAX_TOKENS,
                           sampling=_bad_sampling(), stop_token_ids=stop))
    return reqs


def _serve(model, model_dir, stage: str | None, stop: frozenset[int] = frozenset()):
    """Runs the batch to the end; per request: tokens, end reason, error, and each
    normal request's block table after every step."""
    runner = make_runner(model, num_blocks=64, block_size=4)
    c = model.config
    runner.guides = Guides(model_dir, c.vocab_size, c.eos_token_ids)
    if stage is not None:
        runner.faults = FaultInjector({BAD_MARK: f"row_{stage}"})
        runner.sampler.inject_faults = True
    core = Scheduler(SchedulerConfig(watermark=0.0, max_num_batched_tokens=16, max_num_seqs=8,
                                     chunk_size=8,
                                     max_queue_time_premium_s=0.0,
                                     max_queue_time_standard_s=0.0,
                                     max_queue_time_best_effort_s=0.0))
    core.attach_executor(ModelInfo(4, 64, c.max_position_embeddings, c.vocab_size,
                                   frozenset(c.eos_token_ids)))
    for req in _requests(stop):
        core.add_request(req)
    tokens, ends = collections.defaultdict(list), {}
    tables: list[dict[str, list[int]]] = []
    in_flight = collections.deque()
    while True:
        while len(in_flight) < 2:  # scheduling ahead, as the serving loop does
            out = core.schedule()
            if out.is_empty:
                break
            result = runner.execute(build_plan(out, INCARNATION, core.block_manager))
            assert result.error_code == 0, result.error_message
            in_flight.append((out, result))
        if not in_flight:
            break
        out, result = in_flight.popleft()
        events = [core.row_failed(f.seq_id, f"{f.stage}: {f.message}", f.invalid_input)
                  for f in result.row_failures]
        events += core.update(out, *wire.result_columns(result))
        core.assert_invariants()
        for ev in filter(None, events):
            req, token, reason, _ = ev
            if token is not None:
                tokens[req.request_id].append(token)
            if reason is not None:
                ends[req.request_id] = (reason, req.error)
        tables.append({r.request_id: core.block_manager.block_table(r.seq_id)
                       for r in core.running if r.request_id != "bad"})
    assert not runner.seqs or set(runner.seqs) <= {99}, "the executor kept finished state"
    return tokens, ends, tables, core


@pytest.fixture(scope="module")
def undisturbed(model, model_dir):
    first = _serve(model, model_dir, None)[0]["bad"][0]
    tokens, ends, tables, core = _serve(model, model_dir, None, frozenset({first}))
    assert ends["bad"][0] == FinishReason.STOP and tokens["bad"] == [first]
    assert all(len(tokens[f"n{i}"]) == MAX_TOKENS for i in range(len(NORMAL_PROMPTS)))
    return tokens, tables


@pytest.mark.parametrize("stage", ROW_STAGES)
def test_a_row_that_fails_in_any_stage_fails_alone(model, model_dir, undisturbed, stage):
    tokens, ends, tables, core = _serve(model, model_dir, stage)
    base_tokens, base_tables = undisturbed
    normal = [f"n{i}" for i in range(len(NORMAL_PROMPTS))]
    assert {r: tokens[r] for r in normal} == {r: base_tokens[r] for r in normal}
    assert tables == base_tables  # step for step: no block moved, none freed early
    reason, error = ends["bad"]
    assert reason == FinishReason.ERROR and stage in error and "injected" in error
    assert tokens["bad"] == []  # its placeholder sample never reached the client
    assert core.num_recomputed_tokens == 0 and core.num_preemptions == 0
