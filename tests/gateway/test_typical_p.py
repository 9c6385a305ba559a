"""typical_p at the edge, through a real gateway: the official openai client's extra_body
and a gRPC GenerateRequest reach the scheduler with it, and a value outside (0, 1] is a 400
/ INVALID_ARGUMENT naming the field and its range before anything is submitted."""

from __future__ import annotations

import grpc
import openai
import pytest

from protos.continuum.v1 import generation_pb2, generation_pb2_grpc, sampling_pb2, scheduler_pb2

from .harness import FakeScheduler, collect, fake_scheduler, gateway, run

RANGE = "typical_p must be in (0, 1] (1 keeps every token)"


def _ok_events():
    return [scheduler_pb2.TokenEvent(token_ids=[42],
                                     finish_reason=sampling_pb2.FINISH_REASON_LENGTH)]


def _client(running):
    return openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{running.http_port}/v1",
                              api_key="unused", max_retries=0)


def test_typical_p_reaches_the_scheduler_over_http_and_grpc(tokenizer):
    scheduler = FakeScheduler(events=_ok_events())

    async def scenario():
        async with fake_scheduler(scheduler) as address, \
                gateway(tokenizer, address, http_port=0) as (running, channel):
            client = _client(running)
            await client.completions.create(model="", prompt="hi", max_tokens=1,
                                            extra_body={"typical_p": 0.5})
            await client.chat.completions.create(
                model="", messages=[{"role": "user", "content": "hi"}], max_tokens=1,
                extra_body={"typical_p": 1})
            stub = generation_pb2_grpc.GenerationStub(channel)
            await collect(stub.Generate(generation_pb2.GenerateRequest(
                prompt="hi", max_tokens=1, sampling=sampling_pb2.SamplingParams(typical_p=0.25)),
                timeout=10))
            await client.completions.create(model="", prompt="hi", max_tokens=1)

    run(scenario())
    sent = [s.sampling for s in scheduler.submitted]
    assert [round(s.typical_p, 4) for s in sent[:3]] == [0.5, 1.0, 0.25]
    assert not sent[3].HasField("typical_p")  # unset stays unset: the sampler's 1.0


@pytest.mark.parametrize("value", [0, -0.1, 1.5, 1e39, "0.5"])
def test_typical_p_outside_its_range_is_a_400_naming_it(tokenizer, value):
    scheduler = FakeScheduler(events=_ok_events())

    async def scenario():
        async with fake_scheduler(scheduler) as address, \
                gateway(tokenizer, address, http_port=0) as (running, _):
            with pytest.raises(openai.BadRequestError) as caught:
                await _client(running).chat.completions.create(
                    model="", messages=[{"role": "user", "content": "hi"}], max_tokens=1,
                    extra_body={"typical_p": value})
            return caught.value

    error = run(scenario())
    assert error.status_code == 400
    body = error.body if isinstance(error.body, dict) else {}
    assert body.get("param") == "typical_p"
    words = "typical_p must be a number, got str" if isinstance(value, str) else RANGE
    assert words in body.get("message", ""), body
    assert scheduler.submitted == []


def test_typical_p_outside_its_range_is_invalid_argument_over_grpc(tokenizer):
    scheduler = FakeScheduler(events=_ok_events())

    async def scenario():
        async with fake_scheduler(scheduler) as address, \
                gateway(tokenizer, address) as (_, channel):
            stub = generation_pb2_grpc.GenerationStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await collect(stub.Generate(generation_pb2.GenerateRequest(
                    prompt="hi", sampling=sampling_pb2.SamplingParams(typical_p=0.0)),
                    timeout=10))
            return caught.value

    error = run(scenario())
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"sampling.{RANGE}, got 0" in error.details()
    assert scheduler.submitted == []
