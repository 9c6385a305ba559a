"""Every field of a SubmitRequest, checked at the scheduler.

The internal plane does not trust its caller: a request the executor would refuse or
choke on (``logprobs: 100000`` held a batch 19 s, 2,380 resyncs) is refused with
INVALID_ARGUMENT naming the field and its limit. Limits and sampling checks are the
gateway's (``protos/limits.py``, ``protos/sampling_checks.py``), so a refusal reads the
same at either door; model-dependent ones wait until an executor has registered.
"""

from __future__ import annotations

from protos import limits, sampling_checks, tiers
from protos.continuum.v1 import scheduler_pb2
from scheduler_svc.core import ModelInfo, Scheduler


def _envelope(r: scheduler_pb2.SubmitRequest) -> str | None:
    """Identifiers, sizes and tiers: the checks that need no model."""
    if not r.request_id:
        return "request_id must not be empty"
    problem = (sampling_checks.identifier_problem(r.request_id, "request_id",
                                                  limits.MAX_SUBMIT_REQUEST_ID_CHARS)
               or sampling_checks.identifier_problem(r.tenant, "tenant", limits.MAX_TENANT_CHARS))
    if problem:
        return problem
    if not r.prompt_token_ids:
        return "prompt_token_ids must not be empty"
    if problem := sampling_checks.MAX_TOKENS.problem(r.max_tokens):
        return problem
    if r.priority_tier >= tiers.NUM_TIERS:
        return f"priority_tier is {r.priority_tier}; the tiers are {tiers.describe()}"
    if r.num_resumed_output_tokens > len(r.prompt_token_ids):
        return (f"num_resumed_output_tokens ({r.num_resumed_output_tokens}) exceeds the "
                f"{len(r.prompt_token_ids)} tokens of prompt_token_ids it counts within")
    found = sampling_checks.sampling_problem(r.sampling)
    return found and found[0]


def _against_model(r: scheduler_pb2.SubmitRequest, model: ModelInfo) -> str | None:
    # sampling.top_k past the vocabulary is no error: it keeps every token (the
    # executor clamps it), and the gateway passes such values through.
    found = sampling_checks.vocabulary_problem(r.sampling, model.vocab_size)
    return (sampling_checks.token_ids_problem("prompt_token_ids", r.prompt_token_ids,
                                              model.vocab_size)
            or (found and found[0]))


def validate_submit(r: scheduler_pb2.SubmitRequest, core: Scheduler) -> str | None:
    """A message for the caller when the request can never be served, else None."""
    problem = _envelope(r)
    if problem is not None or core.model is None:
        return problem  # model limits are unknown until an executor registers
    return (_against_model(r, core.model)
            or core.admission_problem(len(r.prompt_token_ids), r.max_tokens))
