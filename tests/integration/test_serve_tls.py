"""`continuum serve` with mutual TLS on every port: the client-facing gRPC and HTTP
ports and the internal scheduler port (its gateway and the supervisor present client
certificates); the official openai client gets a real completion."""

from __future__ import annotations

import ssl
import subprocess
import sys

import grpc
import httpx2
import openai
import pytest

from protos.continuum.v1 import generation_pb2
from runtime import tls
from tests.integration.conftest import start_server
from tests.pki import make_pki

pytestmark = pytest.mark.integration


def test_serve_with_mutual_tls_on_every_port(tmp_path, model_dir):
    pki = make_pki(tmp_path)
    files = {"cert-file": pki.cert_file, "key-file": pki.key_file,
             "client-ca-file": pki.ca_file}
    flags = [item for name, path in files.items()
             for item in (f"--tls-{name}", str(path), f"--scheduler-tls-{name}", str(path))]
    flags += ["--scheduler-tls-ca-file", str(pki.ca_file),
              "--scheduler-tls-client-cert-file", str(pki.client_cert_file),
              "--scheduler-tls-client-key-file", str(pki.client_key_file)]
    server = start_server(tmp_path, model_dir, "--kv-cache-bytes", str(96 << 20), *flags)
    try:
        context = ssl.create_default_context(cafile=pki.ca_file)
        context.load_cert_chain(*pki.client)
        client = openai.OpenAI(base_url=f"https://localhost:{server.http_port}/v1",
                               api_key="unused", max_retries=0, timeout=120,
                               http_client=httpx2.Client(verify=context))
        answer = client.completions.create(model="", prompt="The capital of France is",
                                           max_tokens=4, temperature=0)
        assert answer.choices[0].text and answer.usage.completion_tokens == 4

        credentials = tls.channel_credentials(pki.ca_file, *pki.client)
        with grpc.secure_channel(f"localhost:{server.port}", credentials) as channel:
            responses = list(server.generation_stub(channel).Generate(
                generation_pb2.GenerateRequest(prompt="Hello", max_tokens=2), timeout=60))
            assert responses[-1].finish_reason
        with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            with pytest.raises(grpc.RpcError) as refused:
                list(server.generation_stub(channel).Generate(
                    generation_pb2.GenerateRequest(prompt="Hello", max_tokens=2), timeout=10))
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        assert server.stop() == 0, "".join(server.log[-30:])


def test_tls_flags_that_do_not_fit_stop_serve_and_the_scheduler_at_once(tmp_path):
    pki = make_pki(tmp_path)
    done = subprocess.run(
        [sys.executable, "-m", "continuum", "serve", "--scheduler-tls-cert-file",
         str(pki.cert_file), "--scheduler-tls-key-file", str(pki.key_file)],
        capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "--scheduler-tls-ca-file" in done.stderr, done.stderr
    done = subprocess.run(
        [sys.executable, "-m", "scheduler_svc", "--ipc", f"ipc://{tmp_path}/e.sock",
         "--scheduler-port", "0", "--scheduler-tls-cert-file", str(pki.cert_file),
         "--scheduler-tls-key-file", str(tmp_path / "missing.pem")],
        capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert done.stderr.splitlines()[-1].startswith("scheduler: cannot read the TLS")
