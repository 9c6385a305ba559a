"""The real stack: `continuum serve` (gateway → scheduler → executor) on loopback."""

from __future__ import annotations

import concurrent.futures
import json
import subprocess
import sys
import time

import grpc
import pytest

from protos.continuum.v1 import generation_pb2 as gen
from protos.continuum.v1 import sampling_pb2

pytestmark = pytest.mark.integration


def chat(question: str, max_tokens: int = 48, **sampling) -> gen.GenerateRequest:
    req = gen.GenerateRequest(max_tokens=max_tokens)
    req.chat.messages.add(role="user", content=question)
    req.sampling.temperature = sampling.pop("temperature", 0.0)
    for key, value in sampling.items():
        setattr(req.sampling, key, value)
    return req


def collect(server, request: gen.GenerateRequest) -> list[gen.GenerateResponse]:
    with grpc.insecure_channel(server.addr) as ch:
        return list(server.generation_stub(ch).Generate(request, timeout=300))


def wait_until_idle(server, timeout_s: float = 10.0):
    deadline = time.monotonic() + timeout_s
    while True:
        stats = server.stats()
        idle = stats.num_running == 0 and stats.num_waiting == 0
        if idle or time.monotonic() > deadline:
            return stats
        time.sleep(0.1)


def test_capital_of_france_streams_paris_with_usage(server):
    responses = collect(server, chat("What is the capital of France?"))
    text = "".join(r.text for r in responses)
    assert "Paris" in text
    assert len(responses) > 2, "the answer must arrive in several stream messages"
    last = responses[-1]
    assert last.finish_reason == sampling_pb2.FINISH_REASON_STOP
    ids = [t for r in responses for t in r.token_ids]
    assert last.usage.completion_tokens == len(ids)
    assert last.usage.prompt_tokens > 10  # the chat template's system prompt is in it
    assert last.usage.total_tokens == last.usage.prompt_tokens + last.usage.completion_tokens
    assert all(r.finish_reason == sampling_pb2.FINISH_REASON_UNSPECIFIED for r in responses[:-1])


def test_eight_concurrent_requests_complete_and_free_every_block(server):
    questions = [f"Count from {i} to {i + 5}." for i in range(8)]
    lengths = [8 + 3 * i for i in range(8)]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        futures = [
            pool.submit(collect, server, chat(q, max_tokens=n, ignore_eos=True))
            for q, n in zip(questions, lengths, strict=True)
        ]
        results = [f.result() for f in futures]
    for responses, n in zip(results, lengths, strict=True):
        usage = responses[-1].usage
        assert usage.completion_tokens == n == sum(len(r.token_ids) for r in responses)
        assert responses[-1].finish_reason == sampling_pb2.FINISH_REASON_LENGTH
    stats = wait_until_idle(server)
    assert stats.num_total_blocks > 0
    assert stats.num_free_blocks == stats.num_total_blocks
    # The real executor answers in plan order, so every answer took the columnar path.
    assert stats.num_columnar_updates > 0 and stats.num_update_fallbacks == 0


def test_every_process_freezes_its_start_up_heap_and_the_scheduler_paces_collection(server):
    """Each process froze what start-up allocated once ready (runtime/gc_freeze.py), and
    the scheduler took collection off its step path (scheduler_svc/gc_pacing.py): their
    start-up lines say how much each froze; the executor's holds the model."""
    frozen = {}
    for event in _log_lines(server):
        if event["event"] in ("scheduler listening", "gateway serving"):
            frozen[event["event"].split()[0]] = event["gc_frozen_objects"]
        elif event["event"].startswith("start-up heap frozen:"):
            frozen["executor"] = int(event["event"].split("start-up heap frozen:")[1].split()[0])
    assert frozen.keys() == {"scheduler", "gateway", "executor"}, frozen
    assert min(frozen.values()) > 1000 and frozen["executor"] > 100_000, frozen


def _log_lines(server) -> list[dict]:
    """The JSON lines the processes wrote (serve's own lines are plain text)."""
    return [json.loads(line) for line in server.log if line.startswith("{")]


def test_every_process_logs_one_json_format(server):
    """Gateway, scheduler and executor write the same JSON lines (runtime/log_setup.py):
    an event, a level, a UTC timestamp and the process's name, whichever logger (structlog
    or the standard library's) wrote it."""
    seen = {}
    for event in _log_lines(server):
        assert {"event", "level", "timestamp", "process"} <= event.keys(), event
        assert event["timestamp"].endswith("Z"), event  # UTC
        seen.setdefault(event["process"], event)
    assert {"gateway", "scheduler", "executor"} <= seen.keys(), seen.keys()
    assert "logger" in seen["executor"]  # a standard-library logger, bridged


def test_client_cancel_aborts_upstream_and_frees_blocks(server):
    with grpc.insecure_channel(server.addr) as ch:
        call = server.generation_stub(ch).Generate(
            chat("Write a long story about a dragon.", max_tokens=400, ignore_eos=True),
            timeout=300)
        first = next(call)
        assert first.token_ids
        assert server.stats().num_running == 1
        call.cancel()
    stats = wait_until_idle(server)
    assert stats.num_running == 0
    assert stats.num_free_blocks == stats.num_total_blocks


def test_generate_cli_streams_the_answer(server):
    out = subprocess.run(
        [sys.executable, "-m", "continuum", "generate", "What is the capital of France?",
         "--addr", server.addr],
        capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stderr
    assert "Paris" in out.stdout
