"""Row ``schema_fuzz``: every field of both APIs, from their schemas, on a live server while
steady_streams.py's greedy streams run (docs/reliability.md).

The OpenAI endpoints with bodies from gateway/api/openai_schema.py (body_strategies.py)
and gRPC ``Generate`` from its descriptor (proto_strategies.py, sent as bytes), swept field
by field, ``SIZES[size]`` inputs a field, seeded by its name. Asserted per input: no server
error, an answer within TIMEOUT_S (else ``slow``), a refusal of at most MAX_REFUSAL_BYTES
(else ``echo``); after the run, every background stream equalled its reference and the
server is healthy with its pids. Each distinct failure (up to MAX_SHRUNK a target) is then
shrunk within SHRINK_S and printed as its reproducer.
"""

from __future__ import annotations

import json
import random
import re
import sys
import time
import urllib.request
import zlib

import grpc
from google.protobuf import text_format
from hypothesis import HealthCheck, Phase, find, given, seed, settings
from hypothesis.errors import NoSuchExample

from benchmarks.reliability import steady_streams
from benchmarks.reliability.fuzz import TIMEOUT_S, grpc_code, grpc_failed, http_failed, http_raw
from gateway.api import openai_schema
from gateway.config import default_body_limit
from harness import body_strategies, proto_strategies
from harness.fuzz_common import PHASES, Tally
from protos.continuum.v1 import generation_pb2_grpc

SIZES = {"ci": 1, "short": 2, "default": 5, "long": 100}  # inputs per field
MAX_SHRUNK, SHRINK_S = 3, 60.0
# A refusal quotes what it refuses in a bounded excerpt (protos/echo.py): one longer than
# this grew with the input, an amplifier for whoever sends megabytes.
MAX_REFUSAL_BYTES = 8192
GRPC_TARGET = "grpc Generate"


class Target:
    """One entry point: its fields, how an input probing one is drawn, sent, judged and
    shown; answers cached by the input's key (shrinking replays many)."""

    def __init__(self, name: str, fields: list[str], strategy_for, send, show, key=None):
        self.name, self.fields, self.strategy_for = name, fields, strategy_for
        self._send, self.show, self._key = send, show, key or (lambda x: x)
        self.cache: dict = {}

    def answer(self, x) -> tuple[str, str]:
        """(status, failure signature or "" when it passed)."""
        key = self._key(x)
        if key not in self.cache:
            self.cache[key] = self._send(x)
        return self.cache[key]

    def answered(self, x) -> bool:
        return self._key(x) in self.cache


def _abbreviate(text: str, limit: int = 1500) -> str:
    """Runs of one character as ``c<xN>``, then cut to ``limit``: a 900 KB string
    reads as one line."""
    text = re.sub(r"(.)\1{39,}", lambda m: f"{m.group(1)}<x{len(m.group(0))}>", text,
                  flags=re.DOTALL)
    return text if len(text) <= limit else text[:limit] + f"... ({len(text)} chars)"


def _signature(status: str, detail: bytes | str) -> str:
    """What tells two failures apart: the status and the first words of the message,
    digits and ids masked."""
    text = detail.decode("utf-8", "replace") if isinstance(detail, bytes) else detail
    message = re.search(r'"message":\s*"([^"]{0,80})', text)
    words = message.group(1) if message else text[:80]
    return f"{status}: {re.sub(r'[0-9a-f]{6,}|[0-9]+', '#', words)}"


