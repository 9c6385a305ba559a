"""Typed readers for OpenAI request fields, and the fields both dialects share.

Every reader checks the JSON type, then the range before assigning, so no client value
makes a protobuf assignment raise (past 2^32) or overflow a float32 to inf. The sampling
numbers' ranges and messages are protos/sampling_checks.py's ``NUMBERS`` (a parameter added
there is read here unchanged); whole-request caps are gateway/validation.py's.
"""

from __future__ import annotations

import json
import re
from typing import Any

from gateway.validation import RequestError, context_exceeded
from protos import sampling_checks as checks
from protos import tiers
from protos.continuum.v1 import generation_pb2
from protos.echo import clip
from protos.limits import MAX_STOP_TOKEN_IDS

UINT32_MAX = checks.UINT32_MAX
# tools / tool_choice are the chat dialect's (gateway/tools/tool_calls.py); the legacy
# functions / function_call are not taken.
UNSUPPORTED = ("suffix", "functions", "function_call", "audio", "modalities", "prediction")


def bad(message: str, param: str | None = None) -> RequestError:
    return RequestError(message, param=param)


def _typed(name: str, value: Any, integer: bool) -> int | float:
    """``value`` if it is a number (an integer where ``integer``, returned as an int)."""
    number = isinstance(value, int | float) and not isinstance(value, bool)
    if not (_is_int(value) if integer else number):
        kind = "an integer" if integer else "a number"
        raise bad(f"{name} must be {kind}, got {type(value).__name__}", name)
    return int(value) if integer else value


def integer(body: dict, name: str, low: int, high: int, default=None):
    """An integer field in [low, high] (checks.range_problem's words)."""
    value = body.get(name)
    if value is None:
        return default
    value = _typed(name, value, integer=True)
    if problem := checks.range_problem(name, value, low, high, integer=True):
        raise bad(problem, name)
    return value


def bounded(body: dict, bound: checks.Bound):
    """The field ``bound`` names, typed and in its interval; None when absent."""
    value = body.get(bound.name)
    if value is None:
        return None
    value = _typed(bound.name, value, bound.integer)
    if bound.name == "top_k" and value == -1:
        return 0  # vLLM's "no top-k", as 0 is ours
    if problem := bound.problem(value):
        raise bad(problem, bound.name)
    return value


def _of_type(body: dict, name: str, default: Any, kind: type, what: str) -> Any:
    """``body[name]`` if it is a ``kind`` (``default`` when absent or null), else a 400."""
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, kind):
        raise bad(f"{name} must be {what}, got {type(value).__name__}", name)
    return value


def boolean(body: dict, name: str, default: bool = False) -> bool:
    return _of_type(body, name, default, bool, "true or false")


def string(body: dict, name: str, default: str = "") -> str:
    return _of_type(body, name, default, str, "a string")


def stop_strings(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop]
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        return stop
    raise bad("stop must be a string or a list of strings", "stop")


def _is_int(value: Any) -> bool:
    """3, or 3.0 (JSON Schema, and so OpenAI's schema, counts 3.0 an integer), never a bool."""
    if isinstance(value, float):
        return value.is_integer()
    return isinstance(value, int) and not isinstance(value, bool)


def looks_like_token_ids(value: Any) -> bool:
    """A non-empty list starting with an integer (`token_ids` checks the rest)."""
    return isinstance(value, list) and bool(value) and _is_int(value[0])


def token_ids(value: list, name: str, max_len: int, vocab_size: int,
              context: bool = True) -> list[int]:
    """A list of ints as token ids: length first (cheap), then each id's type and range;
    ``context``: the limit is the model's context (OpenAI's overflow wording and code)."""
    if len(value) > max_len:
        if not context:
            raise bad(f"{name} holds {len(value)} token ids; at most {max_len}", name)
        raise context_exceeded(max_len, f"{name} holds {len(value)} token ids", name, name)
    for index, token_id in enumerate(value):
        if not _is_int(token_id):
            raise bad(f"{name}[{index}] must be a token id (an integer), got "
                      f"{type(token_id).__name__}", name)
    ids = [int(token_id) for token_id in value]
    if problem := checks.token_ids_problem(name, ids, vocab_size):
        raise bad(problem, name)
    return ids


def _priority(body: dict, proto: generation_pb2.GenerateRequest) -> None:
    """Continuum's ``priority``: a tier's name (as protos/tiers.py reads it) or number."""
    priority = body.get("priority")
    if priority is None:
        return
    tier = None
    if isinstance(priority, str):
        tier = tiers.parse(priority)
    elif _is_int(priority) and 0 <= priority < tiers.NUM_TIERS:
        tier = int(priority)
    if tier is None:
        raise bad(f"priority must be one of {', '.join(tiers.NAMES)} (or "
                  f"{', '.join(map(str, range(tiers.NUM_TIERS)))})", "priority")
    proto.priority = tiers.to_priority(tier)


