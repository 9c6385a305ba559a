"""The HTTP API of a live `continuum serve` against published OpenAPI documents, with
schemathesis: OpenAI's own (openai/openai-openapi, restricted to the operations served
here; skipped when it is not in the data directory) and the gateway's GET /openapi.json.
The driver is harness/openapi_run.py, whose `openapi` row of `make
reliability` runs the same at length (docs/reliability.md, "Published schemas").

Per document: no 5xx, every answer valid under the document (streams chunk by chunk),
and under our own also every status, content type and header documented. Then every
answer shape the drawn cases reach only by chance (logprobs, n > 1, tool calls, usage on
every chunk), whole and streamed, is held to both documents.
"""

from __future__ import annotations

import pytest

from harness import openapi_run

pytestmark = pytest.mark.integration
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = [{"type": "function", "function": {
    "name": "weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}}, "required": ["city"]}}}]


@pytest.fixture(scope="module")
def model(server) -> str:
    return openapi_run.served_model(server.http_port)


@pytest.fixture(scope="module")
def own(server) -> openapi_run.Document:
    return openapi_run.load_own(server.http_port)


@pytest.fixture(scope="module")
def openai() -> openapi_run.Document | None:
    path = openapi_run.openai_document()
    return openapi_run.load_openai(path) if path.exists() else None


def _run(doc: openapi_run.Document, server, model: str) -> dict:
    result = openapi_run.Run(doc, server.http_port, model).run(openapi_run.SIZES["ci"])
    print(f"\n{doc.name}: {result['cases']} cases, {result['generated']} generated, in "
          f"{result['seconds']} s: {result['statuses']}")
    failures = "\n\n".join(f"{f['operation']} {f['kind']} ({f['status']}): "
                           f"{f['messages']}\n{f['reproducer']}" for f in result["failures"])
    assert result["server_errors"] == 0, failures
    assert result["schema_violations"] == 0, failures
    assert result["status_violations"] == 0, failures
    # The tamed bodies reach generation often enough to judge its answers.
    assert result["generated"] >= result["cases"] // 10, result["statuses"]
    return result


def test_openais_document_finds_no_server_error_and_no_schema_violation(server, model,
                                                                        openai):
    if openai is None:
        pytest.skip(f"OpenAI's published OpenAPI document is not at "
                    f"{openapi_run.openai_document()} (set {openapi_run.OPENAI_ENV})")
    _run(openai, server, model)


def test_our_own_document_finds_no_server_error_and_no_violation(server, model, own):
    _run(own, server, model)


# Answer shapes, each whole and streamed: (path, body without stream).
SHAPES = {
    "chat": (CHAT, {"messages": QUESTION}),
    "chat logprobs n=2": (CHAT, {"messages": QUESTION, "logprobs": True, "top_logprobs": 3,
                                 "n": 2}),
    "chat named tool": (CHAT, {"messages": QUESTION, "tools": WEATHER, "tool_choice": {
        "type": "function", "function": {"name": "weather"}}}),
    "chat json_object": (CHAT, {"messages": QUESTION,
                                "response_format": {"type": "json_object"}}),
    # the grammar masks most alternatives: their logprobs are -inf, which JSON lacks
    "chat guided logprobs": (CHAT, {"messages": QUESTION, "guided_choice": ["yes", "no"],
                                    "logprobs": True, "top_logprobs": 5}),
    "completion": (COMPLETIONS, {"prompt": "The capital of France is"}),
    "completion logprobs n=2": (COMPLETIONS, {"prompt": "The capital of France is",
                                              "logprobs": 2, "n": 2}),
    "completion echo": (COMPLETIONS, {"prompt": "The capital of France is", "echo": True}),
    "completion guided logprobs": (COMPLETIONS, {"prompt": "Is Paris in France?",
                                                 "guided_choice": ["yes", "no"],
                                                 "logprobs": 5}),
}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_every_answer_shape_is_valid_under_both_documents(server, model, own, openai,
                                                          shape, stream):
    path, body = SHAPES[shape]
    body = {"model": model, "max_tokens": 6, "temperature": 0, **body, "stream": stream}
    if stream:  # the usage chunk at the end; usage on every chunk for some
        body["stream_options"] = {"include_usage": True,
                                  "continuous_usage_stats": "logprobs" in shape}
    case = own.case("POST", path, body)
    response = case.call(base_url=f"http://127.0.0.1:{server.http_port}",
                         headers=openapi_run.AUTH, timeout=openapi_run.TIMEOUT_S)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"][0].startswith(
        "text/event-stream" if stream else "application/json")
    for doc in (own, openai):
        if doc is not None:
            found = openapi_run.judge(doc, doc.case("POST", path, body), response)
            assert not any(found.values()), (doc.name, dict(found), response.text[:3000])
