"""`continuum serve --model <the Gemma 3 270M GGUF>`: the real Gemma 3 weights served
through the whole stack and the official `openai` client. The server converts the GGUF
itself (tokenizer, chat template, sliding windows); a chat answer, structured output that
fits its schema, a named tool call whose arguments fit the function, a stream, and the
model's name and context length in /v1/models and /metrics."""

from __future__ import annotations

import json
import urllib.request

import openai
import pytest

from tests.integration.conftest import start_server

pytestmark = pytest.mark.integration
PLACE = {"type": "object",
         "properties": {"city": {"type": "string", "maxLength": 30},
                        "country": {"type": "string", "maxLength": 30}},
         "required": ["city", "country"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather of a city",
    "parameters": {"type": "object",
                   "properties": {"city": {"type": "string", "maxLength": 24},
                                  "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
PROMPT = "The capital of France is"
ASK = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory, gemma_gguf):
    srv = start_server(tmp_path_factory.mktemp("gemma"), gemma_gguf,
                       "--kv-cache-bytes", str(128 << 20))
    yield srv
    assert srv.stop() == 0, "".join(srv.log[-30:])


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=180)


def test_models_and_metrics_name_the_model_and_its_context(client, server):
    (model,) = client.models.list().data
    assert model.id.startswith("gemma")
    assert model.model_extra["max_model_len"] == 32768  # the GGUF's context_length
    metrics = f"http://127.0.0.1:{server.http_port}/metrics"
    with urllib.request.urlopen(metrics, timeout=30) as response:
        text = response.read().decode()
    assert (f'continuum_gateway_model_info{{model_name="{model.id}",max_model_len="32768"}} 1.0'
            in text)


def test_a_completion_is_transformers_greedy_text(client, gemma_reference):
    """The whole serving path (gateway tokenizer, executor, detokenizer) gives the tokens
    transformers gives reading the same GGUF."""
    tok, model = gemma_reference
    ids = tok(PROMPT, return_tensors="pt").input_ids
    expected = tok.decode(model.generate(ids, max_new_tokens=10, do_sample=False)[0, ids.shape[1]:])
    answer = client.completions.create(model="", prompt=PROMPT, max_tokens=10, temperature=0)
    assert answer.choices[0].text == expected and answer.usage.prompt_tokens == ids.shape[1]


def test_chat_goes_through_gemmas_template_and_streams_the_same(client):
    # The GGUF is the pretrained model (no chat template of its own): the converter gives
    # it Gemma's turn format; what the base model says in a turn is its own business.
    kwargs = {"model": "", "messages": ASK, "max_tokens": 16, "temperature": 0}
    answer = client.chat.completions.create(**kwargs)
    text = answer.choices[0].message.content
    assert text.strip() and answer.choices[0].finish_reason in ("stop", "length")
    # <bos>, <start_of_turn>user\n, the 7 question tokens, <end_of_turn>\n,
    # <start_of_turn>model\n: the markers are single special tokens, never text.
    assert answer.usage.prompt_tokens == 16
    assert "<start_of_turn>" not in text and "<end_of_turn>" not in text
    pieces = [chunk.choices[0].delta.content or ""
              for chunk in client.chat.completions.create(**kwargs, stream=True)
              if chunk.choices]
    assert "".join(pieces) == text


def test_structured_output_fits_its_schema(client):
    answer = client.chat.completions.create(
        model="", messages=ASK, max_tokens=60, temperature=0,
        response_format={"type": "json_schema",
                         "json_schema": {"name": "place", "schema": PLACE, "strict": True}})
    value = json.loads(answer.choices[0].message.content)
    assert set(value) == {"city", "country"}
    assert all(isinstance(v, str) and len(v) <= 30 for v in value.values())


def test_a_named_tool_call_fits_the_function(client):
    answer = client.chat.completions.create(
        model="", max_tokens=60, temperature=0, tools=[WEATHER],
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    arguments = json.loads(call.function.arguments)
    assert set(arguments) == {"city", "unit"} and arguments["unit"] in ("celsius", "fahrenheit")
