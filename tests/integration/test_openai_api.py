"""The OpenAI-compatible HTTP API of the real stack, driven by the official `openai`
client (and raw sockets where the client hides what we check), next to the gRPC API."""

from __future__ import annotations

import http.client
import json
import shutil
import socket
import subprocess
import sys
import time

import grpc
import openai
import pytest

from protos.continuum.v1 import generation_pb2 as gen

from .test_serve import collect, wait_until_idle

pytestmark = pytest.mark.integration
PROMPT = "The capital of France is"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)


def test_models_lists_the_served_model(client, server):
    models = client.models.list()
    assert [m.id for m in models.data] == [server.stats().model_id]


def test_greedy_completion_equals_the_grpc_answer(client, server):
    http_answer = client.completions.create(model="", prompt=PROMPT, max_tokens=8,
                                            temperature=0)
    grpc_answer = collect(server, gen.GenerateRequest(prompt=PROMPT, max_tokens=8,
                                                      sampling={"temperature": 0.0}))
    choice = http_answer.choices[0]
    assert choice.text == "".join(r.text for r in grpc_answer)
    assert choice.finish_reason == "length"
    assert http_answer.usage.completion_tokens == 8
    assert http_answer.usage.prompt_tokens == grpc_answer[-1].usage.prompt_tokens
    assert http_answer.id.startswith("cmpl-") and http_answer.object == "text_completion"


def test_chat_completion_answers_paris(client):
    answer = client.chat.completions.create(model="", messages=QUESTION, max_tokens=24,
                                            temperature=0)
    assert "Paris" in answer.choices[0].message.content
    assert answer.choices[0].message.role == "assistant"
    assert answer.choices[0].finish_reason == "stop"
    assert answer.usage.total_tokens == answer.usage.prompt_tokens + answer.usage.completion_tokens


def test_chat_stream_matches_non_stream_and_ends_with_usage(client):
    whole = client.chat.completions.create(model="", messages=QUESTION, max_tokens=24,
                                           temperature=0)
    chunks = list(client.chat.completions.create(
        model="", messages=QUESTION, max_tokens=24, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    usage_chunk, content = chunks[-1], chunks[:-1]
    assert usage_chunk.choices == [] and usage_chunk.usage == whole.usage
    text = "".join(c.choices[0].delta.content or "" for c in content)
    assert text == whole.choices[0].message.content
    reasons = [c.choices[0].finish_reason for c in content]
    assert reasons[-1] == "stop" and reasons.count("stop") == 1
    assert content[0].choices[0].delta.role == "assistant"


def test_stop_string_cuts_the_text_before_it(client):
    full = client.completions.create(model="", prompt=PROMPT, max_tokens=16, temperature=0)
    assert "." in full.choices[0].text
    cut = client.completions.create(model="", prompt=PROMPT, max_tokens=16, temperature=0,
                                    stop=["."])
    assert cut.choices[0].text == full.choices[0].text.split(".")[0]
    assert cut.choices[0].finish_reason == "stop"


def test_seeded_choices_are_reproducible_and_use_seed_plus_index(client):
    def sample(n, seed):
        answer = client.completions.create(model="", prompt=PROMPT, max_tokens=12,
                                           temperature=1.0, n=n, seed=seed)
        return [c.text for c in sorted(answer.choices, key=lambda c: c.index)]

    pair = sample(2, 42)
    assert len(pair) == 2
    assert sample(2, 42) == pair
    assert sample(1, 43) == pair[1:]


def test_logprobs_come_back_for_each_token(client):
    answer = client.completions.create(model="", prompt=PROMPT, max_tokens=4, temperature=0,
                                       logprobs=3)
    logprobs = answer.choices[0].logprobs
    assert "".join(logprobs.tokens) == answer.choices[0].text
    assert len(logprobs.token_logprobs) == 4 and all(lp <= 0 for lp in logprobs.token_logprobs)
    # Greedy: the chosen token is the most likely alternative.
    for token, logprob, top in zip(logprobs.tokens, logprobs.token_logprobs,
                                   logprobs.top_logprobs, strict=True):
        assert len(top) == 3 and max(top.values()) == pytest.approx(logprob, abs=1e-5)
        assert top[token] == pytest.approx(logprob, abs=1e-5)


def test_logit_bias_steers_the_real_model(client, server):
    """Over gRPC (token ids come back) and HTTP: -100 bans the greedy token, +100 on one
    token makes greedy decoding repeat it."""
    plain = collect(server, gen.GenerateRequest(prompt=PROMPT, max_tokens=2,
                                                sampling={"temperature": 0.0}))
    first = [t for r in plain for t in r.token_ids][0]
    banned = collect(server, gen.GenerateRequest(
        prompt=PROMPT, max_tokens=2, sampling={"temperature": 0.0, "logit_bias": {first: -100}}))
    assert [t for r in banned for t in r.token_ids][0] != first
    forced = client.completions.create(model="", prompt=PROMPT, max_tokens=3, temperature=0,
                                       logit_bias={"330": 100})
    grpc_forced = collect(server, gen.GenerateRequest(
        prompt=PROMPT, max_tokens=3, sampling={"temperature": 0.0, "logit_bias": {330: 100}}))
    assert [t for r in grpc_forced for t in r.token_ids] == [330, 330, 330]
    assert forced.choices[0].text == "".join(r.text for r in grpc_forced)


CITY_SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                "country": {"type": "string",
                                                            "maxLength": 30}},
               "required": ["city", "country"], "additionalProperties": False}


