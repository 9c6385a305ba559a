"""The OpenAI-compatible HTTP API in front of a scripted fake scheduler: the
validation table, SSE framing, error shapes, backpressure, auth, routing, metrics.

The fake scheduler only scripts what upstream says; the gateway, its HTTP server
and the client (aiohttp) are real and talk over loopback.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re

import aiohttp
import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.admit.auth import ApiKeys
from protos.continuum.v1 import generation_pb2, generation_pb2_grpc, sampling_pb2, scheduler_pb2
from protos.limits import MAX_STOP_STRINGS

from .harness import MODEL_NAME, FakeScheduler, collect, fake_scheduler, gateway, run


def _events(tokenizer, text, finish=sampling_pb2.FINISH_REASON_LENGTH):
    events = [scheduler_pb2.TokenEvent(token_ids=[t]) for t in tokenizer.encode(text)]
    events[-1].finish_reason = finish
    return events


@contextlib.asynccontextmanager
async def http_gateway(tokenizer, scheduler: FakeScheduler, keys=None, **config):
    """Yields (base URL, aiohttp session, grpc channel, running gateway)."""
    async with fake_scheduler(scheduler) as address, \
            gateway(tokenizer, address, keys=keys, http_port=0, **config) as (running, channel):
        async with aiohttp.ClientSession(f"http://127.0.0.1:{running.http_port}") as session:
            yield session, channel, running


async def _post(session, path, body, headers=None):
    data = body if isinstance(body, bytes | str) else json.dumps(body)
    async with session.post(path, data=data, headers=headers or {}) as response:
        return response.status, dict(response.headers), await response.read()


# (path, body, status, param, code, words in the message)
_CHAT = "/v1/chat/completions"
_COMP = "/v1/completions"
_MSG = [{"role": "user", "content": "hi"}]
VALIDATION_TABLE = [
    (_COMP, {"prompt": ""}, 400, "prompt", None, "prompt is empty"),
    (_COMP, {}, 400, "prompt", None, "prompt is required"),
    (_COMP, {"prompt": ["a", "b"]}, 400, "prompt", None, "one prompt per request"),
    (_COMP, {"prompt": [1, 2, 10**7]}, 400, "prompt", None, "vocabulary"),
    (_COMP, {"prompt": [1, -2]}, 400, "prompt", None, "negative"),
    (_COMP, {"prompt": "hi " * 9000}, 400, "prompt", "context_length_exceeded",
     "maximum context length is"),
    (_COMP, {"prompt": "hi", "max_tokens": 100_000}, 400, "max_tokens",
     "context_length_exceeded", "maximum context length is"),
    (_COMP, {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens", None, "max_tokens"),
    (_COMP, {"prompt": "hi", "temperature": -1}, 400, "temperature", None, "in [0, 2]"),
    (_COMP, {"prompt": "hi", "temperature": 2.5}, 400, "temperature", None,
     "temperature must be in [0, 2] (0 means greedy), got 2.5"),
    (_COMP, {"prompt": "hi", "temperature": "hot"}, 400, "temperature", None, "a number"),
    (_COMP, {"prompt": "hi", "top_p": 0}, 400, "top_p", None, "top_p"),
    (_COMP, {"prompt": "hi", "top_p": 1.5}, 400, "top_p", None, "top_p must be in (0, 1]"),
    (_COMP, {"prompt": "hi", "top_k": -5}, 400, "top_k", None, "top_k"),
    (_COMP, {"prompt": "hi", "min_p": 2}, 400, "min_p", None, "min_p"),
    (_COMP, {"prompt": "hi", "presence_penalty": 3}, 400, "presence_penalty", None, "-2"),
    (_COMP, {"prompt": "hi", "frequency_penalty": -9}, 400, "frequency_penalty", None, "-2"),
    (_COMP, {"prompt": "hi", "repetition_penalty": 0}, 400, "repetition_penalty", None,
     "repetition_penalty must be in (0, "),
    (_COMP, {"prompt": "hi", "seed": -1}, 400, "seed", None, "seed"),
    (_COMP, {"prompt": "hi", "n": 0}, 400, "n", None, "n must be"),
    (_COMP, {"prompt": "hi", "n": 17}, 400, "n", None, "n must be an integer in [1, 16]"),
    (_COMP, {"prompt": "hi", "logprobs": 6}, 400, "logprobs", None, "logprobs"),
    (_COMP, {"prompt": "hi", "stop": 5}, 400, "stop", None, "stop must be"),
    (_COMP, {"prompt": "hi", "stop": ["x"] * (MAX_STOP_STRINGS + 1)}, 400, "stop", None,
     "stop strings given"),
    (_COMP, {"prompt": "hi", "stop": ["y" * 300]}, 400, "stop", None, "bytes long"),
    (_COMP, {"prompt": "hi", "min_tokens": 50, "max_tokens": 10}, 400, "min_tokens", None,
     "min_tokens"),
    (_COMP, {"prompt": "hi", "stream_options": {"include_usage": True}}, 400,
     "stream_options", None, "only allowed when stream"),
    (_COMP, {"prompt": "hi", "logit_bias": {"1": 500}}, 400, "logit_bias", None,
     "logit_bias[1] = 500; a bias must be in [-100, 100]"),
    (_COMP, {"prompt": "hi", "logit_bias": [1, 5]}, 400, "logit_bias", None,
     "must be an object"),
    (_COMP, {"prompt": "hi", "model": "gpt-4"}, 404, "model", "model_not_found",
     "is not served here"),
    (_COMP, {"prompt": "hi", "priority": "urgent"}, 400, "priority", None, "premium"),
    (_COMP, {"prompt": "hi", "stop_token_ids": [10**7]}, 400, "stop_token_ids", None,
     "vocabulary"),
    (_CHAT, {"messages": []}, 400, "messages", None, "non-empty list"),
    (_CHAT, {"messages": "hi"}, 400, "messages", None, "non-empty list"),
    (_CHAT, {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages", None,
     "role"),
    (_CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400,
     "messages", None, "only text parts"),
    (_CHAT, {"messages": _MSG, "top_logprobs": 3}, 400, "top_logprobs", None,
     "requires logprobs"),
    (_CHAT, {"messages": _MSG, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs",
     None, "top_logprobs must be an integer in [0, 20], got 21"),
    (_CHAT, {"messages": _MSG, "tools": [{"type": "function"}]}, 400, "tools", None,
     "function is required"),
    (_CHAT, {"messages": _MSG, "max_completion_tokens": 10**6}, 400, "max_tokens",
     "context_length_exceeded", "maximum context length"),
    (_CHAT, [1, 2], 400, None, None, "JSON object"),
    (_CHAT, "{not json", 400, None, None, "not valid JSON"),
]


@pytest.mark.parametrize(
    "path,body,status,param,code,words", VALIDATION_TABLE,
    ids=[f"{i}-{row[3] or 'body'}" for i, row in enumerate(VALIDATION_TABLE)],
)
def test_validation_table(tokenizer, path, body, status, param, code, words):
    scheduler = FakeScheduler(events=_events(tokenizer, "never sent"))

    async def scenario():
        async with http_gateway(tokenizer, scheduler) as (session, _, _g):
            return await _post(session, path, body)

    got_status, headers, raw = run(scenario())
    assert got_status == status, raw
    assert headers["Content-Type"].startswith("application/json")
    error = json.loads(raw)["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param
    assert error["code"] == code
    assert words in error["message"]
    assert error["type"] == "invalid_request_error"
    assert scheduler.submitted == [], "a refused request must not reach the scheduler"


def test_oversized_body_is_413_with_an_openai_error(tokenizer):
    scheduler = FakeScheduler()

    async def scenario():
        async with http_gateway(tokenizer, scheduler, max_body_bytes=4096) as (session, _, _g):
            return await _post(session, _COMP, {"prompt": "x" * 10_000})

    status, _, raw = run(scenario())
    assert status == 413
    assert "4096 bytes" in json.loads(raw)["error"]["message"]


def test_unknown_route_and_method_are_json_errors(tokenizer):
    async def scenario():
        async with http_gateway(tokenizer, FakeScheduler()) as (session, _, _g):
            async with session.get("/v1/nope") as missing:
                a = missing.status, await missing.json()
            async with session.get(_COMP) as wrong_method:
                b = wrong_method.status, await wrong_method.json()
            return a, b

    (s404, body404), (s405, body405) = run(scenario())
    assert s404 == 404 and "/v1/nope" in body404["error"]["message"]
    assert s405 == 405 and "GET" in body405["error"]["message"]


def _sse_events(raw: bytes) -> list[str]:
    text = raw.decode()
    assert text.endswith("\n\n"), "every SSE event ends with a blank line"
    events = text.split("\n\n")[:-1]
    for event in events:
        assert event.startswith("data: "), event
        assert "\n" not in event, "one data line per event"
    return [e[len("data: "):] for e in events]


def test_chat_stream_is_clean_sse_with_one_finish_reason_and_usage(tokenizer):
    scheduler = FakeScheduler(events=_events(tokenizer, "The capital is Paris.",
                                             sampling_pb2.FINISH_REASON_STOP))

    async def scenario():
        async with http_gateway(tokenizer, scheduler) as (session, _, _g):
            body = {"messages": _MSG, "stream": True, "stream_options": {"include_usage": True}}
            return await _post(session, _CHAT, body)

    status, headers, raw = run(scenario())
    assert status == 200
    assert headers["Content-Type"].startswith("text/event-stream")
    events = _sse_events(raw)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
    assert len({c["id"] for c in chunks}) == 1
    usage_chunk, content = chunks[-1], chunks[:-1]
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"]["completion_tokens"] == len(scheduler.events)
    assert all(c["usage"] is None for c in content)
    assert content[0]["choices"][0]["delta"]["role"] == "assistant"
    reasons = [c["choices"][0]["finish_reason"] for c in content]
    assert reasons[-1] == "stop" and reasons.count("stop") == 1 and set(reasons[:-1]) == {None}
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in content)
    assert text == "The capital is Paris."


def test_continuous_usage_stats_put_usage_so_far_on_every_chunk(tokenizer):
    """vLLM's stream_options.continuous_usage_stats: each chunk's usage counts the tokens
    streamed so far; the final usage chunk follows as with include_usage."""
    scheduler = FakeScheduler(events=_events(tokenizer, "The capital is Paris.",
                                             sampling_pb2.FINISH_REASON_STOP))

    async def scenario():
        async with http_gateway(tokenizer, scheduler) as (session, _, _g):
            body = {"messages": _MSG, "stream": True,
                    "stream_options": {"continuous_usage_stats": True}}
            return await _post(session, _CHAT, body)

    status, _, raw = run(scenario())
    chunks = [json.loads(e) for e in _sse_events(raw)[:-1]]
    assert status == 200 and chunks[-1]["choices"] == []
    counts = [c["usage"]["completion_tokens"] for c in chunks[:-1]]
    prompt = {c["usage"]["prompt_tokens"] for c in chunks}
    assert counts == sorted(counts) and counts[-1] == len(scheduler.events)
    assert chunks[-1]["usage"]["completion_tokens"] == len(scheduler.events)
    assert len(prompt) == 1 and prompt.pop() > 0
    assert all(c["usage"]["total_tokens"] == c["usage"]["prompt_tokens"]
               + c["usage"]["completion_tokens"] for c in chunks)


def test_completion_echo_and_n_choices(tokenizer):
    scheduler = FakeScheduler(events=_events(tokenizer, " Paris"))

    async def scenario():
        async with http_gateway(tokenizer, scheduler) as (session, _, _g):
            body = {"prompt": "Capital:", "echo": True, "n": 2, "seed": 7, "max_tokens": 4}
            return await _post(session, _COMP, body)

    status, _, raw = run(scenario())
    body = json.loads(raw)
    assert status == 200, body
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert all(c["text"] == "Capital: Paris" for c in body["choices"])
    assert body["usage"]["completion_tokens"] == 2 * len(scheduler.events)
    # Each choice is its own sequence: distinct ids, seed + index.
    seeds = sorted(s.sampling.seed for s in scheduler.submitted)
    assert seeds == [7, 8]
    assert len({s.request_id for s in scheduler.submitted}) == 2


def test_overload_is_429_with_retry_after_at_once(tokenizer):
    scheduler = FakeScheduler(error=(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                     "the queue is full (1024 waiting)",
                                     (("retry-after-ms", "2500"),)))

    async def scenario():
        async with http_gateway(tokenizer, scheduler) as (session, _, _g):
            return await _post(session, _COMP, {"prompt": "hi", "stream": True})

    status, headers, raw = run(scenario(), timeout_s=10)
    assert status == 429
    assert headers["Retry-After"] == "3"
    error = json.loads(raw)["error"]
    assert error["type"] == "rate_limit_error" and error["code"] == "rate_limit_exceeded"
    assert "queue is full" in error["message"]


def test_the_schedulers_error_code_trailer_is_the_errors_code(tokenizer):
    """A replica whose context is smaller than the gateway's refuses the request itself;
    its ``error-code`` trailer becomes OpenAI's ``code`` (tools detect overflow by it)."""
    details = ("This model's maximum context length is 512 tokens. However, you requested "
               "600 tokens (8 in the prompt, 592 for the completion).")
    scheduler = FakeScheduler(error=(grpc.StatusCode.INVALID_ARGUMENT, details,
                                     (("error-code", "context_length_exceeded"),)))

    async def scenario():
        async with http_gateway(tokenizer, scheduler) as (session, _, _g):
            return await _post(session, _COMP, {"prompt": "hi", "max_tokens": 592})

    status, _, raw = run(scenario(), timeout_s=10)
    error = json.loads(raw)["error"]
    assert status == 400 and error["code"] == "context_length_exceeded"
    assert error["message"] == details