def http_target(port: int, path: str, cap: int) -> Target:
    def send(x) -> tuple[str, str]:
        data, headers = x
        started = time.monotonic()
        status, reply = http_raw(port, path, data, list(headers), timeout=TIMEOUT_S)
        slow = status == "timeout" or time.monotonic() - started > TIMEOUT_S
        body = reply.partition(b"\r\n\r\n")[2]
        if not slow and status != "200" and len(body) > MAX_REFUSAL_BYTES:
            return "echo", _signature(f"echo {status} of {len(body)} bytes", body)
        failed = slow or http_failed(status, reply)
        return ("slow" if slow else status), (_signature(status, body) if failed else "")

    def show(x) -> str:
        data, headers = x
        lines = [f"POST {path}"] + [f"{k.decode('latin-1')}: {v.decode('latin-1')}"
                                    for k, v in headers]
        text = data.decode("utf-8", "backslashreplace")
        return "\n".join(lines) + f"\n\n{_abbreviate(text)}  ({len(data)} bytes)"

    def strategy_for(key: str):
        return body_strategies.wire_requests(path, key, cap).map(
            lambda r: (r[0], tuple(r[1])))

    return Target(f"http {path}", body_strategies.field_names(path), strategy_for, send,
                  show)


def grpc_target(channel: grpc.Channel) -> Target:
    raw = channel.unary_stream("/continuum.v1.Generation/Generate")  # bytes in and out

    def send(req) -> tuple[str, str]:
        started = time.monotonic()
        call = raw(proto_strategies.wire_bytes(req), timeout=TIMEOUT_S)
        code = grpc_code(call)
        slow = code == "DEADLINE_EXCEEDED" or time.monotonic() - started > TIMEOUT_S
        detail = "" if slow or code == "OK" else call.details() or ""
        if len(detail.encode()) > MAX_REFUSAL_BYTES:
            return "echo", _signature(f"echo {code} of {len(detail)} chars", detail)
        failed = slow or grpc_failed(code)
        return ("slow" if slow else code), (_signature(code, detail) if failed else "")

    def show(req) -> str:
        text = text_format.MessageToString(req, as_utf8=True)
        note = " (each \\000\\001\\002 goes on the wire as a lone surrogate, U+D800)" \
            if proto_strategies.SURROGATE_MARK in text else ""
        return f"Generate{note}:\n{_abbreviate(text)}"

    # messages are unhashable: an input is keyed by its bytes
    return Target(GRPC_TARGET, proto_strategies.field_names(),
                  proto_strategies.generate_requests, send, show, proto_strategies.wire_bytes)


def _settings(examples: int, phases=PHASES) -> settings:
    return settings(max_examples=examples, deadline=None, database=None, phases=phases,
                    suppress_health_check=list(HealthCheck))


def _seed(target: Target, name: str) -> int:
    """A seed of each field's own: the same inputs every run, different ones per field
    (derandomize would seed every field's property, one function, alike)."""
    return zlib.crc32(f"{target.name} {name}".encode())


def _first_pass(target: Target, name: str, per_field: int, tally: Tally,
                found: dict, log):
    """The property for one field: records every status, keeps each new failure."""

    @seed(_seed(target, name))
    @_settings(per_field)
    @given(x=target.strategy_for(name))
    def first_pass(x) -> None:
        status, failure = target.answer(x)
        tally.add(target.name, status)
        if failure and failure not in found:
            found[failure] = (name, x)
            log(f"[schema_fuzz] {target.name} {name}: {failure}", file=sys.stderr,
                flush=True)

    return first_pass


def fuzz_target(target: Target, per_field: int, tally: Tally, log) -> None:
    """``per_field`` inputs for each field of the target (a first pass that never stops
    at a failure), then a shrunk reproducer for each distinct failure."""
    found: dict[str, tuple[str, object]] = {}  # signature -> (field, input)
    for name in target.fields:
        _first_pass(target, name, per_field, tally, found, log)()
    for number, (failure, (name, drawn)) in enumerate(found.items()):
        minimal = drawn
        if number < MAX_SHRUNK and not failure.startswith("slow"):
            minimal = _shrink(target, name, failure, per_field) or drawn
        reproducer = target.show(minimal)
        log(f"[schema_fuzz] reproducer for {target.name} {name} ({failure}):\n{reproducer}",
            file=sys.stderr, flush=True)
        tally.failures.append({"target": target.name, "field": name, "error": failure,
                               "reproducer": reproducer[:3000]})


