"""Bad requests get INVALID_ARGUMENT / NOT_FOUND with an actionable message, before any
upstream call, through a real gateway whose scheduler address has nothing listening."""

from __future__ import annotations

import time

import grpc
import pytest

from protos.continuum.v1 import generation_pb2, sampling_pb2, scheduler_pb2

from .harness import MODEL_NAME, collect, free_port, gateway, generation_stub, run

INVALID = grpc.StatusCode.INVALID_ARGUMENT
GenerateRequest = generation_pb2.GenerateRequest
SamplingParams = sampling_pb2.SamplingParams


def _chat(*turns):
    return generation_pb2.ChatInput(
        messages=[generation_pb2.ChatMessage(role=r, content=c) for r, c in turns]
    )


BAD_REQUESTS = {
    "no input": (GenerateRequest(), INVALID, "set exactly one of prompt, chat or token_ids"),
    "empty prompt": (GenerateRequest(prompt=""), INVALID, "prompt is empty"),
    "empty chat": (GenerateRequest(chat=generation_pb2.ChatInput()), INVALID, "no messages"),
    "bad role": (GenerateRequest(chat=_chat(("robot", "hi"))), INVALID, "use one of assistant"),
    "empty token ids": (
        GenerateRequest(token_ids=generation_pb2.TokenIds()),
        INVALID,
        "token_ids is empty",
    ),
    "token id out of vocab": (
        GenerateRequest(token_ids=generation_pb2.TokenIds(ids=[1, 2, 49152])),
        INVALID,
        "token_ids.ids[2] = 49152 is not a token id: the model's vocabulary has 49152",
    ),
    "unknown model": (
        GenerateRequest(prompt="hi", model="gpt-4"),
        grpc.StatusCode.NOT_FOUND,
        "model 'gpt-4' is not served here; this gateway serves 'smollm2'",
    ),
    "context overflow": (
        GenerateRequest(prompt="hi", max_tokens=9000),
        INVALID,
        "This model's maximum context length is 8192 tokens. However, you requested 9001 "
        "tokens (1 in the prompt, 9000 for the completion).",
    ),
    "prompt fills context": (
        GenerateRequest(token_ids=generation_pb2.TokenIds(ids=[5] * 8192)),
        INVALID,
        "you requested 8193 tokens (8192 in the prompt, 1 for the completion)",
    ),
    "negative temperature": (
        GenerateRequest(prompt="hi", sampling=SamplingParams(temperature=-0.5)),
        INVALID,
        "sampling.temperature must be in [0, 2] (0 means greedy), got -0.5",
    ),
    "nan temperature": (
        GenerateRequest(prompt="hi", sampling=SamplingParams(temperature=float("nan"))),
        INVALID,
        "sampling.temperature must be in [0, 2] (0 means greedy), got nan",
    ),
    "top_p zero": (
        GenerateRequest(prompt="hi", sampling=SamplingParams(top_p=0.0)),
        INVALID,
        "sampling.top_p must be in (0, 1] (1 keeps every token; for greedy decoding use "
        "temperature 0), got 0",
    ),
    "top_p above one": (
        GenerateRequest(prompt="hi", sampling=SamplingParams(top_p=1.5)),
        INVALID,
        "sampling.top_p must be in (0, 1]",
    ),
    "min_p above one": (
        GenerateRequest(prompt="hi", sampling=SamplingParams(min_p=2.0)),
        INVALID,
        "sampling.min_p must be in [0, 1] (0 keeps every token), got 2",
    ),
    "zero repetition penalty": (
        GenerateRequest(prompt="hi", sampling=SamplingParams(repetition_penalty=0.0)),
        INVALID,
        "sampling.repetition_penalty must be in (0, 1000000] (1 disables it), got 0",
    ),
    "presence penalty": (
        GenerateRequest(prompt="hi", sampling=SamplingParams(presence_penalty=2.5)),
        INVALID,
        "sampling.presence_penalty must be in [-2, 2], got 2.5",
    ),
    "frequency penalty": (
        GenerateRequest(prompt="hi", sampling=SamplingParams(frequency_penalty=-3)),
        INVALID,
        "sampling.frequency_penalty must be in [-2, 2], got -3",
    ),
    "too many logprobs": (
        GenerateRequest(prompt="hi", sampling=SamplingParams(logprobs=21)),
        INVALID,
        "sampling.logprobs must be an integer in [0, 20] (alternatives per generated token), "
        "got 21",
    ),
    "stop token id out of vocab": (
        GenerateRequest(prompt="hi", sampling=SamplingParams(stop_token_ids=[2, 60000])),
        INVALID,
        "sampling.stop_token_ids[1] = 60000 is not a token id",
    ),
    "logit_bias token out of vocab": (
        GenerateRequest(prompt="hi", sampling=SamplingParams(logit_bias={60000: 1.0})),
        INVALID,
        "sampling.logit_bias names token 60000, which is not a token id",
    ),
    "logit_bias past 100": (
        GenerateRequest(prompt="hi", sampling=SamplingParams(logit_bias={5: -100.5})),
        INVALID,
        "sampling.logit_bias[5] = -100.5; a bias must be in [-100, 100]",
    ),
    "min_tokens above max_tokens": (
        GenerateRequest(prompt="hi", max_tokens=4, sampling=SamplingParams(min_tokens=5)),
        INVALID,
        "sampling.min_tokens (5) must be <= max_tokens (4)",
    ),
    "too many stop strings": (
        GenerateRequest(prompt="hi", stop=[f"s{i}" for i in range(17)]),
        INVALID,
        "17 stop strings given; at most 16",
    ),
    "long stop string": (
        GenerateRequest(prompt="hi", stop=["ok", "é" * 129]),
        INVALID,
        "stop[1] is 258 bytes long; each stop string is at most 256 bytes",
    ),
    "empty stop string": (
        GenerateRequest(prompt="hi", stop=[""]),
        INVALID,
        "stop[0] is empty",
    ),
    "long request id": (
        GenerateRequest(prompt="hi", request_id="x" * 129),
        INVALID,
        "request_id is 129 characters long; the limit is 128",
    ),
    "unprintable request id": (
        GenerateRequest(prompt="hi", request_id="abc\n"),
        INVALID,
        "request_id must be printable ASCII; it contains '\\n'",
    ),
    "unknown priority": (
        GenerateRequest(prompt="hi", priority=7),
        INVALID,
        "priority 7 is not a known Priority value",
    ),
    "stop token ids past the cap": (
        GenerateRequest(prompt="hi", sampling=SamplingParams(stop_token_ids=range(49152))),
        INVALID,
        "sampling.stop_token_ids holds 49152 token ids; at most 128",
    ),
    "more token ids than the context": (
        GenerateRequest(token_ids=generation_pb2.TokenIds(ids=[5] * 8193)),
        INVALID,
        "maximum context length is 8192 tokens. However, token_ids.ids holds 8193 token ids",
    ),
    "too many chat messages": (
        GenerateRequest(chat=_chat(*[("user", "hi")] * 1025)),
        INVALID,
        "chat holds 1025 messages; at most 1024",
    ),
    "prompt text past any context": (
        GenerateRequest(prompt="x" * (8192 * 81 + 1)),
        INVALID,
        "maximum context length is 8192 tokens. However, the prompt is 663553 characters long, "
        "and at most 663552 characters (81 a token at most)",
    ),
    "chat text past any context": (
        GenerateRequest(chat=_chat(("user", "x" * 400_000), ("user", "y" * 300_000))),
        INVALID,
        "chat message text is 700000 characters long",
    ),
    "penalty past float32": (
        GenerateRequest(prompt="hi", sampling=SamplingParams(presence_penalty=1e39)),
        INVALID,
        "sampling.presence_penalty must be in [-2, 2], got inf",
    ),
}


