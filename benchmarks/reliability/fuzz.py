"""Row 3: hypothesis fuzzing of the client-facing entry points (HTTP and gRPC).

Each target is a hypothesis property run for ``examples`` inputs. The property records
the status every input got and fails only on what the issue forbids: a 5xx (HTTP) or
INTERNAL / UNKNOWN / UNAVAILABLE (gRPC) from a healthy server, no answer within the
timeout (a hang), or a dead server. A failure is shrunk by hypothesis and its minimal
input printed as the reproducer; the target's run then stops there (the counts show how
far it got). After every target a normal request must still succeed.

HTTP inputs go over a raw socket, so anything can be sent: JSON of random shape, bodies
near the real schema with extreme values in every field (integers past 2^64, float
literals past a double, deep nesting, lone surrogates), random bytes, and random header
values (charsets, request ids with non-ASCII bytes). ``fuzz_zmq`` covers the
ZeroMQ channel's two ends.
"""

from __future__ import annotations

import json
import socket
import time

import grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from benchmarks.reliability.fuzz_common import PHASES, UINT32, UINT64, Tally, run_property
from benchmarks.reliability.streams import SERVER_ERROR_CODES
from protos.continuum.v1 import generation_pb2 as gen
from protos.continuum.v1 import generation_pb2_grpc

TIMEOUT_S = 20.0
RAW = {  # JSON text no json.dumps writes: spliced in where a string "\x00RAW<k>\x00" stands
    0: "1e999", 1: "-1e999", 2: "1" + "0" * 400, 3: '"\\ud800"', 4: '"\\udfff x"',
    5: "[" * 100_000 + "]" * 100_000, 6: '{"a":' * 50_000 + "1" + "}" * 50_000,
    7: "NaN", 8: "Infinity", 9: "18446744073709551616", 10: "-9223372036854775809",
    11: "4294967296", 12: "1.5", 13: "true",
}
SMALL_INT = st.integers(-2, 6)
EXTREME_INT = st.sampled_from([2**31, 2**32, 2**63, 2**64, -(2**63), 10**30])
SCALAR = st.one_of(st.none(), st.booleans(), SMALL_INT, EXTREME_INT,
                   st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=20),
                   st.sampled_from([f"\x00RAW{k}\x00" for k in RAW]))
ANY_JSON = st.recursive(SCALAR, lambda kids: st.lists(kids, max_size=5)
                        | st.dictionaries(st.text(max_size=12), kids, max_size=5),
                        max_leaves=25)
FIELD = st.one_of(SCALAR, st.lists(SCALAR, max_size=40), ANY_JSON)
TEXT = st.text(max_size=120)
PROMPT = st.one_of(TEXT, st.lists(st.integers(-1, 2**33), max_size=20),
                   st.lists(TEXT, max_size=3), FIELD)
MESSAGE = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant",
                                                          "tool", ""]) | FIELD,
                                 "content": TEXT | FIELD})
COMMON = ["model", "max_tokens", "temperature", "top_p", "n", "stream", "stop", "seed",
          "presence_penalty", "frequency_penalty", "user", "ignore_eos", "min_tokens",
          "top_k", "min_p", "repetition_penalty", "stop_token_ids", "priority",
          "stream_options", "logit_bias", "best_of", "echo", "logprobs"]
CHAT_ONLY = ["max_completion_tokens", "top_logprobs", "response_format", "tools"]
# null means "the default length" (up to the context limit for chat): a valid request
# that would take minutes here, so these stay set (every other value is drawn).
LENGTH_KEYS = ("max_tokens", "max_completion_tokens")


def _splice(body: object) -> bytes:
    text = json.dumps(body, allow_nan=True)
    for k, raw in RAW.items():
        text = text.replace(f'"\\u0000RAW{k}\\u0000"', raw)
    return text.encode("utf-8", "surrogatepass")


def http_raw(port: int, path: str, body: bytes, headers: list[tuple[bytes, bytes]],
             timeout: float = TIMEOUT_S) -> tuple[str, bytes]:
    """One request over a fresh socket; (status code or 'closed'/'timeout', response)."""
    head = [b"POST " + path.encode() + b" HTTP/1.1", b"Host: 127.0.0.1",
            b"Connection: close", b"Content-Length: %d" % len(body)]
    if not any(k.lower() == b"content-type" for k, _ in headers):
        head.append(b"Content-Type: application/json")
    head += [k + b": " + v for k, v in headers]
    data = b""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        end = time.monotonic() + timeout
        try:
            sock.sendall(b"\r\n".join(head) + b"\r\n\r\n" + body)
            while time.monotonic() < end:
                sock.settimeout(max(0.1, end - time.monotonic()))
                chunk = sock.recv(65536)
                if not chunk:
                    break
                data += chunk
            else:
                return ("timeout" if not data else _status(data)), data
        except TimeoutError:
            return ("timeout" if not data else _status(data)), data
        except ConnectionError:
            return ("closed" if not data else _status(data)), data
    return ("closed" if not data else _status(data)), data


