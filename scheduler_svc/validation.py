"""Every field of a SubmitRequest, checked at the scheduler.

The internal plane does not trust its caller: a request the executor would
refuse or choke on (``logprobs: 100000`` once held a batch for 19 s while the
loop resynchronized 2,380 times) is refused here with INVALID_ARGUMENT and a
message naming the field and its limit. The limits are the gateway's
(``protos/limits.py``); those that depend on the model (vocabulary, context,
KV pool) are checked once an executor has registered; before that the request
waits, as it would for a restarting executor.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from protos import limits, tiers
from protos.continuum.v1 import sampling_pb2, scheduler_pb2
from scheduler_svc.core import ModelInfo, Scheduler


def _identifier(value: str, field: str, max_chars: int) -> str | None:
    if len(value) > max_chars:
        return f"{field} is {len(value)} characters long; the limit is {max_chars}"
    bad = next((c for c in value if not " " <= c <= "~"), None)
    if bad is not None:
        return f"{field} must be printable ASCII; it contains {bad!r}"
    return None


def _in_range(field: str, value: float, low: float, high: float, closed_low: bool) -> str | None:
    above_low = value >= low if closed_low else value > low
    if math.isfinite(value) and above_low and value <= high:
        return None
    interval = f"{'[' if closed_low else '('}{low:g}, {high:g}]"
    return f"sampling.{field} must be in {interval}, got {value:g}"


def _token_ids(field: str, ids: Sequence[int], vocab_size: int) -> str | None:
    bad = next((i for i, t in enumerate(ids) if t >= vocab_size), None)
    if bad is None:
        return None
    return (f"{field}[{bad}] = {ids[bad]} is outside the vocabulary "
            f"(size {vocab_size}, ids 0..{vocab_size - 1})")


def _sampling(s: sampling_pb2.SamplingParams) -> str | None:
    """The checks that need no model."""
    if s.HasField("temperature") and not (math.isfinite(s.temperature) and s.temperature >= 0):
        return f"sampling.temperature must be a finite number >= 0, got {s.temperature:g}"
    if s.HasField("top_p") and (problem := _in_range("top_p", s.top_p, 0.0, 1.0, False)):
        return problem
    if problem := _in_range("min_p", s.min_p, 0.0, 1.0, True):
        return problem
    if s.HasField("repetition_penalty") and not (
            math.isfinite(s.repetition_penalty) and s.repetition_penalty > 0):
        return f"sampling.repetition_penalty must be a finite number > 0, " \
               f"got {s.repetition_penalty:g}"
    for field in ("presence_penalty", "frequency_penalty"):
        if problem := _in_range(field, getattr(s, field), -limits.MAX_PENALTY,
                                limits.MAX_PENALTY, True):
            return problem
    if s.HasField("logprobs") and s.logprobs > limits.MAX_LOGPROBS:
        return (f"sampling.logprobs asks for {s.logprobs} alternatives; "
                f"at most {limits.MAX_LOGPROBS}")
    if len(s.stop_token_ids) > limits.MAX_STOP_TOKEN_IDS:
        return (f"sampling.stop_token_ids holds {len(s.stop_token_ids)} ids; "
                f"at most {limits.MAX_STOP_TOKEN_IDS}")
    if len(s.logit_bias) > limits.MAX_LOGIT_BIAS_ENTRIES:
        return (f"sampling.logit_bias holds {len(s.logit_bias)} entries; "
                f"at most {limits.MAX_LOGIT_BIAS_ENTRIES}")
    bad = next((v for v in s.logit_bias.values()
                if not (math.isfinite(v) and abs(v) <= limits.MAX_LOGIT_BIAS)), None)
    if bad is not None:
        return f"sampling.logit_bias has a bias of {bad:g}; biases lie in [-100, 100]"
    kind = s.guided.WhichOneof("kind")
    if kind in ("json_schema", "regex", "lark") and \
            len(getattr(s.guided, kind).encode()) > limits.MAX_GUIDED_BYTES:
        return f"sampling.guided.{kind} is larger than {limits.MAX_GUIDED_BYTES} bytes"
    return None


def _envelope(r: scheduler_pb2.SubmitRequest) -> str | None:
    """Identifiers, sizes and tiers: the checks that need no model."""
    if not r.request_id:
        return "request_id must not be empty"
    problem = (_identifier(r.request_id, "request_id", limits.MAX_SUBMIT_REQUEST_ID_CHARS)
               or _identifier(r.tenant, "tenant", limits.MAX_TENANT_CHARS))
    if problem:
        return problem
    if not r.prompt_token_ids:
        return "prompt_token_ids must not be empty"
    if r.max_tokens <= 0:
        return "max_tokens must be > 0"
    if r.priority_tier >= tiers.NUM_TIERS:
        return f"priority_tier is {r.priority_tier}; the tiers are {tiers.describe()}"
    if r.num_resumed_output_tokens > len(r.prompt_token_ids):
        return (f"num_resumed_output_tokens ({r.num_resumed_output_tokens}) exceeds the "
                f"{len(r.prompt_token_ids)} tokens of prompt_token_ids it counts within")
    return _sampling(r.sampling)


def _against_model(r: scheduler_pb2.SubmitRequest, model: ModelInfo) -> str | None:
    # sampling.top_k past the vocabulary is no error: it keeps every token (the
    # executor clamps it), and the gateway passes such values through.
    vocab = model.vocab_size
    return (_token_ids("prompt_token_ids", r.prompt_token_ids, vocab)
            or _token_ids("sampling.stop_token_ids", r.sampling.stop_token_ids, vocab)
            or _token_ids("sampling.logit_bias", sorted(r.sampling.logit_bias), vocab))


def validate_submit(r: scheduler_pb2.SubmitRequest, core: Scheduler) -> str | None:
    """A message for the caller when the request can never be served, else None."""
    problem = _envelope(r)
    if problem is not None or core.model is None:
        return problem  # model limits are unknown until an executor registers
    return (_against_model(r, core.model)
            or core.admission_problem(len(r.prompt_token_ids), r.max_tokens))
