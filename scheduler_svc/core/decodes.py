"""The decodes of a step: every running sequence rides the step clock, and the decoding
ones are the plan's bulk.

The progress rule is docs/design.md §2 (``num_computed_tokens = computed_base +
clock.epoch``). A base moves only when its sequence starts or stops running (rebased onto
the other clock), when a prefill chunk or a step of its own computes tokens, and when a
tick found it not decoding (it gives that token back). The decoding ones are
``ids``/``tokens`` (two dicts in one order, the plan's bulk columns as they are); the
rest (``others``) join the bulk at the next step that they decode. A calendar keyed by
epoch names the riders that need a look: their token starts a block, or their sample is
their last by length (``StepRecord.length_ends``).
"""

from __future__ import annotations

import operator
from collections.abc import Callable

from scheduler_svc.core.block_manager import NEEDS_GROW, BlockManager
from scheduler_svc.core.plan import StepRecord
from scheduler_svc.core.request import IDLE, DecodeClock, Request

_order_key = operator.attrgetter("running_key")  # the RunningSet's priority order
_seq_id = operator.attrgetter("seq_id")


def _each_block(counts: list[int], blocks: list[int]) -> list[list[int]]:
    """``blocks`` cut into each sequence's (``counts``; -1: none, it was preempted)."""
    each, at = [], 0
    for n in counts:
        each.append(blocks[at:at + max(n, 0)])
        at += max(n, 0)
    return each


