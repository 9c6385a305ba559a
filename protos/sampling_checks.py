"""The checks of a request's sampling values and request-level caps, in one place.

Every edge calls here (gateway/api/openai_fields.py, gateway/validation.py,
scheduler_svc/validation.py), so each limit is stated once (protos/limits.py, ``NUMBERS``)
and a refusal reads the same wherever raised, only the field path differs. A new sampling
parameter is one ``Bound`` in ``NUMBERS``. A check returns a message (or ``(message,
param)``) to refuse, None to accept. Standard library and protobuf messages only.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from protos import limits
from protos.echo import clip

UINT32_MAX = 2**32 - 1
UINT64_MAX = 2**64 - 1


def range_problem(label: str, value: float, low: float, high: float, *,
                  low_open: bool = False, integer: bool = False, note: str = "") -> str | None:
    """``value`` against [low, high] ((low, high] when ``low_open``); ``integer`` says the
    bounds are whole numbers (printed exactly); ``note`` tells the reader what to send."""
    above_low = value > low if low_open else value >= low
    if (isinstance(value, int) or math.isfinite(value)) and above_low and value <= high:
        return None
    interval = f"{'(' if low_open else '['}{_bound(low)}, {_bound(high)}]"
    return (f"{label} must be {'an integer ' if integer else ''}in {interval}"
            f"{f' ({note})' if note else ''}, got {_show(value)}")


def _bound(value: float) -> str:
    """An interval's end as a person writes it: 2, 0.5, 1000000, 18446744073709551615."""
    return str(int(value)) if float(value).is_integer() else f"{value:g}"


def _show(value: float) -> str:
    """A client's number as a message quotes it (an int of any size, bounded)."""
    return clip(value) if isinstance(value, int) else f"{value:g}"


@dataclass(frozen=True)
class Bound:
    """A number's accepted interval: ``[low, high]``, or ``(low, high]`` if ``low_open``;
    ``integer``: whole numbers only; ``note``: what a refusal adds so the caller knows what
    to send instead."""

    name: str
    low: float
    high: float
    low_open: bool = False
    integer: bool = False
    note: str = ""

    def problem(self, value: float, path: str = "") -> str | None:
        return range_problem(path + self.name, value, self.low, self.high,
                             low_open=self.low_open, integer=self.integer, note=self.note)


# Every SamplingParams number, under the same name in an OpenAI body. Unset optional
# fields take the proto's documented default and are not checked.
NUMBERS = (
    Bound("temperature", 0.0, limits.MAX_TEMPERATURE, note="0 means greedy"),
    Bound("top_p", 0.0, 1.0, low_open=True,
          note="1 keeps every token; for greedy decoding use temperature 0"),
    Bound("top_k", 0, UINT32_MAX, integer=True, note="0 keeps every token"),
    Bound("min_p", 0.0, 1.0, note="0 keeps every token"),
    Bound("typical_p", 0.0, 1.0, low_open=True, note="1 keeps every token"),
    Bound("repetition_penalty", 0.0, limits.MAX_REPETITION_PENALTY, low_open=True,
          note="1 disables it"),
    Bound("presence_penalty", -limits.MAX_PENALTY, limits.MAX_PENALTY),
    Bound("frequency_penalty", -limits.MAX_PENALTY, limits.MAX_PENALTY),
    Bound("seed", 0, UINT64_MAX, integer=True),
    Bound("min_tokens", 0, UINT32_MAX, integer=True),
)
LOGPROBS = Bound("logprobs", 0, limits.MAX_LOGPROBS, integer=True,
                 note="alternatives per generated token")
N = Bound("n", 1, limits.MAX_N, integer=True, note="completions per request")
MAX_TOKENS = Bound("max_tokens", 1, UINT32_MAX, integer=True)


def _is_set(sampling, name: str) -> bool:
    """Whether the proto field holds a value to check (an unset optional one does not)."""
    field = sampling.DESCRIPTOR.fields_by_name[name]
    return not field.has_presence or sampling.HasField(name)