@pytest.fixture(scope="module")
def unreachable_scheduler() -> str:
    return f"127.0.0.1:{free_port()}"


@pytest.mark.parametrize("case", BAD_REQUESTS, ids=list(BAD_REQUESTS))
def test_bad_request_is_rejected_with_a_helpful_message(tokenizer, unreachable_scheduler, case):
    request, code, message = BAD_REQUESTS[case]

    async def scenario():
        async with gateway(tokenizer, unreachable_scheduler) as (_, channel):
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await collect(generation_stub(channel).Generate(request, timeout=10))
            return info.value

    error = run(scenario())
    # UNAVAILABLE here would mean the request got past validation to the (absent) scheduler.
    assert error.code() == code, error.details()
    assert message in error.details()


def test_valid_request_to_unreachable_scheduler_is_unavailable_quickly(
    tokenizer, unreachable_scheduler
):
    async def scenario():
        async with gateway(tokenizer, unreachable_scheduler) as (_, channel):
            stub = generation_stub(channel)
            errors = []
            for request in (
                GenerateRequest(prompt="hi", model=MODEL_NAME),
                GenerateRequest(chat=_chat(("user", "What is the capital of France?"))),
            ):
                started = time.monotonic()
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await collect(stub.Generate(request, timeout=20))
                errors.append((info.value, time.monotonic() - started))
            return errors

    for error, elapsed in run(scenario()):
        assert error.code() == grpc.StatusCode.UNAVAILABLE
        assert f"no scheduler replica reachable at {unreachable_scheduler}" in error.details()
        assert elapsed < 5.0


