"""Function calling through the real model (``continuum serve``, one server for the
module) with the official ``openai`` client: a named or "required" tool_choice is a
grammar-constrained call whose arguments fit the function's schema, whatever the
model; streamed calls accumulate in the client's helper; tool turns render; and the
gRPC API takes the same tools, its call forced through ``sampling.guided``."""

from __future__ import annotations

import http.client
import json

import grpc
import openai
import pytest

from protos.continuum.v1 import generation_pb2 as gen
from protos.continuum.v1 import sampling_pb2
from tests.integration.conftest import start_server
from tests.tiers import spawns_processes

pytestmark = pytest.mark.integration

WEATHER_PARAMETERS = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 24},
                   "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather of a city",
    "parameters": WEATHER_PARAMETERS}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The local time of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string",
                                                             "maxLength": 24}},
                   "required": ["city"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
@spawns_processes
def server(tmp_path_factory, model_dir):
    srv = start_server(tmp_path_factory.mktemp("tools"), model_dir)
    yield srv
    assert srv.stop() == 0, "".join(srv.log[-30:])


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)


def _weather_arguments(text: str) -> dict:
    """The arguments, checked against WEATHER_PARAMETERS key by key."""
    arguments = json.loads(text)
    assert set(arguments) == {"city", "unit"}
    assert isinstance(arguments["city"], str) and len(arguments["city"]) <= 24
    assert arguments["unit"] in ("celsius", "fahrenheit")
    return arguments


def test_a_named_tool_choice_is_a_valid_call_and_streams_the_same(client):
    kwargs = {"model": "", "messages": ASK, "tools": [WEATHER, TIME], "tool_choice": NAMED,
              "max_tokens": 60, "temperature": 0}
    answer = client.chat.completions.create(**kwargs)
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.id.startswith("call_") and call.type == "function"
    assert call.function.name == "get_weather"
    _weather_arguments(call.function.arguments)
    with client.chat.completions.stream(**kwargs) as stream:
        pieces = [event.chunk for event in stream if event.type == "chunk"]
        streamed = stream.get_final_completion()
    entries = [e for c in pieces for ch in c.choices for e in (ch.delta.tool_calls or [])]
    assert entries[0].id.startswith("call_") and entries[0].function.name == "get_weather"
    assert len(entries) > 2 and all(e.index == 0 and e.id is None for e in entries[1:])
    assert pieces[-1].choices[0].finish_reason == "tool_calls"
    (streamed_call,) = streamed.choices[0].message.tool_calls
    assert streamed_call.function.arguments == call.function.arguments


def test_required_gives_one_call_of_the_tools(client):
    answer = client.chat.completions.create(
        model="", messages=ASK, tools=[WEATHER, TIME], tool_choice="required",
        parallel_tool_calls=False, max_tokens=60, temperature=0)
    (call,) = answer.choices[0].message.tool_calls
    assert call.function.name in ("get_weather", "get_time")
    assert isinstance(json.loads(call.function.arguments)["city"], str)
    assert answer.choices[0].finish_reason == "tool_calls"


def test_tool_turns_in_the_history_are_rendered_and_answered(client, server):
    history = [*ASK,
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "call_abc", "type": "function", "function": {
                       "name": "get_weather",
                       "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
               {"role": "tool", "tool_call_id": "call_abc", "content": "18 degrees, sunny"}]
    with_tools = client.chat.completions.create(
        model="", messages=history, tools=[WEATHER], max_tokens=4, temperature=0)
    choice = with_tools.choices[0]
    assert choice.finish_reason in ("stop", "length", "tool_calls")
    assert choice.message.content or choice.message.tool_calls
    # /tokenize renders the same prompt: the tools block, the call and its result
    assert _token_count(server, {"messages": history, "tools": [WEATHER]}) == \
        with_tools.usage.prompt_tokens
    assert with_tools.usage.prompt_tokens > _token_count(server, {"messages": ASK}) + 100


def _token_count(server, body: dict) -> int:
    connection = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=60)
    connection.request("POST", "/tokenize", json.dumps(body),
                       {"Content-Type": "application/json"})
    response = connection.getresponse()
    assert response.status == 200
    return json.loads(response.read())["count"]


def test_grpc_takes_tools_and_forces_a_call_through_guided(server):
    chat = gen.ChatInput(messages=[gen.ChatMessage(role="user", content=ASK[0]["content"])],
                         tools=[gen.Tool(name="get_weather", description="weather",
                                         parameters=json.dumps(WEATHER_PARAMETERS))])
    request = gen.GenerateRequest(chat=chat, max_tokens=60, sampling=sampling_pb2.SamplingParams(
        temperature=0, guided=sampling_pb2.Guided(json_schema=json.dumps(WEATHER_PARAMETERS))))
    with grpc.insecure_channel(server.addr) as channel:
        stub = server.generation_stub(channel)
        responses = list(stub.Generate(request, timeout=120))
        _weather_arguments("".join(r.text for r in responses))
        request.chat.tools.add(name="get_weather")  # a second tool of that name
        with pytest.raises(grpc.RpcError) as caught:
            list(stub.Generate(request, timeout=60))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "names must be unique" in caught.value.details()
