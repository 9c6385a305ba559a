"""Row 3, continued: hypothesis fuzzing of both ends of the ZeroMQ channel.

Scheduler end: a rogue DEALER connects to a live server's ipc ROUTER and sends random
frames, multi-frame messages and well-framed ExecutorMessages with nonsense inside (a
Hello with impossible fields and no valid auth tag, StepResults whose columns disagree,
heartbeats naming other incarnations). Executor end: the harness binds a ROUTER, starts
a real executor against it (as tests/executor/test_process.py does), takes its Hello and
sends random frames and SchedulerMessages (plans with out-of-range blocks, unknown
sequences, wrong incarnations, plan-ring offers naming rings that do not exist or paths
outside /dev/shm, doorbells with no ring behind them); executors' heartbeats claim rings
the scheduler never offered. Property for both: the process stays alive and, at the
end, still does its job — the server answers a normal request with the same executor
incarnation (a rogue Hello must not have replaced the real executor), the executor
answers a well-formed plan.
"""

from __future__ import annotations

import contextlib
import pathlib
import subprocess
import time

import zmq
from google.protobuf.descriptor import FieldDescriptor
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from harness import servers
from harness.fuzz_common import PHASES, UINT32, UINT64, Tally, run_property
from protos import seq_columns, wire
from protos.continuum.v1 import executor_pb2 as pb
from protos.continuum.v1 import sampling_pb2

U32S = st.lists(UINT32, max_size=12)
U64S = st.lists(UINT64, max_size=12)
# Packed seq ids (protos/seq_columns.py): whole ones, or bytes with a ragged tail; either
# may come beside the plain column.
PACKED = U64S.map(seq_columns.pack) | st.binary(max_size=40)
# Shared-memory names a peer may name: ours, others', paths out of /dev/shm, nonsense.
RING_NAMES = st.sampled_from(["continuum-plan-1-00", "../etc/passwd", "/x", "", "a" * 300]) | \
    st.text(max_size=40)
FLOATS = st.lists(st.floats(width=32, allow_nan=True, allow_infinity=True), max_size=12)


F = FieldDescriptor
# A field ``_filled`` is not told how to draw is drawn by its type (a field added to the
# proto is fuzzed from the next run on); messages and oneof members are the caller's.
_BY_TYPE = {F.TYPE_UINT32: UINT32, F.TYPE_UINT64: UINT64,
            F.TYPE_INT32: st.integers(-2**31, 2**31 - 1),
            F.TYPE_INT64: st.integers(-2**63, 2**63 - 1), F.TYPE_BOOL: st.booleans(),
            F.TYPE_FLOAT: st.floats(width=32), F.TYPE_DOUBLE: st.floats(),
            F.TYPE_ENUM: st.integers(0, 9), F.TYPE_BYTES: st.binary(max_size=40),
            F.TYPE_STRING: st.text(max_size=20)}


def _strategies(msg, fields: dict) -> dict:
    drawn = dict(fields)
    for field in msg.DESCRIPTOR.fields:
        if field.name in drawn or field.message_type is not None or \
                field.containing_oneof is not None or field.type not in _BY_TYPE:
            continue
        one = _BY_TYPE[field.type]
        drawn[field.name] = st.lists(one, max_size=12) if field.is_repeated else one
    return drawn


def _filled(msg, draw, fields: dict) -> object:
    for name, strategy in _strategies(msg, fields).items():
        if draw(st.booleans()):
            value = draw(strategy)
            if isinstance(value, list):
                getattr(msg, name).extend(value)
            else:
                setattr(msg, name, value)
    return msg


