"""Every refusal of a request that cannot fit the model's context speaks OpenAI's words:
status 400, ``code: "context_length_exceeded"`` and "maximum context length is N
tokens" with the numbers, on completions and chat alike, whatever counted it (the
prompt's characters, its tokens, or the prompt plus ``max_tokens``). Tools detect
context overflow by exactly that (LiteLLM and LangChain match the phrase; OpenAI's own
clients read the code); the gRPC API carries the same message."""

from __future__ import annotations

import grpc
import openai
import pytest

from protos.continuum.v1 import generation_pb2 as gen
from protos.continuum.v1 import scheduler_pb2, scheduler_pb2_grpc
from tests.conftest import TEST_METADATA
from tests.scheduler.submit_client import StreamFailed, submit

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def context(client) -> int:
    (model,) = client.models.list().data
    return model.model_extra["max_model_len"]


def _user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


# (API, what is too long, arguments given the context's length in tokens)
CASES = [
    ("completions", "characters", lambda n: {"prompt": "x" * (n * 100)}),
    ("completions", "tokens", lambda n: {"prompt": "hi " * (n + 10)}),
    ("completions", "token ids", lambda n: {"prompt": [17] * (n + 1)}),
    ("completions", "prompt plus max_tokens", lambda n: {"prompt": "hi", "max_tokens": n}),
    ("chat", "characters", lambda n: {"messages": _user("x" * (n * 100))}),
    ("chat", "tokens", lambda n: {"messages": _user("hi " * (n + 10))}),
    ("chat", "prompt plus max_tokens", lambda n: {"messages": _user("hi"), "max_tokens": n}),
    ("chat", "prompt plus max_completion_tokens",
     lambda n: {"messages": _user("hi"), "max_completion_tokens": n}),
]


@pytest.mark.parametrize("api,what,arguments", CASES, ids=[f"{a}-{w}" for a, w, _ in CASES])
def test_over_the_context_is_openais_context_length_exceeded(client, context, api, what,
                                                             arguments):
    create = client.completions.create if api == "completions" else (
        client.chat.completions.create)
    with pytest.raises(openai.BadRequestError) as caught:
        create(model="", **arguments(context))
    error = caught.value.body
    assert caught.value.status_code == 400
    assert error["code"] == "context_length_exceeded", error
    assert f"maximum context length is {context} tokens" in error["message"], error
    assert len(error["message"]) < 600


@pytest.mark.parametrize("request_", [
    gen.GenerateRequest(prompt="hi " * 20000),
    gen.GenerateRequest(token_ids=gen.TokenIds(ids=[17] * 20000)),
    gen.GenerateRequest(prompt="hi", max_tokens=1 << 20),
], ids=["tokens", "token-ids", "max-tokens"])
def test_the_grpc_api_says_the_same(server, context, request_):
    assert context < 20000
    with grpc.insecure_channel(server.addr) as channel:
        with pytest.raises(grpc.RpcError) as caught:
            list(server.generation_stub(channel).Generate(request_, timeout=60))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"maximum context length is {context} tokens" in caught.value.details()


def test_the_schedulers_own_refusal_names_the_code_for_the_gateway(server, context):
    """A gateway whose idea of the context is larger than its replica's (deployed apart)
    passes the scheduler's refusal on: the scheduler says it in the same words and sends
    the code in its ``error-code`` trailer, which the HTTP API turns into ``code``."""
    request = scheduler_pb2.SubmitRequest(request_id="ctx", prompt_token_ids=[17] * 8,
                                          max_tokens=context)
    with grpc.insecure_channel(f"127.0.0.1:{server.scheduler_port}") as channel:
        stub = scheduler_pb2_grpc.SchedulerStub(channel)
        with pytest.raises(StreamFailed) as caught:
            submit(stub, request, timeout=30, metadata=TEST_METADATA)
    assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert f"maximum context length is {context} tokens" in caught.value.message
    assert caught.value.trailers["error-code"] == "context_length_exceeded"
