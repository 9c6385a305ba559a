"""Structured-output specs are compiled against the served tokenizer before admission:
specs that only fail against a tokenizer (token ranges past the vocabulary, unknown
special tokens, regexes that outgrow llguidance's lexer once they run, schemas nested
past the recursion limit) are a 400 / INVALID_ARGUMENT with llguidance's reason, on
both APIs; good specs still reach the scheduler."""

from __future__ import annotations

import json
import os
import signal
import time

import aiohttp
import grpc
import pytest

from gateway.admit.parse_guard import parse_guard
from gateway.api import http_replies
from gateway.metrics import GatewayMetrics
from gateway.structured import compile_worker, guided_check
from gateway.structured.guided_check import GuidedCheck
from gateway.tools import tool_checks
from gateway.validation import RequestError
from protos import guided as guided_spec
from protos.continuum.v1 import generation_pb2, generation_pb2_grpc, sampling_pb2, scheduler_pb2

from .harness import FakeScheduler, collect, fake_scheduler, gateway, run

DEEP_SCHEMA = "[" * 5000 + "]" * 5000  # JSON text, a string field: the body's depth cap misses it
PATTERN_SCHEMA = json.dumps({"type": "object", "properties": {"a": {
    "type": "string", "pattern": "(x{1000}){1000}"}}})
# (HTTP field, its value, the Guided the gRPC API sends for it, words of the refusal)
BAD_SPECS = [
    ("guided_grammar", "start: <[99999999]>", {"lark": "start: <[99999999]>"},
     "Token range end too large"),
    ("guided_grammar", "start: <[50000-60000]>", {"lark": "start: <[50000-60000]>"},
     "Token range end too large: 60000"),
    ("guided_grammar", "start: <|no_such_token|>", {"lark": "start: <|no_such_token|>"},
     "unknown special token"),
    ("guided_regex", "a{1000000}", {"regex": "a{1000000}"}, "too many expressions"),
    ("guided_regex", "(a{1000}){1000}", {"regex": "(a{1000}){1000}"}, "too many expressions"),
    ("guided_json", DEEP_SCHEMA, {"json_schema": DEEP_SCHEMA}, "nests too deeply"),
    # A pattern's regex is built only when generation enters its string: probed alone.
    ("guided_json", PATTERN_SCHEMA, {"json_schema": PATTERN_SCHEMA}, "pattern '(x{1000})"),
]
GOOD_SPECS = [
    {"lark": 'start: "yes" | "no"'},
    {"lark": "start: <|im_end|>"},  # a special token the tokenizer has
    {"regex": "[0-9]{3}-[a-z]+"},
    {"json_schema": json.dumps({"type": "object", "properties": {"n": {"type": "integer"}}})},
    {"json_object": True},
    {"json_schema": json.dumps({"type": "object", "properties": {"phone": {
        "type": "string", "pattern": r"^(\([0-9]{3}\))?[0-9]{3}-[0-9]{4}$"}},
        "patternProperties": {"^x-[a-z]+$": {"type": "string"}}})},
]


@pytest.mark.parametrize("field,value,spec,words", BAD_SPECS, ids=[s[1][:24] for s in BAD_SPECS])
def test_specs_that_fail_only_against_the_tokenizer_are_named(tokenizer, field, value, spec,
                                                              words):
    message = tokenizer.guided.problem(sampling_pb2.Guided(**spec))
    assert message is not None and words in message
    assert len(message) < 600  # llguidance's message, bounded


@pytest.mark.parametrize("spec", GOOD_SPECS, ids=[next(iter(s)) for s in GOOD_SPECS])
def test_good_specs_pass(tokenizer, spec):
    assert tokenizer.guided.problem(sampling_pb2.Guided(**spec)) is None


def test_what_the_gateway_refuses_is_what_the_executor_meets(tokenizer):
    """The same grammar, tokenizer and limits: the executor's matcher fails on its first
    token where the gateway's probe refused the spec."""
    grammar = guided_spec.grammar_of(sampling_pb2.Guided(regex="a{1000000}"))
    matcher = guided_spec.new_matcher(tokenizer.guided.tokenizer(), grammar)
    matcher.compute_bitmask()
    matcher.consume_token(tokenizer.encode("a")[-1])
    assert matcher.is_error() and "too many expressions" in matcher.get_error()


def test_a_repeated_spec_is_compiled_once(tokenizer):
    before = tokenizer.guided.num_compiles
    spec = sampling_pb2.Guided(regex=f"cached-{time.monotonic_ns()}[0-9]+")
    assert [tokenizer.guided.problem(spec) for _ in range(3)] == [None] * 3
    assert tokenizer.guided.num_compiles - before == 1


def _check(tokenizer, **kwargs) -> GuidedCheck:
    return GuidedCheck(tokenizer._backend.to_str, tokenizer.info.vocab_size,
                       tokenizer.info.eos_token_ids, workers=1, **kwargs)


def test_a_compile_past_its_cpu_budget_is_killed_and_the_spec_refused(tokenizer, monkeypatch):
    monkeypatch.setattr(compile_worker, "POLL_S", 0.002)
    check = _check(tokenizer)
    try:
        assert check.problem(sampling_pb2.Guided(regex="[0-9]+")) is None  # started
        (first,) = check.worker_pids()
        check.cpu_budget_s = 0.001  # a bomb passes it; a slow host's "[0-9]+" might too
        message = check.problem(sampling_pb2.Guided(regex="(a{1500}){1500}"))
        assert message is not None and "took too long to compile" in message
        assert first not in check.worker_pids()  # killed; the next check starts another
        check.cpu_budget_s = 60.0
        assert check.problem(sampling_pb2.Guided(regex="[a-z]+")) is None
    finally:
        check.close()


