"""The edge's last guards: client values echoed in errors and logs are bounded
(protos/echo.py), and whatever parsing a request raises is a counted 400, never a 500
(gateway/admit/parse_guard.py)."""

from __future__ import annotations

import json

import aiohttp
import grpc
import pytest
from structlog.testing import capture_logs

from gateway.admit.parse_guard import parse_guard
from gateway.metrics import GatewayMetrics
from gateway.validation import RequestError
from protos.continuum.v1 import generation_pb2, generation_pb2_grpc, sampling_pb2, scheduler_pb2
from protos.echo import clip, shorten

from .harness import FakeScheduler, collect, fake_scheduler, gateway, run

HUGE = "x" * 900_000


def test_clip_quotes_a_bounded_escaped_head():
    assert clip("abc") == "'abc'"
    assert clip("a" * 101) == repr("a" * 100) + "…"
    assert len(clip("\x00" * 10_000)) <= 103 and clip("\x00" * 10_000).endswith("…")
    assert len(clip([HUGE, HUGE])) <= 101 and len(clip(10**4000)) <= 101
    assert shorten("y" * 1000, 10) == "y" * 10 + "…" and shorten("ok") == "ok"


@pytest.mark.parametrize("raised", [
    RecursionError("maximum recursion depth exceeded"), UnicodeEncodeError(
        "utf-8", "\ud800", 0, 1, "surrogates not allowed"), OverflowError("int too large"),
    ValueError("bad"), TypeError("not a str"), KeyError(HUGE), MemoryError(),
])
def test_the_parse_guard_makes_any_exception_a_counted_400(raised):
    metrics = GatewayMetrics("m")
    with capture_logs() as logs, pytest.raises(RequestError) as caught:
        with parse_guard("chat", metrics):
            raise raised
    error = caught.value
    assert error.code == grpc.StatusCode.INVALID_ARGUMENT
    assert error.message.startswith(f"could not parse the request: {type(raised).__name__}")
    assert len(error.message) < 300
    page = metrics.render().decode()
    assert 'continuum_gateway_request_parse_errors_total{model_name="m",api="chat"} 1.0' in page
    assert len(logs) == 1 and "traceback" in logs[0] and len(repr(logs[0])) < 4000


def test_the_parse_guard_passes_request_errors_through_uncounted():
    metrics = GatewayMetrics("m")
    refusal = RequestError("temperature must be between 0 and 2", param="temperature")
    with pytest.raises(RequestError) as caught, parse_guard("chat", metrics):
        raise refusal
    assert caught.value is refusal
    assert "continuum_gateway_request_parse_errors_total{" not in metrics.render().decode()


_HUGE_BODIES = [  # (path, body, status)
    ("/v1/completions", {"model": HUGE, "prompt": "hi"}, 404),
    ("/v1/chat/completions", {"messages": [{"role": HUGE, "content": "hi"}]}, 400),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {HUGE: 1}}, 400),
    ("/v1/completions", {"prompt": "hi", "tenant": HUGE}, 400),
    ("/tokenize", {"model": HUGE, "prompt": "hi"}, 404),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "tools": [{"type": "function", "function": {"name": "f"}}],
                              "tool_choice": {"type": "function", "function": {"name": HUGE}}},
     400),
]
_HUGE_GRPC = [
    generation_pb2.GenerateRequest(model=HUGE, prompt="hi"),
    generation_pb2.GenerateRequest(chat=generation_pb2.ChatInput(
        messages=[generation_pb2.ChatMessage(role=HUGE, content="hi")])),
    generation_pb2.GenerateRequest(request_id=HUGE, prompt="hi"),
]


def _scheduler():
    return FakeScheduler(events=[scheduler_pb2.TokenEvent(
        token_ids=[42], finish_reason=sampling_pb2.FINISH_REASON_LENGTH)])


async def _huge_values(tokenizer):
    async with fake_scheduler(_scheduler()) as address, \
            gateway(tokenizer, address, http_port=0) as (running, channel), \
            aiohttp.ClientSession(f"http://127.0.0.1:{running.http_port}") as session:
        http = []
        for path, body, _ in _HUGE_BODIES:
            async with session.post(path, data=json.dumps(body)) as response:
                http.append((response.status, await response.read()))
        generate = generation_pb2_grpc.GenerationStub(channel).Generate
        details = []
        for request in _HUGE_GRPC:
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await collect(generate(request, timeout=10))
            details.append(caught.value.details())
        return http, details


def test_a_900_kb_value_comes_back_as_a_short_error_and_a_short_log_line(tokenizer):
    with capture_logs() as logs:
        http, details = run(_huge_values(tokenizer))
    for (path, _, status), (got, raw) in zip(_HUGE_BODIES, http, strict=True):
        assert got == status and len(raw) < 1024, (path, got, raw[:200])
        assert "x" * 101 not in json.loads(raw)["error"]["message"]  # quoted at most clipped
    assert all(len(text.encode()) < 1024 for text in details), [d[:100] for d in details]
    assert logs and all(len(repr(event)) < 2048 for event in logs)


async def _failing_parse(tokenizer):
    async with fake_scheduler(_scheduler()) as address, \
            gateway(tokenizer, address, http_port=0) as (running, channel), \
            aiohttp.ClientSession(f"http://127.0.0.1:{running.http_port}") as session:
        async with session.post("/v1/completions", json={"prompt": "boom"}) as response:
            http = response.status, await response.json()
        generate = generation_pb2_grpc.GenerationStub(channel).Generate
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await collect(generate(generation_pb2.GenerateRequest(prompt="boom"), timeout=10))
        async with session.post("/tokenize", json={"prompt": "boom"}) as response:
            tokenize = response.status
        async with session.get("/metrics") as response:
            metrics = await response.text()
        return http, caught.value, tokenize, metrics


def test_an_unexpected_error_while_parsing_is_a_counted_400_on_both_apis(tokenizer,
                                                                          monkeypatch):
    def broken(text):
        raise RuntimeError("tokenizer exploded")

    monkeypatch.setattr(tokenizer, "encode", broken)
    (status, body), error, tokenize, metrics = run(_failing_parse(tokenizer))
    assert status == 400 and body["error"]["type"] == "invalid_request_error"
    assert body["error"]["message"] == ("could not parse the request: RuntimeError: "
                                        "tokenizer exploded")
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.details().startswith("could not parse the request: RuntimeError")
    assert tokenize == 400
    for api in ("completion", "grpc", "tokenize"):
        assert (f'continuum_gateway_request_parse_errors_total{{model_name="smollm2",api="{api}"}}'
                ' 1.0' in metrics), api