def _status(data: bytes) -> str:
    parts = data.split(b" ", 2)
    return parts[1].decode(errors="replace") if len(parts) > 1 else "garbled"


def _http_failed(status: str, data: bytes) -> bool:
    if status in ("timeout", "garbled"):
        return True
    if status.isdigit() and int(status) >= 500:
        return True
    return b'"type":"server_error"' in data.replace(b" ", b"")


def _body(path: str) -> st.SearchStrategy:
    """A valid body with up to three fields replaced by anything (each input probes one
    or two parsing paths, the rest must pass), random JSON, or random bytes."""
    chat = "chat" in path
    keys = COMMON + (CHAT_ONLY if chat else [])
    base = ({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4} if chat
            else {"prompt": "Hi", "max_tokens": 4})
    first = ["messages"] if chat else ["prompt"]
    near = st.dictionaries(st.sampled_from(first + keys), FIELD, max_size=3).map(
        lambda changes: {**base, **{k: v for k, v in changes.items()
                                    if not (k in LENGTH_KEYS and v is None)}})
    if chat:
        near = near | st.lists(MESSAGE, max_size=4).map(lambda m: {**base, "messages": m})
    else:
        near = near | PROMPT.map(lambda p: {**base, "prompt": p})
    return st.one_of(near.map(_splice), ANY_JSON.map(_splice), st.binary(max_size=600))


HEADER_NAMES = st.sampled_from([b"Content-Type", b"X-Request-Id", b"Accept",
                                b"Authorization", b"Accept-Charset", b"X-Tenant"])
HEADER_VALUE = st.one_of(
    st.binary(max_size=40).map(lambda b: b.replace(b"\r", b"").replace(b"\n", b"")),
    st.sampled_from([b"application/json; charset=", b"application/json; charset=bogus",
                     b"application/json; charset=utf-16", b"text/plain", b"\xff\xfe",
                     b"application/json; charset=latin-1", b"a" * 9000]))


def fuzz_http(port: int, tally: Tally, examples: int) -> None:
    for path in ("/v1/completions", "/v1/chat/completions"):
        run_property(_http_property(port, path, tally, examples), f"http {path}", tally)


def _http_property(port: int, path: str, tally: Tally, examples: int):
    target = f"http {path}"

    @settings(max_examples=examples, deadline=None, database=None, derandomize=True,
              phases=PHASES,
              suppress_health_check=list(HealthCheck))
    @given(body=_body(path), headers=st.lists(st.tuples(HEADER_NAMES, HEADER_VALUE),
                                               max_size=3))
    def prop(body: bytes, headers: list) -> None:
        status, data = http_raw(port, path, body, headers)
        tally.add(target, status)
        assert not _http_failed(status, data), f"{target} answered {status}: {data[:300]!r}"

    return prop


# --- gRPC -----------------------------------------------------------------------------

FLOAT = st.floats(width=32, allow_nan=True, allow_infinity=True)


GRPC_FIELDS = {  # field -> strategy of anything its type can hold
    "request_id": st.text(max_size=140), "tenant": st.text(max_size=140),
    "stop": st.lists(st.text(max_size=300), max_size=20),
    "priority": st.integers(-(2**31), 2**31 - 1), "n": UINT32,
    "model": st.sampled_from(["SmolLM2-135M-Instruct"]) | st.text(max_size=20),
    # max_tokens 0 means "up to 256": left out, so valid requests answer in seconds.
    "max_tokens": st.integers(1, 8) | st.sampled_from([2**31, 2**32 - 1]),
    "temperature": FLOAT, "top_p": FLOAT, "min_p": FLOAT, "repetition_penalty": FLOAT,
    "presence_penalty": FLOAT, "frequency_penalty": FLOAT, "top_k": UINT32,
    "min_tokens": UINT32, "logprobs": UINT32, "seed": UINT64, "ignore_eos": st.booleans(),
    "stop_token_ids": st.lists(st.integers(0, 2**32 - 1), max_size=30),
    "input": st.sampled_from(["prompt", "chat", "token_ids", "none"]),
}
SAMPLING_FIELDS = {"temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                   "frequency_penalty", "top_k", "min_tokens", "logprobs", "seed",
                   "ignore_eos", "stop_token_ids"}


@st.composite
def generate_requests(draw) -> gen.GenerateRequest:
    """A valid request ("Hi", 4 tokens, greedy) with up to four fields set to anything."""
    req = gen.GenerateRequest(prompt="Hi", max_tokens=4)
    req.sampling.temperature = 0.0
    for name in draw(st.sets(st.sampled_from(sorted(GRPC_FIELDS)), max_size=4)):
        value = draw(GRPC_FIELDS[name])
        if name == "input":
            _set_input(req, value, draw)
            continue
        msg = req.sampling if name in SAMPLING_FIELDS else req
        if isinstance(value, list):
            getattr(msg, name).extend(value)
        else:
            setattr(msg, name, value)
    return req


