"""Random OpenAI bodies through the whole HTTP admit path in process (JSON decoding, the
dialect, validation), and random bytes through the gRPC one (decoding, validation):
every outcome is a ValidatedRequest or a RequestError, never any other exception (which
a front end would turn into a 500 / INTERNAL)."""

from __future__ import annotations

import json

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.api import openai_schema
from gateway.api.json_body import decode_json
from gateway.api.openai_api import CHAT, COMPLETION
from gateway.validation import RequestError, ValidatedRequest, parse_request, validate
from harness import body_strategies
from protos.continuum.v1 import generation_pb2

FIELDS = sorted(openai_schema.top_level_keys())  # every key a reader reads (its own test)
_numbers = st.one_of(
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from([0, 1, 2, 16, 17, 2**31, 2**32, 2**64, -1, 49151, 49152]),
    st.floats(allow_nan=False, allow_infinity=False),
    st.sampled_from([1e39, -1e39, 3.5e38, 1e-45, 0.5, 2.0]),
)
_text = st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=12)
_leaf = st.none() | st.booleans() | _numbers | _text | st.sampled_from(
    ["premium", "standard", "user", "system", "text", "assistant"])
_value = st.recursive(_leaf, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
    st.sampled_from(["role", "content", "type", "text", "include_usage"]) | _text,
    inner, max_size=4), max_leaves=12)
_message = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "x"]) | _leaf,
                                  "content": _value})
_body = st.dictionaries(st.sampled_from(FIELDS), _value, max_size=8).flatmap(
    lambda body: st.fixed_dictionaries({
        "prompt": st.just(body.get("prompt", "hi")) | st.lists(_numbers, max_size=4),
        "messages": st.lists(_message, min_size=0, max_size=3),
    }).map(lambda extra: {**extra, **body}))


SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[
    HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


@SETTINGS
@given(body=_body, chat=st.booleans())
def test_any_body_is_validated_or_refused(tokenizer, body, chat):
    raw = json.dumps(body).encode()
    try:
        api = (CHAT if chat else COMPLETION).parse(decode_json(raw), "smollm2", tokenizer)
        result = validate(api.proto, tokenizer, "smollm2")
    except RequestError as exc:
        assert exc.message
        return
    assert isinstance(result, ValidatedRequest)


@settings(SETTINGS, max_examples=120)
@given(data=st.data())
def test_any_schema_body_is_validated_or_refused(tokenizer, data):
    """The live fuzzer's bodies (harness/body_strategies.py), each field
    of each generation endpoint at its edges, through the same in-process path."""
    path = data.draw(st.sampled_from(["/v1/completions", "/v1/chat/completions"]))
    key = data.draw(st.sampled_from(body_strategies.field_names(path)))
    raw = body_strategies.splice(data.draw(body_strategies.bodies(path, key)))
    try:
        api = (CHAT if "chat" in path else COMPLETION).parse(decode_json(raw), "smollm2",
                                                             tokenizer)
        result = validate(api.proto, tokenizer, "smollm2")
    except RequestError as exc:
        assert exc.message
        return
    assert isinstance(result, ValidatedRequest)


_prefix = generation_pb2.GenerateRequest(prompt="hi", max_tokens=4).SerializeToString()


@SETTINGS
@given(data=st.binary(max_size=64), keep_prompt=st.booleans())
def test_any_grpc_bytes_are_validated_or_refused(tokenizer, data, keep_prompt):
    """Protobuf fields may repeat (last wins): a valid prefix then random fields."""
    request = parse_request((_prefix if keep_prompt else b"") + data)
    try:
        result = validate(request, tokenizer, "smollm2")
    except RequestError as exc:
        assert exc.message
        return
    assert isinstance(result, ValidatedRequest)
