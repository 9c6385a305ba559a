"""Hypothesis strategies for any protobuf message, built from its descriptor
(docs/reliability.md, "Schema fuzzing").

Nothing here names a field of ``GenerateRequest``: the walk visits every field of every
nested message and draws by type, strings by what the field means (``HINTS``), so a field
added to the proto is drawn from the next run on. Requests are drawn per field path
(``field_names``): a valid request with that path and up to two more drawn, or a whole
message field by field; ``bound_lengths`` keeps a valid request short. Protobuf strings
must be UTF-8, so ``SURROGATE_MARK`` in a drawn string becomes a surrogate in the bytes."""

from __future__ import annotations

import functools

from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message
from google.protobuf.message_factory import GetMessageClass
from hypothesis import strategies as st

from gateway.api.openai_schema import Text
from harness import fuzz_values as values
from protos.continuum.v1 import generation_pb2 as gen

F = FieldDescriptor
INT_RANGES = {
    F.TYPE_INT32: (-(2**31), 2**31 - 1), F.TYPE_SINT32: (-(2**31), 2**31 - 1),
    F.TYPE_SFIXED32: (-(2**31), 2**31 - 1), F.TYPE_UINT32: (0, 2**32 - 1),
    F.TYPE_FIXED32: (0, 2**32 - 1), F.TYPE_INT64: (-(2**63), 2**63 - 1),
    F.TYPE_SINT64: (-(2**63), 2**63 - 1), F.TYPE_SFIXED64: (-(2**63), 2**63 - 1),
    F.TYPE_UINT64: (0, 2**64 - 1), F.TYPE_FIXED64: (0, 2**64 - 1),
}
HINTS = {  # what a string field means, by full name; any other is plain text
    "continuum.v1.GenerateRequest.request_id": Text.IDENTIFIER,
    "continuum.v1.GenerateRequest.tenant": Text.IDENTIFIER,
    "continuum.v1.GenerateRequest.model": Text.MODEL,
    "continuum.v1.ChatMessage.role": Text.ROLE,
    "continuum.v1.Tool.name": Text.TOOL_NAME,
    "continuum.v1.ToolCall.name": Text.TOOL_NAME,
    "continuum.v1.Tool.parameters": Text.JSON_SCHEMA,
    "continuum.v1.ToolCall.arguments": Text.JSON,
    "continuum.v1.Guided.json_schema": Text.JSON_SCHEMA,
    "continuum.v1.Guided.regex": Text.REGEX,
    "continuum.v1.Guided.lark": Text.LARK,
}
# max_tokens 0 means "up to 256" and anything short of the context is served: a valid
# request would take minutes here, so lengths stay tiny or far past any context.
MAX_TOKENS = "continuum.v1.GenerateRequest.max_tokens"
SHORT, PAST_CONTEXT = 8, 2**20
SURROGATE_MARK = "\x00\x01\x02"  # 3 UTF-8 bytes, replaced by 3 bytes of U+D800
SURROGATE_BYTES = b"\xed\xa0\x80"
MAX_DEPTH = 4  # message nesting drawn (GenerateRequest > chat > message > tool call)


def scalars(field: FieldDescriptor) -> st.SearchStrategy:
    """One value of a non-message field's type."""
    if field.full_name == MAX_TOKENS:
        return st.integers(1, SHORT) | st.sampled_from([PAST_CONTEXT, 2**31, 2**32 - 1])
    if field.type in INT_RANGES:
        return values.integers(*INT_RANGES[field.type])
    if field.type in (F.TYPE_FLOAT, F.TYPE_DOUBLE):
        return values.floats(32 if field.type == F.TYPE_FLOAT else 64)
    if field.type == F.TYPE_BOOL:
        return st.booleans()
    if field.type == F.TYPE_ENUM:
        known = [v.number for v in field.enum_type.values]
        return st.sampled_from([max(known) + 1, -1, 2**31 - 1, -(2**31), *known])
    if field.type == F.TYPE_BYTES:
        return st.binary(max_size=64)
    kind = HINTS.get(field.full_name, Text.PLAIN)
    return values.texts(kind) | st.just(SURROGATE_MARK + "Hi")


def _small(item):
    """What a list past the caps repeats: the item cut short (a string) or empty (a
    message), so that a long list stays a few hundred KB."""
    if isinstance(item, str):
        return item[:16]
    return type(item)() if isinstance(item, Message) else item


def _many(item: st.SearchStrategy) -> st.SearchStrategy[list]:
    """A few items, or one item repeated past any cap (1025 messages, 17 stops, ...)."""
    repeated = st.tuples(item, st.sampled_from([17, 129, 301, 1025, 5000]))
    return repeated.map(lambda t: [_small(t[0])] * t[1]) | st.lists(item, max_size=4)


def field_values(field: FieldDescriptor, depth: int) -> st.SearchStrategy:
    """What ``assign`` takes for ``field``: a list (repeated), a dict (map), a message
    or a scalar."""
    if field.message_type is not None and field.message_type.GetOptions().map_entry:
        key, value = (field.message_type.fields_by_name[n] for n in ("key", "value"))
        entries = st.dictionaries(scalars(key), scalars(value), max_size=4)
        bulk = st.tuples(scalars(value), st.sampled_from([301, 5000])).map(
            lambda t: dict.fromkeys(range(t[1]), t[0]))
        return bulk | entries
    one = messages(field.message_type, depth + 1) if field.message_type is not None \
        else scalars(field)
    return _many(one) if field.is_repeated else one


