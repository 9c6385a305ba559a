"""TLS and mutual TLS on the gateway's ports and on its channels to the scheduler
(runtime/tls.py), with a throwaway CA from trustme, the official openai client and grpc
stubs: what is served, what is refused, and a certificate replaced under a running
gateway."""

from __future__ import annotations

import contextlib
import pathlib
import ssl
import subprocess
import sys

import grpc
import httpx2
import openai
import pytest

from gateway.config import ConfigError, GatewayConfig
from protos.continuum.v1 import (
    generation_pb2,
    generation_pb2_grpc,
    sampling_pb2,
    scheduler_pb2,
    scheduler_pb2_grpc,
)
from runtime import tls
from tests.pki import Pki, make_pki

from .harness import FakeScheduler, collect, fake_scheduler, free_port, gateway, run


@pytest.fixture
def pki(tmp_path) -> Pki:
    return make_pki(tmp_path)


def _events():
    return [scheduler_pb2.TokenEvent(token_ids=[42],
                                     finish_reason=sampling_pb2.FINISH_REASON_LENGTH)]


def _tls_config(pki: Pki, mutual: bool = False) -> dict:
    return {"tls_cert_file": pki.cert_file, "tls_key_file": pki.key_file,
            "tls_client_ca_file": pki.ca_file if mutual else None, "http_port": 0}


def _openai(port: int, ca_file: pathlib.Path, cert: tuple | None = None) -> openai.AsyncOpenAI:
    context = ssl.create_default_context(cafile=ca_file)
    if cert is not None:
        context.load_cert_chain(*cert)
    client = httpx2.AsyncClient(verify=context)
    return openai.AsyncOpenAI(base_url=f"https://localhost:{port}/v1", api_key="unused",
                              max_retries=0, timeout=10, http_client=client)


async def _complete(port: int, ca_file: pathlib.Path, cert: tuple | None = None) -> str:
    async with _openai(port, ca_file, cert) as client:
        answer = await client.completions.create(model="", prompt="hi", max_tokens=1)
    return answer.choices[0].finish_reason


async def _generate(port: int, credentials: grpc.ChannelCredentials | None):
    """The Generate stream's responses, or the grpc status code it failed with."""
    target = f"localhost:{port}"
    async with (grpc.aio.insecure_channel(target) if credentials is None
                else grpc.aio.secure_channel(target, credentials)) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        try:
            return await collect(stub.Generate(generation_pb2.GenerateRequest(prompt="hi"),
                                               timeout=5))
        except grpc.aio.AioRpcError as exc:
            return exc.code()


def _roots(pki: Pki, client: bool = False) -> grpc.ChannelCredentials:
    if client:
        return tls.channel_credentials(pki.ca_file, pki.client_cert_file, pki.client_key_file)
    return grpc.ssl_channel_credentials(root_certificates=pki.ca_file.read_bytes())


def test_tls_serves_both_ports_and_plaintext_is_refused(tokenizer, pki):
    async def scenario():
        async with fake_scheduler(FakeScheduler(events=_events())) as address, \
                gateway(tokenizer, address, **_tls_config(pki)) as (running, _):
            assert await _complete(running.http_port, pki.ca_file) == "length"
            responses = await _generate(running.port, _roots(pki))
            assert responses[-1].finish_reason == sampling_pb2.FINISH_REASON_LENGTH
            assert await _generate(running.port, None) == grpc.StatusCode.UNAVAILABLE
            async with httpx2.AsyncClient() as plain:
                with pytest.raises(httpx2.HTTPError):
                    await plain.get(f"http://127.0.0.1:{running.http_port}/v1/models")

    run(scenario())


def test_mutual_tls_refuses_a_client_without_a_certificate_signed_by_the_ca(
        tokenizer, pki, tmp_path):
    rogue = make_pki(tmp_path, "rogue")  # a certificate, but from another CA

    async def scenario():
        async with fake_scheduler(FakeScheduler(events=_events())) as address, \
                gateway(tokenizer, address, **_tls_config(pki, mutual=True)) as (running, _):
            port = running.http_port
            client = (pki.client_cert_file, pki.client_key_file)
            assert await _complete(port, pki.ca_file, client) == "length"
            for refused in (None, (rogue.client_cert_file, rogue.client_key_file)):
                with pytest.raises(openai.APIConnectionError):
                    await _complete(port, pki.ca_file, refused)
            responses = await _generate(running.port, _roots(pki, client=True))
            assert responses[-1].finish_reason == sampling_pb2.FINISH_REASON_LENGTH
            assert await _generate(running.port, _roots(pki)) == grpc.StatusCode.UNAVAILABLE
            rogue_client = tls.channel_credentials(pki.ca_file, rogue.client_cert_file,
                                                   rogue.client_key_file)
            assert await _generate(running.port, rogue_client) == grpc.StatusCode.UNAVAILABLE

    run(scenario())


