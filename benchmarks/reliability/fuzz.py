"""Row 3: hypothesis fuzzing of the client-facing entry points (HTTP and gRPC).

Each target is a property run for ``examples`` inputs that fails only on what bad input
must never cause: a 5xx (HTTP) or INTERNAL / UNKNOWN / UNAVAILABLE (gRPC), a hang, or a dead
server; a failure's input is printed as drawn (fuzz_schema.py shrinks). After every target
a normal request must still succeed. HTTP goes over a raw socket (JSON of any shape, the
endpoint's fields set to anything, random bytes and headers); gRPC sends requests from the
``GenerateRequest`` descriptor, random bytes and mutated serializations. fuzz_zmq.py
covers the ZeroMQ channel's two ends.
"""

from __future__ import annotations

import socket
import time

import grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from continuum.bench.clients import SERVER_ERROR_CODES
from gateway.api import openai_schema
from harness import proto_strategies
from harness.body_strategies import ANY_JSON, LENGTH_KEYS, SCALAR, splice
from harness.fuzz_common import PHASES, Tally, run_property
from protos.continuum.v1 import generation_pb2 as gen
from protos.continuum.v1 import generation_pb2_grpc

TIMEOUT_S = 20.0
FIELD = st.one_of(SCALAR, st.lists(SCALAR, max_size=40), ANY_JSON)
TEXT = st.text(max_size=120)
PROMPT = st.one_of(TEXT, st.lists(st.integers(-1, 2**33), max_size=20),
                   st.lists(TEXT, max_size=3), FIELD)
MESSAGE = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant",
                                                          "tool", ""]) | FIELD,
                                 "content": TEXT | FIELD})


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


def http_failed(status: str, data: bytes) -> bool:
    if status in ("timeout", "garbled"):
        return True
    if status.isdigit() and int(status) >= 500:
        return True
    return b'"type":"server_error"' in data.replace(b" ", b"")


def _body(path: str) -> st.SearchStrategy:
    """A valid body with up to three fields replaced by anything (each input probes one
    or two parsing paths, the rest must pass), random JSON, or random bytes."""
    chat = "chat" in path
    keys = sorted(openai_schema.ENDPOINTS[path])
    base = openai_schema.VALID[path]
    near = st.dictionaries(st.sampled_from(keys), FIELD, max_size=3).map(
        lambda changes: {**base, **{k: v for k, v in changes.items()
                                    if not (k in LENGTH_KEYS and v is None)}})
    if chat:
        near = near | st.lists(MESSAGE, max_size=4).map(lambda m: {**base, "messages": m})
    else:
        near = near | PROMPT.map(lambda p: {**base, "prompt": p})
    return st.one_of(near.map(splice), ANY_JSON.map(splice), st.binary(max_size=600))


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
        assert not http_failed(status, data), f"{target} answered {status}: {data[:300]!r}"

    return prop


# --- gRPC -----------------------------------------------------------------------------

def grpc_code(call) -> str:
    try:
        for _ in call:
            pass
    except grpc.RpcError as exc:
        return exc.code().name
    return "OK"


def grpc_failed(code: str) -> bool:
    return code in {c.name for c in SERVER_ERROR_CODES} | {"UNAVAILABLE"}


def fuzz_grpc(addr: str, tally: Tally, examples: int) -> None:
    with grpc.insecure_channel(addr) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        raw = channel.unary_stream("/continuum.v1.Generation/Generate")  # bytes in, bytes out

        @settings(max_examples=examples, deadline=None, database=None, derandomize=True,
              phases=PHASES,
                  suppress_health_check=list(HealthCheck))
        @given(req=proto_strategies.generate_requests())
        def typed(req) -> None:
            code = grpc_code(stub.Generate(req, timeout=TIMEOUT_S))
            tally.add("grpc GenerateRequest", code)
            assert not grpc_failed(code), f"GenerateRequest answered {code}: {req}"

        @settings(max_examples=examples, deadline=None, database=None, derandomize=True,
              phases=PHASES,
                  suppress_health_check=list(HealthCheck))
        @given(data=st.binary(max_size=400)
               | proto_strategies.generate_requests().flatmap(_mutated))
        def raw_bytes(data: bytes) -> None:
            code = grpc_code(raw(data, timeout=TIMEOUT_S))
            tally.add("grpc raw bytes", code)
            assert not grpc_failed(code), f"raw bytes {data!r} answered {code}"

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
    from harness.streams import request

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