def test_draining_gateway_returns_503_and_health_says_so(tokenizer):
    async def scenario():
        async with http_gateway(tokenizer, FakeScheduler()) as (session, _, running):
            async with session.get("/health") as before:
                healthy = before.status
            running.http.draining = True
            status, _, raw = await _post(session, _COMP, {"prompt": "hi"})
            async with session.get("/health") as after:
                return healthy, status, json.loads(raw), after.status

    healthy, status, body, draining_health = run(scenario())
    assert healthy == 200
    assert status == 503 and body["error"]["type"] == "service_unavailable_error"
    assert draining_health == 503


KEYS = ApiKeys.parse(["sk-alice-0123456:alice", "sk-admin-0123456"], "test")


def test_api_keys_guard_http_except_health(tokenizer):
    scheduler = FakeScheduler(events=_events(tokenizer, "ok"))

    async def scenario():
        async with http_gateway(tokenizer, scheduler, keys=KEYS) as (session, _, _g):
            results = {}
            results["none"] = (await _post(session, _COMP, {"prompt": "hi"}))[0]
            bad = {"Authorization": "Bearer sk-alice-0123457"}
            results["wrong"] = (await _post(session, _COMP, {"prompt": "hi"}, bad))[0]
            alice = {"Authorization": "Bearer sk-alice-0123456"}
            results["alice"] = (await _post(session, _COMP, {"prompt": "hi"}, alice))[0]
            results["alice-as-bob"] = await _post(
                session, _COMP, {"prompt": "hi", "tenant": "bob"}, alice)
            admin = {"Authorization": "bearer sk-admin-0123456"}
            results["admin-as-bob"] = (await _post(
                session, _COMP, {"prompt": "hi", "tenant": "bob"}, admin))[0]
            for path in ("/health", "/live", "/metrics", "/v1/models", "/openapi.json"):
                async with session.get(path) as response:
                    results[path] = response.status
            return results

    results = run(scenario())
    assert results["none"] == 401 and results["wrong"] == 401
    assert results["alice"] == 200 and results["admin-as-bob"] == 200
    status, _, raw = results["alice-as-bob"]
    assert status == 403 and "tenant 'alice'" in json.loads(raw)["error"]["message"]
    assert results["/health"] == 200 and results["/live"] == 200
    assert results["/metrics"] == results["/v1/models"] == results["/openapi.json"] == 401
    # The key's tenant is what the scheduler accounts to.
    assert [s.tenant for s in scheduler.submitted] == ["alice", "bob"]


