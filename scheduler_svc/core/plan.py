"""What one iteration produces: the plan that is sent, the record kept, the events.

* ``SchedulerOutput``: one step's plan, columnar, immutable once ``schedule()`` returns
  it (``scheduler_svc/plan.py`` encodes it; the loop keeps it until the answer comes).
* ``StepRecord``: the scheduler's bookkeeping for that step, filled while it is built,
  holding what ``update`` needs to apply the answer.
* ``Event``: what a client must hear, one shape from the core to the servicer.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any, NamedTuple

from protos import seq_columns
from scheduler_svc.core.preemption import CostModel
from scheduler_svc.core.request import FinishReason, Request


class Event(NamedTuple):
    """A new token (or none) and the finish reason (or None) for ``request``'s client;
    ``logprob`` the token's TokenLogprob when asked for (the loop attaches it).

    Read it by unpacking (``req, token, reason, logprob = ev``), not by attribute: sampled
    tokens' events (core/results.py) are plain equal 4-tuples, because a NamedTuple costs
    three times a tuple (~0.25 µs per decode, a quarter of a step at 1,024 running)."""

    request: Request
    token: int | None
    finish_reason: FinishReason | None
    logprob: Any = None


@dataclasses.dataclass(frozen=True)
class ModelInfo:
    """What the scheduler needs to know about the executor it plans for."""

    block_size: int
    num_blocks: int
    max_model_len: int
    vocab_size: int
    eos_token_ids: frozenset[int]
    num_host_blocks: int = 0
    cost: CostModel = CostModel()
    # Trailing positions every layer attends to (0: some layer sees the whole context):
    # KV further back is released as sequences grow (core/block_manager.py).
    kv_window: int = 0


class SchedulerOutput(NamedTuple):
    """One step's plan, columnar. ``new`` sequences travel in full; the first
    ``num_bulk`` of ``cached`` are the bulk's decodes (one token each, each
    samples). Immutable (a NamedTuple: the cheapest immutable record to build each
    step), and its lists are not changed after ``schedule()`` returns it."""

    step_id: int
    # (request, tokens scheduled this step) for sequences the executor lacks.
    new: list[tuple[Request, int]]
    cached: list[Request]
    cached_seq_ids: list[int]
    cached_num_tokens: list[int]
    cached_num_new_blocks: list[int]
    cached_new_block_ids: list[int]
    finished_seq_ids: list[int]
    swap_out: list[tuple[int, int]]  # device, host
    swap_in: list[tuple[int, int]]  # host, device
    num_batched_tokens: int
    num_prefill_tokens: int
    num_bulk: int
    # ``cached_seq_ids`` packed (protos/seq_columns.py), as the plan carries them.
    packed_cached_seq_ids: bytes = b""

    @property
    def is_empty(self) -> bool:
        return not (self.new or self.cached or self.finished_seq_ids or self.swap_out)

    def scheduled(self) -> Iterator[tuple[Request, int, bool]]:
        """(request, tokens this step, sent in full) for every scheduled sequence."""
        for req, n in self.new:
            yield req, n, True
        yield from ((r, n, False) for r, n in zip(self.cached, self.cached_num_tokens,
                                                   strict=True))


_new_plan = tuple.__new__  # SchedulerOutput without its Python-level __new__ (hot path)


class StepRecord:
    """One step as the scheduler keeps it: the plan's columns while it is built, then
    what ``update`` needs. Only the scheduler reads or writes it."""

    __slots__ = ("step_id", "new", "cached", "cached_seq_ids", "cached_num_tokens",
                 "cached_num_new_blocks", "cached_new_block_ids", "cached_prefills",
                 "swap_in", "num_batched_tokens", "num_prefill_tokens", "num_bulk",
                 "bulk_token_lists", "length_ends", "sampler_ids", "sampler_bytes",
                 "num_new_samplers", "ended", "removed", "isolated", "plan")

    def __init__(self, step_id: int) -> None:
        self.step_id = step_id
        self.new: list[tuple[Request, int]] = []
        self.cached: list[Request] = []
        self.cached_seq_ids: list[int] = []
        self.cached_num_tokens: list[int] = []
        self.cached_num_new_blocks: list[int] = []
        self.cached_new_block_ids: list[int] = []
        # Prefill chunks among ``cached``, last (they sample iff they complete).
        self.cached_prefills: list[Request] = []
        self.swap_in: list[tuple[int, int]] = []
        self.num_batched_tokens = 0
        self.num_prefill_tokens = 0
        self.num_bulk = 0
        # The bulk's token lists, in ``cached`` order, and the indices of those whose
        # sample is their last by length (core/decodes.py).
        self.bulk_token_lists: list[list[int]] = []
        self.length_ends: list[int] = []
        # The seq ids the executor's answer lists, in order, if every sample comes back;
        # the first ``num_new_samplers`` are new sequences, then the bulk decodes.
        self.sampler_ids: list[int] = []
        self.sampler_bytes = b""  # the same, packed (protos/seq_columns.py)
        self.num_new_samplers = 0
        # Requests the building of this step ended (their clients hear it at once).
        self.ended: list[Event] = []
        # Sequences that left the running set while it was unanswered (their samples
        # need the per-sequence checks).
        self.removed: set[int] = set()
        # A suspect's step of its own (core/isolation.py): the only sequence in it.
        self.isolated: Request | None = None
        self.plan: SchedulerOutput | None = None

    def add_new(self, req: Request, n: int, swap_in: list[tuple[int, int]] = ()) -> None:
        """``req`` starts (or resumes, its blocks ``swap_in`` copied back first) with
        ``n`` tokens: the executor gets it in full."""
        self.new.append((req, n))
        self.swap_in.extend(swap_in)

    def end(self, req: Request, reason: FinishReason) -> None:
        """``req`` ended while this step was built (its transition is done)."""
        self.ended.append(Event(req, None, reason))

    def add_chunk(self, req: Request, n: int, new_blocks: list[int]) -> None:
        """``req`` (running, known to the executor) computes ``n`` more prompt tokens."""
        self.cached.append(req)
        self.cached_seq_ids.append(req.seq_id)
        self.cached_prefills.append(req)
        self.cached_num_tokens.append(n)
        self.cached_num_new_blocks.append(len(new_blocks))
        self.cached_new_block_ids.extend(new_blocks)

    def freeze(self, finished_seq_ids: list[int],
               swap_out: list[tuple[int, int]]) -> SchedulerOutput:
        """The plan to send, and the answer's expected seq ids (``sampler_ids``)."""
        self.plan = _new_plan(SchedulerOutput, (
            self.step_id, self.new, self.cached, self.cached_seq_ids,
            self.cached_num_tokens, self.cached_num_new_blocks, self.cached_new_block_ids,
            finished_seq_ids, swap_out, self.swap_in, self.num_batched_tokens,
            self.num_prefill_tokens, self.num_bulk, seq_columns.pack(self.cached_seq_ids)))
        return self.plan

    def list_samplers(self) -> None:
        """The answer's seq ids, in plan order, if every sample comes back (new sequences,
        then the cached ones: decodes all sample, a prefill chunk when it completes)."""
        ids = [r.seq_id for r, _ in self.new if r.num_computed_tokens >= len(r.token_ids)]
        self.num_new_samplers = len(ids)
        cached_ids = self.cached_seq_ids
        num_decodes = len(cached_ids) - len(self.cached_prefills)
        done = [r.seq_id for r in self.cached_prefills
                if r.num_computed_tokens >= len(r.token_ids)]
        # An answer's packed ids are checked against these bytes; the decodes' part is the
        # plan's own packed column (its ints were read once, at freeze, while cached).
        decodes = self.plan.packed_cached_seq_ids[:num_decodes * seq_columns.ID_BYTES]
        self.sampler_bytes = (seq_columns.pack(ids) + decodes + seq_columns.pack(done)
                              if ids or done else decodes)
        ids += cached_ids[:num_decodes]
        ids += done
        self.sampler_ids = ids
