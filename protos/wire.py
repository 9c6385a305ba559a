"""Framing for the scheduler ⇄ executor channel.

Every ZeroMQ message is one frame holding a serialized ``SchedulerMessage`` or
``ExecutorMessage`` (protos/continuum/v1/executor.proto). The schema version
travels in each envelope; a peer speaking another version is refused with
``WireError`` rather than misread.
"""

from __future__ import annotations

from google.protobuf.message import DecodeError

from protos import seq_columns
from protos.continuum.v1 import executor_pb2 as pb

# 2: a StepResult's ids and a BatchPlan's cached ids may come packed (packed_seq_ids,
# packed_cached_seq_ids); a peer of version 1 would read them as empty.
SCHEMA_VERSION = 2


class WireError(ValueError):
    """A frame that cannot be decoded or speaks another schema version."""


def encode_to_executor(kind: str, msg) -> bytes:
    """Wraps ``msg`` (a BatchPlan or Heartbeat) as field ``kind`` of a SchedulerMessage."""
    env = pb.SchedulerMessage(schema_version=SCHEMA_VERSION)
    getattr(env, kind).CopyFrom(msg)
    return env.SerializeToString()


# The doorbell for a plan written into the shared-memory ring (runtime/plan_ring.py): one
# fixed frame, so the executor knows it without decoding it.
RING_BELL = encode_to_executor("ring_bell", pb.RingBell())


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


# Bounds a Hello must respect to be believed: a peer announcing more is broken or
# hostile (the scheduler sizes its block bookkeeping, ~40 bytes a block, and its checks
# by these numbers). 2^23 blocks is over 40× what SmolLM2-135M with 16-token blocks
# gets on a 141 GB GPU.
MAX_BLOCK_SIZE = 4096
MAX_DEVICE_BLOCKS = 1 << 23
MAX_VOCAB_SIZE = 1 << 24
MAX_MODEL_LEN = 1 << 24


def hello_payload(hello: pb.Hello) -> bytes:
    """What the Hello's ``auth_tag`` signs: the Hello serialized deterministically with
    the tag empty (both sides compute it the same way)."""
    unsigned = pb.Hello()
    unsigned.CopyFrom(hello)
    unsigned.ClearField("auth_tag")
    return unsigned.SerializeToString(deterministic=True)


def hello_problem(hello: pb.Hello) -> str | None:
    """Why a Hello cannot describe a real executor, or None."""
    if hello.schema_version != SCHEMA_VERSION:
        return f"schema version {hello.schema_version}, expected {SCHEMA_VERSION}"
    if not hello.incarnation:
        return "empty incarnation"
    for name, limit in (("block_size", MAX_BLOCK_SIZE), ("num_device_blocks", MAX_DEVICE_BLOCKS),
                        ("vocab_size", MAX_VOCAB_SIZE), ("max_model_len", MAX_MODEL_LEN)):
        value = getattr(hello, name)
        if not 1 <= value <= limit:
            return f"{name} {value} is outside [1, {limit}]"
    if hello.num_host_blocks > MAX_DEVICE_BLOCKS:
        return f"num_host_blocks {hello.num_host_blocks} exceeds {MAX_DEVICE_BLOCKS}"
    if any(t >= hello.vocab_size for t in hello.eos_token_ids):
        return "an eos token id is outside the vocabulary"
    return None


def plan_cached_seq_ids(plan: pb.BatchPlan) -> list[int]:
    """A plan's cached seq ids, from whichever field holds them (check the packed one's
    length first: executor_svc/plan_check.py)."""
    packed = plan.packed_cached_seq_ids
    return seq_columns.unpack(packed) if packed else list(plan.cached_seq_ids)


def result_columns(result: pb.StepResult) -> tuple[bytes | list[int], list[int]]:
    """A StepResult's seq ids, its ``packed_seq_ids`` as they came (protos/seq_columns.py)
    or else ``seq_ids`` as a list, and its tokens as a list. Read them once: each read of
    a repeated field builds its ints again (a 256-row column costs as much to read as the
    list it gives costs to check)."""
    packed = result.packed_seq_ids
    return (packed if packed else result.seq_ids[:]), result.token_ids[:]


def seq_id_list(seq_ids: bytes | list[int]) -> list[int]:
    """``result_columns``' seq ids as a list."""
    return seq_columns.unpack(seq_ids) if seq_ids.__class__ is bytes else seq_ids


def result_seq_ids(result: pb.StepResult) -> list[int]:
    """The ids of the sequences that sampled, from whichever field holds them."""
    return seq_id_list(result_columns(result)[0])


def result_problem(result: pb.StepResult, vocab_size: int,
                   columns: tuple[bytes | list[int], list[int]] | None = None,
                   expected: bytes | None = None) -> str | None:
    """Why a StepResult's columns cannot be applied (lengths that disagree, a sequence
    twice, token ids outside the vocabulary), or None. Unknown seq ids are the
    scheduler's to ignore (a sequence aborted while the step ran). ``columns``: its
    ``result_columns``, when the caller has read them already; ``expected``: the packed
    ids the scheduler planned to sample (Scheduler.expected_samplers), which name each
    sequence once, so packed ids equal to them are not read for duplicates."""
    seq_ids, token_ids = columns if columns is not None else result_columns(result)
    if seq_ids.__class__ is bytes:
        if result.seq_ids:
            return "both seq_ids and packed_seq_ids are set"
        if len(seq_ids) % seq_columns.ID_BYTES:
            return (f"packed_seq_ids holds {len(seq_ids)} bytes, not "
                    f"{seq_columns.ID_BYTES} a sequence")
        n = len(seq_ids) // seq_columns.ID_BYTES
    else:
        n = len(seq_ids)
    if len(token_ids) != n:
        return f"{n} seq_ids but {len(token_ids)} token_ids"
    if result.logprobs and len(result.logprobs) != n:
        return f"{n} seq_ids but {len(result.logprobs)} logprobs"
    if result.top_n:
        if len(result.top_n) != n or not result.logprobs:
            return f"{n} seq_ids but {len(result.top_n)} top_n counts"
        total = sum(result.top_n)
        if len(result.top_token_ids) != total or len(result.top_logprobs) != total:
            return (f"top_n sums to {total} but {len(result.top_token_ids)} top ids and "
                    f"{len(result.top_logprobs)} top logprobs came")
    elif result.top_token_ids or result.top_logprobs:
        return "top alternatives without top_n"
    if seq_ids != expected and len(set(seq_id_list(seq_ids))) != n:
        return "a seq id appears twice"  # one sample per sequence and step
    if n and max(token_ids) >= vocab_size:
        return f"token id {max(token_ids)} is outside the vocabulary ({vocab_size})"
    if result.top_token_ids and max(result.top_token_ids) >= vocab_size:
        return "a top token id is outside the vocabulary"
    if result.row_failures:
        failed = [f.seq_id for f in result.row_failures]
        if len(set(failed)) != len(failed) or not set(failed) <= set(seq_id_list(seq_ids)):
            return "a row failure names a sequence twice or one that did not sample"
    return None
