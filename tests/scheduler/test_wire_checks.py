"""protos/wire.py's checks of what an executor sends: impossible Hellos and StepResults
whose columns disagree are named, never applied."""

from __future__ import annotations

import pytest

from protos import seq_columns, wire
from protos.continuum.v1 import executor_pb2 as pb
from runtime import internal_auth
from tests.scheduler.fake_peer import SECRET, make_hello


def result(**fields) -> pb.StepResult:
    base = {"seq_ids": [1, 2], "token_ids": [5, 6]}
    return pb.StepResult(**{**base, **fields})


@pytest.mark.parametrize("fields, expect", [
    ({}, None),
    ({"logprobs": [-0.1, -0.2], "top_n": [1, 0], "top_token_ids": [3],
      "top_logprobs": [-0.5]}, None),
    ({"token_ids": [5]}, "token_ids"),
    ({"logprobs": [-0.1]}, "logprobs"),
    ({"logprobs": [-0.1, -0.2], "top_n": [1]}, "top_n"),
    ({"logprobs": [-0.1, -0.2], "top_n": [2, 0], "top_token_ids": [3]}, "top_n sums"),
    ({"top_token_ids": [3]}, "without top_n"),
    ({"token_ids": [5, 1000]}, "vocabulary"),
    ({"seq_ids": [1, 1]}, "twice"),
    ({"logprobs": [-0.1, -0.2], "top_n": [1, 0], "top_token_ids": [4000],
      "top_logprobs": [-0.5]}, "vocabulary"),
])
@pytest.mark.parametrize("read_first", [False, True], ids=["fields", "columns read first"])
def test_result_problem(fields, expect, read_first):
    # The loop reads the columns once and hands them in: the verdict is the same.
    message = result(**fields)
    columns = wire.result_columns(message) if read_first else None
    problem = wire.result_problem(message, vocab_size=1000, columns=columns)
    assert (problem is None) if expect is None else expect in problem


def packed(*seq_ids: int, **fields) -> pb.StepResult:
    """A result as the executor sends it: its seq ids packed."""
    return pb.StepResult(**{"packed_seq_ids": seq_columns.pack(seq_ids), "token_ids": [5, 6],
                            **fields})


@pytest.mark.parametrize("message, expected, expect", [
    (packed(1, 2), None, None),
    (packed(1, 2), seq_columns.pack([1, 2]), None),  # as planned: read for nothing else
    (packed(2, 1), seq_columns.pack([1, 2]), None),  # another order: checked, applied apart
    (packed(1, 1), None, "twice"),
    (packed(1, 1), seq_columns.pack([1, 2]), "twice"),
    (packed(1), None, "token_ids"),
    (packed(1, 2, seq_ids=[1, 2]), None, "both"),
    (pb.StepResult(packed_seq_ids=b"\x01" * 12, token_ids=[5]), None, "not 8"),
    (packed(1, 2, row_failures=[pb.RowFailure(seq_id=3)]), None, "did not sample"),
])
def test_a_packed_result_is_checked_as_a_plain_one(message, expected, expect):
    problem = wire.result_problem(message, 1000, wire.result_columns(message), expected)
    assert (problem is None) if expect is None else expect in problem
    if expect is None:
        assert wire.result_seq_ids(message) == seq_columns.unpack(message.packed_seq_ids)


@pytest.mark.parametrize("fields, expect", [
    ({}, None),
    ({"incarnation": ""}, "incarnation"),
    ({"block_size": 0}, "block_size"),
    ({"block_size": 1 << 20}, "block_size"),
    ({"num_device_blocks": 0}, "num_device_blocks"),
    ({"vocab_size": 0}, "vocab_size"),
    ({"max_model_len": 0}, "max_model_len"),
    ({"num_host_blocks": 1 << 30}, "num_host_blocks"),
    ({"eos_token_ids": [5000]}, "eos"),
    ({"schema_version": 9}, "schema"),
])
def test_hello_problem(fields, expect):
    problem = wire.hello_problem(make_hello(**fields))
    assert (problem is None) if expect is None else expect in problem


def test_the_hello_tag_covers_every_field_but_itself():
    hello = make_hello()
    payload = wire.hello_payload(hello)
    assert internal_auth.check_tag(SECRET, payload, hello.auth_tag)
    again = pb.Hello()
    again.ParseFromString(hello.SerializeToString())  # as the scheduler receives it
    assert wire.hello_payload(again) == payload
    again.model_id = "other"
    assert not internal_auth.check_tag(SECRET, wire.hello_payload(again), hello.auth_tag)
