"""Executing BatchPlans: the executor's persistent batch state and one step of work.

``Runner.execute(plan)`` checks the plan (executor_svc/plan_check.py), drops finished
sequences, adds new ones, applies deltas to cached ones, runs the block copies, one forward
pass over the flattened batch, and samples for every sequence whose computed tokens reach
its known tokens. A refused plan changes nothing; a failed forward drops every sequence
(the scheduler resends them in full after any error). A sequence whose own per-row work
fails (its grammar matcher, logit bias, penalties, draw, logprobs) fails alone: the step
stands for every other one, and the result lists it in ``row_failures``.
"""

from __future__ import annotations

import dataclasses
import logging
import time

import torch

from executor_svc.batch import SequenceState, StepInputs, build_inputs
from executor_svc.faults import FaultInjector, InjectedFault
from executor_svc.guided import Guides
from executor_svc.kv_cache import KVCache
from executor_svc.models.decoder import DecoderModel
from executor_svc.plan_check import PlanError, PlanLimits, check_plan
from executor_svc.sampler import (
    PLACEHOLDER_TOKEN,
    RowFailure,
    SampleOutput,
    Sampler,
    SampleRow,
    SamplingConfig,
    placeholder_row,
    random_seed,
)
from kernels.attention import AttentionBackend
from protos import seq_columns
from protos.continuum.v1 import executor_pb2 as pb

log = logging.getLogger("executor.runner")


