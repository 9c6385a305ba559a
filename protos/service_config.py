"""The gRPC service config for clients of ``continuum.v1.Generation``, and the channel
options that apply it.

The config is ``protos/continuum/v1/service_config.json`` (docs/grpc.md explains each
value): ``Generate`` retried on UNAVAILABLE and RESOURCE_EXHAUSTED, at most four attempts,
waiting the server's ``grpc-retry-pushback-ms`` where it sent one (protos/pushback.py) and
an exponential backoff otherwise, under a per-channel retry budget; a 600 s deadline for a
call that sets none. gRPC retries a call only until its response headers or a first
message arrived: a stream that already produced tokens is never retried by it. The JSON
file is the one every language reads; this module hands it to a Python channel.
"""

from __future__ import annotations

import json
import pathlib

PATH = pathlib.Path(__file__).resolve().parent / "continuum" / "v1" / "service_config.json"


def text() -> str:
    """The service config as JSON text (checked to parse)."""
    raw = PATH.read_text(encoding="utf-8")
    json.loads(raw)
    return raw


def channel_options() -> tuple[tuple[str, str | int], ...]:
    """Options for ``grpc.insecure_channel`` / ``grpc.secure_channel`` (and their aio
    twins) that turn retries on with this config as the channel's default."""
    return (("grpc.enable_retries", 1), ("grpc.service_config", text()))
