"""The bad-input table: hostile and malformed requests against the real three-process
server, on both APIs. Each row asserts the exact status and that the message names the
field (or the limit); after each group of 8 rows (and the last) the server must still
answer a normal request.

One server for the whole table (module scope), with API keys so that 401/403 rows run
against the same process. HTTP rows go through raw sockets or http.client (which send
bytes the `openai` client would never produce) and the `openai` client where natural;
gRPC rows through stubs and, for bytes that are not a valid GenerateRequest, through
`channel.unary_stream` with no serializer.
"""

from __future__ import annotations

import json
import socket

import grpc
import openai
import pytest
from google.protobuf.internal.encoder import _VarintBytes

from protos.continuum.v1 import generation_pb2 as gen
from protos.continuum.v1 import sampling_pb2

from .conftest import start_server

pytestmark = pytest.mark.integration
BASIC = "sk-basic-0123456789"  # tenant acme, default tiers (standard, best_effort)
VIP = "sk-vip-0123456789"  # tenant vip, every tier
AUTH = {"Authorization": f"Bearer {BASIC}"}
META = (("authorization", f"Bearer {BASIC}"),)
COMP, CHAT = "/v1/completions", "/v1/chat/completions"
MSG = [{"role": "user", "content": "hi"}]
VOCAB = 49152
INVALID = grpc.StatusCode.INVALID_ARGUMENT


@pytest.fixture(scope="module")
def server(tmp_path_factory, model_dir):
    tmp = tmp_path_factory.mktemp("bad-input")
    keys = tmp / "keys"
    keys.write_text(f"{BASIC}:acme\n{VIP}:vip:premium+standard+best_effort\n")
    srv = start_server(tmp, model_dir, "--api-keys-file", str(keys),
                       "--kv-cache-bytes", str(96 << 20))
    yield srv
    assert srv.stop() == 0, "".join(srv.log[-30:])


@pytest.fixture(scope="module")
def channel(server):
    with grpc.insecure_channel(server.addr) as ch:
        yield ch


# --- how rows are sent ---------------------------------------------------------------


def _raw_http(server, path: str, body: bytes, headers: dict[str, bytes | str]) -> tuple:
    """One request on a fresh socket, headers as given (bytes pass through unencoded)."""
    head = [f"POST {path} HTTP/1.1", "Host: 127.0.0.1", f"Content-Length: {len(body)}",
            "Connection: close"]
    data = "\r\n".join(head).encode() + b"\r\n"
    for key, value in headers.items():
        data += key.encode() + b": " + (value if isinstance(value, bytes) else value.encode())
        data += b"\r\n"
    with socket.create_connection(("127.0.0.1", server.http_port), timeout=60) as sock:
        sock.sendall(data + b"\r\n" + body)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    status_line, _, rest = answer.partition(b"\r\n")
    payload = rest.partition(b"\r\n\r\n")[2]
    return int(status_line.split()[1]), payload.decode("utf-8", "replace")


def http_row(path, body, headers=None, auth=True):
    def send(server, channel):
        raw = body if isinstance(body, bytes) else json.dumps(body).encode()
        return _raw_http(server, path, raw, {**(AUTH if auth else {}), **(headers or {})})
    return send


def grpc_row(request, metadata=META):
    def send(server, channel):
        stub = server.generation_stub(channel)
        try:
            list(stub.Generate(request, timeout=60, metadata=metadata))
        except grpc.RpcError as exc:
            return exc.code(), exc.details()
        return grpc.StatusCode.OK, ""
    return send


def grpc_bytes_row(data: bytes):
    def send(server, channel):
        generate = channel.unary_stream("/continuum.v1.Generation/Generate")
        try:
            list(generate(data, timeout=60, metadata=META))
        except grpc.RpcError as exc:
            return exc.code(), exc.details()
        return grpc.StatusCode.OK, ""
    return send


def openai_row(call, key=BASIC):
    def send(server, channel):
        client = openai.OpenAI(base_url=server.base_url, api_key=key, max_retries=0, timeout=60)
        try:
            call(client)
        except openai.APIStatusError as exc:
            return exc.status_code, exc.message
        return 200, ""
    return send


def _field(number: int, wire_type: int) -> bytes:
    return _VarintBytes(number << 3 | wire_type)


_PROMPT_HI = _field(2, 2) + b"\x02hi"
_S = sampling_pb2.SamplingParams

