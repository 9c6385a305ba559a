"""A request's authoritative state: its token history and progress."""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

from protos import tiers


class RequestStatus(enum.IntEnum):
    """Ordered: everything >= FINISHED is terminal."""

    WAITING = 0  # never ran, or preempted by recompute (num_computed_tokens == 0)
    RUNNING = 1  # holds device blocks; the executor holds its state
    SWAPPED = 2  # its KV sits in host blocks
    FINISHED = 3


# The members as module constants, for the per-step paths: on Python 3.11 reading one off
# its class costs ~140 ns (EnumType defines __getattr__, so every read of a class attribute
# goes through Python), a global ~12 ns.
WAITING, RUNNING, SWAPPED, FINISHED = RequestStatus


class FinishReason(enum.IntEnum):
    """Values match continuum.v1.FinishReason."""

    STOP = 1
    LENGTH = 2
    ABORT = 3
    ERROR = 4


class DecodeClock:
    """What a request's progress is counted against: its ``num_computed_tokens`` is
    ``computed_base + epoch``. The scheduler's step clock ticks once a batched step
    (``epoch``, and ``step`` the step it ticked for), giving every running sequence one
    more computed token without touching it (core/decodes.py); a request that is not
    running rides ``IDLE``, which never ticks.
    """

    __slots__ = ("epoch", "step")

    def __init__(self) -> None:
        self.epoch = 0
        self.step = -1


IDLE = DecodeClock()  # never ticks: the clock of every request that is not running


@dataclasses.dataclass(eq=False, slots=True)
class Request:
    """One generation request, owned by the scheduler.

    Progress model (docs/design.md §2): ``num_computed_tokens`` catches up with
    ``len(token_ids)``; prefill, chunked prefill, decode and recompute are the
    same rule. ``0 <= num_computed_tokens <= len(token_ids)`` always holds.
    """

    request_id: str
    seq_id: int
    token_ids: list[int]
    num_prompt_tokens: int
    max_tokens: int
    sampling: Any = None  # opaque here; forwarded to the executor as is
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False
    min_tokens: int = 0
    tenant: str = "default"
    priority_tier: int = tiers.DEFAULT  # protos/tiers.py: 0 premium .. 2 best effort
    arrival_time: float = 0.0
    # Output tokens generated before this request was (re)submitted (a continuation).
    num_resumed_output_tokens: int = 0

    # State. The fields every step reads or writes come first, side by side, so one
    # sequence's per-step work touches as few cache lines as possible.
    # ``num_computed_tokens`` and ``scheduled_step`` are properties over these three: a
    # running sequence rides the scheduler's step clock, so its count advances a token
    # each batched step without being written (core/decodes.py, the only writer of
    # ``decode_clock``; everyone else uses the properties). ``scheduled_base`` is -1
    # while the clock schedules it (it decodes in the plan's bulk).
    computed_base: int = dataclasses.field(default=0, init=False, repr=False)
    scheduled_base: int = dataclasses.field(default=-1, init=False, repr=False)
    decode_clock: DecodeClock = dataclasses.field(default=IDLE, init=False, repr=False)
    status: RequestStatus = RequestStatus.WAITING
    # Filled at admission from the executor's model: what ends it.
    stop_ids: frozenset[int] = frozenset()
    length_limit: int = 0
    finish_reason: FinishReason | None = None
    first_scheduled_time: float | None = None
    admit_seq: int = 0  # admission order (victims: most recently admitted first)
    num_preemptions: int = 0
    num_swaps: int = 0  # of those, by swapping out (the rest recomputed)
    preempt_times: list[float] = dataclasses.field(default_factory=list)
    protected: bool = False  # preempted too often: not chosen again until it finishes
    # Failed steps it took part in (the executor raised, hung or died in them), and the
    # steps of its own it must still complete before it batches again
    # (Scheduler.step_failed).
    num_failed_steps: int = 0
    num_solo_steps_due: int = 0
    # Why it ended without finishing (ERROR, or ABORT by the server): what the client
    # is told. Empty for a normal end or a client's own abort.
    error: str = ""
    # With ``error``: the request's own input caused it (a grammar the executor's matcher
    # could not follow): the client is told INVALID_ARGUMENT, not INTERNAL.
    invalid_input: bool = False
    # With ``error``, set when the server shed it from the queue (overload): the client
    # is told RESOURCE_EXHAUSTED and to retry after this many seconds.
    retry_after_s: float = 0.0
    # Chain hashes of its first full blocks under the current executor's block size,
    # filled by the block manager as it needs them: each block of a request is hashed
    # once in its lifetime (admission, registration and every resume reuse them).
    block_hashes: list[int] = dataclasses.field(default_factory=list)
    # The token tuples those hashes were computed from, in step with them: the prefix
    # index keeps a reference to them (core/prefix_index.py).
    block_chunks: list[tuple[int, ...]] = dataclasses.field(default_factory=list)

    # Its priority_key as one int, set by the RunningSet (core/running.py) as it starts.
    running_key: int = dataclasses.field(default=0, init=False, repr=False)

    @property
    def num_computed_tokens(self) -> int:
        """Tokens whose K/V the executor holds or computes in a step already planned."""
        return self.computed_base + self.decode_clock.epoch

    @num_computed_tokens.setter
    def num_computed_tokens(self, value: int) -> None:
        self.computed_base = value - self.decode_clock.epoch

    @property
    def scheduled_step(self) -> int:
        """The last step that gave it tokens."""
        base = self.scheduled_base
        return base if base >= 0 else self.decode_clock.step

    @scheduled_step.setter
    def scheduled_step(self, value: int) -> None:
        """Set for a chunk or a step of its own; never for one in the plan's bulk."""
        self.scheduled_base = value

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        """Tokens generated by this scheduler (not counting resumed ones)."""
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status >= FINISHED

    def prepare(self, eos_token_ids: frozenset[int], max_model_len: int) -> None:
        """Caches what ends this request, for the per-step check in ``finish_reason_for``."""
        self.stop_ids = self.stop_token_ids | (frozenset() if self.ignore_eos else eos_token_ids)
        self.length_limit = min(self.num_prompt_tokens + self.max_tokens, max_model_len)

    def finish_reason_for(self, token: int) -> FinishReason | None:
        """Why the request stops now that ``token`` was appended, or None."""
        if token in self.stop_ids and (
            not self.min_tokens
            or self.num_output_tokens + self.num_resumed_output_tokens >= self.min_tokens
        ):
            return FinishReason.STOP
        if len(self.token_ids) >= self.length_limit:
            return FinishReason.LENGTH
        return None
