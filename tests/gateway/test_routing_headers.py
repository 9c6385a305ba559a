"""An inference gateway's tenant and tier headers (gateway/admit/routing_headers.py), through a
real gateway over both APIs: they fill what the request leaves unset and grant nothing
the key does not."""

from __future__ import annotations

import pathlib

import openai
import pytest

from gateway.admit.auth import ApiKeys
from gateway.config import ConfigError, GatewayConfig
from protos.continuum.v1 import generation_pb2, generation_pb2_grpc, sampling_pb2, scheduler_pb2

from .harness import FakeScheduler, collect, fake_scheduler, gateway, run

PREMIUM, STANDARD, BEST_EFFORT = 0, 1, 2  # SubmitRequest.priority_tier
KEYS = ApiKeys.parse(["sk-vip-0123456:acme:premium+standard", "sk-plain-0123456",
                      "sk-bound-0123456:acme"], "test")


def _ok_events():
    return [scheduler_pb2.TokenEvent(token_ids=[42],
                                     finish_reason=sampling_pb2.FINISH_REASON_LENGTH)]


def _openai(running, key):
    return openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{running.http_port}/v1",
                              api_key=key, max_retries=0)


def test_fairness_id_and_objective_set_tenant_and_tier_over_http_and_grpc(tokenizer):
    scheduler = FakeScheduler(events=_ok_events())

    async def scenario():
        async with fake_scheduler(scheduler) as address, \
                gateway(tokenizer, address, keys=KEYS, http_port=0,
                        objective_tiers=("gold=premium",)) as (running, channel):
            plain = _openai(running, "sk-plain-0123456")
            await plain.completions.create(
                model="", prompt="hi", max_tokens=1,
                extra_headers={"x-llm-d-inference-fairness-id": "team-a",
                               "x-llm-d-inference-objective": "sheddable"})
            await plain.completions.create(  # GIE's older names
                model="", prompt="hi", max_tokens=1,
                extra_headers={"x-gateway-inference-fairness-id": "team-b",
                               "x-gateway-inference-objective": "unknown-objective"})
            await plain.completions.create(  # the body's own fields win
                model="", prompt="hi", max_tokens=1,
                extra_body={"tenant": "team-c", "priority": "standard"},
                extra_headers={"x-llm-d-inference-fairness-id": "team-a",
                               "x-llm-d-inference-objective": "sheddable"})
            vip = _openai(running, "sk-vip-0123456")
            await vip.completions.create(
                model="", prompt="hi", max_tokens=1,
                extra_headers={"x-llm-d-inference-objective": "gold"})
            stub = generation_pb2_grpc.GenerationStub(channel)
            await collect(stub.Generate(
                generation_pb2.GenerateRequest(prompt="hi"), timeout=10,
                metadata=(("authorization", "Bearer sk-plain-0123456"),
                          ("x-llm-d-inference-fairness-id", "team-g"),
                          ("x-llm-d-inference-objective", "best_effort"))))

    run(scenario())
    got = [(s.tenant, s.priority_tier) for s in scheduler.submitted]
    assert got == [("team-a", BEST_EFFORT), ("team-b", STANDARD), ("team-c", STANDARD),
                   ("acme", PREMIUM), ("team-g", BEST_EFFORT)]


def test_headers_grant_nothing_the_key_lacks(tokenizer):
    scheduler = FakeScheduler(events=_ok_events())

    async def scenario():
        async with fake_scheduler(scheduler) as address, \
                gateway(tokenizer, address, keys=KEYS, http_port=0) as (running, _):
            errors = []
            for key, headers in (
                    ("sk-plain-0123456", {"x-llm-d-inference-objective": "critical"}),
                    ("sk-bound-0123456", {"x-llm-d-inference-fairness-id": "other"}),
                    ("sk-plain-0123456", {"x-llm-d-inference-fairness-id": "bad\tvalue"}),
                    ("sk-plain-0123456", {"x-llm-d-inference-fairness-id": "x" * 200})):
                with pytest.raises(openai.APIStatusError) as refused:
                    await _openai(running, key).completions.create(
                        model="", prompt="hi", max_tokens=1, extra_headers=headers)
                errors.append((refused.value.status_code, refused.value.message))
            return errors

    errors = run(scenario())
    assert [status for status, _ in errors] == [403, 403, 400, 400]
    assert "premium" in errors[0][1] and "tenant 'acme'" in errors[1][1]
    assert "x-llm-d-inference-fairness-id header" in errors[2][1]
    assert scheduler.submitted == []  # nothing refused reached the scheduler


def test_a_bad_objective_tier_entry_is_one_clear_error():
    with pytest.raises(ConfigError, match="--objective-tier 'gold=platinum'"):
        GatewayConfig(model_dir=pathlib.Path("."), scheduler_address="127.0.0.1:1",
                      objective_tiers=("gold=platinum",))
