"""Framing for the scheduler ⇄ executor channel.

Every ZeroMQ message is one frame holding a serialized ``SchedulerMessage`` or
``ExecutorMessage`` (protos/continuum/v1/executor.proto). The schema version
travels in each envelope; a peer speaking another version is refused with
``WireError`` rather than misread.
"""

from __future__ import annotations

from google.protobuf.message import DecodeError

from protos.continuum.v1 import executor_pb2 as pb

SCHEMA_VERSION = 1


class WireError(ValueError):
    """A frame that cannot be decoded or speaks another schema version."""


def encode_to_executor(kind: str, msg) -> bytes:
    """Wraps ``msg`` (a BatchPlan or Heartbeat) as field ``kind`` of a SchedulerMessage."""
    env = pb.SchedulerMessage(schema_version=SCHEMA_VERSION)
    getattr(env, kind).CopyFrom(msg)
    return env.SerializeToString()


def encode_to_scheduler(kind: str, msg) -> bytes:
    """Wraps ``msg`` (a Hello, StepResult or Heartbeat) as an ExecutorMessage."""
    env = pb.ExecutorMessage(schema_version=SCHEMA_VERSION)
    getattr(env, kind).CopyFrom(msg)
    return env.SerializeToString()


def _decode(env, frame: bytes):
    try:
        env.ParseFromString(frame)
    except DecodeError as exc:
        raise WireError(f"undecodable frame ({len(frame)} bytes): {exc}") from exc
    if env.schema_version != SCHEMA_VERSION:
        raise WireError(
            f"peer speaks schema version {env.schema_version}, this process speaks "
            f"{SCHEMA_VERSION}; run matching scheduler and executor versions"
        )
    kind = env.WhichOneof("kind")
    if kind is None:
        raise WireError("frame carries no message")
    return kind, getattr(env, kind)


def decode_from_scheduler(frame: bytes):
    """Returns ``(kind, message)`` for a frame the scheduler sent."""
    return _decode(pb.SchedulerMessage(), frame)


def decode_from_executor(frame: bytes):
    """Returns ``(kind, message)`` for a frame an executor sent."""
    return _decode(pb.ExecutorMessage(), frame)