def test_structured_output_follows_the_schema_through_the_real_model(client):
    answer = client.chat.completions.create(
        model="", messages=QUESTION, max_tokens=60, temperature=0,
        response_format={"type": "json_schema",
                         "json_schema": {"name": "place", "schema": CITY_SCHEMA,
                                         "strict": True}})
    value = json.loads(answer.choices[0].message.content)
    assert set(value) == {"city", "country"} and answer.choices[0].finish_reason == "stop"
    anything = client.chat.completions.create(
        model="", messages=QUESTION, max_tokens=60, temperature=0,
        response_format={"type": "json_object"})
    assert isinstance(json.loads(anything.choices[0].message.content), dict)
    choice = client.completions.create(model="", prompt="Is Paris in France? Answer:",
                                       max_tokens=5, temperature=0,
                                       extra_body={"guided_choice": [" yes", " no"]})
    assert choice.choices[0].text in (" yes", " no")


@pytest.mark.parametrize("kwargs,error,param,code", [
    ({"extra_body": {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "nope"}}}}}, openai.BadRequestError,
     "response_format", None),
    ({"extra_body": {"response_format": {"type": "xml"}}}, openai.BadRequestError,
     "response_format", None),
    ({"temperature": 3.0}, openai.BadRequestError, "temperature", None),
    ({"logit_bias": {"1": 101}}, openai.BadRequestError, "logit_bias", None),
    ({"logit_bias": {"99999999": 1}}, openai.BadRequestError, "logit_bias", None),
    ({"logit_bias": {"x": 1}}, openai.BadRequestError, "logit_bias", None),
    ({"logit_bias": {str(i): 1 for i in range(301)}}, openai.BadRequestError, "logit_bias",
     None),
    ({"max_tokens": 100_000}, openai.BadRequestError, "max_tokens", "context_length_exceeded"),
    ({"model": "gpt-4"}, openai.NotFoundError, "model", "model_not_found"),
    ({"n": 99}, openai.BadRequestError, "n", None),
])
def test_errors_have_openai_shape(client, kwargs, error, param, code):
    arguments = {"model": "", "prompt": PROMPT, "max_tokens": 4, **kwargs}
    with pytest.raises(error) as caught:
        client.completions.create(**arguments)
    body = caught.value.body
    assert set(body) == {"message", "type", "param", "code"}
    assert body["param"] == param and body["code"] == code
    assert body["message"]


def _raw_post(server, path: str, body: dict) -> http.client.HTTPConnection:
    connection = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=60)
    connection.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    return connection