def _shrink(target: Target, name: str, failure: str, per_field: int):
    """The smallest input probing ``name`` that hypothesis finds with the same failure,
    within SHRINK_S (past it only inputs already answered count, so that the search
    ends consistent)."""
    deadline = time.monotonic() + SHRINK_S

    def same(x) -> bool:
        if time.monotonic() > deadline and not target.answered(x):
            return False
        return target.answer(x)[1] == failure

    try:
        return find(target.strategy_for(name), same, random=random.Random(_seed(target, name)),
                    settings=_settings(max(20, 4 * per_field), (Phase.generate, Phase.shrink)))
    except NoSuchExample:
        return None


def body_cap(http_port: int) -> int:
    """The body limit the gateway runs with (its default: from the context length,
    which /tokenize reports)."""
    req = urllib.request.Request(f"http://127.0.0.1:{http_port}/tokenize",
                                 data=b'{"prompt": "Hi"}',
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        return default_body_limit(json.load(resp)["max_model_len"])


def health(serve, pids: dict[str, int]) -> dict:
    """/health, one normal request, and whether every process is the one we started."""
    from harness.streams import request

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{serve.http_port}/health",
                                    timeout=30) as resp:
            health_status = resp.status
    except OSError as exc:
        health_status = getattr(exc, "code", str(exc))
    with grpc.insecure_channel(serve.addr) as ch:
        try:
            answers = list(generation_pb2_grpc.GenerationStub(ch).Generate(
                request("Say hello.", 4), timeout=120))
            normal_ok = bool(answers) and answers[-1].finish_reason != 0
        except grpc.RpcError:
            normal_ok = False
    alive = serve.proc.poll() is None
    kept = {role: alive and serve.pid(role) == pid for role, pid in pids.items()}
    return {"health_status": health_status, "normal_request_ok": normal_ok,
            "processes_kept": kept}


def run(serve, size: str = "short", log=print) -> dict:
    """Every target against ``serve`` (a procs.Serve) while steady streams run."""
    per_field = SIZES[size]
    tally = Tally()
    pids = {r: serve.pid(r) for r in ("gateway", "scheduler_svc", "executor_svc")}
    background = steady_streams.SteadyStreams(serve)
    background.reference()
    started = time.monotonic()
    cap = body_cap(serve.http_port)
    background.start()
    fields: dict[str, int] = {}
    try:
        with grpc.insecure_channel(serve.addr) as channel:
            targets = [http_target(serve.http_port, p, cap) for p in openai_schema.ENDPOINTS]
            for target in [*targets, grpc_target(channel)]:
                fields[target.name] = len(target.fields)
                fuzz_target(target, per_field, tally, log)
    finally:
        streams_row = background.stop()
    after = health(serve, pids)
    statuses = {t: dict(c) for t, c in tally.counts.items()}
    return {
        "row": "schema_fuzz", "examples": tally.examples, "per_field": per_field,
        "seconds": round(time.monotonic() - started), "body_cap": cap,
        "timeout_s": TIMEOUT_S, "num_streams": len(steady_streams.PROMPTS),
        "server_errors": sum(n for c in tally.counts.values() for s, n in c.items()
                             if s != "slow" and _is_server_error(s)),
        "slow": sum(c.get("slow", 0) for c in tally.counts.values()),
        "echoes": sum(c.get("echo", 0) for c in tally.counts.values()),
        "fields": fields, "statuses": statuses, "failures": len(tally.failures),
        "reproducers": tally.failures[:12], **streams_row, **after,
    }


def _is_server_error(status: str) -> bool:
    return (status.isdigit() and int(status) >= 500) or grpc_failed(status) or \
        status in ("garbled", "timeout")


def met(row: dict) -> bool:
    """The row's target: no server error, nothing slow, no echo, the streams unchanged,
    healthy."""
    return (row["failures"] == 0 and row["server_errors"] == 0 and row["slow"] == 0
            and row["echoes"] == 0 and row["streams_identical"] and row["health_status"] == 200
            and row["normal_request_ok"] and all(row["processes_kept"].values()))
