"""The published-schema run's own rules (harness/openapi_run.py), on a
small document of our making: no server, no OpenAI document."""

from __future__ import annotations

import json

from harness import openapi_run

CHUNK = {"type": "object", "required": ["choices"], "properties": {"choices": {
    "type": "array", "items": {"type": "object", "required": ["finish_reason"],
                               "properties": {"finish_reason": {"enum": ["stop"]}}}}}}
ERROR = {"type": "object", "required": ["error"],
         "properties": {"error": {"type": "object", "required": ["message"]}}}


def _document(content: dict) -> openapi_run.Document:
    raw = {"openapi": "3.1.0", "info": {"title": "t", "version": "1"},
           "servers": [{"url": "https://example.invalid/v1"}],
           "paths": {"/answers": {"post": {
               "requestBody": {"content": {"application/json": {"schema": {}}}},
               "responses": {"200": {"description": "OK", "content": content}}}}},
           "components": {"schemas": {"Chunk": CHUNK, "ErrorResponse": ERROR}}}
    return openapi_run.Document("test", raw, strict=False)


def _stream(*payloads) -> bytes:
    return "".join(f"data: {p if isinstance(p, str) else json.dumps(p)}\n\n"
                   for p in payloads).encode()


def test_a_stream_is_judged_event_by_event_against_its_chunk_schema():
    doc = _document({"text/event-stream": {"schema": {"$ref": "#/components/schemas/Chunk"}}})
    assert doc.prefix == "/v1"
    ok = {"choices": [{"finish_reason": "stop"}]}
    assert openapi_run.stream_failures(doc, "/answers", _stream(ok, "[DONE]")) == []
    assert openapi_run.stream_failures(
        doc, "/answers", _stream(ok, {"error": {"message": "late"}}, "[DONE]")) == []
    assert openapi_run.stream_failures(doc, "/answers", _stream(ok)) == [
        "the stream does not end with data: [DONE]"]
    [bad] = openapi_run.stream_failures(
        doc, "/answers", _stream({"choices": [{"finish_reason": "nope"}]}, "[DONE]"))
    assert bad.startswith("event 0: choices/0/finish_reason")
    [infinite] = openapi_run.stream_failures(
        doc, "/answers", b'data: {"choices": [], "x": -Infinity}\n\ndata: [DONE]\n\n')
    assert "-Infinity is not JSON" in infinite


def test_without_a_stream_schema_chunks_are_the_answer_with_nulls_allowed():
    """OpenAI's /completions documents no stream: its chunks are held to the answer's
    schema, with finish_reason and usage null (as every chunk but a choice's last has)."""
    doc = _document({"application/json": {"schema": {"$ref": "#/components/schemas/Chunk"}}})
    chunk = {"choices": [{"finish_reason": None}]}
    assert openapi_run.stream_failures(doc, "/answers", _stream(chunk, "[DONE]")) == []


def test_nullable_allows_null_and_a_discriminator_maps_its_options_own_words():
    assert openapi_run._allow_null({"type": "string", "nullable": True}) == {
        "anyOf": [{"type": "string"}, {"type": "null"}]}
    schemas = {"Call": {"properties": {"type": {"enum": ["function"]}}},
               "Custom": {"properties": {"type": {"enum": ["custom"]}}}}
    union = {"oneOf": [{"$ref": "#/components/schemas/Call"},
                       {"$ref": "#/components/schemas/Custom"}],
             "discriminator": {"propertyName": "type"}}
    openapi_run._map_discriminators(union, schemas)
    assert union["discriminator"]["mapping"] == {"function": "#/components/schemas/Call",
                                                 "custom": "#/components/schemas/Custom"}
