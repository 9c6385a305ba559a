"""`/tokenize` and `/detokenize` through a real gateway: the ids are the ones generation
submits for the same input, and bad input is the same 400 / 404."""

from __future__ import annotations

import json

import aiohttp

from gateway.admit.auth import ApiKeys
from protos.continuum.v1 import sampling_pb2, scheduler_pb2

from .harness import FakeScheduler, fake_scheduler, gateway, run

MESSAGES = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "What is the capital of France?"}]


def _scheduler():
    return FakeScheduler(events=[scheduler_pb2.TokenEvent(
        token_ids=[42], finish_reason=sampling_pb2.FINISH_REASON_LENGTH)])


async def _post(session, path, body, headers=None):
    async with session.post(path, data=json.dumps(body), headers=headers or {}) as response:
        return response.status, await response.json()


def test_tokenize_gives_the_ids_generation_submits_and_detokenize_inverts_it(tokenizer):
    scheduler = _scheduler()

    async def scenario():
        async with fake_scheduler(scheduler) as address, \
                gateway(tokenizer, address, http_port=0) as (running, _), \
                aiohttp.ClientSession(f"http://127.0.0.1:{running.http_port}") as session:
            chat = await _post(session, "/tokenize", {"model": "", "messages": MESSAGES})
            await _post(session, "/v1/chat/completions",
                        {"messages": MESSAGES, "max_tokens": 1})
            text = await _post(session, "/tokenize", {"prompt": "Hello, world!",
                                                      "return_token_strs": True})
            await _post(session, "/v1/completions", {"prompt": "Hello, world!",
                                                     "max_tokens": 1})
            back = await _post(session, "/detokenize", {"tokens": text[1]["tokens"]})
            async with session.get("/v1/models") as response:
                models = await response.json()
            return chat, text, back, models

    chat, text, back, models = run(scenario())
    assert chat[0] == 200 and text[0] == 200 and back[0] == 200
    submitted = [list(s.prompt_token_ids) for s in scheduler.submitted]
    assert chat[1]["tokens"] == submitted[0] and text[1]["tokens"] == submitted[1]
    assert chat[1]["count"] == len(submitted[0]) and chat[1]["max_model_len"] > 0
    assert text[1]["token_strs"] == [tokenizer.id_to_token(i) for i in submitted[1]]
    assert back[1]["prompt"] == "Hello, world!"
    card = models["data"][0]
    assert card["root"] == card["id"] and card["max_model_len"] == chat[1]["max_model_len"]


def test_bad_tokenize_input_is_a_clear_4xx_and_keys_guard_it(tokenizer):
    keys = ApiKeys.parse(["sk-tok-0123456"], "test")
    auth = {"Authorization": "Bearer sk-tok-0123456"}
    cases = [
        ("/tokenize", [1, 2], 400, None),
        ("/tokenize", {"prompt": "a", "messages": MESSAGES}, 400, "messages"),
        ("/tokenize", {"prompt": ""}, 400, "prompt"),
        ("/tokenize", {"model": "gpt-9", "prompt": "a"}, 404, "model"),
        ("/tokenize", {"messages": [{"content": "no role"}]}, 400, "messages"),
        ("/detokenize", {"tokens": [10**9]}, 400, "tokens"),
        ("/detokenize", {"tokens": "1 2"}, 400, "tokens"),
        ("/detokenize", {"tokens": [1.5]}, 400, "tokens"),
    ]

    async def scenario():
        async with fake_scheduler(_scheduler()) as address, \
                gateway(tokenizer, address, keys=keys, http_port=0) as (running, _), \
                aiohttp.ClientSession(f"http://127.0.0.1:{running.http_port}") as session:
            unauthenticated = await _post(session, "/tokenize", {"prompt": "a"})
            answers = [await _post(session, path, body, auth) for path, body, _, _ in cases]
            after = await _post(session, "/tokenize", {"prompt": "still fine"}, auth)
            return unauthenticated, answers, after

    unauthenticated, answers, after = run(scenario())
    assert unauthenticated[0] == 401
    for (path, body, status, param), (got, error) in zip(cases, answers, strict=True):
        assert got == status, (path, body, error)
        assert error["error"]["param"] == param and error["error"]["message"], (path, body)
    assert after[0] == 200 and after[1]["count"] > 0


def test_tokenize_and_detokenize_refuse_input_past_the_context(tokenizer):
    limit = tokenizer.info.max_model_len
    long_chat = [{"role": "user", "content": "hello " * limit}]
    cases = [  # (path, body, status, param)
        ("/tokenize", {"prompt": "x" * (limit * tokenizer.info.max_token_chars + 1)}, 400,
         "prompt"),  # refused before it is tokenized
        ("/tokenize", {"prompt": "hello " * limit}, 400, "prompt"),  # refused once it is
        ("/tokenize", {"messages": long_chat}, 400, "messages"),
        ("/detokenize", {"tokens": [5] * (limit + 1)}, 400, "tokens"),
        ("/detokenize", {"tokens": [5] * limit}, 200, None),
    ]

    async def scenario():
        async with fake_scheduler(_scheduler()) as address, \
                gateway(tokenizer, address, http_port=0) as (running, _), \
                aiohttp.ClientSession(f"http://127.0.0.1:{running.http_port}") as session:
            return [await _post(session, path, body) for path, body, _, _ in cases]

    for (path, _, status, param), (got, answer) in zip(cases, run(scenario()), strict=True):
        assert got == status, (path, answer)
        if status == 200:
            continue
        error = answer["error"]
        assert error["code"] == "context_length_exceeded" and error["param"] == param
        assert f"maximum context length is {limit} tokens" in error["message"], error