def test_undecodable_request_is_invalid_argument(tokenizer, unreachable_scheduler):
    raw = b"\x12\x02\xff\xfe"  # field 2 (prompt), 2 bytes that are not UTF-8

    async def scenario():
        async with gateway(tokenizer, unreachable_scheduler) as (_, channel):
            generate = channel.unary_stream("/continuum.v1.Generation/Generate")
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await collect(generate(raw, timeout=10))
            return info.value

    error = run(scenario())
    assert error.code() == INVALID
    assert "string fields must be UTF-8" in error.details()


# One bad value per check of protos/sampling_checks.py, as (OpenAI body fields, the same
# value as SamplingParams).
SAME_EVERYWHERE = [
    ({"temperature": 2.5}, SamplingParams(temperature=2.5)),
    ({"top_p": 0}, SamplingParams(top_p=0.0)),
    ({"min_p": 1.5}, SamplingParams(min_p=1.5)),
    ({"repetition_penalty": 0}, SamplingParams(repetition_penalty=0.0)),
    ({"presence_penalty": -2.5}, SamplingParams(presence_penalty=-2.5)),
    ({"frequency_penalty": 3}, SamplingParams(frequency_penalty=3.0)),
    ({"logit_bias": {"5": 101}}, SamplingParams(logit_bias={5: 101.0})),
]


@pytest.mark.parametrize("body,sampling", SAME_EVERYWHERE, ids=[str(b) for b, _ in SAME_EVERYWHERE])
def test_the_gateway_the_openai_readers_and_the_scheduler_say_the_same(tokenizer, body,
                                                                      sampling):
    """One check, one message: the gRPC edge and the scheduler word a refusal alike, and
    the OpenAI reader the same but for the field's path (``top_p``, not ``sampling.top_p``)."""
    from gateway.api.openai_api import COMPLETION
    from gateway.validation import RequestError, check_sampling
    from scheduler_svc.validation import validate_submit
    from tests.scheduler.factories import make_scheduler

    with pytest.raises(RequestError) as at_grpc:
        check_sampling(sampling, tokenizer)
    with pytest.raises(RequestError) as at_http:
        COMPLETION.parse({"prompt": "hi", **body}, MODEL_NAME, tokenizer)
    submit = scheduler_pb2.SubmitRequest(request_id="r", prompt_token_ids=[1], max_tokens=1,
                                         sampling=sampling)
    at_scheduler = validate_submit(submit, make_scheduler())
    assert at_grpc.value.message == at_scheduler
    assert at_grpc.value.message == "sampling." + at_http.value.message
    assert at_grpc.value.param == at_http.value.param == next(iter(body))


def test_a_whole_number_written_with_a_point_is_an_integer(tokenizer):
    """JSON has one number type, and JSON Schema (so OpenAI's published schema) counts 3.0
    an integer: the readers take it as 3 (a client that computes a length in floating
    point is served); 3.5 is refused where an integer is read."""
    from gateway.api.openai_api import COMPLETION
    from gateway.validation import RequestError

    api = COMPLETION.parse({"prompt": [1.0, 2], "max_tokens": 3.0, "n": 2.0, "seed": 7.0,
                            "stop_token_ids": [5.0], "priority": 1.0}, MODEL_NAME, tokenizer)
    assert list(api.proto.token_ids.ids) == [1, 2] and api.proto.max_tokens == 3
    assert api.proto.n == 2 and api.proto.sampling.seed == 7
    assert list(api.proto.sampling.stop_token_ids) == [5]
    with pytest.raises(RequestError, match="max_tokens must be an integer, got float"):
        COMPLETION.parse({"prompt": "hi", "max_tokens": 3.5}, MODEL_NAME, tokenizer)
