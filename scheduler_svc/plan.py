"""SchedulerOutput (pure Python, columnar) → BatchPlan (wire).

Columnar because per-sequence sub-messages cost ~14× more to encode (docs/facts.md). Only
sequences new to the executor travel in full. A SchedulerOutput field named as a
BatchPlan field travels as it is (``_AS_IS``, from the proto's descriptor); the rest are
framed by hand where bytes beat protobuf's conversion. The plan is built inside its
envelope, so sending it is one ``SerializeToString``.
"""

from __future__ import annotations

from protos import wire
from protos.continuum.v1 import executor_pb2 as pb
from scheduler_svc.core import BlockManager, Request, SchedulerOutput


def _template(req: Request) -> pb.NewSequence:
    """What does not change in ``req``'s entry of a plan that sends it in full: its
    prompt and sampling parameters."""
    template = pb.NewSequence(
        num_prompt_tokens=req.num_prompt_tokens - req.num_resumed_output_tokens,
        token_ids=req.token_ids)
    if req.sampling is not None:
        template.sampling.CopyFrom(req.sampling)
    return template


def _varint(value: int) -> bytes:
    """``value`` (a tag or a length: never negative) as a protobuf varint."""
    if 0 <= value < 0x80:  # a tag or a short length: one byte
        return _ONE_BYTE[value]
    if value < 0x4000:
        return bytes((value & 0x7F | 0x80, value >> 7))
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


_ONE_BYTE = [bytes((v,)) for v in range(0x80)]


def _field(tag: bytes, payload: bytes) -> bytes:
    """A length-delimited field (``tag`` encoded): a message, or a packed column."""
    return tag + _varint(len(payload)) + payload


def _tag(message, name: str) -> bytes:
    """The key of ``message``'s field ``name`` as a length-delimited one (a message or a
    packed column), read from the proto's own field number."""
    return _varint(message.DESCRIPTOR.fields_by_name[name].number << 3 | 2)


# Framed by hand in ``PlanBuilder.frame`` (or not sent: the packed column stands for
# ``cached_seq_ids``); every other SchedulerOutput field that BatchPlan has goes as is:
# (its index in the NamedTuple, its name, whether it is repeated).
_FRAMED = frozenset({"new", "cached_seq_ids", "packed_cached_seq_ids", "cached_num_new_blocks",
                     "swap_out", "swap_in"})
_PLAN_FIELDS = pb.BatchPlan.DESCRIPTOR.fields_by_name
_AS_IS = tuple((i, name, _PLAN_FIELDS[name].is_repeated)
               for i, name in enumerate(SchedulerOutput._fields)
               if name in _PLAN_FIELDS and name not in _FRAMED)

_PLAN_IN_ENVELOPE = (pb.SchedulerMessage(schema_version=wire.SCHEMA_VERSION)
                     .SerializeToString() + _tag(pb.SchedulerMessage, "plan"))
_NEW_SEQS = _tag(pb.BatchPlan, "new_seqs")
_PACKED_CACHED = _tag(pb.BatchPlan, "packed_cached_seq_ids")
_COLUMN_TAGS = {name: _tag(pb.BatchPlan, name)
                for name in ("cached_num_scheduled_tokens", "cached_num_new_blocks")}


def _small_column(name: str, values: list[int]) -> bytes:
    """BatchPlan's packed column ``name`` holding ``values``, encoded. Counts under 128
    (a decode's 1 token, a block start's 1 block: nearly every entry) are each their own
    one-byte varint, so the column is ``bytes(values)``, built in C; any other goes
    through protobuf."""
    if not values:
        return b""
    try:
        packed: bytes | None = bytes(values)
    except ValueError:  # a count over 255
        packed = None
    if packed is not None and packed.isascii():
        return _field(_COLUMN_TAGS[name], packed)
    column = pb.BatchPlan()
    getattr(column, name).extend(values)
    return column.SerializeToString()


