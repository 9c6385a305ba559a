"""A client nobody here wrote: clients/node/generate.js, @grpc/grpc-js and
@grpc/proto-loader (pinned in clients/node/package-lock.json, installed by `make setup`),
reading only the .proto files and the service config, against a real `continuum serve`.

It streams the greedy text the Python stub gets for the same request, with the last
message's usage and timing; and when the gateway refuses it (a per-client stream cap) with
``grpc-retry-pushback-ms``, grpc-js's own retry policy from our service config waits the
pushback, tries once more and succeeds. Skipped only where node is not installed."""

from __future__ import annotations

import json
import pathlib
import re
import shutil
import subprocess
import time
import urllib.request

import grpc
import pytest

from protos.continuum.v1 import generation_pb2 as gen
from protos.pushback import PUSHBACK_KEY, RETRY_AFTER_KEY

from .conftest import start_server

pytestmark = pytest.mark.integration
ROOT = pathlib.Path(__file__).resolve().parents[2]
CLIENT = ROOT / "clients" / "node" / "generate.js"
MODULES = ROOT / "clients" / "node" / "node_modules" / "@grpc"
PUSHBACK_MS = 1000  # the gateway's per-client cap refusal (gateway/edge/client_limits.py)
PROMPT = "The capital of France is"
GREEDY = {"prompt": PROMPT, "max_tokens": 16,
          "sampling": {"temperature": 0.0, "ignore_eos": True}}
REFUSALS = re.compile(r'^continuum_gateway_request_errors_total'
                      r'\{[^}]*code="RESOURCE_EXHAUSTED"[^}]*\} (\S+)$', re.M)


@pytest.fixture(scope="module")
def node() -> str:
    found = shutil.which("node")
    if found is None:
        pytest.skip("node is not installed: the Node client's tests need Node.js 18 or later")
    if not (MODULES / "grpc-js").is_dir() or not (MODULES / "proto-loader").is_dir():
        pytest.fail("clients/node/node_modules lacks @grpc/grpc-js or @grpc/proto-loader: "
                    "run `make setup` (npm ci in clients/node)")
    return found


@pytest.fixture(scope="module")
def capped_server(tmp_path_factory, model_dir, node):
    """One stream at a time per client address: the second one is refused with a pushback."""
    srv = start_server(tmp_path_factory.mktemp("node"), model_dir,
                       "--kv-cache-bytes", str(96 << 20), "--max-streams-per-client", "1")
    yield srv
    assert srv.stop() == 0


def _node_client(node: str, server, request: dict) -> subprocess.Popen:
    return subprocess.Popen([node, str(CLIENT), server.addr, json.dumps(request)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finished(proc: subprocess.Popen) -> tuple[list[dict], dict]:
    """The client's responses and its last (status) line."""
    out, err = proc.communicate(timeout=120)
    lines = [json.loads(line) for line in out.splitlines() if line.strip()]
    assert lines and "status" in lines[-1], f"node client said:\n{out}\n{err}"
    return [line["response"] for line in lines[:-1]], lines[-1]


def _refusals(server) -> float:
    url = f"http://127.0.0.1:{server.http_port}/metrics"
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    return sum(float(value) for value in REFUSALS.findall(text))


def test_node_streams_the_greedy_text_python_gets_with_usage_and_timing(node, capped_server):
    responses, status = _finished(_node_client(node, capped_server, GREEDY))
    assert status["status"] == "OK", status
    assert status["attempts"] == 1
    with grpc.insecure_channel(capped_server.addr) as channel:
        python = list(capped_server.generation_stub(channel).Generate(
            gen.GenerateRequest(**GREEDY), timeout=120))
    text = "".join(r["text"] for r in responses)
    assert text and text == "".join(r.text for r in python)
    tokens = [t for r in responses for t in r["token_ids"]]
    assert tokens == [t for r in python for t in r.token_ids] and len(tokens) == 16

    last = responses[-1]
    assert last["finish_reason"] == "FINISH_REASON_LENGTH"
    usage = last["usage"]
    assert usage["completion_tokens"] == 16 and usage["prompt_tokens"] > 0
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert usage == {k: getattr(python[-1].usage, k) for k in usage}
    timing = last["timing"]
    assert 0 <= timing["queue_time_s"] < timing["time_to_first_token_s"]
    assert timing["time_to_first_token_s"] <= timing["e2e_latency_s"] < 120
    assert all(r["usage"] is None and r["timing"] is None for r in responses[:-1])


def test_grpc_js_retries_a_refusal_after_its_pushback(node, capped_server):
    """A Python stream holds the address's one slot; the Node call is refused with the
    pushback, and the slot is given back only once the gateway has counted that refusal.
    A retry on the config's own backoff (0.2 s) would come sooner than the pushback."""
    with grpc.insecure_channel(capped_server.addr) as channel:
        holder = capped_server.generation_stub(channel).Generate(
            gen.GenerateRequest(prompt=PROMPT, max_tokens=512,
                                sampling={"temperature": 0.0, "ignore_eos": True}),
            timeout=120)
        next(holder)  # streaming: it holds the slot
        before = _refusals(capped_server)
        proc = _node_client(node, capped_server, GREEDY)
        deadline = time.monotonic() + 60
        while _refusals(capped_server) == before:
            assert proc.poll() is None and time.monotonic() < deadline, "no refusal counted"
            time.sleep(0.02)
        holder.cancel()  # the slot comes back well within the pushback
    responses, status = _finished(proc)
    assert status["status"] == "OK", status
    assert status["attempts"] == 2  # one refusal, then the retry that streamed
    assert status["first_message_ms"] >= PUSHBACK_MS
    assert "".join(r["text"] for r in responses)
    assert _refusals(capped_server) == before + 1


def test_the_refusal_grpc_js_sees_carries_the_pushback(node, capped_server):
    """With retries spent (the slot held throughout), the client gets the refusal itself:
    RESOURCE_EXHAUSTED, both trailers, every attempt refused."""
    with grpc.insecure_channel(capped_server.addr) as channel:
        holder = capped_server.generation_stub(channel).Generate(
            gen.GenerateRequest(prompt=PROMPT, max_tokens=1024,
                                sampling={"temperature": 0.0, "ignore_eos": True}),
            timeout=120)
        next(holder)
        _, status = _finished(_node_client(node, capped_server, GREEDY))
        holder.cancel()
    assert status["status"] == "RESOURCE_EXHAUSTED", status
    assert "--max-streams-per-client" in status["details"]
    trailers = status["trailers"]
    assert trailers[PUSHBACK_KEY] == trailers[RETRY_AFTER_KEY] == str(PUSHBACK_MS)
    assert status["attempts"] == 4  # the config's maxAttempts, each one pushed back