class Runner:
    """Owns the per-sequence state of one executor incarnation; single-threaded."""

    def __init__(
        self, model: DecoderModel, kv: KVCache, backend: AttentionBackend, incarnation: str,
        sampler: Sampler | None = None,  # tensor parallelism swaps in its own (tp_serve.py)
        faults: FaultInjector | None = None,  # test-only (executor_svc/faults.py); None: inert
        guides: Guides | None = None,  # structured output; None: guided requests fail
    ) -> None:
        self.model = model
        self.kv = kv
        self.backend = backend
        self.sampler = sampler or Sampler(model.config.eos_token_ids)
        self.limits = PlanLimits(
            incarnation=incarnation,
            num_blocks=kv.num_blocks,
            num_host_blocks=kv.num_host_blocks,
            block_size=kv.spec.block_size,
            max_model_len=model.config.max_position_embeddings,
            vocab_size=model.config.vocab_size,
        )
        self.seqs: dict[int, SequenceState] = {}
        self.last_step_id = 0  # of the last plan executed (for heartbeats)
        self.faults = faults or FaultInjector()
        self.guides = guides
        self.graphs = None  # decode-step CUDA graphs (executor_svc/cuda_graphs.py), or None
        if self.faults.faults:
            log.warning("TEST-ONLY fault injection is on: %r", self.faults)
            self.sampler.inject_faults = True

    def reset(self, incarnation: str | None = None) -> None:
        """Forgets every sequence: the scheduler treats a (re-)introduced executor as empty.
        ``incarnation``: the new one plans will name (a re-registration)."""
        self.seqs.clear()
        if incarnation is not None:
            self.limits = dataclasses.replace(self.limits, incarnation=incarnation)

    def execute(self, plan: pb.BatchPlan) -> pb.StepResult:
        start = time.perf_counter()
        result = pb.StepResult(incarnation=plan.incarnation, step_id=plan.step_id)
        try:
            cached = check_plan(plan, self.limits, self.seqs)
        except PlanError as exc:
            log.warning("plan %d refused: %s", plan.step_id, exc)
            result.error_code, result.error_message = exc.code, str(exc)
            return result
        self.last_step_id = plan.step_id
        scheduled = self._apply(plan, cached)
        try:
            self._copy_blocks(plan)
            self.faults.check(plan)
            if scheduled:
                self._run(scheduled, result)
        except Exception as exc:  # any failure here is a resync, never a crash
            log.exception("step %d failed; dropping all %d sequences", plan.step_id,
                          len(self.seqs))
            result = pb.StepResult(
                incarnation=plan.incarnation, step_id=plan.step_id,
                error_code=pb.STEP_ERROR_CODE_INTERNAL, error_message=f"forward failed: {exc}",
                num_dropped_sequences=len(self.seqs),
            )
            self.seqs.clear()
        result.step_ms = (time.perf_counter() - start) * 1e3
        return result

    def _apply(self, plan: pb.BatchPlan,
               cached: list[int]) -> list[tuple[SequenceState, int]]:
        """Mutates state to the plan (``cached``: its cached seq ids, as check_plan read
        them); returns (sequence, tokens to compute) with n >= 1."""
        for seq_id in plan.finished_seq_ids:
            self.seqs.pop(seq_id, None)  # idempotent: a repeat or unknown id is fine
        scheduled = []
        for new in plan.new_seqs:
            # A seq_id still held is replaced: resends after an error are authoritative.
            seq = _new_state(new)
            if self.faults.faults:
                seq.fault = self.faults.row_stage(new)
            self.seqs[new.seq_id] = seq
            scheduled.append((seq, new.num_scheduled_tokens))
        offset = 0
        for seq_id, n, num_new in zip(cached, plan.cached_num_scheduled_tokens,
                                      plan.cached_num_new_blocks, strict=True):
            seq = self.seqs[seq_id]
            seq.block_table.extend(plan.cached_new_block_ids[offset : offset + num_new])
            offset += num_new
            scheduled.append((seq, n))
        return [(seq, n) for seq, n in scheduled if n > 0]

    def _copy_blocks(self, plan: pb.BatchPlan) -> None:
        # Before the forward: this step may write into blocks just swapped out or copied
        # from. Copy-on-write runs last, so it may read a block swapped in this step.
        self.kv.swap(list(plan.swap_out_src), list(plan.swap_out_dst),
                     list(plan.swap_in_src), list(plan.swap_in_dst))
        self.kv.copy(list(plan.copy_src), list(plan.copy_dst))

    def _run(self, scheduled: list[tuple[SequenceState, int]], result: pb.StepResult) -> None:
        device = self.model.embed.device
        inputs = build_inputs(scheduled, self.kv.spec.block_size, device)
        start = time.perf_counter()
        logits = self.forward(inputs)
        result.forward_ms = (time.perf_counter() - start) * 1e3
        for seq, n in scheduled:
            seq.num_computed += n
        if not inputs.sampling_seqs:
            return
        seqs = inputs.sampling_seqs
        early: dict[int, RowFailure] = {}  # rows whose matcher could not be made
        rows = [  # the common row inline: this runs for every sampling sequence each step
            SampleRow(s.sampling, s.seed, s.num_tokens, s.token_ids, s.num_prompt_tokens,
                      None, s.fault)
            if s.failure is None and not s.sampling.guided else self._row(s, i, early)
            for i, s in enumerate(seqs)
        ]
        out = self.sampler.sample(logits, rows)
        for i, failure in early.items():
            out.failed[i] = failure
            out.token_ids[i] = PLACEHOLDER_TOKEN
        for seq, token in zip(seqs, out.token_ids, strict=True):
            seq.token_ids.append(token)
        _fill_result(result, [s.seq_id for s in seqs], out)
        for i, failure in out.failed.items():
            seq = seqs[i]
            seq.failure = failure
            log.warning("sequence %d failed alone in the %s stage: %s", seq.seq_id,
                        failure.stage, failure.message)
            result.row_failures.add(seq_id=seq.seq_id, stage=failure.stage,
                                    message=failure.message,
                                    invalid_input=failure.invalid_input)

    def _row(self, seq: SequenceState, i: int, early: dict[int, RowFailure]) -> SampleRow:
        row = SampleRow(seq.sampling, seq.seed, seq.num_tokens, seq.token_ids,
                        seq.num_prompt_tokens, None, seq.fault)
        if seq.failure is not None:  # reported once already; its request has ended
            return placeholder_row(row)
        if seq.sampling.guided:
            try:
                row = dataclasses.replace(row, guide=self._guide(seq))
            except Exception as exc:  # its grammar alone: this row fails, not the step
                early[i] = RowFailure.of("guide", exc)
                return placeholder_row(row)
        return row

    def _guide(self, seq: SequenceState):
        """The sequence's grammar matcher, made on its first sample."""
        if seq.guide is None:
            if seq.fault == "guide":
                raise InjectedFault("injected failure in the guide stage")
            if self.guides is None:
                raise RuntimeError("structured output is not available on this executor")
            seq.guide = self.guides.new(seq.sampling.guided)
        return seq.guide

    def forward(self, inputs: StepInputs) -> torch.Tensor:  # [S, V]
        logits = self.graphs.run(inputs) if self.graphs is not None else None
        if logits is not None:  # a captured decode step, replayed
            return logits
        return self.model.forward(
            inputs.input_ids, inputs.positions, inputs.slot_mapping, inputs.meta,
            self.backend, self.kv, inputs.sample_rows,
        )


