"""How the chaos matrix counts a stream against its reference (no server needed)."""

from __future__ import annotations

import pytest

from benchmarks.reliability import burst, overload
from benchmarks.reliability.chaos import classify, duplicated
from continuum.bench.clients import Outcome
from sim.metrics import percentile

REF = [1, 2, 3, 4, 5, 6]


def ok(tokens: list[int]) -> Outcome:
    return Outcome(token_ids=tokens, finish_reason="FINISH_REASON_LENGTH")


def test_a_stream_equal_to_its_reference_is_identical():
    assert classify(ok(list(REF)), REF) == "identical"


def test_a_stretch_sent_twice_after_a_resume_is_duplicated():
    assert duplicated([1, 2, 3, 2, 3, 4], REF)
    assert classify(ok([1, 2, 3, 3, 4, 5]), REF) == "duplicated"
    assert classify(ok([*REF, 6]), REF) == "duplicated"


def test_a_missing_or_wrong_token_is_diverged_not_duplicated():
    assert classify(ok([1, 2, 4, 5, 6, 7]), REF) == "diverged"
    assert classify(ok([1, 2, 3, 9, 9, 9]), REF) == "diverged"


def test_no_terminal_answer_is_lost_and_an_error_status_is_errored_or_ended():
    assert classify(Outcome(status="deadline"), REF) == "lost"
    assert classify(Outcome(status="unavailable"), REF) == "errored"
    assert classify(Outcome(status="unavailable"), REF, expect_end=True) == "ended"
    assert classify(Outcome(status="deadline"), REF, expect_end=True) == "lost"


def test_the_rows_use_the_one_percentile_and_report_no_figure_as_none():
    """The reliability rows use sim.metrics.percentile, the definition every table uses
    (linear between closest ranks), and a percentile of nothing is None in a row."""
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile([float(i) for i in range(1, 101)], 99) == pytest.approx(99.01)
    assert burst._round(percentile([], 99)) is None
    assert overload._round(percentile([], 99)) is None
