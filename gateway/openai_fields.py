"""Typed readers for OpenAI request fields, and the fields both dialects share.

Every reader checks the JSON type and a range that fits the protobuf field it
feeds (uint32, uint64, float32), so no client value can make a protobuf
assignment raise (ValueError past 2^32) or overflow to inf (a float32 holds
about 3.4e38). Semantic limits that both APIs share (n <= 16, stop caps,
vocabulary, context) are checked once, in `gateway/validation.py`.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

from gateway.validation import MAX_N, MAX_STOP_TOKEN_IDS, RequestError, context_exceeded
from protos import tiers
from protos.continuum.v1 import generation_pb2
from protos.echo import clip
from protos.limits import MAX_LOGIT_BIAS, MAX_LOGIT_BIAS_ENTRIES

UINT32_MAX = 2**32 - 1
UINT64_MAX = 2**64 - 1
# Our proto fields say int32-range for these; the largest value both ends agree on.
INT31_MAX = 2**31 - 1
# tools / tool_choice are the chat dialect's (gateway/tool_calls.py); the legacy
# functions / function_call are not taken.
_UNSUPPORTED = ("suffix", "functions", "function_call", "audio", "modalities", "prediction")


def bad(message: str, param: str | None = None) -> RequestError:
    return RequestError(message, param=param)


def number(body: dict, name: str, low: float, high: float, default=None):
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise bad(f"{name} must be a number, got {type(value).__name__}", name)
    if isinstance(value, int) and not low <= value <= high:  # may be too big for a float
        raise bad(f"{name} must be between {low:g} and {high:g}, got {clip(value)}", name)
    if not (math.isfinite(value) and low <= value <= high):
        raise bad(f"{name} must be between {low:g} and {high:g}, got {value:g}", name)
    return value


def integer(body: dict, name: str, low: int, high: int, default=None):
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad(f"{name} must be an integer, got {type(value).__name__}", name)
    if not low <= value <= high:
        raise bad(f"{name} must be between {low} and {high}, got {clip(value)}", name)
    return value


def boolean(body: dict, name: str, default: bool = False) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad(f"{name} must be true or false, got {type(value).__name__}", name)
    return value


def string(body: dict, name: str, default: str = "") -> str:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, str):
        raise bad(f"{name} must be a string, got {type(value).__name__}", name)
    return value


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
    return isinstance(value, int) and not isinstance(value, bool)


def looks_like_token_ids(value: Any) -> bool:
    """A non-empty list starting with an integer (`token_ids` checks the rest)."""
    return isinstance(value, list) and bool(value) and _is_int(value[0])


def token_ids(value: list, name: str, max_len: int, vocab_size: int,
              context: bool = True) -> list[int]:
    """A list of ints as token ids: length first (cheap), then each id's type and range.
    ``context`` says the limit is the model's context (OpenAI's overflow wording and code);
    otherwise it is a plain cap on the list."""
    if len(value) > max_len:
        if not context:
            raise bad(f"{name} holds {len(value)} token ids; at most {max_len}", name)
        raise context_exceeded(max_len, f"{name} holds {len(value)} token ids", name, name)
    for index, token_id in enumerate(value):
        if not _is_int(token_id):
            raise bad(f"{name}[{index}] must be a token id (an integer), got "
                      f"{type(token_id).__name__}", name)
        if not 0 <= token_id < vocab_size:
            kind = "a negative token id" if token_id < 0 else "not a token id"
            raise bad(f"{name}[{index}] = {token_id} is {kind}: the model's vocabulary has "
                      f"{vocab_size} tokens (ids 0..{vocab_size - 1})", name)
    return value


def _priority(body: dict, proto: generation_pb2.GenerateRequest) -> None:
    """Continuum's ``priority``: a tier's name (any spelling protos/tiers.py reads) or
    its number."""
    priority = body.get("priority")
    if priority is None:
        return
    tier = None
    if isinstance(priority, str):
        tier = tiers.parse(priority)
    elif _is_int(priority) and 0 <= priority < tiers.NUM_TIERS:
        tier = priority
    if tier is None:
        raise bad(f"priority must be one of {', '.join(tiers.NAMES)} (or "
                  f"{', '.join(map(str, range(tiers.NUM_TIERS)))})", "priority")
    proto.priority = tiers.to_priority(tier)


def common(body: dict, proto: generation_pb2.GenerateRequest, served_model: str,
           vocab_size: int) -> None:
    """Fields shared by completions and chat: model, sampling, stop, n, extensions."""
    for name in _UNSUPPORTED:
        if body.get(name) not in (None, {}, []):
            raise bad(f"{name} is not supported by this server; remove it", name)
    proto.model = string(body, "model") or served_model
    sampling = proto.sampling
    temperature = number(body, "temperature", 0.0, 2.0)
    if temperature is not None:
        sampling.temperature = temperature
    top_p = number(body, "top_p", 0.0, 1.0)
    if top_p is not None:
        if top_p == 0:
            raise bad("top_p must be > 0 (use temperature 0 for greedy decoding)", "top_p")
        sampling.top_p = top_p
    sampling.presence_penalty = number(body, "presence_penalty", -2.0, 2.0, 0.0)
    sampling.frequency_penalty = number(body, "frequency_penalty", -2.0, 2.0, 0.0)
    seed = integer(body, "seed", 0, UINT64_MAX)
    if seed is not None:
        sampling.seed = seed
    top_k = integer(body, "top_k", -1, INT31_MAX, 0)
    sampling.top_k = max(top_k, 0)  # -1 (as in vLLM) and 0 both mean "no top-k"
    sampling.min_p = number(body, "min_p", 0.0, 1.0, 0.0)
    repetition_penalty = number(body, "repetition_penalty", 0.0, 1e6)
    if repetition_penalty is not None:
        sampling.repetition_penalty = repetition_penalty
    sampling.min_tokens = integer(body, "min_tokens", 0, INT31_MAX, 0)
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
    proto.n = integer(body, "n", 1, MAX_N, 1)
    best_of = integer(body, "best_of", 1, UINT32_MAX)
    if best_of is not None and best_of != proto.n:
        raise bad("best_of other than n is not supported; remove it", "best_of")
    proto.tenant = string(body, "tenant")
    _priority(body, proto)


def logit_bias(body: dict, sampling, vocab_size: int) -> None:
    """OpenAI's ``logit_bias``: an object from token ids (JSON keys, so strings of
    digits) to biases in [-100, 100]; its size is capped before any entry is read."""
    bias = body.get("logit_bias")
    if bias is None:
        return
    if not isinstance(bias, dict):
        raise bad("logit_bias must be an object mapping token ids to biases", "logit_bias")
    if len(bias) > MAX_LOGIT_BIAS_ENTRIES:
        raise bad(f"logit_bias holds {len(bias)} entries; at most {MAX_LOGIT_BIAS_ENTRIES}",
                  "logit_bias")
    for key, value in bias.items():
        if not (isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= 10):
            raise bad(f"logit_bias key {clip(key)} must be a token id (digits)", "logit_bias")
        token_id = int(key)
        if token_id >= vocab_size:
            raise bad(f"logit_bias key {token_id} is not a token id: the model's vocabulary "
                      f"has {vocab_size} tokens (ids 0..{vocab_size - 1})", "logit_bias")
        if isinstance(value, bool) or not isinstance(value, int | float) or \
                not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
            raise bad(f"logit_bias[{key}] must be a number in [-{MAX_LOGIT_BIAS:g}, "
                      f"{MAX_LOGIT_BIAS:g}], got {clip(value)}", "logit_bias")
        sampling.logit_bias[token_id] = float(value)


_GUIDED_EXTENSIONS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")


def guided(body: dict, sampling) -> None:
    """Structured output: OpenAI's ``response_format`` (``text``, ``json_object``,
    ``json_schema``) or one of vLLM's ``guided_json`` / ``guided_regex`` /
    ``guided_choice`` / ``guided_grammar``, into ``sampling.guided``. Whether it
    compiles is validation's (protos/guided.py)."""
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
