"""Row ``openapi``: the published OpenAPI documents, run against a live server with
schemathesis (docs/reliability.md, "Published schemas": the documents, the case counts,
how bodies are tamed and what is judged).

OpenAI's document is read from ``$CONTINUUM_OPENAI_OPENAPI``, else
``openai-openapi/openapi.yaml`` in the data directory (sim/data.py), never copied here, and
restricted to ``OPENAI_OPERATIONS``; the gateway's own ``/openapi.json`` runs whole. Each
property is seeded by document, operation and mode, so every run draws the same cases.
``judge`` counts a server error (a 5xx, or no answer within TIMEOUT_S) and a schema
violation (streams judged event by event here: schemathesis reads an event-stream schema
as each event's fields, where both documents mean its ``data``); for the gateway's own
document, also an undocumented status, content type or required header."""

from __future__ import annotations

import collections
import copy
import json
import os
import pathlib
import re
import sys
import time
import urllib.parse
import urllib.request
import zlib

import jsonschema
import referencing
import requests
import schemathesis
import yaml
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode, checks

from harness.fuzz_common import PHASES
from sim.data import data_dir

OPENAI_ENV = "CONTINUUM_OPENAI_OPENAPI"
OPENAI_OPERATIONS = ("createCompletion", "createChatCompletion", "listModels")
# Cases per operation (positive; negative ones are a quarter of it), by size. Operations
# without a body have little to draw: a few cases each.
SIZES = {"ci": 16, "short": 16, "default": 60, "long": 400}
BODILESS_CASES = 3
MAX_TOKENS, MAX_N = 4, 2
# OpenAI's document makes prompt nullable, null meaning this default; the readers here
# take no null prompt (a 400), so it goes as the default it stands for in 3 cases of 4.
NULL_PROMPT = "<|endoftext|>"
TIMEOUT_S = 30.0
MAX_FAILURES = 12  # distinct failures kept with a reproducer, per document
COUNTS = ("cases", "generated", "streamed", "server_errors", "schema_violations",
          "status_violations")
AUTH = {"Authorization": "Bearer unused"}  # any key: the servers here run without keys
_SCHEMAS = "urn:continuum:document"


def openai_document() -> pathlib.Path:
    """Where OpenAI's published document is read from (it may be absent)."""
    env = os.environ.get(OPENAI_ENV)
    return pathlib.Path(env) if env else data_dir() / "openai-openapi" / "openapi.yaml"


def _allow_null(node):
    """OpenAPI 3.0's ``nullable: true`` (which OpenAI's 3.1 document still writes) as JSON
    Schema: null is valid too. Returns a converted copy."""
    if isinstance(node, list):
        return [_allow_null(item) for item in node]
    if not isinstance(node, dict):
        return node
    converted = {key: _allow_null(value) for key, value in node.items() if key != "nullable"}
    return {"anyOf": [converted, {"type": "null"}]} if node.get("nullable") else converted


class Document:
    """One OpenAPI document: schemathesis's view of the operations to run, and validators
    of what schemathesis does not judge (stream events, error bodies). ``strict``: also
    hold answers to the documented statuses, content types and headers. ``prefix``: the
    path its server URL puts before its paths (OpenAI's /v1)."""

    def __init__(self, name: str, raw: dict, strict: bool, operations=None):
        self.name, self.strict = name, strict
        servers = raw.get("servers") or [{}]
        self.prefix = urllib.parse.urlparse(servers[0].get("url", "")).path.rstrip("/")
        config = schemathesis.Config.from_dict({"max-stream-events": 1024})
        schema = schemathesis.openapi.from_dict(copy.deepcopy(raw), config=config)
        if operations is not None:
            schema = schema.include(operation_id=list(operations))
        self.schema = schema
        schemas = _allow_null(raw["components"]["schemas"])
        # path -> the component its stream's events hold; where a POST documents no
        # stream, its answer's as a chunk (used only if it streams)
        chunks = {}
        for result in self.schema.get_all_operations():
            path, method = result.ok().path, result.ok().method.lower()
            content = raw["paths"][path][method]["responses"]["200"]["content"]
            if "text/event-stream" in content:
                chunks[path] = _component(content["text/event-stream"]["schema"])
            elif method == "post":
                name = _component(content["application/json"]["schema"])
                chunks[path] = f"{name}_as_chunk"
                schemas[chunks[path]] = _as_chunk(schemas[name])
        resource = referencing.Resource.from_contents(
            {"components": {"schemas": schemas}},
            default_specification=referencing.jsonschema.DRAFT202012)
        self._registry = referencing.Registry().with_resource(_SCHEMAS, resource)
        self.error = self.validator("ErrorResponse")
        self.chunks = {path: self.validator(name) for path, name in chunks.items()}

    def validator(self, component: str) -> jsonschema.Validator:
        """A validator of the component schema ``component`` (null where ``nullable``)."""
        return jsonschema.Draft202012Validator(
            {"$ref": f"{_SCHEMAS}#/components/schemas/{component}"}, registry=self._registry)

    def case(self, method: str, path: str, body):
        """A schemathesis case of this document's operation at the served ``path``."""
        operation = self.schema[path.removeprefix(self.prefix)][method]
        return operation.Case(body=body, media_type="application/json")