# (row id, send, expected status, words the message must contain)
ROWS = [
    # HTTP: the body as bytes and JSON
    ("nested 100k deep", http_row(COMP, b"[" * 100_000 + b"]" * 100_000), 400,
     "deeper than 32 levels"),
    ("nested objects", http_row(COMP, b'{"a":' * 5000 + b"1" + b"}" * 5000), 400,
     "deeper than 32"),
    ("invalid UTF-8 body", http_row(COMP, b'{"prompt": "\xff\xfe"}'), 400, "not valid UTF-8"),
    ("bogus charset", http_row(COMP, {"prompt": "hi"},
                               {"Content-Type": "application/json; charset=bogus"}), 400,
     "charset 'bogus' is not supported"),
    ("latin-1 charset", http_row(COMP, {"prompt": "hi"},
                                 {"Content-Type": "application/json; charset=latin-1"}), 400,
     "send the JSON body as UTF-8"),
    ("NaN literal", http_row(COMP, b'{"prompt": "hi", "temperature": NaN}'), 400, "NaN"),
    ("Infinity literal", http_row(COMP, b'{"prompt": "hi", "top_p": -Infinity}'), 400,
     "-Infinity"),
    ("1e400 temperature", http_row(COMP, b'{"prompt": "hi", "temperature": 1e400}'), 400,
     "temperature must be in [0, 2]"),
    ("1e39 penalty (past float32)", http_row(COMP, {"prompt": "hi", "presence_penalty": 1e39}),
     400, "presence_penalty must be in [-2, 2]"),
    ("not JSON", http_row(COMP, b"{prompt: hi}"), 400, "not valid JSON"),
    ("empty body", http_row(COMP, b""), 400, "not valid JSON"),
    # The default body limit of an 8k context (1 MiB), on both APIs.
    ("body past the default limit", http_row(COMP, {"prompt": "hi", "user": "u" * (1 << 20)}),
     413, "--max-body-bytes"),
    ("grpc: message past the default limit", grpc_row(gen.GenerateRequest(
        prompt="hi", tenant="t" * (1 << 20))), grpc.StatusCode.RESOURCE_EXHAUSTED, "larger"),
    ("array body", http_row(CHAT, [1, 2]), 400, "must be a JSON object"),
    ("null body", http_row(COMP, None), 400, "must be a JSON object"),
    ("5000-digit integer", http_row(COMP, b'{"prompt": "hi", "n": 1' + b"0" * 5000 + b"}"),
     400, "not valid JSON"),
    # HTTP: integers past the protobuf field types
    ("n past 2^32", http_row(COMP, {"prompt": "hi", "n": 2**32}), 400,
     "n must be an integer in [1, 16]"),
    ("n 17", http_row(COMP, {"prompt": "hi", "n": 17}), 400, "in [1, 16]"),
    ("prompt id past 2^32", http_row(COMP, {"prompt": [1, 2**32]}), 400,
     "prompt[1] = 4294967296 is not a token id"),
    ("negative prompt id", http_row(COMP, {"prompt": [5, -1]}), 400, "negative token id"),
    ("stop_token_ids past 2^32", http_row(COMP, {"prompt": "hi", "stop_token_ids": [2**32]}),
     400, "stop_token_ids[0] = 4294967296"),
    ("stop_token_ids = the vocabulary (the hang)", http_row(COMP, {
        "prompt": "hi", "stop_token_ids": list(range(VOCAB)), "min_tokens": 1,
        "max_tokens": 2}), 400, "stop_token_ids holds 49152 token ids; at most 128"),
    ("max_tokens past 2^32", http_row(COMP, {"prompt": "hi", "max_tokens": 2**32 + 1}), 400,
     "max_tokens must be an integer in [1, 4294967295]"),
    ("seed past 2^64", http_row(COMP, {"prompt": "hi", "seed": 2**64}), 400,
     "seed must be an integer in [0, 18446744073709551615]"),
    ("min_tokens past uint32", http_row(COMP, {"prompt": "hi", "min_tokens": 2**40}), 400,
     "min_tokens must be an integer in [0, 4294967295]"),
    ("top_logprobs float", http_row(CHAT, {"messages": MSG, "logprobs": True,
                                           "top_logprobs": 1.5}), 400,
     "top_logprobs must be an integer"),
    # HTTP: strings that are not Unicode text
    ("lone surrogate in prompt", http_row(COMP, b'{"prompt": "a\\ud800b"}'), 400,
     "prompt contains a lone UTF-16 surrogate"),
    ("lone surrogate in a message", http_row(
        CHAT, b'{"messages": [{"role": "user", "content": "\\udc00"}]}'), 400,
     "messages[0].content contains a lone UTF-16 surrogate"),
    ("lone surrogate in a text part", http_row(CHAT, (
        b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\ud83d"}]}]}')),
     400, "messages[0].content[0].text contains a lone"),
    ("lone surrogate in stop", http_row(COMP, b'{"prompt": "hi", "stop": ["\\udfff"]}'), 400,
     "stop[0] contains a lone"),
    # HTTP: wrong JSON types at depth
    ("message not an object", http_row(CHAT, {"messages": ["hi"]}), 400,
     "messages[0] must be an object"),
    ("role a number", http_row(CHAT, {"messages": [{"role": 5, "content": "x"}]}), 400,
     "messages[0].role is required"),
    ("content a number", http_row(CHAT, {"messages": [{"role": "user", "content": 5}]}), 400,
     "messages[0].content must be a string"),
    ("stop list of numbers", http_row(COMP, {"prompt": "hi", "stop": [1, 2]}), 400,
     "stop must be a string or a list of strings"),
    ("stream a string", http_row(COMP, {"prompt": "hi", "stream": "yes"}), 400,
     "stream must be true or false"),
    ("stream_options a list", http_row(COMP, {"prompt": "hi", "stream": True,
                                              "stream_options": [1]}), 400,
     "stream_options must be an object"),
    # HTTP: caps before any tokenization
    ("1,025 messages", http_row(CHAT, {"messages": MSG * 1025}), 400,
     "holds 1025 messages; at most 1024"),
    ("8,193 prompt ids", http_row(COMP, {"prompt": [5] * 8193}), 400,
     "maximum context length is 8192 tokens. However, prompt holds 8193 token ids"),
    ("prompt longer than any context", http_row(COMP, {"prompt": "x" * 700_000}), 400,
     "characters long, and at most"),
    ("body over the limit", http_row(COMP, {"prompt": "x" * (5 << 20)}), 413,
     "larger than the server's limit"),
    # HTTP: headers
    ("no API key", http_row(COMP, {"prompt": "hi"}, auth=False), 401, "missing or invalid API key"),
    ("wrong API key", http_row(COMP, {"prompt": "hi"}, {"Authorization": "Bearer sk-nope-000000"}),
     401, "API key"),
    ("Authorization with 0xFF and NUL", http_row(COMP, {"prompt": "hi"},
                                                 {"Authorization": b"Bearer \xff\x00"}), 400,
     "Invalid header value"),
    ("Authorization with 0xFF", http_row(COMP, {"prompt": "hi"},
                                         {"Authorization": b"Bearer sk-\xff-0123456"}), 401,
     "API key"),
    ("X-Request-Id with 0xFF", http_row(COMP, {"prompt": "hi"}, {"X-Request-Id": b"id-\xff"}),
     400, "X-Request-Id header must be printable ASCII"),
    ("X-Request-Id too long", http_row(COMP, {"prompt": "hi"}, {"X-Request-Id": "r" * 129}),
     400, "X-Request-Id header is 129 characters long; the limit is 128"),
    # HTTP through the openai client: rights and routing
    ("premium without the tier", openai_row(lambda c: c.completions.create(
        model="", prompt="hi", max_tokens=1, extra_body={"priority": "premium"})), 403,
     "may not use priority 'premium'"),
    ("another tenant", openai_row(lambda c: c.completions.create(
        model="", prompt="hi", max_tokens=1, extra_body={"tenant": "bob"})), 403,
     "belongs to tenant 'acme'"),
    ("unknown model", openai_row(lambda c: c.completions.create(
        model="gpt-4", prompt="hi", max_tokens=1)), 404, "is not served here"),
    ("logit_bias out of range", openai_row(lambda c: c.chat.completions.create(
        model="", messages=MSG, logit_bias={"1": 500})), 400,
     "a bias must be in [-100, 100]"),
    ("logit_bias past the vocabulary", openai_row(lambda c: c.chat.completions.create(
        model="", messages=MSG, logit_bias={"4000000": 1})), 400, "is not a token id"),
    # gRPC: stubs
    ("grpc: no API key", grpc_row(gen.GenerateRequest(prompt="hi"), metadata=()),
     grpc.StatusCode.UNAUTHENTICATED, "API key"),
    ("grpc: premium without the tier", grpc_row(gen.GenerateRequest(
        prompt="hi", priority=gen.PRIORITY_PREMIUM)), grpc.StatusCode.PERMISSION_DENIED,
     "may not use priority 'premium'"),
    ("grpc: inf temperature", grpc_row(gen.GenerateRequest(
        prompt="hi", sampling=_S(temperature=float("inf")))), INVALID,
     "sampling.temperature must be in [0, 2] (0 means greedy), got inf"),
    ("grpc: penalty past float32", grpc_row(gen.GenerateRequest(
        prompt="hi", sampling=_S(frequency_penalty=1e39))), INVALID,
     "sampling.frequency_penalty must be in [-2, 2], got inf"),
    ("grpc: n = 2^32 - 1", grpc_row(gen.GenerateRequest(prompt="hi", n=2**32 - 1)), INVALID,
     "n must be an integer in [1, 16] (completions per request)"),
    ("grpc: 129 stop token ids", grpc_row(gen.GenerateRequest(
        prompt="hi", sampling=_S(stop_token_ids=list(range(129))))), INVALID,
     "sampling.stop_token_ids holds 129 token ids; at most 128"),
    ("grpc: token id past the vocabulary", grpc_row(gen.GenerateRequest(
        token_ids=gen.TokenIds(ids=[1, 2**32 - 1]))), INVALID, "token_ids.ids[1] = 4294967295"),
    ("grpc: 8,193 token ids", grpc_row(gen.GenerateRequest(
        token_ids=gen.TokenIds(ids=[5] * 8193))), INVALID,
     "maximum context length is 8192 tokens. However, token_ids.ids holds 8193 token ids"),
    ("grpc: 1,025 chat messages", grpc_row(gen.GenerateRequest(chat=gen.ChatInput(
        messages=[gen.ChatMessage(role="user", content="hi")] * 1025))), INVALID,
     "chat holds 1025 messages; at most 1024"),
    ("grpc: message over the limit", grpc_row(gen.GenerateRequest(prompt="x" * (5 << 20))),
     grpc.StatusCode.RESOURCE_EXHAUSTED, "larger than max"),
    ("grpc: request id with a newline", grpc_row(gen.GenerateRequest(
        prompt="hi", request_id="a\nb")), INVALID, "request_id must be printable ASCII"),
    ("grpc: unknown priority", grpc_row(gen.GenerateRequest(prompt="hi", priority=9)), INVALID,
     "priority 9 is not a known Priority value"),
    # gRPC: raw bytes
    ("grpc bytes: invalid UTF-8 prompt", grpc_bytes_row(_field(2, 2) + b"\x02\xff\xfe"), INVALID,
     "string fields must be UTF-8"),
    ("grpc bytes: 11-byte varint", grpc_bytes_row(
        _PROMPT_HI + _field(6, 0) + b"\xff" * 10 + b"\x01"), INVALID,
     "not a valid GenerateRequest"),
    ("grpc bytes: length past the end", grpc_bytes_row(_field(2, 2) + b"\x7fhi"), INVALID,
     "not a valid GenerateRequest"),
    ("grpc bytes: negative enum", grpc_bytes_row(
        _PROMPT_HI + _field(9, 0) + _VarintBytes(2**64 - 5)), INVALID,
     "is not a known Priority value"),
]


def _normal_request_works(server) -> None:
    status, body = _raw_http(server, COMP, json.dumps(
        {"prompt": "Hello", "max_tokens": 1, "temperature": 0}).encode(), AUTH)
    assert status == 200, body
    assert json.loads(body)["usage"]["completion_tokens"] == 1


# A normal request after every GROUP rows and after the last (each costs a generation).
GROUP = 8


@pytest.mark.parametrize("index,send,status,words",
                         [(i, *row[1:]) for i, row in enumerate(ROWS)],
                         ids=[row[0] for row in ROWS])
def test_bad_input_is_refused_and_the_server_serves_on(server, channel, index, send, status,
                                                       words):
    got, message = send(server, channel)
    assert got == status, message
    if isinstance(status, int) and message.startswith("{"):  # an OpenAI error body
        error = json.loads(message)["error"]
        assert set(error) == {"message", "type", "param", "code"}
        message = error["message"]
    assert words in message
    if index % GROUP == GROUP - 1 or index == len(ROWS) - 1:
        _normal_request_works(server)


def test_the_table_is_big_enough():
    assert len(ROWS) >= 40
    assert sum(isinstance(row[2], grpc.StatusCode) for row in ROWS) >= 12


def test_premium_with_the_tier_is_served(server):
    client = openai.OpenAI(base_url=server.base_url, api_key=VIP, max_retries=0, timeout=60)
    answer = client.completions.create(model="", prompt="Hi", max_tokens=1,
                                       extra_body={"priority": "premium"})
    assert answer.usage.completion_tokens == 1
