"""The retry pushback trailers (protos/pushback.py): both names, one number, gRFC A6's first."""

from __future__ import annotations

from protos.pushback import PUSHBACK_KEY, RETRY_AFTER_KEY, completed, delay_ms, trailers


def test_both_trailers_carry_the_same_whole_milliseconds():
    assert trailers(1000) == ((PUSHBACK_KEY, "1000"), (RETRY_AFTER_KEY, "1000"))
    assert trailers(249.2) == ((PUSHBACK_KEY, "250"), (RETRY_AFTER_KEY, "250"))  # never sooner
    assert trailers(-5) == ((PUSHBACK_KEY, "0"), (RETRY_AFTER_KEY, "0"))  # never "do not retry"


def test_the_delay_is_read_under_either_name_the_standard_one_first():
    assert delay_ms(((RETRY_AFTER_KEY, "250"),)) == 250
    assert delay_ms(((RETRY_AFTER_KEY, "250"), (PUSHBACK_KEY, "300"))) == 300
    assert delay_ms(((PUSHBACK_KEY, "-1"), (RETRY_AFTER_KEY, "40"))) == 40
    for junk in ((), None, ((PUSHBACK_KEY, "soon"),), ((PUSHBACK_KEY, b"12"),)):
        assert delay_ms(junk) is None


def test_retryable_statuses_always_end_with_both_trailers():
    other = ("error-code", "rate_limit_exceeded")
    assert completed("RESOURCE_EXHAUSTED", ((RETRY_AFTER_KEY, "2500"), other), 1000) == (
        (PUSHBACK_KEY, "2500"), (RETRY_AFTER_KEY, "2500"), other)
    assert completed("UNAVAILABLE", (), 1000) == trailers(1000)
    assert completed("INVALID_ARGUMENT", (other,), 1000) == (other,)