def _component(schema: dict) -> str:
    """The component a ``$ref`` names (both documents name their answers' schemas)."""
    return schema["$ref"].removeprefix("#/components/schemas/")


def _as_chunk(answer: dict) -> dict:
    """A whole answer's schema as its stream chunks': ``finish_reason`` and ``usage`` may
    be null, as they are in every chunk before the last of a choice (of the stream)."""
    chunk = copy.deepcopy(answer)
    properties = chunk.get("properties", {})
    choice = properties.get("choices", {}).get("items", {}).get("properties", {})
    for fields, key in ((properties, "usage"), (choice, "finish_reason")):
        if key in fields:
            fields[key] = {"anyOf": [fields[key], {"type": "null"}]}
    return chunk


def load_openai(path: pathlib.Path) -> Document:
    with open(path, encoding="utf-8") as handle:
        raw = yaml.load(handle, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    _map_discriminators(raw, raw["components"]["schemas"])
    return Document("OpenAI's openapi.yaml", raw, strict=False, operations=OPENAI_OPERATIONS)


def _map_discriminators(node, schemas: dict) -> None:
    """OpenAI's discriminators name no mapping, so OpenAPI reads each value as a schema's
    name, and ``"type": "function"`` names none: the mapping its options' own single
    ``type`` words say (what OpenAI's answers send), in place."""
    if isinstance(node, list):
        for item in node:
            _map_discriminators(item, schemas)
        return
    if not isinstance(node, dict):
        return
    found = node.get("discriminator")
    if isinstance(found, dict) and "mapping" not in found:
        mapping = {}
        for option in node.get("oneOf", node.get("anyOf", [])):
            ref = option.get("$ref", "")
            word = schemas.get(_component(option), {}).get("properties", {}).get(
                found["propertyName"], {}).get("enum", []) if ref else []
            if len(word) == 1:
                mapping[word[0]] = ref
        found["mapping"] = mapping
    for value in node.values():
        _map_discriminators(value, schemas)


def load_own(http_port: int) -> Document:
    request = urllib.request.Request(f"http://127.0.0.1:{http_port}/openapi.json",
                                     headers=AUTH)
    with urllib.request.urlopen(request, timeout=30) as response:
        return Document("the gateway's /openapi.json", json.load(response), strict=True)


# --- judging one answer ---------------------------------------------------------------


def _schemathesis_failures(case, response, check) -> list[str]:
    try:
        case.validate_response(response, checks=[check])
    except schemathesis.errors.FailureGroup as group:
        return [f"{f.title}: {f.message}" for f in group.exceptions]
    return []


def _no_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def strict_json(text: str | bytes):
    """``text`` parsed as RFC 8259 has JSON: no NaN or Infinity, which Python writes and
    reads but strict parsers (JavaScript's, Go's) refuse, whole answer and all."""
    return json.loads(text, parse_constant=_no_constant)


def schema_errors(validator: jsonschema.Validator, instance) -> list[str]:
    return [f"{'/'.join(map(str, e.absolute_path)) or '(root)'}: {e.message[:300]}"
            for e in validator.iter_errors(instance)][:3]


def stream_failures(doc: Document, path: str, content: bytes) -> list[str]:
    """Each event of an SSE answer: a chunk valid under the document's chunk schema for
    ``path``, or an error object; ``[DONE]`` last."""
    events = [block for block in content.decode("utf-8").split("\n\n") if block.strip()]
    payloads = [event.removeprefix("data: ") for event in events]
    found = [] if payloads and payloads[-1] == "[DONE]" else ["the stream does not end "
                                                              "with data: [DONE]"]
    for number, payload in enumerate(payloads[:-1]):
        try:
            chunk = strict_json(payload)
        except ValueError as exc:
            found.append(f"event {number} is not JSON ({exc}): {payload[:200]!r}")
            continue
        validator = doc.error if isinstance(chunk, dict) and "error" in chunk \
            else doc.chunks[path]
        found += [f"event {number}: {e}" for e in schema_errors(validator, chunk)]
    return found


def judge(doc: Document, case, response) -> dict[str, list[str]]:
    """The failures of one answer, by kind: server_errors, schema_violations and
    status_violations."""
    found = collections.defaultdict(list)
    found["server_errors"] += _schemathesis_failures(case, response, checks.not_a_server_error)
    content_type = response.headers.get("content-type", [""])[0]
    path = case.operation.path
    if content_type.startswith("text/event-stream") and response.status_code == 200:
        found["schema_violations"] += stream_failures(doc, path, response.content)
    else:
        found["schema_violations"] += _schemathesis_failures(
            case, response, checks.response_schema_conformance)
        body = response.content[:200]
        if content_type.startswith("application/json"):
            try:
                body = strict_json(response.content)
            except ValueError as exc:
                found["schema_violations"].append(f"the answer is not JSON: {exc}")
        if response.status_code >= 400:
            found["schema_violations"] += schema_errors(doc.error, body)
    if doc.strict:
        for check in (checks.status_code_conformance, checks.content_type_conformance,
                      checks.response_headers_conformance):
            found["status_violations"] += _schemathesis_failures(case, response, check)
    return found


# --- running a document ---------------------------------------------------------------


class Run:
    """One document's cases against one server: statuses per operation, failure counts,
    and the first distinct failures with a reproducer."""

    def __init__(self, doc: Document, http_port: int, model: str, log=print):
        self.doc, self.model, self.log = doc, model, log
        self.base_url = f"http://127.0.0.1:{http_port}{doc.prefix}"
        self.session = requests.Session()
        self.statuses: dict[str, collections.Counter] = collections.defaultdict(
            collections.Counter)
        self.counts: collections.Counter = collections.Counter()
        self.failures: dict[str, dict] = {}

    def tame(self, case, served: bool, stream: bool):
        """The served model (``served``: 3 cases of 4), a small output, and a stream
        where ``stream`` and the drawn body leaves it unsaid (see the module doc)."""
        body = case.body
        if not isinstance(body, dict):
            return case
        if served:
            body["model"] = self.model
            if "prompt" in body and body["prompt"] is None:
                body["prompt"] = NULL_PROMPT
        if case.operation.path.endswith("completions"):
            if stream:
                body.setdefault("stream", True)
            keys = ("max_tokens", "max_completion_tokens")
            for key in keys:
                value = body.get(key)
                if value is None and key in body or value == 0 or \
                        isinstance(value, int | float) and value > MAX_TOKENS:
                    body[key] = MAX_TOKENS
            if not any(key in body for key in keys):
                body["max_tokens"] = MAX_TOKENS
            for key in ("n", "best_of"):
                if isinstance(body.get(key), int | float) and body[key] > MAX_N:
                    body[key] = MAX_N
        return case

    def case(self, case) -> None:
        """Sends one case and tallies its answer."""
        label = case.operation.label
        try:
            response = case.call(base_url=self.base_url, session=self.session,
                                 headers=AUTH, timeout=TIMEOUT_S)
        except requests.RequestException as exc:
            self.statuses[label][type(exc).__name__] += 1
            self._record(case, {"server_errors": [f"no answer: {type(exc).__name__}"]}, None)
            return
        self.statuses[label][str(response.status_code)] += 1
        if response.status_code == 200 and label.endswith("completions"):
            self.counts["generated"] += 1
            streamed = response.headers.get("content-type", [""])[0].startswith(
                "text/event-stream")
            self.counts["streamed"] += streamed
        self._record(case, judge(self.doc, case, response), response)

    def _record(self, case, found: dict[str, list[str]], response) -> None:
        self.counts["cases"] += 1
        for kind, messages in found.items():
            if not messages:
                continue
            self.counts[kind] += 1
            key = f"{case.operation.label} {kind}: " + re.sub(r"[0-9a-f]{6,}|[0-9]+", "#",
                                                              messages[0][:120])
            if key not in self.failures and len(self.failures) < MAX_FAILURES:
                status = response.status_code if response is not None else "none"
                self.failures[key] = {
                    "operation": case.operation.label, "kind": kind, "status": status,
                    "messages": [m[:1500] for m in messages[:3]],
                    "reproducer": case.as_curl_command(headers=AUTH,
                                                       base_url=self.base_url)[:3000]}
                self.log(f"[openapi] {self.doc.name}: {key}", file=sys.stderr, flush=True)

    def operation(self, operation, mode: GenerationMode, num_cases: int) -> None:
        served = st.sampled_from((True, True, True, False))
        strategy = st.builds(self.tame, operation.as_strategy(mode), served, st.booleans())
        label = f"{self.doc.name} {operation.label} {mode.value}"

        @seed(zlib.crc32(label.encode()))
        @settings(max_examples=num_cases, deadline=None, database=None, phases=PHASES,
                  suppress_health_check=list(HealthCheck))
        @given(case=strategy)
        def cases(case) -> None:
            self.case(case)

        cases()

    def run(self, cases_per_operation: int) -> dict:
        started = time.monotonic()
        for result in self.doc.schema.get_all_operations():
            operation = result.ok()
            has_body = operation.method.upper() == "POST"
            num = cases_per_operation if has_body else BODILESS_CASES
            self.operation(operation, GenerationMode.POSITIVE, num)
            if has_body:
                self.operation(operation, GenerationMode.NEGATIVE, max(1, num // 4))
            self.log(f"[openapi] {self.doc.name} {operation.label}: "
                     f"{dict(self.statuses[operation.label])}", file=sys.stderr, flush=True)
        return {"document": self.doc.name, "seconds": round(time.monotonic() - started, 1),
                **{k: self.counts[k] for k in COUNTS},
                "statuses": {op: dict(c) for op, c in self.statuses.items()},
                "failures": list(self.failures.values())}


def served_model(http_port: int) -> str:
    request = urllib.request.Request(f"http://127.0.0.1:{http_port}/v1/models", headers=AUTH)
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.load(response)["data"][0]["id"]


def run(serve, size: str = "default", log=print) -> dict:
    """The row: both documents (OpenAI's only when present) against ``serve`` (a
    procs.Serve, or anything with its ``http_port``)."""
    http_port = serve.http_port
    model = served_model(http_port)
    per_operation = SIZES[size]
    path = openai_document()
    documents = [load_own(http_port)]
    if path.exists():
        documents.insert(0, load_openai(path))
    runs = [Run(doc, http_port, model, log).run(per_operation) for doc in documents]
    totals = {k: sum(r[k] for r in runs) for k in COUNTS}
    return {"row": "openapi", "per_operation": per_operation, **totals,
            "openai_document": str(path) if path.exists() else f"absent: {path}",
            "documents": runs}


def met(row: dict) -> bool:
    return row["server_errors"] == row["schema_violations"] == row["status_violations"] == 0


def summary(row: dict) -> tuple[str, str, str, bool]:
    """(row name, measured, target, met) for the table."""
    parts = [f"{d['document']}: {d['cases']} cases ({d['generated']} generated, "
             f"{d['streamed']} of them streamed) in "
             f"{d['seconds']} s, server errors {d['server_errors']}, schema violations "
             f"{d['schema_violations']}, status violations {d['status_violations']}"
             for d in row["documents"]]
    if row["openai_document"].startswith("absent"):
        parts.append(f"OpenAI's document {row['openai_document']} (set {OPENAI_ENV})")
    return ("published OpenAPI documents (schemathesis)", "; ".join(parts),
            "0 server errors, 0 schema violations, 0 undocumented statuses", met(row))
