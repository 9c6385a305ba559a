"""What both fuzzing modules share (fuzz.py: HTTP and gRPC; fuzz_zmq.py: the ZeroMQ
channel): the tally of statuses and failures, how one property is run, hypothesis's phases,
and integers at the edges of protobuf's unsigned types. It sits below both so that fuzz.py,
which runs the whole row, imports fuzz_zmq and fuzz_zmq never imports fuzz back.
"""

from __future__ import annotations

import collections

from hypothesis import Phase
from hypothesis import strategies as st

# No shrinking: one failing input is reported as drawn (shrinking replays inputs, and a
# hang costs a whole request timeout per replay).
PHASES = (Phase.explicit, Phase.generate)
UINT32 = st.one_of(st.integers(0, 8), st.sampled_from([2**31 - 1, 2**31, 2**32 - 1]))
UINT64 = st.one_of(st.integers(0, 8), st.sampled_from([2**32, 2**63, 2**64 - 1]))


class Tally:
    """Statuses seen per target, and each failure's reproducer."""

    def __init__(self) -> None:
        self.counts: dict[str, collections.Counter] = collections.defaultdict(
            collections.Counter)
        self.failures: list[dict] = []
        self.examples = 0

    def add(self, target: str, status: str) -> None:
        self.counts[target][status] += 1
        self.examples += 1


def run_property(prop, target: str, tally: Tally) -> None:
    """Runs a property; a falsified one is recorded with hypothesis's reproducer."""
    try:
        prop()
    except Exception as exc:  # hypothesis re-raises the shrunk failure
        notes = "\n".join(getattr(exc, "__notes__", []))
        tally.failures.append({"target": target, "error": str(exc)[:600],
                               "reproducer": notes[:2000]})