def common(body: dict, proto: generation_pb2.GenerateRequest, served_model: str,
           vocab_size: int) -> None:
    """Fields shared by completions and chat: model, sampling, stop, n, extensions."""
    for name in UNSUPPORTED:
        if body.get(name) not in (None, {}, []):
            raise bad(f"{name} is not supported by this server; remove it", name)
    proto.model = string(body, "model") or served_model
    sampling = proto.sampling
    for bound in checks.NUMBERS:  # temperature, top_p, top_k, min_p, penalties, seed, ...
        value = bounded(body, bound)
        if value is not None:
            setattr(sampling, bound.name, value)
    sampling.ignore_eos = boolean(body, "ignore_eos")
    stop_ids = body.get("stop_token_ids")
    if stop_ids is not None:
        if not isinstance(stop_ids, list):
            raise bad("stop_token_ids must be a list of token ids", "stop_token_ids")
        sampling.stop_token_ids.extend(
            token_ids(stop_ids, "stop_token_ids", MAX_STOP_TOKEN_IDS, vocab_size,
                      context=False))
    logit_bias(body, sampling, vocab_size)
    guided(body, sampling)
    proto.stop.extend(stop_strings(body))
    proto.n = bounded(body, checks.N) or 1
    best_of = integer(body, "best_of", 1, UINT32_MAX)
    if best_of is not None and best_of != proto.n:
        raise bad("best_of other than n is not supported; remove it", "best_of")
    proto.tenant = string(body, "tenant")
    _priority(body, proto)


def logit_bias(body: dict, sampling, vocab_size: int) -> None:
    """OpenAI's ``logit_bias`` (token-id strings to numbers); its size is capped before
    any entry is read, and checked whole before anything is assigned."""
    bias = body.get("logit_bias")
    if bias is None:
        return
    if not isinstance(bias, dict):
        raise bad("logit_bias must be an object mapping token ids to biases", "logit_bias")
    if problem := checks.logit_bias_size_problem(len(bias)):
        raise bad(problem, "logit_bias")
    parsed = {}
    for key, value in bias.items():
        if not (isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= 10):
            raise bad(f"logit_bias key {clip(key)} must be a token id (digits)", "logit_bias")
        _typed(f"logit_bias[{key}]", value, integer=False)
        parsed[int(key)] = value
    if problem := checks.logit_bias_problem(parsed, vocab_size):
        raise bad(problem, "logit_bias")
    for token_id, value in parsed.items():
        sampling.logit_bias[token_id] = float(value)


_GUIDED_EXTENSIONS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")


def guided(body: dict, sampling) -> None:
    """OpenAI's ``response_format`` or one of vLLM's ``guided_*`` into ``sampling.guided``;
    whether it compiles is validation's."""
    given = [name for name in ("response_format", *_GUIDED_EXTENSIONS)
             if body.get(name) is not None]
    if len(given) > 1:
        raise bad(f"{' and '.join(given)} both constrain the output; send one", given[1])
    if not given:
        return
    name, value = given[0], body[given[0]]
    target = sampling.guided
    if name == "response_format":
        _response_format(value, target)
    elif name == "guided_json":
        if not isinstance(value, dict | str):
            raise bad("guided_json must be a JSON Schema (an object or its JSON text)", name)
        target.json_schema = value if isinstance(value, str) else json.dumps(value)
    elif name == "guided_choice":
        if not (isinstance(value, list) and value and all(isinstance(c, str) and c
                                                          for c in value)):
            raise bad("guided_choice must be a non-empty list of non-empty strings", name)
        target.regex = "|".join(re.escape(choice) for choice in value)
    else:
        if not isinstance(value, str) or not value:
            raise bad(f"{name} must be a non-empty string", name)
        if name == "guided_regex":
            target.regex = value
        else:
            target.lark = value


def _response_format(value: Any, target) -> None:
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return
    if kind == "json_object":
        target.json_object = True
    elif kind == "json_schema":
        spec = value.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise bad("response_format.json_schema.schema is required: a JSON Schema object",
                      "response_format")
        target.json_schema = json.dumps(schema)
    else:
        raise bad("response_format must be {\"type\": \"text\"}, {\"type\": "
                  "\"json_object\"} or {\"type\": \"json_schema\", \"json_schema\": "
                  "{\"name\": ..., \"schema\": {...}}}", "response_format")


def stream_options(body: dict, stream: bool) -> tuple[bool, bool]:
    """(include_usage, continuous_usage_stats): a final usage chunk (OpenAI), and usage
    so far on every chunk (vLLM's extension; it implies the final one too)."""
    options = body.get("stream_options")
    if options is None:
        return False, False
    if not stream:
        raise bad("stream_options is only allowed when stream is true", "stream_options")
    if not isinstance(options, dict):
        raise bad("stream_options must be an object", "stream_options")
    continuous = boolean(options, "continuous_usage_stats")
    return boolean(options, "include_usage") or continuous, continuous
