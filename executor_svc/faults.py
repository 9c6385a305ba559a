"""Test-only fault injection: make one request's step fail on purpose.

Inert unless ``CONTINUUM_FAULT_INJECT`` is set (never set it in production; the executor
reads it at start, executor_svc/settings.py, and hands the Runner its injector). Its value is
one or more ``ACTION=TOKEN`` separated by commas, ACTION one of:

* ``raise_on_token`` — the forward pass of a step raises when the plan sends in full a
  sequence whose prompt contains token id TOKEN (the scheduler sees
  STEP_ERROR_CODE_INTERNAL, as for a real forward failure);
* ``exit_on_token`` — the executor process dies (``os._exit(1)``) in that step, as for a
  request that crashes the device or the process;
* ``row_STAGE`` (STAGE one of executor_svc/sampler.py ROW_STAGES: ``row_mask``,
  ``row_choose``, ...) — that sequence's own per-row work raises in STAGE every time it
  samples, as for a grammar matcher or sampler row that fails: the step goes on for every
  other sequence and only that request ends with an error.

tests/integration/test_poison.py uses it.
"""

from __future__ import annotations

import logging
import os

from protos.continuum.v1 import executor_pb2 as pb

ENV_FAULT_INJECT = "CONTINUUM_FAULT_INJECT"
ROW_STAGES = ("guide", "logit_bias", "penalties", "mask", "min_tokens", "choose", "advance",
              "logprobs")  # a sampling row's stages, in the order the sampler runs them
ACTIONS = ("raise_on_token", "exit_on_token", *(f"row_{stage}" for stage in ROW_STAGES))
log = logging.getLogger("executor.faults")


class InjectedFault(RuntimeError):
    """Raised inside a step by ``raise_on_token``, or inside one row by ``row_STAGE``."""


class FaultInjector:
    """``check(plan)`` before a step's forward pass; does nothing unless configured."""

    def __init__(self, faults: dict[int, str] | None = None) -> None:
        self.faults = faults or {}  # token id → action

    @classmethod
    def parse(cls, spec: str) -> FaultInjector:
        """From ``CONTINUUM_FAULT_INJECT``'s value (read in executor_svc/settings.py; "": inert);
        ValueError naming the variable if it is malformed."""
        faults = {}
        for item in filter(None, spec.split(",")):
            action, _, token = item.strip().partition("=")
            if action not in ACTIONS or not token.isdigit():
                raise ValueError(f"{ENV_FAULT_INJECT}={spec!r}: expected one or more of "
                                 f"{', '.join(a + '=TOKEN_ID' for a in ACTIONS)}")
            faults[int(token)] = action
        return cls(faults)

    def __repr__(self) -> str:  # as the variable's value
        return ",".join(f"{action}={token}" for token, action in self.faults.items())

    def row_stage(self, new: pb.NewSequence) -> str:
        """The per-row stage in which ``new``'s sampling must fail ("": none)."""
        for token in self.faults.keys() & set(new.token_ids[:new.num_prompt_tokens]):
            if self.faults[token].startswith("row_"):
                return self.faults[token].removeprefix("row_")
        return ""

    def check(self, plan: pb.BatchPlan) -> None:
        if not self.faults:
            return
        for new in plan.new_seqs:
            for token in self.faults.keys() & set(new.token_ids[:new.num_prompt_tokens]):
                action = self.faults[token]
                if action.startswith("row_"):
                    continue  # raised by the sampler, in its row alone
                log.error("injected fault (%s) for sequence %d", action, new.seq_id)
                if action == "exit_on_token":
                    os._exit(1)
                raise InjectedFault(f"injected fault for token {token}")
