"""Client input quoted back, bounded: every error message and log line that names a
value the client sent goes through here, so its size never follows the input's.

The gateway and the scheduler both refuse requests with messages that quote what was
sent (a model name, a role, a logit_bias key, a request id); a client may send
megabytes of any of them, and an answer or a log line as large as that is a cost paid
twice (and an amplifier for whoever floods the logs). The limits are
``protos/limits.py``'s.
"""

from __future__ import annotations

import reprlib

from protos.limits import MAX_DIAGNOSTIC_CHARS, MAX_ECHO_CHARS

ELLIPSIS = "…"
# repr of containers and numbers with every part bounded first, so that quoting a
# 900 KB list costs what quoting its first few items does.
_BOUNDED_REPR = reprlib.Repr()
_BOUNDED_REPR.maxstring = MAX_ECHO_CHARS
_BOUNDED_REPR.maxother = MAX_ECHO_CHARS
_BOUNDED_REPR.maxlong = MAX_ECHO_CHARS
_BOUNDED_REPR.maxlevel = 2


def clip(value: object, max_chars: int = MAX_ECHO_CHARS) -> str:
    """``value`` quoted as repr writes it, escapes included, in at most ``max_chars``
    characters between the quotes (fewer of the value's where they need escapes), then
    "…" when something was left out."""
    if isinstance(value, str):
        head = value[:max_chars]
        quoted = repr(head)
        while len(quoted) > max_chars + 2:  # an escape is at most 10 characters ("\U000e0001")
            head = head[:len(head) - (len(quoted) - max_chars + 7) // 10]
            quoted = repr(head)
        return quoted + (ELLIPSIS if len(head) < len(value) else "")
    text = _BOUNDED_REPR.repr(value)
    return text if len(text) <= max_chars else text[:max_chars] + ELLIPSIS


def shorten(text: str, max_chars: int = MAX_DIAGNOSTIC_CHARS) -> str:
    """A diagnostic (prose that may quote client input) cut to ``max_chars``, then "…"."""
    return text if len(text) <= max_chars else text[:max_chars] + ELLIPSIS