class PlanBuilder:
    """Encodes plans. Owns each request's prompt in wire form (``prepare``), serialized
    as it arrives, so the admitting step appends bytes (~8 µs less than converting a
    300-token prompt) and a preempted request reuses them.

    ``frame`` joins a prepared prompt, the small-count columns and the envelope as bytes
    (protobuf's wire format is concatenable), never building them as messages. Finished
    requests' entries are swept every ``sweep_every`` arrivals, never in a step."""

    def __init__(self, sweep_every: int = 1024) -> None:
        # by seq id: the request, its template's bytes and number of token ids
        self._templates: dict[int, tuple[Request, bytes, int]] = {}
        self._sweep_every = self._until_sweep = sweep_every

    def prepare(self, req: Request) -> tuple[Request, bytes, int]:
        template = _template(req)
        entry = self._templates[req.seq_id] = (req, template.SerializeToString(),
                                               len(template.token_ids))
        self._until_sweep -= 1
        if self._until_sweep <= 0:
            self._until_sweep = self._sweep_every
            self._templates = {k: v for k, v in self._templates.items()
                               if not v[0].is_finished}
        return entry

    @property
    def num_prepared(self) -> int:
        """Requests whose wire form is kept (finished ones until the next sweep)."""
        return len(self._templates)

    def frame(self, out: SchedulerOutput, incarnation: str, bm: BlockManager) -> bytes:
        """The bytes to send for ``out``: a SchedulerMessage whose ``plan`` is set."""
        plan = pb.BatchPlan(incarnation=incarnation)
        for i, name, repeated in _AS_IS:
            value = out[i]
            if value:
                if repeated:
                    getattr(plan, name).extend(value)
                else:
                    setattr(plan, name, value)
        if out.swap_out:
            plan.swap_out_src[:], plan.swap_out_dst[:] = zip(*out.swap_out, strict=True)
        if out.swap_in:
            plan.swap_in_src[:], plan.swap_in_dst[:] = zip(*out.swap_in, strict=True)
        parts = [plan.SerializeToString(),
                 _field(_PACKED_CACHED, out.packed_cached_seq_ids) if out.cached else b"",
                 _small_column("cached_num_scheduled_tokens", out.cached_num_tokens),
                 _small_column("cached_num_new_blocks", out.cached_num_new_blocks)]
        templates = self._templates
        for req, n in out.new:
            entry = templates.get(req.seq_id)
            _, template, num_tokens = self.prepare(req) if entry is None else entry
            seq = pb.NewSequence(seq_id=req.seq_id,
                                 num_computed_tokens=req.num_computed_tokens - n,
                                 num_scheduled_tokens=n,
                                 block_ids=bm.block_table(req.seq_id))
            extra = len(req.token_ids) - num_tokens  # generated before a resume
            if extra:
                seq.token_ids.extend(req.token_ids[-extra:])
            rest = seq.SerializeToString()  # the entry is the template's fields, then these
            parts += (_NEW_SEQS, _varint(len(template) + len(rest)), template, rest)
        body = b"".join(parts)
        return _PLAN_IN_ENVELOPE + _varint(len(body)) + body

    def message(self, out: SchedulerOutput, incarnation: str,
                bm: BlockManager) -> pb.SchedulerMessage:
        """``frame``'s message, parsed (tools and tests)."""
        return pb.SchedulerMessage.FromString(self.frame(out, incarnation, bm))


def build_plan_message(out: SchedulerOutput, incarnation: str,
                       bm: BlockManager) -> pb.SchedulerMessage:
    """One plan's frame, its prompts converted now (tools and tests; the loop keeps a
    PlanBuilder)."""
    return PlanBuilder().message(out, incarnation, bm)


def build_plan(out: SchedulerOutput, incarnation: str, bm: BlockManager) -> pb.BatchPlan:
    return build_plan_message(out, incarnation, bm).plan
