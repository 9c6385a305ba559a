"""``continuum generate`` under the contract's service config (protos/service_config.py):
gRPC's own retry policy tries a refused call again after the server's
``grpc-retry-pushback-ms``, not after its shorter backoff; a negative pushback (gRFC A6's
"do not retry") ends the call; and a stream that already produced a message is committed,
never retried. The server is a real grpc server in this process, scripted per attempt."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import pathlib
import re
import time

import grpc
import pytest

from continuum.cli import main
from protos import service_config
from protos.continuum.v1 import generation_pb2, generation_pb2_grpc, sampling_pb2
from protos.pushback import PUSHBACK_KEY, RETRY_AFTER_KEY

ROOT = pathlib.Path(__file__).resolve().parents[2]
PUSHBACK_MS = 500  # well past the config's first backoff (0.2 s, jittered by 20 %)


@dataclasses.dataclass(frozen=True)
class Refuse:
    code: grpc.StatusCode
    pushback: str
    after_a_message: bool = False


SERVE = "serve"


class Scripted(generation_pb2_grpc.GenerationServicer):
    """Answers attempt i as ``script[i]`` says (the last entry repeats); records when each
    attempt arrived and the attempt count gRPC's retry layer sent with it."""

    def __init__(self, script):
        self.script = script
        self.attempts: list[tuple[float, str | None]] = []

    def Generate(self, request, context):  # noqa: N802
        metadata = dict(context.invocation_metadata())
        self.attempts.append((time.monotonic(), metadata.get("grpc-previous-rpc-attempts")))
        step = self.script[min(len(self.attempts), len(self.script)) - 1]
        if step == SERVE:
            yield generation_pb2.GenerateResponse(text="hello")
            yield generation_pb2.GenerateResponse(text=" world",
                                                  finish_reason=sampling_pb2.FINISH_REASON_STOP)
            return
        if step.after_a_message:
            yield generation_pb2.GenerateResponse(text="hel")
        context.set_trailing_metadata(((PUSHBACK_KEY, step.pushback),
                                       (RETRY_AFTER_KEY, step.pushback)))
        context.abort(step.code, "refused by the script")


@pytest.fixture
def scripted():
    servers = []

    def start(*script) -> tuple[Scripted, str]:
        servicer = Scripted(script)
        server = grpc.server(concurrent.futures.ThreadPoolExecutor(4))
        generation_pb2_grpc.add_GenerationServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        servers.append(server)
        return servicer, f"127.0.0.1:{port}"

    yield start
    for server in servers:
        server.stop(None)


def _generate(addr: str) -> int:
    with pytest.raises(SystemExit) as done:
        main(["generate", "hi", "--addr", addr, "--timeout", "30"])
    return done.value.code


def test_the_config_retries_generate_on_both_refusals():
    [method] = json.loads(service_config.text())["methodConfig"]
    assert method["name"] == [{"service": "continuum.v1.Generation", "method": "Generate"}]
    policy = method["retryPolicy"]
    assert set(policy["retryableStatusCodes"]) == {"UNAVAILABLE", "RESOURCE_EXHAUSTED"}
    assert dict(service_config.channel_options())["grpc.enable_retries"] == 1


def test_a_server_that_keeps_refusing_sees_the_configs_attempts_and_no_more(scripted, capsys):
    [method] = json.loads(service_config.text())["methodConfig"]
    servicer, addr = scripted(Refuse(grpc.StatusCode.RESOURCE_EXHAUSTED, "50"))
    assert _generate(addr) == 1
    assert "RESOURCE_EXHAUSTED" in capsys.readouterr().err
    assert len(servicer.attempts) == method["retryPolicy"]["maxAttempts"] > 1
    assert [previous for _, previous in servicer.attempts] == [
        None, *map(str, range(1, len(servicer.attempts)))]  # gRPC's own retries, counted


@pytest.mark.parametrize("doc", ["docs/usage.md", "docs/grpc.md"])
def test_the_docs_show_the_config_in_force(doc):
    shown = re.findall(r"```json\n(.*?)```", (ROOT / doc).read_text(), re.S)
    assert json.loads(service_config.text()) in [json.loads(block) for block in shown]


@pytest.mark.parametrize("code", [grpc.StatusCode.RESOURCE_EXHAUSTED,
                                  grpc.StatusCode.UNAVAILABLE])
def test_a_refusal_is_retried_once_its_pushback_has_passed(scripted, capsys, code):
    servicer, addr = scripted(Refuse(code, str(PUSHBACK_MS)), SERVE)
    assert _generate(addr) == 0
    assert capsys.readouterr().out == "hello world\n"
    (first, _), (second, previous) = servicer.attempts
    assert second - first >= PUSHBACK_MS / 1000
    assert previous == "1"  # gRPC's retry layer, not the client's code, sent it again


def test_a_negative_pushback_is_not_retried(scripted, capsys):
    servicer, addr = scripted(Refuse(grpc.StatusCode.RESOURCE_EXHAUSTED, "-1"), SERVE)
    assert _generate(addr) == 1
    assert "RESOURCE_EXHAUSTED" in capsys.readouterr().err
    assert len(servicer.attempts) == 1


def test_a_stream_that_produced_tokens_is_not_retried(scripted, capsys):
    servicer, addr = scripted(Refuse(grpc.StatusCode.UNAVAILABLE, "100", after_a_message=True),
                              SERVE)
    assert _generate(addr) == 1
    assert capsys.readouterr().out.startswith("hel")  # printed, so never sent again
    assert len(servicer.attempts) == 1