def test_api_keys_guard_grpc_except_health(tokenizer):
    scheduler = FakeScheduler(events=_events(tokenizer, "ok"))
    request = generation_pb2.GenerateRequest(prompt="hi")

    async def scenario():
        async with http_gateway(tokenizer, scheduler, keys=KEYS) as (_, channel, _g):
            generate = generation_pb2_grpc.GenerationStub(channel).Generate
            with pytest.raises(grpc.aio.AioRpcError) as denied:
                await collect(generate(request, timeout=5))
            ok = await collect(generate(
                request, timeout=5, metadata=(("authorization", "Bearer sk-alice-0123456"),)))
            health = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=5)
            return denied.value, ok, health

    denied, ok, health = run(scenario())
    assert denied.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "API key" in denied.details()
    assert ok[-1].finish_reason == sampling_pb2.FINISH_REASON_LENGTH
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    assert [s.tenant for s in scheduler.submitted] == ["alice"]


def test_requests_route_around_a_stopped_replica(tokenizer):
    live = FakeScheduler(events=_events(tokenizer, "fine"))
    doomed = FakeScheduler(events=_events(tokenizer, "fine"))

    async def scenario():
        async with fake_scheduler(live) as live_address:
            stopped = fake_scheduler(doomed)
            dead_address = await stopped.__aenter__()
            await stopped.__aexit__(None, None, None)  # stopped before the gateway starts
            addresses = f"{dead_address},{live_address}"
            async with gateway(tokenizer, addresses, http_port=0) as (running, _):
                async with aiohttp.ClientSession(
                        f"http://127.0.0.1:{running.http_port}") as session:
                    statuses = [(await _post(session, _COMP, {"prompt": "hi"}))[0]
                                for _ in range(4)]
                    async with session.get("/metrics") as response:
                        return statuses, await response.text()

    statuses, metrics = run(scenario())
    assert statuses == [200] * 4
    assert len(live.submitted) == 4 and doomed.submitted == []
    assert "continuum:replica_healthy" in metrics