def sampling_problem(sampling) -> tuple[str, str] | None:
    """The checks of a SamplingParams that need no model: every number's interval,
    logprobs, and the sizes of stop_token_ids, logit_bias and a guided spec."""
    for bound in NUMBERS:
        if _is_set(sampling, bound.name) and \
                (problem := bound.problem(getattr(sampling, bound.name), "sampling.")):
            return problem, bound.name
    if sampling.HasField("logprobs") and (problem := LOGPROBS.problem(sampling.logprobs,
                                                                      "sampling.")):
        return problem, "logprobs"
    if len(sampling.stop_token_ids) > limits.MAX_STOP_TOKEN_IDS:
        return (f"sampling.stop_token_ids holds {len(sampling.stop_token_ids)} token ids; at "
                f"most {limits.MAX_STOP_TOKEN_IDS}", "stop_token_ids")
    if problem := logit_bias_problem(sampling.logit_bias, None, "sampling."):
        return problem, "logit_bias"
    kind = sampling.guided.WhichOneof("kind")
    if kind in ("json_schema", "regex", "lark") and \
            (size := len(getattr(sampling.guided, kind).encode())) > limits.MAX_GUIDED_BYTES:
        return (f"sampling.guided.{kind} is {size} bytes; at most {limits.MAX_GUIDED_BYTES}",
                "response_format")
    return None


def vocabulary_problem(sampling, vocab_size: int) -> tuple[str, str] | None:
    """The token ids a SamplingParams names (stop_token_ids, logit_bias), against the
    model's vocabulary."""
    if problem := token_ids_problem("sampling.stop_token_ids", sampling.stop_token_ids,
                                    vocab_size):
        return problem, "stop_token_ids"
    if problem := logit_bias_problem(sampling.logit_bias, vocab_size, "sampling."):
        return problem, "logit_bias"
    return None


def token_ids_problem(label: str, ids: Sequence[int], vocab_size: int) -> str | None:
    """The first id in ``ids`` that is not a token of a ``vocab_size`` vocabulary."""
    for index, token_id in enumerate(ids):
        if not 0 <= token_id < vocab_size:
            kind = "a negative token id" if token_id < 0 else "not a token id"
            return (f"{label}[{index}] = {token_id} is {kind}: the model's vocabulary has "
                    f"{vocab_size} tokens (ids 0..{vocab_size - 1})")
    return None


def logit_bias_problem(bias: Mapping[int, float], vocab_size: int | None,
                       path: str = "") -> str | None:
    """OpenAI's logit_bias rules: at most MAX_LOGIT_BIAS_ENTRIES entries, each bias a
    finite number in [-MAX_LOGIT_BIAS, MAX_LOGIT_BIAS], each key a token id of the
    vocabulary (not checked while ``vocab_size`` is None: no model known yet)."""
    if problem := logit_bias_size_problem(len(bias), path):
        return problem
    for token_id, value in sorted(bias.items()):
        if vocab_size is not None and not 0 <= token_id < vocab_size:
            return (f"{path}logit_bias names token {token_id}, which is not a token id: the "
                    f"model's vocabulary has {vocab_size} tokens (ids 0..{vocab_size - 1})")
        if not ((isinstance(value, int) or math.isfinite(value))
                and abs(value) <= limits.MAX_LOGIT_BIAS):
            return (f"{path}logit_bias[{token_id}] = {_show(value)}; a bias must be in "
                    f"[-{limits.MAX_LOGIT_BIAS:g}, {limits.MAX_LOGIT_BIAS:g}]")
    return None


def logit_bias_size_problem(num_entries: int, path: str = "") -> str | None:
    """The cap on logit_bias entries, checked before any entry is read."""
    if num_entries > limits.MAX_LOGIT_BIAS_ENTRIES:
        return (f"{path}logit_bias holds {num_entries} entries; at most "
                f"{limits.MAX_LOGIT_BIAS_ENTRIES}")
    return None


def stop_strings_problem(stop: Sequence[str]) -> str | None:
    """At most MAX_STOP_STRINGS stop strings, each non-empty and at most
    MAX_STOP_STRING_BYTES bytes of UTF-8."""
    if len(stop) > limits.MAX_STOP_STRINGS:
        return f"{len(stop)} stop strings given; at most {limits.MAX_STOP_STRINGS}"
    for index, text in enumerate(stop):
        if not text:
            return f"stop[{index}] is empty; remove it or give a non-empty string"
        size = len(text.encode("utf-8"))
        if size > limits.MAX_STOP_STRING_BYTES:
            return (f"stop[{index}] is {size} bytes long; each stop string is at most "
                    f"{limits.MAX_STOP_STRING_BYTES} bytes")
    return None


def identifier_problem(value: str, field: str, max_chars: int) -> str | None:
    """A request id or tenant: at most ``max_chars`` printable ASCII characters."""
    if len(value) > max_chars:
        return f"{field} is {len(value)} characters long; the limit is {max_chars}"
    bad = next((c for c in value if not " " <= c <= "~"), None)
    if bad is not None:
        return f"{field} must be printable ASCII; it contains {clip(bad)}"
    return None
