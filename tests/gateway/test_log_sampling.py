"""A crowd of identical events is one log line a second, each line saying how many
occurrences it stands for."""

from __future__ import annotations

from gateway.log_sampling import Sampled


class _Log:
    def __init__(self):
        self.lines: list[tuple[str, dict]] = []

    def warning(self, event, **fields):
        self.lines.append((event, fields))


def test_the_first_is_logged_at_once_then_one_line_a_second_with_the_count():
    now = [100.0]
    log = _Log()
    sampled = Sampled(log, "warning", "refused", every_s=1.0, clock=lambda: now[0])
    assert sampled(code="RESOURCE_EXHAUSTED") is True
    logged = [sampled(code="RESOURCE_EXHAUSTED") for _ in range(999)]
    assert not any(logged) and len(log.lines) == 1
    now[0] += 1.0
    assert sampled(code="RESOURCE_EXHAUSTED") is True
    assert log.lines == [("refused", {"occurrences": 1, "code": "RESOURCE_EXHAUSTED"}),
                         ("refused", {"occurrences": 1000, "code": "RESOURCE_EXHAUSTED"})]
    now[0] += 0.5
    assert sampled() is False  # within a second of the last line
