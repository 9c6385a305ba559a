"""GET /openapi.json (gateway/api/openapi_doc.py): its request bodies are the readers'
shapes, what it requires the readers require, its paths are the app's routes, and the
answers the dialects send are valid under it (and under OpenAI's published document,
where it lies). A fake scheduler; no model runs.
"""

from __future__ import annotations

import contextlib
import json

import aiohttp
import jsonschema
import pytest

from gateway.admit.auth import ApiKeys
from gateway.api import openai_schema, openapi_doc
from gateway.api import openai_schema as shapes
from gateway.api.http_tokenize import detokenize, tokenize
from gateway.api.openai_api import CHAT, COMPLETION
from gateway.validation import RequestError
from harness import openapi_run
from protos.continuum.v1 import sampling_pb2, scheduler_pb2

from .harness import MODEL_NAME, FakeScheduler, fake_scheduler, gateway, run

DOCUMENT = openapi_doc.document()
READERS = {
    "/v1/completions": lambda body, tokenizer: COMPLETION.parse(body, MODEL_NAME, tokenizer),
    "/v1/chat/completions": lambda body, tokenizer: CHAT.parse(body, MODEL_NAME, tokenizer),
    "/tokenize": lambda body, tokenizer: tokenize(body, MODEL_NAME, tokenizer),
    "/detokenize": lambda body, tokenizer: detokenize(body, MODEL_NAME, tokenizer),
}


def _body_validator(path: str) -> jsonschema.Validator:
    schema = DOCUMENT["paths"][path]["post"]["requestBody"]["content"]["application/json"]
    return jsonschema.Draft202012Validator(schema["schema"])


@pytest.mark.parametrize("shape,expected", [
    (shapes.REFUSED, False),
    (shapes.number(0.0, 1.0, low_open=True),
     {"type": "number", "exclusiveMinimum": 0.0, "maximum": 1.0}),
    (shapes.integer(0, None), {"type": "integer", "minimum": 0}),
    (shapes.words("a", "b"), {"type": "string", "enum": ["a", "b"]}),
    (shapes.string(min_length=1), {"type": "string", "minLength": 1}),
    (shapes.array(shapes.BOOLEAN, 4, min_items=1),
     {"type": "array", "items": {"type": "boolean"}, "minItems": 1, "maxItems": 4}),
    (shapes.obj(required=("a",), a=shapes.BOOLEAN),
     {"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"]}),
    (shapes.SCHEMA_OBJECT, {"type": "object"}),
    (shapes.any_of(shapes.BOOLEAN, shapes.REFUSED), {"anyOf": [{"type": "boolean"}, False]}),
    (openai_schema.COMMON["logit_bias"],
     {"type": "object", "propertyNames": {"type": "string", "pattern": "^[0-9]{1,10}$"},
      "additionalProperties": {"type": "number", "minimum": -100.0, "maximum": 100.0},
      "maxProperties": 300}),
])
def test_each_shape_becomes_the_json_schema_of_what_its_reader_accepts(shape, expected):
    assert openapi_doc.body_schema(shape) == expected


def test_a_served_document_bounds_token_ids_by_its_vocabulary():
    assert openapi_doc.body_schema(shapes.TOKEN_ID, vocab_size=100) == {
        "type": "integer", "minimum": 0, "maximum": 99}
    prompt = openapi_doc.request_schema("/v1/completions", 100)["properties"]["prompt"]
    assert prompt["anyOf"][1]["items"]["maximum"] == 99


@pytest.mark.parametrize("path", sorted(openai_schema.ENDPOINTS))
def test_every_body_lists_each_key_its_reader_reads_and_the_valid_body_is_valid(path):
    schema = DOCUMENT["paths"][path]["post"]["requestBody"]["content"]["application/json"]
    assert set(schema["schema"]["properties"]) == set(openai_schema.ENDPOINTS[path])
    assert not list(_body_validator(path).iter_errors(openai_schema.VALID[path]))


@pytest.mark.parametrize("path", sorted(openai_schema.ENDPOINTS))
def test_what_the_document_requires_its_reader_refuses_without(tokenizer, path):
    valid = openai_schema.VALID[path]
    READERS[path](valid, tokenizer)  # accepted as it is
    required = {key for keys in openai_schema.REQUIRED[path] for key in keys}
    body = {k: v for k, v in valid.items() if k not in required}
    assert not _body_validator(path).is_valid(body)
    with pytest.raises(RequestError):
        READERS[path](body, tokenizer)