@st.composite
def executor_messages(draw, incarnation: str = "") -> bytes:
    inc = st.sampled_from([incarnation, "", "x" * 40]) | st.text(max_size=20)
    kind = draw(st.sampled_from(["hello", "result", "heartbeat"]))
    env = pb.ExecutorMessage(schema_version=draw(st.sampled_from([wire.SCHEMA_VERSION, 0, 2])))
    if kind == "hello":
        _filled(env.hello, draw, {
            "incarnation": inc, "model_id": st.text(max_size=20), "block_size": UINT32,
            "num_device_blocks": UINT32, "num_host_blocks": UINT32, "tp_size": UINT32,
            "max_model_len": UINT32, "vocab_size": UINT32, "eos_token_ids": U32S,
            "prefill_tokens_per_s": st.floats(), "swap_bytes_per_s": st.floats(),
            "block_bytes": UINT64, "auth_tag": st.binary(max_size=40)})
        env.hello.schema_version = draw(st.sampled_from([wire.SCHEMA_VERSION, 7]))
    elif kind == "result":
        _filled(env.result, draw, {
            "incarnation": inc, "step_id": UINT64, "seq_ids": U64S, "token_ids": U32S,
            "logprobs": FLOATS, "top_n": U32S, "top_token_ids": U32S,
            "top_logprobs": FLOATS, "error_code": st.integers(0, 9),
            "forward_ms": st.floats(), "step_ms": st.floats(), "packed_seq_ids": PACKED})
    else:
        _filled(env.heartbeat, draw, {"incarnation": inc, "sent_at": st.floats(),
                                      "last_step_id": UINT64, "num_sequences": UINT32,
                                      "detached": st.booleans(),
                                      "plan_ring_name": RING_NAMES})  # "I read this ring"
    return env.SerializeToString()


@st.composite
def scheduler_messages(draw, incarnation: str = "") -> bytes:
    inc = st.sampled_from([incarnation, incarnation, ""]) | st.text(max_size=20)
    env = pb.SchedulerMessage(schema_version=draw(st.sampled_from([wire.SCHEMA_VERSION, 3])))
    kind = draw(st.sampled_from(["heartbeat", "ring_bell", "plan", "plan"]))
    if kind == "heartbeat":
        _filled(env.heartbeat, draw, {"incarnation": inc, "sent_at": st.floats(),
                                      "last_step_id": UINT64})
        if draw(st.booleans()):  # a plan ring offered: a name to attach, its key
            _filled(env.heartbeat.plan_ring, draw, {
                "name": RING_NAMES, "generation": UINT64, "key": st.binary(max_size=40)})
        return env.SerializeToString()
    if kind == "ring_bell":  # "a plan is in the ring": with no ring, or an empty one
        env.ring_bell.SetInParent()
        return env.SerializeToString()
    plan = env.plan
    _filled(plan, draw, {
        "incarnation": inc, "step_id": UINT64, "cached_seq_ids": U64S,
        "cached_num_scheduled_tokens": U32S, "cached_num_new_blocks": U32S,
        "cached_new_block_ids": U32S, "finished_seq_ids": U64S, "swap_out_src": U32S,
        "swap_out_dst": U32S, "swap_in_src": U32S, "swap_in_dst": U32S, "copy_src": U32S,
        "copy_dst": U32S,
        "packed_cached_seq_ids": PACKED})
    for _ in range(draw(st.integers(0, 3))):
        seq = plan.new_seqs.add()
        _filled(seq, draw, {"seq_id": UINT64, "token_ids": st.lists(st.integers(0, 2**32 - 1),
                                                                     max_size=20),
                            "num_computed_tokens": UINT32, "num_scheduled_tokens": UINT32,
                            "block_ids": U32S, "num_prompt_tokens": UINT32})
        seq.sampling.temperature = draw(st.sampled_from([0.0, 1.0, float("nan")]))
    return env.SerializeToString()


def frames(messages: st.SearchStrategy) -> st.SearchStrategy:
    """One message as zmq frames: a well-framed message, random bytes, or several frames."""
    one = messages | st.binary(max_size=300)
    return st.lists(one, min_size=1, max_size=1) | st.lists(one, min_size=2, max_size=4)


def _settings(examples: int):
    return settings(max_examples=examples, deadline=None, database=None, derandomize=True,
                    phases=PHASES, suppress_health_check=list(HealthCheck))


