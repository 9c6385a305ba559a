"""`vllm bench serve` (vLLM's own benchmark client) against the real `continuum serve`.

vLLM is not installed here (a 240 MB wheel that pins its own torch), so the requests
below are the ones `vllm bench serve --backend openai` and `--backend openai-chat` sent
to this server (vllm 0.34.0, recorded through a logging proxy; docs/benchmarks.md,
"vLLM's benchmark client"), and `vllm_reading` applies the rules that client reads a
stream by: messages split on blank lines, `data: ` stripped, `[DONE]` ends it; a
completions chunk with `choices` is a token; a chat chunk is a token when its delta has
text, or `content: ""` and no `role` (a `role` chunk is the opening, no token); the chunk
without choices gives `usage`. A request with no token chunk is a failure; TTFT is the
first token chunk, the end the last one.

`test_the_real_vllm_client_runs_clean` runs the client itself where
$CONTINUUM_VLLM_BENCH names a `vllm` executable (scripts/vllm_bench.sh makes one)."""

from __future__ import annotations

import dataclasses
import http.client
import json
import os
import subprocess

import pytest

from tests.integration.conftest import start_server
from tests.tiers import spawns_processes

pytestmark = pytest.mark.integration

# 16 tokens of vLLM's `random` dataset (seed 41): what it sends is vocabulary soup.
PROMPT = ("----------- THCwaukee rejuven advertised Maxwell averagingAYBrowimilar Cay heirs"
          " Kerala offensesgencies ovary")
USAGE = {"include_usage": True}
EVERY_USAGE = {"include_usage": True, "continuous_usage_stats": True}


@pytest.fixture(scope="module")
@spawns_processes
def server(tmp_path_factory, model_dir):
    srv = start_server(tmp_path_factory.mktemp("vllm_bench"), model_dir)
    yield srv
    assert srv.stop() == 0, "".join(srv.log[-30:])


def _post(server, path: str, body: dict, headers: dict | None = None):
    conn = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=120)
    try:
        conn.request("POST", path, json.dumps(body),
                     {"Content-Type": "application/json", "User-Agent": "Python/3.11 aiohttp",
                      **(headers or {})})
        response = conn.getresponse()
        return response.status, dict(response.getheaders()), response.read().decode()
    finally:
        conn.close()


@pytest.fixture(scope="module")
def model(server) -> str:
    conn = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=30)
    conn.request("GET", "/v1/models")
    first = json.loads(conn.getresponse().read())["data"][0]  # what the client reads
    conn.close()
    assert first["root"] == first["id"]
    return first["id"]


def completions_request(model: str, max_tokens: int, **extra) -> dict:
    return {"model": model, "prompt": PROMPT, "repetition_penalty": 1.0,
            "max_tokens": max_tokens, "logprobs": None, "stream": True,
            "stream_options": USAGE, "ignore_eos": True, **extra}


def chat_request(model: str, max_tokens: int, **extra) -> dict:
    return {"model": model,
            "messages": [{"role": "user", "content": [{"type": "text", "text": PROMPT}]}],
            "max_completion_tokens": max_tokens, "stream": True, "stream_options": USAGE,
            "ignore_eos": True, **extra}


@dataclasses.dataclass
class Reading:
    tokens: list[dict]  # the chunks counted as tokens, in order
    usage: dict | None
    text: str
    done: bool

    @property
    def success(self) -> bool:
        return bool(self.tokens)


def _is_token(chunk: dict, chat: bool) -> bool:
    choices = chunk.get("choices")
    if not choices:
        return False
    if not chat:
        return True
    delta = choices[0].get("delta")
    if not isinstance(delta, dict):
        return False
    if delta.get("content") or delta.get("reasoning") or delta.get("tool_calls"):
        return True
    return delta.get("content") == "" and "role" not in delta


def vllm_reading(body: str, chat: bool) -> Reading:
    reading = Reading([], None, "", False)
    for message in (m.strip() for m in body.split("\n\n")):
        if not message or message.startswith(":"):
            continue
        assert message.startswith("data: "), message
        payload = message.removeprefix("data: ")
        if payload == "[DONE]":
            reading.done = True
            continue
        chunk = json.loads(payload)
        if _is_token(chunk, chat):
            reading.tokens.append(chunk)
            piece = chunk["choices"][0]
            reading.text += (piece["delta"].get("content") if chat else piece["text"]) or ""
        elif chunk.get("usage"):
            reading.usage = chunk["usage"]
    return reading


def _stream(server, path: str, body: dict, request_id: str | None = None) -> Reading:
    headers = {"X-Request-ID": request_id} if request_id else {}
    status, got, text = _post(server, path, body, headers)
    assert status == 200, text
    assert got["Content-Type"].startswith("text/event-stream")
    if request_id:
        assert got["X-Request-Id"] == request_id
    return vllm_reading(text, chat=path.endswith("chat/completions"))


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_vllm_bench_requests_read_back_whole(server, model, path):
    build = chat_request if path.endswith("chat/completions") else completions_request
    _, _, tokenized = _post(server, "/tokenize", {"model": model, "prompt": PROMPT,
                                                  "add_special_tokens": False})
    prompt_ids = json.loads(tokenized)["tokens"]
    assert len(prompt_ids) == 16  # its prompts are then kept as they are
    for request_id in (None, "bench-45d8da82-0", "bench-45d8da82-1"):  # probe, then the run
        reading = _stream(server, path, build(model, 6), request_id)
        assert reading.success and reading.done and reading.text
        assert reading.usage["completion_tokens"] == 6  # ignore_eos: the length asked for
        assert 1 <= len(reading.tokens) <= 6
        if path == "/v1/completions":
            assert reading.usage["prompt_tokens"] == len(prompt_ids)
        else:  # the chat template's turn markers and default system prompt come on top
            assert reading.usage["prompt_tokens"] > len(prompt_ids)
        if request_id:
            assert all(c["id"].endswith(request_id) for c in reading.tokens)