class Decodes:
    """Owns the step clock, the bulk (``ids``, ``tokens``), ``others`` and the calendar:
    the only writer of a request's ``decode_clock`` and of ``computed_base`` but for
    ``num_computed_tokens``' setter. Every running sequence is in exactly one of
    ``ids`` and ``others``."""

    __slots__ = ("clock", "ids", "tokens", "others", "_starts", "_lasts", "_look")

    def __init__(self) -> None:
        self.clock = DecodeClock()
        self.ids: dict[Request, int] = {}
        self.tokens: dict[Request, list[int]] = {}
        self.others: dict[Request, None] = {}
        # The calendar: epoch → riders whose token then starts a block (``_starts``), or
        # whose sample then is their last by length and starts none (``_lasts``); each
        # rider's one live look is ``_look[req]``, ``epoch << 1 | 1`` for a start.
        self._starts: dict[int, list[Request]] = {}
        self._lasts: dict[int, list[Request]] = {}
        self._look: dict[Request, int] = {}

    def add(self, req: Request) -> None:
        """``req`` starts running: it rides the step clock from now on."""
        clock = self.clock
        req.computed_base -= clock.epoch  # from IDLE, whose epoch is 0
        req.decode_clock = clock
        self.others[req] = None

    def remove(self, req: Request) -> None:
        """``req`` stops running: rebased onto IDLE."""
        if req in self.ids:
            self._leave(req)
        del self.others[req]
        req.computed_base += self.clock.epoch
        req.decode_clock = IDLE

    def recheck_all(self) -> None:
        """An answer the bulk cannot trust (a sample missing or unasked for): every rider
        goes back to ``others``, to join again once it has a decode to do."""
        for req in list(self.ids):
            self._leave(req)
        self._starts.clear()
        self._lasts.clear()

    def schedule(self, rec: StepRecord, bm: BlockManager, step: int, ahead: bool,
                 make_room: Callable[[Request, int], bool]) -> list[Request]:
        """Step 2 of an iteration: one token for every running decode (the bulk), into
        ``rec``; then the clock ticks. Returns the running sequences that do not decode
        (prefills), their tick's token given back.

        ``ahead``: an unanswered step exists; a sequence whose sample is pending
        (``num_computed_tokens == len(token_ids)``) decodes the token to come, unless
        that token is certainly its last. ``make_room(req, n)`` preempts until ``req``
        can hold ``n`` positions (False: ``req`` itself stopped running)."""
        clock, ids, tokens = self.clock, self.ids, self.tokens
        epoch = clock.epoch
        bs = bm.block_size
        prefills: list[Request] = []
        if self.others:
            joining = []
            for req in self.others:
                c = req.computed_base + epoch
                pending = len(req.token_ids) - c
                if pending == 1 or (pending == 0 and ahead and c + 1 < req.length_limit):
                    joining.append(req)
                else:
                    prefills.append(req)
            for req in joining:
                del self.others[req]
                ids[req] = req.seq_id
                tokens[req] = req.token_ids
                req.scheduled_base = -1  # scheduled by the clock from now on
                c = req.computed_base + epoch  # (a resume holds its whole context's blocks)
                self._plan(req, c, epoch, bs, len(bm.block_table(req.seq_id)) * bs - c)
        look = self._look
        starts = self._starts.pop(epoch, None)
        if starts:
            code = epoch << 1 | 1
            starts = [r for r in dict.fromkeys(starts) if look.get(r) == code]
        lasts = self._lasts.pop(epoch, None)
        if lasts:
            code = epoch << 1
            lasts = [r for r in dict.fromkeys(lasts) if look.get(r) == code]
        counts: list[int] | None = None  # the blocks each start got, if not one each
        blocks: list[int] = []
        if not starts:
            starts = []
        elif not bm.window and len(starts) <= bm.num_free_blocks:
            # Nobody can run short: the starts' blocks in one take, in any order.
            blocks = bm.append_each(list(map(_seq_id, starts)))
        else:  # one at a time, in priority order, making room where the pool is short
            starts.sort(key=_order_key)
            counts = []
            for req in starts:
                new: list[int] = []
                if req.decode_clock is clock:  # (else preempted to make room for another)
                    c = req.computed_base + epoch
                    block = bm.try_append_block(req.seq_id, c + 1)
                    if block is NEEDS_GROW:
                        new = bm.grow(req.seq_id, c + 1, 1) if make_room(req, c + 1) else []
                    elif block is not None:
                        new = [block]
                counts.append(len(new))
                blocks += new
            if any(r.decode_clock is not clock for r in starts):  # preempted since: their
                each = _each_block(counts, blocks)  # blocks went with them
                kept = [i for i, r in enumerate(starts) if r.decode_clock is clock]
                blocks = [b for i in kept for b in each[i]]
                starts, counts = [starts[i] for i in kept], [counts[i] for i in kept]
        if lasts:
            lasts = [r for r in lasts if r.decode_clock is clock]
        tail = starts + lasts if lasts else starts  # to the end of the bulk's order
        ends: list[Request] = []
        if tail:
            far: list[Request] = []  # next look at epoch + bs: its next block start
            limit_gap = bs + 2
            for req in tail:
                del ids[req], tokens[req]
                ids[req] = req.seq_id
                tokens[req] = req.token_ids
                c = req.computed_base + epoch
                left = req.length_limit - c
                if left <= 2:
                    ends.append(req)
                elif left > limit_gap:  # (a last's look has left <= 2)
                    far.append(req)
                else:
                    self._plan(req, c + 1, epoch + 1, bs)
            if far:
                at = epoch + bs
                look.update(dict.fromkeys(far, at << 1 | 1))
                later = self._starts.get(at)
                if later is None:
                    self._starts[at] = far
                else:
                    later.extend(far)
        num_bulk = rec.num_bulk = len(ids)
        rec.cached = list(ids)
        rec.cached_seq_ids = list(ids.values())
        rec.bulk_token_lists = list(tokens.values())
        rec.cached_num_tokens = [1] * num_bulk
        nnew = rec.cached_num_new_blocks = [0] * num_bulk
        clock.epoch = epoch + 1  # every running sequence computed a token in ``step``:
        clock.step = step  # "num_computed_tokens += 1; scheduled_step = step"
        if tail:
            lo = num_bulk - len(tail)  # the bulk's tail, in the order they moved
            nnew[lo:lo + len(starts)] = [1] * len(starts) if counts is None else counts
            rec.cached_new_block_ids.extend(blocks)
            for req in ends:
                rec.length_ends.append(lo + tail.index(req))
                self._leave(req)  # it decoded its last: nothing more to decode
        running = []
        for req in prefills:  # they computed nothing: the tick's token goes back
            if req.decode_clock is clock:
                req.computed_base -= 1
                running.append(req)
        if len(running) > 1:
            running.sort(key=_order_key)  # the prefill stage goes in priority order
        return running

    def _leave(self, req: Request) -> None:
        """A rider goes back to ``others`` (its count is unchanged: it rides the clock)."""
        del self.ids[req], self.tokens[req]
        self._look.pop(req, None)
        req.scheduled_base = self.clock.step
        self.others[req] = None

    def _plan(self, req: Request, c: int, epoch: int, bs: int, to_start: int = -1) -> None:
        """Its next look: at the schedule of clock ``epoch`` it will have computed ``c``;
        the first epoch from then whose token starts a block (``to_start`` epochs on:
        by default the next multiple of ``bs``), or whose sample is its last by length."""
        if to_start < 0:
            to_start = (-c) % bs
        to_last = max(0, req.length_limit - 2 - c)
        at = epoch + min(to_start, to_last)
        start = to_start <= to_last
        self._look[req] = at << 1 | start
        calendar = self._starts if start else self._lasts
        due = calendar.get(at)
        if due is None:
            calendar[at] = [req]
        else:
            due.append(req)

    def assert_invariants(self, running: list[Request], bm: BlockManager | None = None) -> None:
        """With ``bm``: a rider holds just the blocks its computed positions fill (a block
        start's append is then its one new block)."""
        clock = self.clock
        assert self.ids.keys() == self.tokens.keys()
        assert not (self.ids.keys() & self.others.keys())
        assert self.ids.keys() | self.others.keys() == set(running)
        assert self._look.keys() <= self.ids.keys()
        for req in running:
            assert req.decode_clock is clock
        for req, seq_id in self.ids.items():
            assert seq_id == req.seq_id and self.tokens[req] is req.token_ids
            assert req.scheduled_base == -1
            code = self._look.get(req)
            if code is not None:
                epoch = code >> 1
                assert epoch >= clock.epoch, "its look is past"
                calendar = self._starts if code & 1 else self._lasts
                assert req in calendar.get(epoch, ()), "no look planned"
            if bm is not None and not bm.window:
                held = len(bm.block_table(req.seq_id))
                assert held == -(-req.num_computed_tokens // bm.block_size), "blocks held"
