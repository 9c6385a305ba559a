"""Checks of the sampling extras both APIs share: logit_bias and structured output.

Called by gateway/validation.py's ``check_sampling`` for every request, gRPC or HTTP;
each answers (message, param) for a refusal, None to accept (validation raises). A
structured-output spec is compiled against the served tokenizer (gateway/guided_check.py).
"""

from __future__ import annotations

import math

from gateway.guided_check import GuidedCheck
from protos import limits
from protos.continuum.v1 import sampling_pb2


def problem(sampling: sampling_pb2.SamplingParams, vocab_size: int,
            guides: GuidedCheck) -> tuple[str, str] | None:
    found = logit_bias_problem(sampling.logit_bias, vocab_size)
    if found is None and sampling.HasField("guided"):
        message = guides.problem(sampling.guided)
        if message is not None:
            return message, "response_format"
    return found


def logit_bias_problem(bias, vocab_size: int) -> tuple[str, str] | None:
    """logit_bias: at most MAX_LOGIT_BIAS_ENTRIES token ids of the vocabulary, each bias
    a finite number in [-100, 100] (OpenAI's rules)."""
    if len(bias) > limits.MAX_LOGIT_BIAS_ENTRIES:
        return (f"logit_bias holds {len(bias)} entries; at most "
                f"{limits.MAX_LOGIT_BIAS_ENTRIES}", "logit_bias")
    for token_id, value in bias.items():
        if token_id >= vocab_size:
            return (f"logit_bias names token {token_id}, which is not a token id: the "
                    f"model's vocabulary has {vocab_size} tokens", "logit_bias")
        if not (math.isfinite(value) and abs(value) <= limits.MAX_LOGIT_BIAS):
            return (f"logit_bias[{token_id}] = {value:g}; a bias must be in "
                    f"[-{limits.MAX_LOGIT_BIAS:g}, {limits.MAX_LOGIT_BIAS:g}]", "logit_bias")
    return None
