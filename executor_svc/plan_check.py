"""Validating a BatchPlan before anything is touched.

The plan comes from another process; a bad one must become a StepResult error (the
scheduler then resynchronizes), never a crash or a half-applied step. Every check here
runs before the runner mutates state, so a refused plan leaves the executor as it was.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

from protos import seq_columns, wire
from protos.continuum.v1 import executor_pb2 as pb


class PlanError(Exception):
    """A refused plan: ``code`` is a StepErrorCode, the message says what was wrong."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class PlanLimits:
    """What the plan is checked against."""

    incarnation: str
    num_blocks: int
    num_host_blocks: int
    block_size: int
    max_model_len: int
    vocab_size: int


class HeldSequence(Protocol):
    """What the checks read of a sequence the executor holds."""

    @property
    def num_tokens(self) -> int: ...

    @property
    def num_computed(self) -> int: ...

    @property
    def num_blocks(self) -> int: ...


def check_plan(plan: pb.BatchPlan, limits: PlanLimits,
               held: Mapping[int, HeldSequence]) -> list[int]:
    """Raises PlanError for the first problem found; returns an executable plan's cached
    seq ids (from whichever field holds them, read once)."""
    if plan.incarnation != limits.incarnation:
        _fail(pb.STEP_ERROR_CODE_STALE_INCARNATION,
              f"plan for incarnation {plan.incarnation!r}, this executor is "
              f"{limits.incarnation!r}")
    cached = _cached_ids(plan)
    _check_lengths(plan, cached)
    _check_new(plan, limits)
    _check_cached(plan, cached, limits, held)
    _check_copies(plan, limits)
    return cached


def _fail(code: int, message: str) -> None:
    raise PlanError(code, message)


def _cached_ids(plan: pb.BatchPlan) -> list[int]:
    packed = plan.packed_cached_seq_ids
    if packed and plan.cached_seq_ids:
        _fail(pb.STEP_ERROR_CODE_MALFORMED_PLAN,
              "both cached_seq_ids and packed_cached_seq_ids are set")
    if len(packed) % seq_columns.ID_BYTES:
        _fail(pb.STEP_ERROR_CODE_MALFORMED_PLAN,
              f"packed_cached_seq_ids holds {len(packed)} bytes, not "
              f"{seq_columns.ID_BYTES} a sequence")
    return wire.plan_cached_seq_ids(plan)


def _check_lengths(plan: pb.BatchPlan, cached: list[int]) -> None:
    n = len(cached)
    if not (len(plan.cached_num_scheduled_tokens) == len(plan.cached_num_new_blocks) == n):
        _fail(pb.STEP_ERROR_CODE_MALFORMED_PLAN, "cached_* arrays differ in length")
    if sum(plan.cached_num_new_blocks) != len(plan.cached_new_block_ids):
        _fail(pb.STEP_ERROR_CODE_MALFORMED_PLAN,
              "sum(cached_num_new_blocks) != len(cached_new_block_ids)")
    pairs = (("swap_out", plan.swap_out_src, plan.swap_out_dst),
             ("swap_in", plan.swap_in_src, plan.swap_in_dst),
             ("copy", plan.copy_src, plan.copy_dst))
    for name, src, dst in pairs:
        if len(src) != len(dst):
            _fail(pb.STEP_ERROR_CODE_MALFORMED_PLAN, f"{name} src/dst differ in length")
    ids = [s.seq_id for s in plan.new_seqs] + cached
    if len(set(ids)) != len(ids):
        _fail(pb.STEP_ERROR_CODE_MALFORMED_PLAN, "a seq_id appears twice in one plan")


def _check_blocks(ids, limit: int, what: str) -> None:
    bad = [b for b in ids if b >= limit]
    if bad:
        _fail(pb.STEP_ERROR_CODE_BAD_BLOCK, f"{what} block id {bad[0]} >= pool size {limit}")


def _check_new(plan: pb.BatchPlan, limits: PlanLimits) -> None:
    for seq in plan.new_seqs:
        n_tokens = len(seq.token_ids)
        end = seq.num_computed_tokens + seq.num_scheduled_tokens
        where = f"new seq {seq.seq_id}"
        if n_tokens == 0 or seq.num_prompt_tokens > n_tokens or end > n_tokens:
            _fail(pb.STEP_ERROR_CODE_MALFORMED_PLAN,
                  f"{where}: {n_tokens} tokens, prompt {seq.num_prompt_tokens}, "
                  f"computed {seq.num_computed_tokens} + scheduled {seq.num_scheduled_tokens}")
        if n_tokens > limits.max_model_len:
            _fail(pb.STEP_ERROR_CODE_MALFORMED_PLAN,
                  f"{where}: {n_tokens} tokens exceed max_model_len {limits.max_model_len}")
        if max(seq.token_ids) >= limits.vocab_size:
            _fail(pb.STEP_ERROR_CODE_MALFORMED_PLAN,
                  f"{where}: token id {max(seq.token_ids)} >= vocab size {limits.vocab_size}")
        bias = seq.sampling.logit_bias
        if bias and max(bias) >= limits.vocab_size:
            _fail(pb.STEP_ERROR_CODE_MALFORMED_PLAN,
                  f"{where}: logit_bias token id {max(bias)} >= vocab size {limits.vocab_size}")
        _check_blocks(seq.block_ids, limits.num_blocks, where)
        if len(seq.block_ids) * limits.block_size < end:
            _fail(pb.STEP_ERROR_CODE_MALFORMED_PLAN,
                  f"{where}: {len(seq.block_ids)} blocks cannot hold {end} tokens")


def _check_cached(plan: pb.BatchPlan, cached: list[int], limits: PlanLimits,
                  held: Mapping[int, HeldSequence]):
    finished = set(plan.finished_seq_ids)
    _check_blocks(plan.cached_new_block_ids, limits.num_blocks, "cached seq")
    for seq_id, n, new_blocks in zip(cached, plan.cached_num_scheduled_tokens,
                                     plan.cached_num_new_blocks, strict=True):
        state = held.get(seq_id)
        if state is None or seq_id in finished:
            _fail(pb.STEP_ERROR_CODE_UNKNOWN_SEQUENCE, f"cached seq {seq_id} is not held")
        end = state.num_computed + n
        if end > limits.max_model_len:
            _fail(pb.STEP_ERROR_CODE_MALFORMED_PLAN,
                  f"seq {seq_id}: position {end - 1} is past max_model_len {limits.max_model_len}")
        if end > state.num_tokens:
            _fail(pb.STEP_ERROR_CODE_MALFORMED_PLAN,
                  f"seq {seq_id}: {n} scheduled but only "
                  f"{state.num_tokens - state.num_computed} tokens are uncomputed")
        if (state.num_blocks + new_blocks) * limits.block_size < end:
            _fail(pb.STEP_ERROR_CODE_MALFORMED_PLAN,
                  f"seq {seq_id}: {state.num_blocks + new_blocks} blocks cannot hold {end} tokens")


def _check_copies(plan: pb.BatchPlan, limits: PlanLimits) -> None:
    _check_blocks(plan.swap_out_src, limits.num_blocks, "swap_out source")
    _check_blocks(plan.swap_out_dst, limits.num_host_blocks, "swap_out host")
    _check_blocks(plan.swap_in_src, limits.num_host_blocks, "swap_in host")
    _check_blocks(plan.swap_in_dst, limits.num_blocks, "swap_in destination")
    _check_blocks(plan.copy_src, limits.num_blocks, "copy source")
    _check_blocks(plan.copy_dst, limits.num_blocks, "copy destination")