@pytest.mark.parametrize("message", [
    {"role": "tool", "content": "42"},  # a tool turn names the call it answers
    {"role": "user", "content": "hi", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
    {"role": "user", "content": [{"type": "image_url"}]},
])
def test_a_message_the_document_refuses_its_reader_refuses(tokenizer, message):
    body = {**openai_schema.VALID["/v1/chat/completions"], "messages": [message]}
    assert not _body_validator("/v1/chat/completions").is_valid(body)
    with pytest.raises(RequestError):
        CHAT.parse(body, MODEL_NAME, tokenizer)


def _walk(node):
    if isinstance(node, dict):
        yield node
        for value in node.values():
            yield from _walk(value)
    elif isinstance(node, list):
        for value in node:
            yield from _walk(value)


def test_every_reference_resolves_and_every_answer_schema_is_json_schema():
    for node in _walk(DOCUMENT):
        ref = node.get("$ref")
        if ref is not None:
            _, kind, name = ref.removeprefix("#/").split("/")
            assert name in DOCUMENT["components"][kind], ref
    for schema in DOCUMENT["components"]["schemas"].values():
        jsonschema.Draft202012Validator.check_schema(schema)


@contextlib.asynccontextmanager
async def _served(tokenizer, scheduler: FakeScheduler, keys=None):
    async with fake_scheduler(scheduler) as address, \
            gateway(tokenizer, address, keys=keys, http_port=0) as (running, _):
        async with aiohttp.ClientSession(f"http://127.0.0.1:{running.http_port}") as session:
            yield running, session


def test_the_document_lists_every_route_the_app_serves_and_which_take_no_key(tokenizer):
    keys = ApiKeys.parse(["sk-alice-0123456:alice"], "test")
    gets = [path for path, item in DOCUMENT["paths"].items() if "get" in item]

    async def scenario():
        async with _served(tokenizer, FakeScheduler(), keys) as (running, session):
            routes = {(route.resource.canonical, route.method.lower())
                      for route in running.http_runner.app.router.routes()
                      if route.method != "HEAD"}
            keyless = {}
            for path in gets:
                async with session.get(path) as response:
                    keyless[path] = response.status
            key = {"Authorization": "Bearer sk-alice-0123456"}
            async with session.get("/openapi.json", headers=key) as response:
                return routes, keyless, response.status, await response.json()

    routes, keyless, status, served = run(scenario())
    documented = {(path, method) for path, item in DOCUMENT["paths"].items() for method in item}
    assert routes == documented
    for path in gets:  # security [] where the route needs no key, and only there
        open_route = DOCUMENT["paths"][path]["get"].get("security") == []
        assert (keyless[path] != 401) == open_route, path
    assert status == 200 and served == openapi_doc.document(tokenizer.info.vocab_size)


@pytest.fixture(scope="module")
def documents() -> list[openapi_run.Document]:
    """Ours, and OpenAI's where it lies (harness/openapi_run.py)."""
    found = [openapi_run.Document("ours", json.loads(json.dumps(DOCUMENT)), strict=True)]
    if openapi_run.openai_document().exists():
        found.append(openapi_run.load_openai(openapi_run.openai_document()))
    return found


def _logprob_events(tokenizer, text: str) -> list[scheduler_pb2.TokenEvent]:
    events = []
    for token in tokenizer.encode(text):
        # an alternative the sampler masked (a grammar's) has -inf: JSON has no such number
        logprob = sampling_pb2.TokenLogprob(token_id=token, logprob=-0.5,
                                            top_token_ids=[token, 7, 9],
                                            top_logprobs=[-0.5, -2, float("-inf")])
        events.append(scheduler_pb2.TokenEvent(token_ids=[token], logprobs=[logprob]))
    events[-1].finish_reason = sampling_pb2.FINISH_REASON_STOP
    events[-1].num_prompt_tokens = 3
    return events


# (path, body, the component of its answer in ours and in OpenAI's)
ANSWERS = [
    ("/v1/completions", {"prompt": "hi", "logprobs": 2}, ("Completion",
                                                          "CreateCompletionResponse")),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "logprobs": True, "top_logprobs": 2},
     ("ChatCompletion", "CreateChatCompletionResponse")),
]


@pytest.mark.parametrize("path,body,components", ANSWERS, ids=["completion", "chat"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_answers_with_logprobs_and_usage_are_valid_under_the_documents(
        tokenizer, documents, path, body, components, stream):
    scheduler = FakeScheduler(events=_logprob_events(tokenizer, "Paris, France."))
    if stream:
        body = {**body, "stream": True, "stream_options": {"include_usage": True}}

    async def scenario():
        async with _served(tokenizer, scheduler) as (_, session):
            async with session.post(path, json=body) as response:
                return response.status, await response.read()

    status, raw = run(scenario())
    assert status == 200, raw
    for doc, component in zip(documents, components, strict=False):
        if stream:
            served = path.removeprefix(doc.prefix)
            assert openapi_run.stream_failures(doc, served, raw) == [], doc.name
        else:
            assert openapi_run.schema_errors(doc.validator(component),
                                             openapi_run.strict_json(raw)) == [], doc.name