def test_metrics_use_the_documented_names_and_tiers(tokenizer):
    events = _events(tokenizer, "Paris is nice")
    events[0].queue_time_s = 0.25

    async def scenario():
        async with http_gateway(tokenizer, FakeScheduler(events=events)) as (session, _, _g):
            await _post(session, _COMP, {"prompt": "hi", "priority": "premium"})
            await _post(session, _COMP, {"prompt": "hi", "temperature": 9})  # refused
            for _ in range(50):  # until the replica poller has read the Stats once
                async with session.get("/metrics") as response:
                    text = await response.text()
                if "continuum:num_requests_running{" in text:
                    break
                await asyncio.sleep(0.1)
            return response.status, response.headers["Content-Type"], text

    status, content_type, text = run(scenario())
    assert status == 200 and content_type.startswith("text/plain")
    label = f'model_name="{MODEL_NAME}",priority="premium"'
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds",
                 "request_queue_time_seconds"):
        assert f"continuum_gateway_{name}_count{{{label}}} 1.0" in text, name
    gaps = float(len(events) - 1)  # one inter-token gap per token after the first
    assert f"continuum_gateway_inter_token_latency_seconds_count{{{label}}} {gaps}" in text
    assert f"continuum_gateway_request_queue_time_seconds_sum{{{label}}} 0.25" in text
    assert f"continuum_gateway_generation_tokens_total{{{label}}} {float(len(events))}" in text
    assert f"continuum_gateway_prompt_tokens_total{{{label}}} 1.0" in text
    assert ('continuum_gateway_request_errors_total{model_name="smollm2",'
            'code="INVALID_ARGUMENT"}') in text
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
                 "num_preemptions_total", "scheduler_update_fallbacks_total"):
        assert f"# TYPE continuum:{name.removesuffix('_total')}" in text, name
    # The fake replica reports one running standard-tier sequence.
    running = re.search(r'continuum:num_requests_running\{model_name="smollm2",'
                        r'priority="standard",replica="[0-9.:]+"\} (\S+)', text)
    assert running is not None and running.group(1) == "1.0"


