"""The schema fuzzer's strategies reach every field (no server needed): each field of
``GenerateRequest`` (nested ones too) and each key of every endpoint's schema is drawn,
the numbers include their widths' edges and unknown enum numbers, lone surrogates reach
the gRPC wire, and no valid input asks for a long generation."""

from __future__ import annotations

import json

import pytest
from google.protobuf.message import DecodeError
from hypothesis import HealthCheck, find, given, settings
from hypothesis import strategies as st

from gateway.api import openai_schema
from harness import body_strategies as bodies
from harness import proto_strategies as protos
from protos import sampling_checks
from protos.continuum.v1 import generation_pb2 as gen
from protos.continuum.v1 import sampling_pb2

SETTINGS = settings(max_examples=400, deadline=None, database=None, derandomize=True,
                    suppress_health_check=list(HealthCheck))
PATHS = protos.field_paths(gen.GenerateRequest.DESCRIPTOR)


def _name(path) -> str:
    return ".".join(f.name for f in path)


def _set_paths(msg, above: str = "") -> set[str]:
    """Every field path set in ``msg`` (the first element of repeated messages)."""
    found = set()
    for field, value in msg.ListFields():
        name = above + field.name
        found.add(name)
        if field.message_type is not None and not field.message_type.GetOptions().map_entry:
            for child in (value if field.is_repeated else [value]):
                found |= _set_paths(child, name + ".")
    return found


def test_the_walk_finds_every_field_of_every_nested_message():
    names = {_name(p) for p in PATHS}
    assert {"prompt", "chat.messages.tool_calls.arguments", "chat.tools.parameters",
            "sampling.logit_bias", "sampling.guided.lark", "sampling.typical_p",
            "token_ids.ids", "priority"} <= names
    for message in (sampling_pb2.SamplingParams, sampling_pb2.Guided, gen.ToolCall):
        for field in message.DESCRIPTOR.fields:
            assert any(p[-1] is field for p in PATHS), field.full_name


def test_every_field_path_is_drawn():
    seen: set[str] = set()

    @SETTINGS
    @given(req=protos.generate_requests())
    def draw(req):
        seen.update(_set_paths(req))

    draw()
    assert {_name(p) for p in PATHS} - seen == set()


@settings(SETTINGS, max_examples=60)
@given(data=st.data())
def test_each_path_can_be_set_to_any_drawn_value(data):
    path = data.draw(st.sampled_from(PATHS))
    req = gen.GenerateRequest(prompt="Hi")
    protos.set_path(req, path, data.draw(protos.field_values(path[-1], len(path) - 1)))
    protos.wire_bytes(req)  # every drawn value serializes


def test_numbers_reach_the_edges_of_their_width_and_unknown_enum_numbers():
    sampling = sampling_pb2.SamplingParams.DESCRIPTOR.fields_by_name
    fields = gen.GenerateRequest.DESCRIPTOR.fields_by_name
    assert find(protos.scalars(sampling["seed"]), lambda v: v == 2**64 - 1) == 2**64 - 1
    assert find(protos.scalars(fields["n"]), lambda v: v == 2**32 - 1) == 2**32 - 1
    known = {v.number for v in gen.Priority.DESCRIPTOR.values}
    assert find(protos.scalars(fields["priority"]), lambda v: v not in known) not in known
    temperature = protos.scalars(sampling["temperature"])
    assert find(temperature, lambda v: v != v)  # NaN


def test_the_mark_goes_on_the_wire_as_a_lone_surrogate():
    req = gen.GenerateRequest(prompt=protos.SURROGATE_MARK + "Hi")
    data = protos.wire_bytes(req)
    assert protos.SURROGATE_BYTES in data
    with pytest.raises(DecodeError):  # what the gateway must refuse, as INVALID_ARGUMENT
        gen.GenerateRequest.FromString(data)


@SETTINGS
@given(req=protos.generate_requests())
def test_no_drawn_request_asks_for_a_long_generation(req):
    assert 0 < req.max_tokens <= protos.SHORT or req.max_tokens >= protos.PAST_CONTEXT


def test_every_key_of_every_endpoint_is_swept():
    for path, fields in openai_schema.ENDPOINTS.items():
        assert set(fields) <= set(bodies.field_names(path)), path
    # every sampling number, typical_p included, with its range from protos/sampling_checks.py
    for bound in sampling_checks.NUMBERS:
        for path in ("/v1/completions", "/v1/chat/completions"):
            assert bound.name in bodies.field_names(path), (path, bound.name)
        shape = openai_schema.COMMON[bound.name]
        assert shape.high == bound.high and shape.kind == ("integer" if bound.integer
                                                           else "number")


@settings(SETTINGS, max_examples=100)
@given(data=st.data())
def test_a_swept_key_is_in_the_body(data):
    path = data.draw(st.sampled_from(sorted(openai_schema.ENDPOINTS)))
    key = data.draw(st.sampled_from(sorted(openai_schema.ENDPOINTS[path])))
    assert key in data.draw(bodies.bodies(path, key))


def test_every_field_path_is_swept():
    assert {_name(p) for p in PATHS} <= set(protos.field_names())


@settings(SETTINGS, max_examples=150)
@given(body=st.sampled_from(bodies.field_names("/v1/chat/completions")).flatmap(
    lambda key: bodies.bodies("/v1/chat/completions", key)))
def test_no_drawn_chat_body_asks_for_a_long_generation(body):
    lengths = [body.get(k) for k in bodies.LENGTH_KEYS if body.get(k) is not None]
    assert lengths
    for n in lengths:
        if isinstance(n, int) and not isinstance(n, bool):
            assert n <= bodies.SHORT or n >= bodies.PAST_CONTEXT


def test_encodings_say_what_they_do():
    body = {"prompt": "Hé", "max_tokens": 4}
    assert bodies.encode(body, "escaped")[0] == b'{"prompt": "H\\u00e9", "max_tokens": 4}'
    assert "é".encode() in bodies.encode(body, "utf8")[0]
    assert bodies.encode(body, "bom")[0].startswith(b"\xef\xbb\xbf{")
    data, headers = bodies.encode(body, "utf16")
    assert json.loads(data.decode("utf-16")) == body and b"utf-16" in headers[0][1]
    assert b"\xc0\xaf" in bodies.encode(body, "invalid_utf8")[0]
    assert bodies.encode(body, "duplicate_key")[0].count(b'"max_tokens"') == 2
    assert bodies.splice({"a": "\x00RAW0\x00"}) == b'{"a": 1e999}'


@settings(SETTINGS, max_examples=30)
@given(data=st.data())
def test_padded_bodies_sit_at_the_cap(data):
    cap = 1 << 20
    body = {"prompt": "Hi", "max_tokens": 4}
    size = len(bodies._padded(body, "/v1/completions", cap, data.draw))
    assert cap - 1 <= size <= cap + 64