def test_the_tokenizer_alignment_round_trips(server, model):
    _, _, tokenized = _post(server, "/tokenize", {"model": model, "prompt": PROMPT,
                                                  "add_special_tokens": False})
    ids = json.loads(tokenized)["tokens"]
    _, _, detokenized = _post(server, "/detokenize", {"model": model, "tokens": ids[:8]})
    prefix = json.loads(detokenized)["prompt"]
    assert PROMPT.startswith(prefix)
    _, _, again = _post(server, "/tokenize", {"model": model, "prompt": prefix,
                                              "add_special_tokens": False})
    assert json.loads(again)["tokens"] == ids[:8]


def _token_id(server, model: str, text: str, index: int = 0) -> int:
    _, _, body = _post(server, "/tokenize", {"model": model, "prompt": text})
    return json.loads(body)["tokens"][index]


@pytest.mark.parametrize("ignore_eos", [False, True])
def test_a_chat_that_ends_at_once_is_one_token_not_a_failure(server, model, ignore_eos):
    eos = _token_id(server, model, "<|im_end|>")
    reading = _stream(server, "/v1/chat/completions",
                      chat_request(model, 4, logit_bias={str(eos): 100}, ignore_eos=ignore_eos))
    assert reading.usage["completion_tokens"] == (4 if ignore_eos else 1)
    assert reading.success and reading.text == ""  # was: no token chunk, a failed request


def test_a_first_token_in_mid_character_is_counted_when_it_comes(server, model):
    """The first byte of a 4-byte character: its chunk has no text yet, and still is the
    first token (TTFT); it was the role chunk, and TTFT waited for the character."""
    first_byte = _token_id(server, model, "\N{LLAMA}")
    assert _token_id(server, model, "\N{LLAMA}", -1) != first_byte  # several pieces
    body = chat_request(model, 3, logit_bias={str(first_byte): 100},
                        stream_options=EVERY_USAGE)
    reading = _stream(server, "/v1/chat/completions", body)
    assert [c["usage"]["completion_tokens"] for c in reading.tokens][0] == 1
    assert reading.tokens[-1]["usage"]["completion_tokens"] == reading.usage[
        "completion_tokens"] == 3


def test_a_chat_stream_ends_at_its_last_token(server, model):
    """A stream ended by the model's end token (no text): that last chunk is a token,
    so the client's end-to-end time and TPOT include the last step."""
    eos = _token_id(server, model, "<|im_end|>")
    body = chat_request(model, 8, logit_bias={str(eos): 100}, min_tokens=2,
                        ignore_eos=False, stream_options=EVERY_USAGE)
    reading = _stream(server, "/v1/chat/completions", body)
    assert reading.usage["completion_tokens"] == 3
    assert reading.tokens[-1]["choices"][0]["finish_reason"] == "stop"
    assert reading.tokens[-1]["usage"]["completion_tokens"] == 3


def _vllm_bench(vllm: str, server, model_dir, tmp_path, name: str, *args: str) -> dict:
    cmd = [vllm, "bench", "serve", "--base-url", f"http://127.0.0.1:{server.http_port}",
           "--tokenizer", str(model_dir), "--dataset-name", "random",
           "--random-input-len", "16", "--random-output-len", "4", "--num-prompts", "4",
           "--max-concurrency", "2", "--seed", "3", "--save-result",
           "--result-dir", str(tmp_path), "--result-filename", f"{name}.json", *args]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return json.loads((tmp_path / f"{name}.json").read_text())


@pytest.mark.skipif(not os.environ.get("CONTINUUM_VLLM_BENCH"),
                    reason="vLLM is not installed: set CONTINUUM_VLLM_BENCH to its `vllm` "
                           "executable (scripts/vllm_bench.sh builds one)")
def test_the_real_vllm_client_runs_clean(server, model, model_dir, tmp_path):
    vllm = os.environ["CONTINUUM_VLLM_BENCH"]
    eos = _token_id(server, model, "<|im_end|>")
    runs = {"completions": ("--backend", "openai", "--endpoint", "/v1/completions"),
            "chat": ("--backend", "openai-chat", "--endpoint", "/v1/chat/completions"),
            "chat_ends_at_once": ("--backend", "openai-chat", "--endpoint",
                                  "/v1/chat/completions", "--extra-body",
                                  json.dumps({"logit_bias": {str(eos): 100}}))}
    for name, args in runs.items():
        result = _vllm_bench(vllm, server, model_dir, tmp_path, name, *args)
        assert (result["completed"], result["failed"]) == (4, 0), name
        assert result["total_output_tokens"] == 16, name