def _fail_first_decode(tokenizer, monkeypatch):
    """Detokenizing the first output fails: a bug in serving, after admission."""
    original, calls = tokenizer.decode, []

    def flaky(ids, skip_special_tokens=True):
        calls.append(ids)
        if len(calls) == 1:
            raise RuntimeError("detokenizer exploded")
        return original(ids, skip_special_tokens)

    monkeypatch.setattr(tokenizer, "decode", flaky)


def test_an_internal_failure_is_a_json_500_and_the_server_keeps_serving(tokenizer, monkeypatch):
    scheduler = FakeScheduler(events=_events(tokenizer, "fine"))
    _fail_first_decode(tokenizer, monkeypatch)

    async def scenario():
        async with http_gateway(tokenizer, scheduler) as (session, _, _g):
            failed = await _post(session, _COMP, {"prompt": "boom"})
            fine = await _post(session, _COMP, {"prompt": "hello"})
            return failed, fine

    (status, _, raw), (after, _, _) = run(scenario())
    assert status == 500
    error = json.loads(raw)["error"]
    assert error["type"] == "server_error" and "exploded" not in error["message"]
    assert after == 200


def test_an_internal_failure_over_grpc_is_internal_without_details(tokenizer, monkeypatch):
    scheduler = FakeScheduler(events=_events(tokenizer, "fine"))
    _fail_first_decode(tokenizer, monkeypatch)

    async def scenario():
        async with http_gateway(tokenizer, scheduler) as (_, channel, _g):
            generate = generation_pb2_grpc.GenerationStub(channel).Generate
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await collect(generate(generation_pb2.GenerateRequest(prompt="x"), timeout=5))
            return caught.value

    error = run(scenario())
    assert error.code() == grpc.StatusCode.INTERNAL
    assert "exploded" not in error.details()