def _wait_running(server, count: int, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while server.stats().num_running != count:
        assert time.monotonic() < deadline, f"never reached {count} running"
        time.sleep(0.05)


def test_streaming_disconnect_frees_blocks(server):
    connection = _raw_post(server, "/v1/completions",
                           {"prompt": PROMPT, "max_tokens": 400, "stream": True,
                            "ignore_eos": True})
    response = connection.getresponse()
    assert response.status == 200
    assert response.readline().startswith(b"data: {")  # generation is under way
    connection.sock.shutdown(socket.SHUT_RDWR)
    connection.close()
    stats = wait_until_idle(server)
    assert stats.num_running == 0 and stats.num_free_blocks == stats.num_total_blocks


def test_non_streaming_disconnect_frees_blocks(server):
    connection = _raw_post(server, "/v1/chat/completions",
                           {"messages": QUESTION, "max_tokens": 400, "ignore_eos": True})
    _wait_running(server, 1)
    connection.sock.shutdown(socket.SHUT_RDWR)
    connection.close()
    stats = wait_until_idle(server)
    assert stats.num_running == 0 and stats.num_free_blocks == stats.num_total_blocks


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
def test_curl_shows_a_clean_sse_stream(server):
    body = json.dumps({"messages": QUESTION, "max_tokens": 8, "stream": True})
    out = subprocess.run(
        ["curl", "-sN", f"{server.base_url}/chat/completions",
         "-H", "Content-Type: application/json", "-d", body],
        capture_output=True, text=True, timeout=120, check=True).stdout
    events = out.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    assert all(e.startswith("data: {") for e in events[:-2])


def test_grpc_n_timing_and_logprobs(server):
    request = gen.GenerateRequest(prompt=PROMPT, max_tokens=5, n=2,
                                  sampling={"temperature": 0.0, "logprobs": 2})
    with grpc.insecure_channel(server.addr) as channel:
        responses = list(server.generation_stub(channel).Generate(request, timeout=120))
    for index in (0, 1):
        mine = [r for r in responses if r.index == index]
        last = mine[-1]
        assert last.finish_reason and sum(1 for r in mine if r.finish_reason) == 1
        ids = [t for r in mine for t in r.token_ids]
        logprobs = [lp for r in mine for lp in r.logprobs]
        assert len(ids) == 5 and [lp.token_id for lp in logprobs] == ids
        assert all(len(lp.top_token_ids) == 2 for lp in logprobs)
        timing = last.timing
        assert 0 < timing.time_to_first_token_s <= timing.e2e_latency_s
        assert 0 <= timing.queue_time_s <= timing.time_to_first_token_s
    texts = {i: "".join(r.text for r in responses if r.index == i) for i in (0, 1)}
    assert texts[0] == texts[1], "greedy choices agree"


@pytest.mark.parametrize("api", ["grpc", "openai"])
def test_continuum_bench_runs_a_mixed_workload(server, tmp_path, api):
    """The load generator end to end: tiers, tenants, cancellations, JSON results."""
    results = tmp_path / "bench.json"
    subprocess.run(
        [sys.executable, "-m", "continuum", "bench", "--api", api, "--addr", server.addr,
         "--base-url", server.base_url, "--num-prompts", "8", "--request-rate", "20",
         "--input-len", "24", "--output-len", "6", "--tiers", "0:1,2:1",
         "--tenants", "a:1,b:1", "--cancel-fraction", "0.25", "--seed", "5",
         "--goodput", "ttft:60000", "--output", str(results), "--no-progress"],
        check=True, capture_output=True, text=True, timeout=300)
    [report] = json.loads(results.read_text())
    overall = report["overall"]
    assert overall["num_requests"] == 8 and overall["errors"] == {}
    assert overall["num_completed"] + overall["num_cancelled"] == 8
    assert overall["num_cancelled"] >= 1
    assert overall["total_output_tokens"] == 6 * overall["num_completed"]
    assert overall["goodput"] == pytest.approx(overall["request_throughput"])
    assert set(report["by_tier"]) == {"premium", "best_effort"}
    assert set(report["by_tenant"]) <= {"a", "b"}
    assert wait_until_idle(server).num_free_blocks == server.stats().num_total_blocks
