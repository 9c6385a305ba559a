"""Decode mode: running sequences that decode one token a step ride a shared clock.

The hottest path of the scheduler is "every running sequence decodes one token". A
sequence in decode mode is not touched for that: advancing the shared DecodeClock
(in ``schedule``) gives each of them one more computed token and this step as its last
scheduled one (``Request.num_computed_tokens`` reads ``computed_base + clock.epoch``).
Their seq ids and token lists are kept as two dicts in one order (``ids``,
``tokens``), which become the plan's bulk columns as they are.

A calendar keyed by clock epoch names the few that need a look at a step: their token
starts a block (``take_due`` returns them; the scheduler appends the block and calls
``block_start``), or their sample could be their last (``take_due`` makes them leave).
Everything else about a running sequence — a prefill chunk, a preemption — happens in
explicit mode, one sequence at a time; one whose prompt's last chunk is computed in a
step the clock ticked for joins at once (``prefilled``), so its first decode rides too.

    ===========  ==================  =====================================
    mode         in                  num_computed_tokens
    ===========  ==================  =====================================
    explicit     ``explicit``        ``req.computed_base``
    decode mode  ``ids``/``tokens``  ``req.computed_base + clock.epoch``
    ===========  ==================  =====================================
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Callable

from scheduler_svc.core.block_manager import NEEDS_GROW, BlockManager
from scheduler_svc.core.plan import StepRecord
from scheduler_svc.core.request import RUNNING, DecodeClock, Request

# Calendar events (the low bit of an event's code, ``epoch << 1 | kind``): the
# sequence's token at that epoch starts a block, or it leaves.
_DUE_START, _DUE_LEAVE = 0, 1
# The smallest block size decode mode is used for (below it every step is a boundary).
MIN_BLOCK_SIZE = 2
_seq_id = operator.attrgetter("seq_id")
_order_key = operator.attrgetter("running_key")  # the RunningSet's priority order


class DecodeMode:
    """Owns the decode clock, the calendar and the bulk columns; the only writer of a
    request's ``_clock``, and of its ``_computed`` as it enters or leaves.

    Every running sequence is in exactly one of ``explicit`` and ``ids`` (``tokens``
    has the same keys in the same order). A sequence leaves decode mode (its count
    written back) before anything but the clock changes it.
    """

    __slots__ = ("clock", "ids", "tokens", "explicit", "_due", "_event", "_num_removed")

    def __init__(self) -> None:
        self.clock = DecodeClock()
        self.ids: dict[Request, int] = {}
        self.tokens: dict[Request, list[int]] = {}
        self.explicit: dict[Request, None] = {}
        self._due: dict[int, list[Request]] = {}  # epoch → sequences with an event then
        self._event: dict[Request, int] = {}  # its one live event: epoch << 1 | kind
        self._num_removed = 0  # sequences that left the running set, ever

    def add(self, req: Request) -> None:
        """``req`` started running: explicit until its first decode."""
        self.explicit[req] = None

    def remove(self, req: Request) -> None:
        """``req`` left the running set."""
        if req.decode_clock is not None:
            self.leave(req)
        del self.explicit[req]
        self._num_removed += 1

    def take_due(self) -> list[Request]:
        """This step's calendar: a sequence whose sample could be its last leaves decode
        mode now; returns those whose token starts a block (still in decode mode)."""
        clock = self.clock
        epoch = clock.epoch
        due = self._due.pop(epoch, None)
        starts: list[Request] = []
        if due:
            event = self._event
            start, leave = epoch << 1 | _DUE_START, epoch << 1 | _DUE_LEAVE
            for req in dict.fromkeys(due):  # once each, in case it came back
                code = event.get(req)
                if code == start:
                    starts.append(req)
                elif code == leave:
                    self.leave(req)
                # else it left decode mode since (and maybe came back)
        return starts

    def schedule(self, rec: StepRecord, bm: BlockManager, step: int, ahead: bool,
                 make_room: Callable[[Request, int], bool]) -> list[Request]:
        """Step 2 of an iteration: one token for every running decode, into ``rec``
        (the bulk first, then the explicit decodes; a block start's block delta is the
        bulk's tail). Returns the running sequences that are not decoding (prefills).

        ``ahead``: unanswered steps exist; a sequence whose sample is pending
        (``num_computed_tokens == len(token_ids)``) decodes the token to come, unless
        that token is certainly its last. ``make_room(req, n)`` preempts until ``req``
        can hold ``n`` positions (False: it lost its turn)."""
        explicit = self.explicit
        due = self.take_due()
        removed_before = self._num_removed
        leave_after: list[Request] = []  # decode this step, then leave decode mode
        if due and not bm.window and len(due) + len(explicit) <= bm.num_free_blocks:
            # No one can run short of a block: the starts need no order, nor one by one.
            starts, blocks = due, self._start_all(due, bm, leave_after)
            order = sorted(explicit, key=_order_key) if len(explicit) > 1 else list(explicit)
        else:
            starts, blocks = [], []  # bulk sequences whose token starts a block, theirs
            if due or len(explicit) > 1:  # blocks go in priority order
                order = sorted(itertools.chain(explicit, due), key=_order_key)
            else:
                order = list(explicit)
        prefills: list[Request] = []
        decodes: list[Request] = []
        grew = self._one_by_one(order, bm, step, ahead, make_room, prefills, decodes,
                                starts, blocks, leave_after)
        # Everything in decode mode decodes now (the clock advance below).
        num_bulk = rec.num_bulk = len(self.ids)
        rec.cached = list(self.ids)
        rec.cached.extend(decodes)
        rec.cached_seq_ids = list(self.ids.values())
        rec.cached_seq_ids.extend(map(_seq_id, decodes))
        rec.bulk_token_lists = list(self.tokens.values())
        clock = self.clock
        if starts and self._num_removed != removed_before:  # the bulk's tail: less
            blocks = [b for r, b in zip(starts, blocks, strict=True)  # preempted ones
                      if r.decode_clock is clock]
        clock.epoch += 1  # everything in decode mode decodes in ``step``: this is their
        clock.step = step  # "num_computed_tokens += 1; scheduled_step = step"
        for req in leave_after:
            if req.decode_clock is clock:
                self.leave(req)
        if (bs := bm.block_size) >= MIN_BLOCK_SIZE:
            for req in decodes:
                if req.status is RUNNING:
                    self.enter(req, bs)
        k = len(rec.cached)
        nnew = [0] * k
        if blocks:
            nnew[num_bulk - len(blocks):num_bulk] = [1] * len(blocks)
            rec.cached_new_block_ids.extend(blocks)
        for i, new in grew:
            nnew[num_bulk + i] = len(new)
            rec.cached_new_block_ids.extend(new)
        rec.cached_num_tokens = [1] * k  # the record's first columns, as ``cached`` above
        rec.cached_num_new_blocks = nnew
        return prefills

    def _start_all(self, starts: list[Request], bm: BlockManager,
                   leave_after: list[Request]) -> list[int]:
        """The calendar's block starts, when the pool holds a block for each: their
        blocks in one take, each moved to the bulk's tail, its next event planned (the
        next start, ``bs`` epochs on, for all but those near their length limit).
        Returns the blocks, in ``starts``' order."""
        seq_ids = list(map(_seq_id, starts))
        blocks = bm.append_each(seq_ids)
        ids, tokens = self.ids, self.tokens
        for req, seq_id in zip(starts, seq_ids, strict=True):  # to the end of the order
            del ids[req]
            ids[req] = seq_id
            del tokens[req]
            tokens[req] = req.token_ids
        bs, epoch = bm.block_size, self.clock.epoch
        far: list[Request] = []  # what _plan(req, c + 1, epoch + 1) makes a start at
        for req in starts:  # epoch + bs, as its block's remaining bs - 1 tokens fill
            c = req.computed_base + epoch
            if req.length_limit - c > bs + 2:
                far.append(req)
            elif not self._plan(req, c + 1, epoch + 1, bs):
                leave_after.append(req)
        if far:
            at = epoch + bs
            self._event.update(dict.fromkeys(far, at << 1 | _DUE_START))
            due = self._due.get(at)
            if due is None:
                self._due[at] = far
            else:
                due.extend(far)
        return blocks

    def _one_by_one(self, order: list[Request], bm: BlockManager, step: int, ahead: bool,
                    make_room: Callable[[Request, int], bool], prefills: list[Request],
                    decodes: list[Request], starts: list[Request], blocks: list[int],
                    leave_after: list[Request]) -> list[tuple[int, list[int]]]:
        """The calendar's block starts (still in decode mode: they get their block, or
        leave, as they must to preempt) and the explicit sequences: a decode goes to
        ``decodes``, anything else to ``prefills``. Returns (index in decodes, new
        block ids) for the decodes that grew."""
        bs = bm.block_size
        clock = self.clock
        epoch = clock.epoch
        ids, tokens = self.ids, self.tokens
        append = decodes.append
        grew: list[tuple[int, list[int]]] = []
        for req in order:
            if req.decode_clock is clock:  # in decode mode, and its token starts a block
                c = req.computed_base + epoch
                block = bm.try_append_block(req.seq_id, c + 1)
                if block is not NEEDS_GROW:
                    if block is not None:
                        blocks.append(block)
                        starts.append(req)
                        del ids[req], tokens[req]  # to the end of the order
                        ids[req] = req.seq_id
                        tokens[req] = req.token_ids
                    if not self._plan(req, c + 1, epoch + 1, bs):
                        leave_after.append(req)
                    continue
                self.leave(req)  # it may have to preempt: one by one
            if req.status is not RUNNING:
                continue  # preempted earlier in this loop
            computed = req.computed_base
            pending = len(req.token_ids) - computed
            if pending != 1 and (pending or not ahead
                                 or computed + 1 >= req.length_limit):
                prefills.append(req)
                continue
            if computed % bs == 0:  # the token starts a new block
                block = bm.try_append_block(req.seq_id, computed + 1)
                if block is NEEDS_GROW:
                    if not make_room(req, computed + 1):
                        continue  # it lost its turn
                    new = bm.grow(req.seq_id, computed + 1, 1)
                    if new:
                        grew.append((len(decodes), new))
                elif block is not None:
                    grew.append((len(decodes), [block]))
            req.computed_base = computed + 1
            req.scheduled_base = step
            append(req)
        return grew

    def enter(self, req: Request, bs: int) -> None:
        """After the clock advanced: ``req`` (explicit, just given a decode or its
        prompt's end) rides the clock from now on, unless its next sample could already
        be its last."""
        clock = self.clock
        c = req.computed_base
        if not self._plan(req, c, clock.epoch, bs):
            return
        req.computed_base = c - clock.epoch
        req.decode_clock = clock
        del self.explicit[req]
        self.ids[req] = req.seq_id
        self.tokens[req] = req.token_ids

    def prefilled(self, req: Request, bs: int, step: int) -> None:
        """``req`` (explicit) computes the last of its prompt in step ``step``: its first
        decode rides the clock, when the clock ticked for that step (an isolated
        suspect's step of its own does not tick it)."""
        if self.clock.step == step and bs >= MIN_BLOCK_SIZE:
            self.enter(req, bs)

    def leave(self, req: Request) -> None:
        clock = req.decode_clock
        req.computed_base += clock.epoch
        req.scheduled_base = clock.step
        req.decode_clock = None
        del self.ids[req]
        del self.tokens[req]
        self._event.pop(req, None)
        self.explicit[req] = None

    def leave_all(self) -> None:
        for req in list(self.ids):
            self.leave(req)
        self._due.clear()

    def _plan(self, req: Request, c: int, epoch: int, bs: int) -> bool:
        """Puts ``req`` in the calendar: at the schedule of clock ``epoch`` it will have
        computed ``c``; its next event is the first epoch whose token starts a block, or
        whose sample could be its last (then it leaves). False when that is a leave at
        ``epoch`` itself."""
        to_start = (-c) % bs
        to_limit = req.length_limit - 2 - c
        if to_limit <= to_start:
            j, kind = to_limit, _DUE_LEAVE
            if j <= 0:
                return False
        else:
            j, kind = to_start, _DUE_START
        epoch += j
        self._event[req] = epoch << 1 | kind
        due = self._due.get(epoch)
        if due is None:
            self._due[epoch] = [req]
        else:
            due.append(req)
        return True

    def assert_invariants(self, running: list[Request], bm: BlockManager | None = None) -> None:
        """With ``bm``: a sequence in decode mode holds just the blocks its computed
        positions fill (a block start's append is then its one new block)."""
        clock = self.clock
        assert self.ids.keys() == self.tokens.keys()
        assert not (self.ids.keys() & self.explicit.keys())
        assert self.ids.keys() | self.explicit.keys() == set(running)
        assert self._event.keys() <= self.ids.keys()
        for req, seq_id in self.ids.items():
            assert req.decode_clock is clock and seq_id == req.seq_id
            assert self.tokens[req] is req.token_ids
            epoch = self._event[req] >> 1
            assert epoch >= clock.epoch, "its event is past"
            assert req in self._due.get(epoch, ()), "no event planned"
            if bm is not None and not bm.window:
                held = len(bm.block_table(req.seq_id))
                assert held == -(-req.num_computed_tokens // bm.block_size), "blocks held"
        for req in self.explicit:
            assert req.decode_clock is None