def fuzz_scheduler_end(serve: servers.Serve, tally: Tally, examples: int,
                       check_serving) -> None:
    """Rogue frames into a live scheduler's ROUTER; ``check_serving()`` afterwards."""
    target = "zmq -> scheduler"
    before = serve.stats().executor_incarnation
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(serve.ipc)
    pids = {r: serve.pid(r) for r in servers.ROLES}

    @_settings(examples)
    @given(parts=frames(executor_messages(before)))
    def prop(parts: list[bytes]) -> None:
        sock.send_multipart(parts)
        with contextlib.suppress(zmq.Again):
            while sock.poll(0):
                sock.recv_multipart(zmq.NOBLOCK)  # whatever the scheduler answers a rogue
        tally.add(target, f"{len(parts)} frame(s)")
        assert serve.proc.poll() is None and servers.children_by_role(serve.proc.pid) == pids, (
            f"a process died after frames {parts!r}")

    try:
        run_property(prop, target, tally)
        time.sleep(1.0)
        after = serve.stats().executor_incarnation
        if after != before:
            tally.failures.append({"target": target, "error": "the registered executor "
                                   f"changed ({before} -> {after}): a rogue Hello took over",
                                   "reproducer": ""})
        check_serving(target)
    finally:
        sock.close()
        ctx.term()


def fuzz_executor_end(tmp: pathlib.Path, tally: Tally, examples: int) -> None:
    """Random frames into a real executor from a harness ROUTER; it must live and serve."""
    target = "zmq -> executor"
    address = f"ipc://{tmp}/fuzz-executor.sock"
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.bind(address)
    servers.ensure_secret()
    proc = servers.spawn("executor_svc", [
        "--model", str(servers.model_dir()), "--ipc", address, "--device", "cpu",
        "--kv-cache-bytes", "8MiB", "--warmup-tokens", "16", "--threads", "1"],
        stderr=subprocess.DEVNULL)
    try:
        peer, hello = _first_hello(router)

        @_settings(examples)
        @given(parts=frames(scheduler_messages(hello.incarnation)))
        def prop(parts: list[bytes]) -> None:
            router.send_multipart([peer, *parts])
            time.sleep(0.01)
            while router.poll(0):
                router.recv_multipart()
            tally.add(target, f"{len(parts)} frame(s)")
            assert proc.poll() is None, f"the executor died after frames {parts!r}"

        run_property(prop, target, tally)
        if proc.poll() is None and not _serves_a_plan(router, peer, hello.incarnation):
            tally.failures.append({"target": target, "reproducer": "",
                                   "error": "the executor no longer answers a valid plan"})
        elif proc.poll() is not None:
            tally.failures.append({"target": target, "reproducer": "",
                                   "error": f"the executor exited with {proc.returncode}"})
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        router.close()
        ctx.term()


def _first_hello(router) -> tuple[bytes, pb.Hello]:
    deadline = time.monotonic() + servers.READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if router.poll(1000):
            parts = router.recv_multipart()
            kind, msg = wire.decode_from_executor(parts[-1])
            if kind == "hello":
                return parts[0], msg
    raise servers.ServerError("the executor sent no Hello")


def _serves_a_plan(router, peer: bytes, incarnation: str) -> bool:
    """A fresh sequence in a well-formed plan gets its token (the executor may first
    re-introduce itself: a plan after a Hello is then sent again)."""
    for attempt in range(3):
        plan = pb.BatchPlan(incarnation=incarnation, step_id=10**9 + attempt)
        plan.new_seqs.add(seq_id=10**9 + attempt, token_ids=[1, 9690, 198, 2683],
                          num_scheduled_tokens=4, block_ids=[0], num_prompt_tokens=4,
                          sampling=sampling_pb2.SamplingParams(temperature=0.0))
        router.send_multipart([peer, wire.encode_to_executor("plan", plan)])
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if not router.poll(1000):
                continue
            kind, msg = wire.decode_from_executor(router.recv_multipart()[-1])
            if kind == "result" and msg.step_id == plan.step_id:
                return msg.error_code == 0 and len(msg.token_ids) == 1
            if kind == "hello":
                incarnation = msg.incarnation
                break
    return False
