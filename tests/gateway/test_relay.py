"""Generate relayed to a scripted fake scheduler: the submitted request, streamed text,
stop strings, cancellation, deadlines, error mapping, health and reflection."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from gateway.routing.replicas import Replica
from protos.continuum.v1 import generation_pb2, sampling_pb2, scheduler_pb2
from protos.pushback import PUSHBACK_KEY, RETRY_AFTER_KEY

from .harness import (
    FakeScheduler,
    collect,
    fake_scheduler,
    gateway,
    gateway_with_fake,
    generation_stub,
    polled,
    run,
)

GenerateRequest = generation_pb2.GenerateRequest


def _events(tokenizer, text, finish=sampling_pb2.FINISH_REASON_LENGTH):
    events = [scheduler_pb2.TokenEvent(token_ids=[t]) for t in tokenizer.encode(text)]
    events[-1].finish_reason = finish
    return events


async def _generate(tokenizer, scheduler, request, timeout=10, wait_for_cancel=False):
    async with gateway_with_fake(tokenizer, scheduler) as (_, channel):
        try:
            return await collect(generation_stub(channel).Generate(request, timeout=timeout))
        finally:
            if wait_for_cancel:  # before the fake scheduler stops (which cancels anyway)
                await asyncio.wait_for(scheduler.cancelled.wait(), 5)


def test_submit_carries_the_resolved_request(tokenizer):
    scheduler = FakeScheduler(events=_events(tokenizer, "Paris."))
    request = GenerateRequest(
        prompt="The capital of France is",
        max_tokens=0,
        priority=generation_pb2.PRIORITY_BEST_EFFORT,
        sampling=sampling_pb2.SamplingParams(temperature=0.0, seed=7),
    )
    responses = run(_generate(tokenizer, scheduler, request))
    (submitted,) = scheduler.submitted
    assert list(submitted.prompt_token_ids) == tokenizer.encode("The capital of France is")
    assert submitted.max_tokens == 256
    assert (submitted.tenant, submitted.priority_tier) == ("default", 2)
    assert submitted.sampling.HasField("temperature") and submitted.sampling.seed == 7
    assert len(submitted.request_id) == 32  # uuid4 hex
    assert {r.request_id for r in responses} == {submitted.request_id}
    assert scheduler.num_many_calls == 1  # its stream on the gateway's one call
    assert "".join(r.text for r in responses) == "Paris."
    assert responses[-1].usage.prompt_tokens == len(submitted.prompt_token_ids)


@pytest.mark.parametrize("timeout", [30, None])
def test_client_deadline_is_kept_for_the_upstream_stream(tokenizer, monkeypatch, timeout):
    """The upstream stream gets the client's remaining time (the gateway keeps it and
    cancels upstream when it passes), not extended; no client deadline, none upstream."""
    given = []
    submit = Replica.submit

    def recording(self, request, time_left):
        given.append(time_left)
        return submit(self, request, time_left)

    monkeypatch.setattr(Replica, "submit", recording)
    scheduler = FakeScheduler(events=_events(tokenizer, "ok"))
    request = GenerateRequest(prompt="hi", request_id="r-1")
    run(_generate(tokenizer, scheduler, request, timeout))
    (remaining,) = given
    if timeout is None:
        assert remaining is None
    else:  # no lower bound: a slow machine may spend any part of it before the submit;
        # a little slack above, as gRPC rounds a client's timeout *up* to its wire unit
        assert remaining is not None and 0 < remaining <= timeout * 1.01
    assert scheduler.submitted[0].request_id == "r-1"


def test_stop_string_ends_stream_and_cancels_upstream(tokenizer):
    # Plenty after the stop string, so upstream cannot finish before the cancel lands
    # however slow the machine.
    text = "Paris is nice. Question: " + "more text " * 100
    scheduler = FakeScheduler(events=_events(tokenizer, text), delay_s=0.05)
    request = GenerateRequest(prompt="hi", stop=["Question:"])
    responses = run(_generate(tokenizer, scheduler, request, wait_for_cancel=True))
    assert "".join(r.text for r in responses) == "Paris is nice. "
    assert responses[-1].finish_reason == sampling_pb2.FINISH_REASON_STOP
    assert not scheduler.completed.is_set()


def test_client_cancel_cancels_upstream(tokenizer):
    scheduler = FakeScheduler(events=_events(tokenizer, "a b c d e f g h i j"), delay_s=0.5)

    async def scenario():
        async with gateway_with_fake(tokenizer, scheduler) as (_, channel):
            call = generation_stub(channel).Generate(GenerateRequest(prompt="hi"), timeout=30)
            await call.read()  # the stream is live upstream
            call.cancel()
            await asyncio.wait_for(scheduler.cancelled.wait(), 5)

    run(scenario())


def test_client_deadline_cancels_upstream(tokenizer):
    scheduler = FakeScheduler(events=_events(tokenizer, "a b c d e f g h i j"), delay_s=0.5)

    async def scenario():
        with pytest.raises(grpc.aio.AioRpcError) as info:
            request = GenerateRequest(prompt="hi")
            await _generate(tokenizer, scheduler, request, timeout=1.2, wait_for_cancel=True)
        return info.value

    assert run(scenario()).code() == grpc.StatusCode.DEADLINE_EXCEEDED


@pytest.mark.parametrize(
    "upstream_code, client_code, message",
    [
        (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full"),
        (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.INVALID_ARGUMENT, "queue full"),
        (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNAVAILABLE, "no scheduler replica"),
        (grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.UNAVAILABLE, "failed the request"),
    ],
)
def test_upstream_errors_map_to_client_statuses(tokenizer, upstream_code, client_code, message):
    trailing = (("retry-after-ms", "250"),)
    scheduler = FakeScheduler(
        events=[scheduler_pb2.TokenEvent(token_ids=[42])],
        error=(upstream_code, "queue full", trailing),
    )

    async def scenario():
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await _generate(tokenizer, scheduler, GenerateRequest(prompt="hi"))
        return info.value

    error = run(scenario())
    assert error.code() == client_code
    assert message in error.details()
    trailers = dict(error.trailing_metadata())
    if client_code == grpc.StatusCode.RESOURCE_EXHAUSTED:  # the scheduler's hint, both names
        assert trailers[PUSHBACK_KEY] == trailers[RETRY_AFTER_KEY] == "250"
    elif client_code == grpc.StatusCode.UNAVAILABLE:  # no replica left: the gateway's own
        assert trailers[PUSHBACK_KEY] == trailers[RETRY_AFTER_KEY] == "1000"
    else:
        assert PUSHBACK_KEY not in trailers and RETRY_AFTER_KEY not in trailers


def test_health_and_reflection(tokenizer):
    async def scenario():
        async with gateway(tokenizer, "127.0.0.1:1") as (running, channel):
            health = health_pb2_grpc.HealthStub(channel)
            serving = await health.Check(health_pb2.HealthCheckRequest(), timeout=5)
            named = await health.Check(
                health_pb2.HealthCheckRequest(service="continuum.v1.Generation"), timeout=5
            )
            reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
            query = reflection_pb2.ServerReflectionRequest(list_services="")
            answers = [a async for a in reflection.ServerReflectionInfo(iter([query]))]
            await running.health.enter_graceful_shutdown()
            draining = await health.Check(health_pb2.HealthCheckRequest(), timeout=5)
            return serving, named, answers, draining

    serving, named, answers, draining = run(scenario())
    assert serving.status == named.status == health_pb2.HealthCheckResponse.SERVING
    services = {s.name for s in answers[0].list_services_response.service}
    assert {"continuum.v1.Generation", "grpc.health.v1.Health"} <= services
    assert draining.status == health_pb2.HealthCheckResponse.NOT_SERVING


def test_shutdown_lets_in_flight_calls_finish_and_refuses_new_ones(tokenizer):
    scheduler = FakeScheduler(events=_events(tokenizer, "one two three four"), delay_s=0.1)

    async def scenario():
        async with gateway_with_fake(tokenizer, scheduler) as (running, channel):
            stub = generation_stub(channel)
            in_flight = stub.Generate(GenerateRequest(prompt="hi"), timeout=10)
            first = await in_flight.read()
            stopping = asyncio.create_task(running.stop(5.0))
            # Refusal starts once stop() has begun: wait for it, not for a guessed time.
            for _ in range(100):
                try:
                    await collect(stub.Generate(GenerateRequest(prompt="hi"), timeout=5))
                except grpc.aio.AioRpcError as exc:
                    refused = exc
                    break
            rest = []
            while (response := await in_flight.read()) != grpc.aio.EOF:
                rest.append(response)
            await stopping
            return [first, *rest], refused

    responses, refused = run(scenario())
    assert "".join(r.text for r in responses) == "one two three four"
    assert responses[-1].finish_reason == sampling_pb2.FINISH_REASON_LENGTH
    assert refused.code() == grpc.StatusCode.UNAVAILABLE


@pytest.mark.parametrize("marked", [True, False])
def test_a_poison_request_is_not_continued_on_another_replica(tokenizer, marked):
    """INTERNAL with the scheduler's request-failed trailer ends the request: another
    replica would only fail (or lose its executor) on it too. Without the trailer an
    INTERNAL is the replica's failure and the request continues on the other one."""
    trailer = (("request-failed", "poison"),) if marked else ()
    failing = FakeScheduler(events=[scheduler_pb2.TokenEvent(token_ids=[42])],
                            error=(grpc.StatusCode.INTERNAL, "the executor failed", trailer))
    other = FakeScheduler(events=_events(tokenizer, " there"))

    async def scenario():
        async with fake_scheduler(failing) as a, fake_scheduler(other) as b, \
                gateway(tokenizer, f"{a},{b}") as (running, channel):
            await polled(running)
            for replica in running.replicas.replicas:  # route to `failing` first
                replica.load = (0.0, 0.0, 0.0) if replica.address == a else (1.0, 0.0, 0.0)
            call = generation_stub(channel).Generate(GenerateRequest(prompt="hi"), timeout=10)
            try:
                return await collect(call), None
            except grpc.aio.AioRpcError as exc:
                return None, exc

    responses, error = run(scenario())
    if marked:
        assert error is not None and error.code() == grpc.StatusCode.INTERNAL
        assert "the executor failed" in error.details()
        assert other.submitted == []
    else:
        assert error is None and responses[-1].finish_reason
        assert len(other.submitted) == 1