def test_a_replaced_certificate_serves_the_next_connection_on_both_ports(
        tokenizer, pki, tmp_path):
    renewed = make_pki(tmp_path, "renewed")

    async def scenario():
        async with fake_scheduler(FakeScheduler(events=_events())) as address, \
                gateway(tokenizer, address, **_tls_config(pki)) as (running, _):
            assert await _complete(running.http_port, pki.ca_file) == "length"
            assert isinstance(await _generate(running.port, _roots(pki)), list)
            pki.cert_file.write_bytes(renewed.cert_file.read_bytes())
            pki.key_file.write_bytes(renewed.key_file.read_bytes())
            assert await _complete(running.http_port, renewed.ca_file) == "length"
            assert isinstance(await _generate(running.port, _roots(renewed)), list)
            with pytest.raises(openai.APIConnectionError):  # the old CA no longer fits
                await _complete(running.http_port, pki.ca_file)
            assert await _generate(running.port, _roots(pki)) == grpc.StatusCode.UNAVAILABLE

    run(scenario())


def test_a_half_replaced_pair_keeps_the_old_certificate(tokenizer, pki, tmp_path):
    renewed = make_pki(tmp_path, "renewed")

    async def scenario():
        async with fake_scheduler(FakeScheduler(events=_events())) as address, \
                gateway(tokenizer, address, **_tls_config(pki)) as (running, _):
            pki.cert_file.write_bytes(renewed.cert_file.read_bytes())  # its key not yet
            assert await _complete(running.http_port, pki.ca_file) == "length"
            assert isinstance(await _generate(running.port, _roots(pki)), list)

    run(scenario())


@contextlib.asynccontextmanager
async def _tls_scheduler(scheduler: FakeScheduler, server_tls: tls.ServerTls):
    server = grpc.aio.server()
    scheduler_pb2_grpc.add_SchedulerServicer_to_server(scheduler, server)
    port = tls.add_port(server, "127.0.0.1:0", server_tls)
    await server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await server.stop(0)


def test_the_gateway_reaches_a_scheduler_that_requires_mutual_tls(tokenizer, pki):
    scheduler = FakeScheduler(events=_events())
    server_tls = tls.ServerTls(pki.cert_file, pki.key_file, pki.ca_file)

    async def scenario():
        async with _tls_scheduler(scheduler, server_tls) as address:
            upstream = {"scheduler_tls_ca_file": pki.ca_file,
                        "scheduler_tls_server_name": "localhost"}
            client = {"scheduler_tls_client_cert_file": pki.client_cert_file,
                      "scheduler_tls_client_key_file": pki.client_key_file}
            async with gateway(tokenizer, address, **upstream, **client) as (running, _):
                responses = await _generate(running.port, None)
                assert responses[-1].finish_reason == sampling_pb2.FINISH_REASON_LENGTH
            async with gateway(tokenizer, address, **upstream) as (running, _):
                assert await _generate(running.port, None) == grpc.StatusCode.UNAVAILABLE
        assert len(scheduler.submitted) == 1

    run(scenario())


@pytest.mark.parametrize("fields, message", [
    ({"tls_cert_file": "c.pem"}, "--tls-cert-file needs --tls-key-file"),
    ({"tls_key_file": "k.pem"}, "--tls-key-file needs --tls-cert-file"),
    ({"tls_client_ca_file": "ca.pem"}, "mutual TLS is TLS first"),
    ({"scheduler_tls_server_name": "x"}, "need --scheduler-tls-ca-file"),
    ({"scheduler_tls_ca_file": "ca.pem", "scheduler_tls_client_cert_file": "c.pem"},
     "go together"),
])
def test_flags_that_do_not_pair_are_refused(fields, message):
    with pytest.raises(ConfigError, match=message):
        GatewayConfig(model_dir=pathlib.Path("unused"), scheduler_address="127.0.0.1:1",
                      **{k: pathlib.Path(v) if k.endswith("file") else v
                         for k, v in fields.items()})


@pytest.mark.spawns  # starts a service process (tests/tiers.py)
def test_files_that_cannot_be_used_fail_at_startup_in_one_line(model_dir, pki, tmp_path):
    other = make_pki(tmp_path, "other")
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate\n")
    cases = [(tmp_path / "missing.pem", pki.key_file, "cannot read"),
             (garbage, pki.key_file, "cannot be used together"),
             (pki.cert_file, other.key_file, "cannot be used together")]
    for cert, key, message in cases:
        done = subprocess.run(
            [sys.executable, "-m", "gateway", "--model-dir", str(model_dir), "--scheduler",
             f"127.0.0.1:{free_port()}", "--port", "0", "--http-port", "0",
             "--ssl-certfile", str(cert), "--ssl-keyfile", str(key)],
            capture_output=True, text=True, timeout=60)
        assert done.returncode == 2, done.stderr
        assert done.stderr.startswith("gateway: ") and message in done.stderr
        assert done.stderr.count("\n") == 1, done.stderr