def assign(msg: Message, field: FieldDescriptor, value) -> None:
    """Sets ``field`` of ``msg`` to ``value`` (replacing a list or map)."""
    if field.message_type is not None and field.message_type.GetOptions().map_entry:
        target = getattr(msg, field.name)
        target.clear()
        target.update(value)
    elif field.is_repeated:
        del getattr(msg, field.name)[:]
        getattr(msg, field.name).extend(value)
    elif field.message_type is not None:
        getattr(msg, field.name).CopyFrom(value)
    else:
        setattr(msg, field.name, value)


def _real_oneofs(desc: Descriptor) -> list:
    """Oneofs other than the synthetic one proto3 wraps each ``optional`` field in."""
    return [o for o in desc.oneofs
            if not (len(o.fields) == 1 and o.name == "_" + o.fields[0].name)]


@functools.cache
def messages(desc: Descriptor, depth: int = 0) -> st.SearchStrategy[Message]:
    """Whole messages of type ``desc``: each field present or not, one member (or none)
    of each oneof; below MAX_DEPTH an empty message."""
    cls = GetMessageClass(desc)
    if depth >= MAX_DEPTH:
        return st.builds(cls)
    in_oneof = {f for o in _real_oneofs(desc) for f in o.fields}
    plain = [f for f in desc.fields if f not in in_oneof]

    @st.composite
    def build(draw) -> Message:
        msg = cls()
        for field in plain:
            if draw(st.booleans()):
                assign(msg, field, draw(field_values(field, depth)))
        for oneof in _real_oneofs(desc):
            chosen = draw(st.sampled_from([None, *oneof.fields]))
            if chosen is not None:
                assign(msg, chosen, draw(field_values(chosen, depth)))
        return msg

    return build()


def field_paths(desc: Descriptor, above: tuple = ()) -> list[tuple[FieldDescriptor, ...]]:
    """Every field of ``desc`` and of every message nested in it, as the path of fields
    from ``desc`` (a message type already on the path is not entered again)."""
    paths = []
    for field in desc.fields:
        path = (*above, field)
        paths.append(path)
        nested = field.message_type
        if nested is not None and not nested.GetOptions().map_entry and \
                nested not in {f.containing_type for f in path}:
            paths += field_paths(nested, path)
    return paths


def set_path(msg: Message, path: tuple[FieldDescriptor, ...], value) -> None:
    """Assigns ``value`` to the last field of ``path``, creating what lies above it (the
    first element of a repeated message on the way)."""
    for field in path[:-1]:
        child = getattr(msg, field.name)
        if field.is_repeated:
            child = child[0] if len(child) else child.add()
        msg = child
    assign(msg, path[-1], value)


def bound_lengths(req: gen.GenerateRequest) -> gen.GenerateRequest:
    if req.max_tokens == 0 or SHORT < req.max_tokens < PAST_CONTEXT:
        req.max_tokens = 4
    return req


def _bases() -> list[gen.GenerateRequest]:
    plain = gen.GenerateRequest(prompt="Hi", max_tokens=4)
    chat = gen.GenerateRequest(max_tokens=4)
    chat.chat.messages.add(role="user", content="Hi")
    for req in (plain, chat):
        req.sampling.temperature = 0.0
    return [plain, chat]


WHOLE = "(whole message)"  # the input of no one field: every field drawn or not


def path_name(path: tuple[FieldDescriptor, ...]) -> str:
    return ".".join(f.name for f in path)


@functools.cache
def _paths_by_name() -> dict[str, tuple[FieldDescriptor, ...]]:
    return {path_name(p): p for p in field_paths(gen.GenerateRequest.DESCRIPTOR)}


def field_names() -> list[str]:
    """What the fuzzer sweeps: every field path of GenerateRequest, then WHOLE."""
    return [*_paths_by_name(), WHOLE]


@st.composite
def _with_path(draw, name: str) -> gen.GenerateRequest:
    """A valid request with the field at ``name`` and up to two more paths drawn."""
    paths = _paths_by_name()
    req = gen.GenerateRequest()
    req.CopyFrom(draw(st.sampled_from(_bases())))
    others = draw(st.lists(st.sampled_from(sorted(paths)), max_size=2))
    for path in (paths[n] for n in [name, *others]):
        set_path(req, path, draw(field_values(path[-1], len(path) - 1)))
    return bound_lengths(req)


def generate_requests(name: str | None = None) -> st.SearchStrategy[gen.GenerateRequest]:
    """Requests probing the field path ``name`` (one of ``field_names``); None: any."""
    if name == WHOLE:
        return messages(gen.GenerateRequest.DESCRIPTOR).map(bound_lengths)
    if name is not None:
        return _with_path(name)
    return st.one_of([generate_requests(n) for n in field_names()])


def wire_bytes(req: gen.GenerateRequest) -> bytes:
    """The request serialized, each SURROGATE_MARK turned into a lone surrogate."""
    return req.SerializeToString().replace(SURROGATE_MARK.encode(), SURROGATE_BYTES)
