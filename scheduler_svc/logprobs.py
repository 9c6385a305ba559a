"""Carries a step's logprobs from the executor's StepResult to the client events.

The core knows nothing about logprobs; the loop calls `with_logprobs` only when
some sequence in the step asked for them (the result's `logprobs` is non-empty),
giving each event whose token has one its TokenLogprob (``Event.logprob``).
"""

from __future__ import annotations

import math

from protos import wire
from protos.continuum.v1 import executor_pb2, sampling_pb2
from scheduler_svc.core import Event


def with_logprobs(events: list[Event], result: executor_pb2.StepResult) -> list[Event]:
    index = {seq_id: i for i, seq_id in enumerate(wire.result_seq_ids(result))}
    starts, total = [], 0
    for n in result.top_n:  # top alternatives are flattened, top_n[i] per sequence
        starts.append(total)
        total += n
    out = []
    for ev in events:
        req, token, reason, _ = ev
        i = index.get(req.seq_id) if token is not None else None
        if i is None or i >= len(result.logprobs) or math.isnan(result.logprobs[i]):
            out.append(ev)
            continue
        item = sampling_pb2.TokenLogprob(token_id=token, logprob=result.logprobs[i])
        if i < len(starts):
            lo, hi = starts[i], starts[i] + result.top_n[i]
            item.top_token_ids.extend(result.top_token_ids[lo:hi])
            item.top_logprobs.extend(result.top_logprobs[lo:hi])
        out.append(Event(req, token, reason, item))
    return out