def test_no_cpu_in_time_is_overload_not_a_verdict(tokenizer):
    """A worker that gets no CPU (stopped here) answers nothing: the request is refused
    as busy (not kept as the spec's verdict), and the next check gets a fresh worker."""
    check = _check(tokenizer)
    spec = sampling_pb2.Guided(regex="[0-9]{2}")
    try:
        assert check.problem(sampling_pb2.Guided(regex="[0-9]+")) is None  # started
        (stopped,) = check.worker_pids()
        check.timeout_s = 0.3
        os.kill(stopped, signal.SIGSTOP)
        started = time.monotonic()
        with pytest.raises(guided_check.CompileBusy):
            check.problem(spec)
        assert time.monotonic() - started < 1.0
        check.timeout_s = 60.0
        assert check.problem(spec) is None and stopped not in check.worker_pids()
    finally:
        check.close()


def test_a_workers_start_is_not_the_specs_time(tokenizer, monkeypatch):
    """A worker's start (a large vocabulary takes seconds) does not count against the
    check's timeout: the first structured request after startup gets its verdict, not a
    429 from a server that is idle."""
    start = compile_worker.Worker.start

    def slow_start(worker):
        time.sleep(1.0)  # longer than the timeout below
        start(worker)

    monkeypatch.setattr(compile_worker.Worker, "start", slow_start)
    check = _check(tokenizer, timeout_s=0.5)
    try:
        assert check.problem(sampling_pb2.Guided(regex="[0-9")) is not None  # a verdict
    finally:
        check.close()


def test_a_worker_that_died_is_replaced(tokenizer):
    check = _check(tokenizer)
    try:
        assert check.problem(sampling_pb2.Guided(regex="[0-9]+")) is None
        (dead,) = check.worker_pids()
        os.kill(dead, signal.SIGKILL)
        assert check.problem(sampling_pb2.Guided(regex="[a-c]+")) is None
        assert check.worker_pids() and dead not in check.worker_pids()
    finally:
        check.close()


def test_busy_is_429_and_resource_exhausted(tokenizer):
    metrics = GatewayMetrics("m")
    with pytest.raises(RequestError) as caught, parse_guard("http", metrics):
        raise guided_check.CompileBusy("busy")
    assert caught.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    response = http_replies.request_error(caught.value)
    assert response.status == 429 and response.headers["Retry-After"] == "1"


def test_tool_parameters_go_through_the_served_tokenizers_check():
    class Refusing:
        def problem(self, spec):
            return f"refused {spec.json_schema}"

    chat = generation_pb2.ChatInput(tools=[generation_pb2.Tool(name="f", parameters='{"a": 1}')])
    assert tool_checks.chat_problem(chat, Refusing()) == 'tools[0] (f) parameters: refused {"a": 1}'


async def _both_apis(tokenizer, scheduler):
    """Every bad spec on HTTP and gRPC, then one good grammar on each."""
    async with fake_scheduler(scheduler) as address, \
            gateway(tokenizer, address, http_port=0) as (running, channel), \
            aiohttp.ClientSession(f"http://127.0.0.1:{running.http_port}") as session:
        generate = generation_pb2_grpc.GenerationStub(channel).Generate
        http, grpc_errors = [], []
        for field, value, spec, _ in BAD_SPECS:
            async with session.post("/v1/completions",
                                    json={"prompt": "hi", field: value}) as response:
                http.append((response.status, await response.json()))
            try:
                await collect(generate(generation_pb2.GenerateRequest(
                    prompt="hi", sampling=sampling_pb2.SamplingParams(
                        guided=sampling_pb2.Guided(**spec))), timeout=10))
                grpc_errors.append(None)
            except grpc.aio.AioRpcError as exc:
                grpc_errors.append(exc)
        async with session.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "yes?"}], "max_tokens": 2,
                "guided_grammar": 'start: "yes" | "no"'}) as response:
            good = response.status
        await collect(generate(generation_pb2.GenerateRequest(
            prompt="hi", max_tokens=2, sampling=sampling_pb2.SamplingParams(
                guided=sampling_pb2.Guided(regex="yes|no"))), timeout=10))
        return http, grpc_errors, good


def test_both_apis_refuse_bad_specs_and_serve_good_ones(tokenizer):
    scheduler = FakeScheduler(events=[scheduler_pb2.TokenEvent(
        token_ids=[42], finish_reason=sampling_pb2.FINISH_REASON_LENGTH)])
    http, grpc_errors, good = run(_both_apis(tokenizer, scheduler))
    for (field, _, _, words), (status, body), error in zip(BAD_SPECS, http, grpc_errors,
                                                           strict=True):
        assert status == 400, (field, body)
        assert body["error"]["param"] == "response_format" and words in body["error"]["message"]
        assert error is not None and error.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert words in error.details()
    assert good == 200
    guided = [s.sampling.guided for s in scheduler.submitted]
    assert [g.lark or g.regex for g in guided] == ['start: "yes" | "no"', "yes|no"]