def _new_state(new: pb.NewSequence) -> SequenceState:
    sampling = SamplingConfig.from_proto(new.sampling)
    return SequenceState(
        seq_id=new.seq_id,
        token_ids=list(new.token_ids),
        num_computed=new.num_computed_tokens,
        block_table=list(new.block_ids),
        sampling=sampling,
        num_prompt_tokens=new.num_prompt_tokens,
        seed=sampling.seed if sampling.seed is not None else random_seed(),
    )


def _fill_result(result: pb.StepResult, seq_ids: list[int], out: SampleOutput) -> None:
    result.packed_seq_ids = seq_columns.pack(seq_ids)  # checked as bytes by the scheduler
    result.token_ids.extend(out.token_ids)
    if out.logprobs:  # only when some sequence asked
        result.logprobs.extend(out.logprobs)
        result.top_n.extend(len(ids) for ids in out.top_ids)
        for ids, values in zip(out.top_ids, out.top_logprobs, strict=True):
            result.top_token_ids.extend(ids)
            result.top_logprobs.extend(values)


def measure_prefill_tokens_per_s(model: DecoderModel, kv: KVCache, backend,
                                 num_tokens: int) -> float:
    """Times one ``num_tokens`` prefill, after a tiny warm-up, writing into blocks 0..; call
    it before any sequence exists (it overwrites their K/V)."""
    block_size = kv.spec.block_size
    num_tokens = max(1, min(num_tokens, kv.num_blocks * block_size))
    device = model.embed.device
    _prefill_once(model, kv, backend, min(8, block_size, num_tokens))
    synchronize(device)  # on a GPU the clock must see the kernels, not their launches
    start = time.perf_counter()
    _prefill_once(model, kv, backend, num_tokens)
    synchronize(device)
    return num_tokens / (time.perf_counter() - start)


def profile_activation_bytes(model: DecoderModel, kv: KVCache, backend, num_tokens: int) -> int:
    """CUDA only: the most memory a ``num_tokens`` prefill allocates beyond what was
    allocated before it (weights and ``kv``, which must hold ``num_tokens``), i.e. what every
    step may need on top of the KV pool."""
    device = model.embed.device
    synchronize(device)
    baseline = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    _prefill_once(model, kv, backend, num_tokens)
    synchronize(device)
    return max(0, torch.cuda.max_memory_allocated(device) - baseline)


def synchronize(device: torch.device) -> None:
    """Waits for the device's queued kernels; nothing to wait for on the CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _prefill_once(model: DecoderModel, kv: KVCache, backend, num_tokens: int) -> None:
    blocks = list(range(-(-num_tokens // kv.spec.block_size)))
    seq = SequenceState(0, [0] * num_tokens, 0, blocks, SamplingConfig(), num_tokens, 0)
    inputs = build_inputs([(seq, num_tokens)], kv.spec.block_size, model.embed.device)
    model.forward(inputs.input_ids, inputs.positions, inputs.slot_mapping, inputs.meta,
                  backend, kv, inputs.sample_rows)
