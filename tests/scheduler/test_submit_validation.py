"""Every SubmitRequest field is checked at the scheduler, which does not trust its
caller: each bad field gets INVALID_ARGUMENT naming it, from a real scheduler
process (fields that need no model) or from the check on a real core with an
executor's model attached (vocabulary, context, KV pool)."""

# ruff: noqa: F811 (the scheduler fixtures are imported from scheduler_process)
from __future__ import annotations

import grpc
import pytest

from protos import limits
from protos.continuum.v1 import sampling_pb2, scheduler_pb2, scheduler_pb2_grpc
from scheduler_svc.validation import validate_submit
from tests.conftest import TEST_METADATA
from tests.scheduler.factories import make_scheduler
from tests.scheduler.scheduler_process import scheduler, scheduler_address  # noqa: F401
from tests.scheduler.submit_client import StreamFailed
from tests.scheduler.submit_client import submit as submit_over_grpc

S = sampling_pb2.SamplingParams
INF, NAN = float("inf"), float("nan")

# (SubmitRequest fields, text the message must contain). None of these needs a model.
WITHOUT_MODEL = [
    ({"request_id": ""}, "request_id must not be empty"),
    ({"request_id": "x" * 137}, "request_id is 137 characters long; the limit is 136"),
    ({"request_id": "a\nb"}, "request_id must be printable ASCII"),
    ({"request_id": "a\x1fb"}, "request_id must be printable ASCII"),
    ({"request_id": "caf\u00e9"}, "request_id must be printable ASCII"),
    ({"tenant": "t" * 129}, "tenant is 129 characters long"),
    ({"tenant": "x\x00"}, "tenant must be printable ASCII"),
    ({"prompt_token_ids": []}, "prompt_token_ids must not be empty"),
    ({"max_tokens": 0}, "max_tokens must be an integer in [1, 4294967295], got 0"),
    ({"priority_tier": 3}, "priority_tier is 3; the tiers are 0 (premium), 1 (standard), 2"),
    ({"priority_tier": 2**32 - 1}, "priority_tier is 4294967295"),
    ({"num_resumed_output_tokens": 4}, "num_resumed_output_tokens (4) exceeds the 3 tokens"),
    ({"sampling": S(logprobs=100_000)},
     "sampling.logprobs must be an integer in [0, 20] (alternatives per generated token), "
     "got 100000"),
    ({"sampling": S(logprobs=21)}, "in [0, 20]"),
    ({"sampling": S(temperature=-0.5)}, "sampling.temperature must be in [0, 2]"),
    ({"sampling": S(temperature=2.5)}, "sampling.temperature must be in [0, 2]"),
    ({"sampling": S(temperature=NAN)}, "sampling.temperature"),
    ({"sampling": S(temperature=INF)}, "sampling.temperature"),
    ({"sampling": S(top_p=0.0)}, "for greedy decoding use temperature 0), got 0"),
    ({"sampling": S(top_p=1.5)}, "sampling.top_p must be in (0, 1]"),
    ({"sampling": S(top_p=NAN)}, "sampling.top_p"),
    ({"sampling": S(min_p=-0.1)}, "sampling.min_p must be in [0, 1]"),
    ({"sampling": S(min_p=INF)}, "sampling.min_p"),
    ({"sampling": S(typical_p=0.0)}, "sampling.typical_p must be in (0, 1]"),
    ({"sampling": S(typical_p=NAN)}, "sampling.typical_p"),
    ({"sampling": S(repetition_penalty=0.0)}, "sampling.repetition_penalty must be in (0, "),
    ({"sampling": S(repetition_penalty=INF)}, "sampling.repetition_penalty"),
    ({"sampling": S(presence_penalty=2.5)}, "sampling.presence_penalty must be in [-2, 2]"),
    ({"sampling": S(frequency_penalty=-INF)}, "sampling.frequency_penalty must be in [-2, 2]"),
    ({"sampling": S(stop_token_ids=range(129))},
     "sampling.stop_token_ids holds 129 token ids; at most 128"),
    ({"sampling": S(logit_bias={i: 1.0 for i in range(301)})},
     "sampling.logit_bias holds 301 entries; at most 300"),
    ({"sampling": S(logit_bias={3: 101.0})}, "sampling.logit_bias[3] = 101; a bias must be in"),
    ({"sampling": S(logit_bias={3: INF})}, "sampling.logit_bias[3] = inf"),
]

# Checked once an executor's model is known (factories: vocabulary 1,000, context 512,
# 64 blocks of 4 tokens).
WITH_MODEL = [
    ({"prompt_token_ids": [1, 1000]},
     "prompt_token_ids[1] = 1000 is not a token id: the model's vocabulary has 1000"),
    ({"sampling": S(stop_token_ids=[5, 2**32 - 1])}, "sampling.stop_token_ids[1] = 4294967295"),
    ({"sampling": S(logit_bias={5: 1.0, 1000: -1.0})},
     "sampling.logit_bias names token 1000, which is not a token id"),
    ({"max_tokens": 2**32 - 1}, "maximum context length is 512 tokens"),
    ({"prompt_token_ids": [7] * 300, "max_tokens": 1}, "KV blocks but the pool has"),
]


def submit(**fields) -> scheduler_pb2.SubmitRequest:
    fields.setdefault("request_id", "v1")
    fields.setdefault("prompt_token_ids", [1, 2, 3])
    fields.setdefault("max_tokens", 4)
    return scheduler_pb2.SubmitRequest(**fields)


@pytest.mark.parametrize("fields,message", WITHOUT_MODEL, ids=[m for _, m in WITHOUT_MODEL])
def test_a_bad_field_is_invalid_argument_over_grpc(scheduler, fields, message):
    stub = scheduler_pb2_grpc.SchedulerStub(scheduler)
    with pytest.raises(StreamFailed) as caught:
        submit_over_grpc(stub, submit(**fields), timeout=10, metadata=TEST_METADATA)
    assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert message in caught.value.message
    stats = stub.Stats(scheduler_pb2.StatsRequest(), timeout=5, metadata=TEST_METADATA)
    assert stats.num_waiting == 0  # refused before it was queued; the replica still answers


@pytest.mark.parametrize("fields,message", WITH_MODEL, ids=[m for _, m in WITH_MODEL])
def test_fields_that_need_the_model(fields, message):
    problem = validate_submit(submit(**fields), make_scheduler(watermark=0.01))
    assert problem is not None and message in problem


def test_the_limits_themselves_pass():
    top = S(temperature=0.0, top_p=1.0, min_p=1.0, typical_p=1.0, repetition_penalty=1e-3,
            presence_penalty=-2.0, frequency_penalty=2.0, logprobs=limits.MAX_LOGPROBS,
            stop_token_ids=[999] * limits.MAX_STOP_TOKEN_IDS, top_k=2**32 - 1,
            seed=2**64 - 1)
    # 128 characters from a client, plus the gateway's suffix for choice 15 of n = 16 (and room).
    edge = submit(request_id="~" * limits.MAX_SUBMIT_REQUEST_ID_CHARS, tenant=" " * 128,
                  priority_tier=2, sampling=top, prompt_token_ids=[999, 0, 5],
                  num_resumed_output_tokens=3)
    assert validate_submit(edge, make_scheduler()) is None