def _set_input(req: gen.GenerateRequest, which: str, draw) -> None:
    if which == "prompt":
        req.prompt = draw(TEXT)
    elif which == "chat":
        req.chat.SetInParent()
        for _ in range(draw(st.integers(0, 4))):
            req.chat.messages.add(role=draw(st.sampled_from(["user", "system", "x", ""])),
                                  content=draw(TEXT))
    elif which == "token_ids":
        req.token_ids.ids.extend(draw(st.lists(st.integers(0, 2**32 - 1), max_size=30)))
    else:
        req.ClearField("prompt")


def _grpc_code(call) -> str:
    try:
        for _ in call:
            pass
    except grpc.RpcError as exc:
        return exc.code().name
    return "OK"


def _grpc_failed(code: str) -> bool:
    return code in {c.name for c in SERVER_ERROR_CODES} | {"UNAVAILABLE"}


def fuzz_grpc(addr: str, tally: Tally, examples: int) -> None:
    with grpc.insecure_channel(addr) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        raw = channel.unary_stream("/continuum.v1.Generation/Generate")  # bytes in, bytes out

        @settings(max_examples=examples, deadline=None, database=None, derandomize=True,
              phases=PHASES,
                  suppress_health_check=list(HealthCheck))
        @given(req=generate_requests())
        def typed(req) -> None:
            code = _grpc_code(stub.Generate(req, timeout=TIMEOUT_S))
            tally.add("grpc GenerateRequest", code)
            assert not _grpc_failed(code), f"GenerateRequest answered {code}: {req}"

        @settings(max_examples=examples, deadline=None, database=None, derandomize=True,
              phases=PHASES,
                  suppress_health_check=list(HealthCheck))
        @given(data=st.binary(max_size=400) | generate_requests().flatmap(_mutated))
        def raw_bytes(data: bytes) -> None:
            code = _grpc_code(raw(data, timeout=TIMEOUT_S))
            tally.add("grpc raw bytes", code)
            assert not _grpc_failed(code), f"raw bytes {data!r} answered {code}"

        run_property(typed, "grpc GenerateRequest", tally)
        run_property(raw_bytes, "grpc raw bytes", tally)


def _mutated(req: gen.GenerateRequest) -> st.SearchStrategy:
    good = req.SerializeToString()
    return st.lists(st.tuples(st.integers(0, max(0, len(good) - 1)), st.integers(0, 255)),
                    max_size=4).map(lambda edits: _apply(good, edits))


def _apply(data: bytes, edits: list[tuple[int, int]]) -> bytes:
    out = bytearray(data)
    for at, value in edits:
        if at < len(out):
            out[at] = value
    return bytes(out)


SIZES = {"ci": 8, "short": 25, "default": 100, "long": 1000}  # examples per target


def run(serve, tmp, size: str = "short") -> dict:
    """Every target against ``serve`` (a procs.Serve), then the executor end on its own."""
    from benchmarks.reliability import fuzz_zmq
    from benchmarks.reliability.streams import request

    examples = SIZES[size]
    tally = Tally()
    pids = {r: serve.pid(r) for r in ("gateway", "scheduler_svc", "executor_svc")}

    def check_serving(target: str) -> None:
        with grpc.insecure_channel(serve.addr) as ch:
            try:
                answers = list(generation_pb2_grpc.GenerationStub(ch).Generate(
                    request("Say hello.", 4), timeout=120))
                ok = bool(answers) and answers[-1].finish_reason != 0
            except grpc.RpcError as exc:
                ok, answers = False, exc.code().name
        if not ok:
            tally.failures.append({"target": target, "reproducer": "",
                                   "error": f"a normal request failed afterwards: {answers}"})

    started = time.monotonic()
    fuzz_http(serve.http_port, tally, examples)
    check_serving("http")
    fuzz_grpc(serve.addr, tally, examples)
    check_serving("grpc")
    fuzz_zmq.fuzz_scheduler_end(serve, tally, examples, check_serving)
    fuzz_zmq.fuzz_executor_end(tmp, tally, max(6, examples // 2))
    survived = {r: serve.pid(r) == p for r, p in pids.items()} if serve.proc.poll() is None \
        else dict.fromkeys(pids, False)
    return {
        "row": "fuzz", "examples": tally.examples, "seconds": round(time.monotonic() - started),
        "statuses": {t: dict(c) for t, c in tally.counts.items()},
        "failures": len(tally.failures), "reproducers": tally.failures[:10],
        "processes_survived": all(survived.values()),
    }
