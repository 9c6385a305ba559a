"""SIGTERM under load: in-flight requests finish, new ones get UNAVAILABLE, every
process exits within the grace period, none is orphaned; and streams still running
when the grace period is over get a terminal error, not a cut connection.

Nothing here depends on the machine's speed: what must be in flight when SIGTERM
lands is held there by construction (one sequence runs at a time, behind a request
far longer than the test), and every wait is for a condition."""

from __future__ import annotations

import concurrent.futures
import json
import signal
import time
import urllib.error
import urllib.request

import grpc
import openai
import pytest

from protos.continuum.v1 import sampling_pb2
from protos.pushback import PUSHBACK_KEY
from tests.integration.conftest import processes_mentioning, start_server
from tests.integration.test_serve import chat, collect

pytestmark = pytest.mark.integration
# Longer than any test here lasts on any machine; such requests are cancelled or cut.
ENDLESS_TOKENS = 3000
KV_BYTES = str(256 << 20)


def _wait_for(condition, what: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _health(srv) -> tuple[int, str]:
    """The readiness probe's status code and its word ("serving", "draining", ...)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{srv.http_port}/health",
                                    timeout=5) as answer:
            return answer.status, json.loads(answer.read())["status"]
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())["status"]


def test_sigterm_drains_in_flight_work_and_refuses_new(tmp_path, model_dir):
    # The six wait behind the anchor for as long as this test holds it: no queue-time bound
    # (it would shed them on a slow machine; shedding has its own tests).
    srv = start_server(tmp_path, model_dir, "--kv-cache-bytes", KV_BYTES,
                       "--grace-period", "120", "--max-num-seqs", "1",
                       "--max-queue-time-standard-s", "0")
    with grpc.insecure_channel(srv.addr) as channel, \
            concurrent.futures.ThreadPoolExecutor(6) as pool:
        anchor = srv.generation_stub(channel).Generate(
            chat("Tell me a long story.", max_tokens=ENDLESS_TOKENS, ignore_eos=True),
            timeout=300)
        next(anchor)  # it runs: everything submitted from now on waits behind it
        futures = [pool.submit(collect, srv, chat(f"Describe color {i}.", max_tokens=12,
                                                  ignore_eos=True)) for i in range(6)]
        _wait_for(lambda: srv.stats().num_waiting == 6, "six queued requests")
        # Ready before the signal, so that the 503 awaited next is the drain's, not a
        # gateway that has not seen its scheduler healthy yet.
        assert _health(srv) == (200, "serving")
        signed_off = time.monotonic()
        srv.proc.send_signal(signal.SIGTERM)
        _wait_for(lambda: _health(srv) == (503, "draining"), "readiness to fail")
        with pytest.raises(grpc.RpcError) as refused:
            collect(srv, chat("Too late?", max_tokens=5))
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        # Worth retrying (elsewhere): a positive pushback, never A6's "do not retry"
        assert int(dict(refused.value.trailing_metadata())[PUSHBACK_KEY]) > 0
        # HTTP: still listening, but new work gets 503 with a reason.
        client = openai.OpenAI(base_url=srv.base_url, api_key="unused", max_retries=0)
        with pytest.raises(openai.InternalServerError) as http_refused:
            client.completions.create(model="", prompt="Too late?", max_tokens=5)
        assert http_refused.value.status_code == 503
        assert "shutting down" in http_refused.value.body["message"]
        assert srv.proc.poll() is None, "the server must wait for its in-flight work"
        anchor.cancel()  # lets the six queued requests run; the drain waits for them
        results = [f.result(timeout=300) for f in futures]
    for responses in results:
        assert responses[-1].finish_reason == sampling_pb2.FINISH_REASON_LENGTH
        assert responses[-1].usage.completion_tokens == 12
    assert srv.proc.wait(timeout=120) == 0
    assert time.monotonic() - signed_off < 120
    _wait_for(lambda: processes_mentioning(srv.ipc) == [], "no orphaned process", 10)


def test_drain_past_its_grace_period_ends_streams_with_an_error(tmp_path, model_dir):
    srv = start_server(tmp_path, model_dir, "--kv-cache-bytes", KV_BYTES, "--grace-period", "1")
    body = {"model": "", "prompt": "Once upon a time", "max_tokens": ENDLESS_TOKENS,
            "stream": True, "ignore_eos": True}
    request = urllib.request.Request(f"{srv.base_url}/completions",
                                     data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with grpc.insecure_channel(srv.addr) as channel, \
            urllib.request.urlopen(request, timeout=120) as sse:
        call = srv.generation_stub(channel).Generate(
            chat("Tell me a long story.", max_tokens=ENDLESS_TOKENS, ignore_eos=True),
            timeout=300)
        next(call)
        assert sse.readline().startswith(b"data: {")  # streaming
        srv.proc.send_signal(signal.SIGTERM)
        with pytest.raises(grpc.RpcError) as ended:
            for _ in call:
                pass
        rest = sse.read().decode()  # to the end of the response, not a cut connection
    events = [line[len("data: "):] for line in rest.split("\n") if line.startswith("data: ")]
    assert ended.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "shut" in ended.value.details()  # the gateway's or the scheduler's drain
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert "shut" in error["message"]
    assert srv.proc.wait(timeout=60) == 0
    _wait_for(lambda: processes_mentioning(srv.ipc) == [], "no orphaned process", 10)
