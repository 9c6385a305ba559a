"""protos/tiers.py: one numbering and one spelling of the priority tiers, equal to the
wire's enum, read from every spelling a person types."""

from __future__ import annotations

import dataclasses

import pytest

from protos import tiers
from protos.continuum.v1 import generation_pb2


def test_the_written_out_enum_values_are_generation_protos():
    assert tiers.PRIORITY_UNSPECIFIED == generation_pb2.PRIORITY_UNSPECIFIED
    assert tiers.PRIORITY_PREMIUM == generation_pb2.PRIORITY_PREMIUM
    assert tiers.PRIORITY_STANDARD == generation_pb2.PRIORITY_STANDARD
    assert tiers.PRIORITY_BEST_EFFORT == generation_pb2.PRIORITY_BEST_EFFORT
    # every enum value has a tier; each tier's enum name is its own name
    for value in generation_pb2.Priority.values():
        assert tiers.from_priority(value) is not None
    for tier, name in enumerate(tiers.NAMES):
        assert generation_pb2.Priority.Name(tiers.to_priority(tier)) == \
            f"PRIORITY_{name.upper()}"
        assert tiers.from_priority(tiers.to_priority(tier)) == tier


def test_unspecified_is_standard_and_unknown_values_have_no_tier():
    assert tiers.from_priority(generation_pb2.PRIORITY_UNSPECIFIED) == tiers.STANDARD
    assert tiers.from_priority(max(generation_pb2.Priority.values()) + 1) is None
    assert tiers.from_priority(-1) is None


@pytest.mark.parametrize("text,tier", [
    ("premium", 0), ("PREMIUM", 0), (" Standard ", 1), ("best_effort", 2),
    ("best-effort", 2), ("best effort", 2), ("Best Effort", 2), ("BEST_EFFORT", 2),
    ("best  -effort", 2),
])
def test_every_spelling_parses(text, tier):
    assert tiers.parse(text) == tier


@pytest.mark.parametrize("text", ["", "urgent", "best", "besteffort", "0", "premium+standard"])
def test_other_words_name_no_tier(text):
    assert tiers.parse(text) is None


def test_printed_spellings():
    assert tiers.NAMES == ("premium", "standard", "best_effort")
    assert [tiers.flag_word(t) for t in range(tiers.NUM_TIERS)] == \
        ["premium", "standard", "best-effort"]
    assert tiers.name(7) == "best_effort" and tiers.name(0) == "premium"
    assert tiers.describe() == "0 (premium), 1 (standard), 2 (best_effort)"


def test_the_schedulers_per_tier_fields_follow_the_tier_names():
    """A config file's keys (max_queue_time_best_effort_s, ...) are the tier names'."""
    from scheduler_svc.core.config import QUEUE_TIME_FIELDS, TPOT_TARGET_FIELDS, SchedulerConfig
    fields = {f.name for f in dataclasses.fields(SchedulerConfig)}
    assert len(QUEUE_TIME_FIELDS) == len(TPOT_TARGET_FIELDS) == tiers.NUM_TIERS
    assert set(QUEUE_TIME_FIELDS) | set(TPOT_TARGET_FIELDS) <= fields
    assert QUEUE_TIME_FIELDS[tiers.BEST_EFFORT] == "max_queue_time_best_effort_s"


def test_every_surface_takes_every_spelling():
    """An API key's tiers, a body's priority, --objective-tier and `continuum report
    --tier` read tiers through protos/tiers.py; each keeps its old spelling."""
    from continuum.ops.report import parse_tier
    from gateway.admit.auth import ApiKeys
    from gateway.admit.routing_headers import objective_priority, parse_objective_tiers
    from gateway.api.openai_fields import _priority

    keys = ApiKeys.parse(["sk-0123456789:acme:premium+Best-Effort"], "test")
    assert keys.entries[0][1].tiers == {tiers.PREMIUM, tiers.BEST_EFFORT}
    for spelling in ("best_effort", "best-effort", "Best Effort", 2):
        proto = generation_pb2.GenerateRequest()
        _priority({"priority": spelling}, proto)
        assert proto.priority == generation_pb2.PRIORITY_BEST_EFFORT
    table = parse_objective_tiers(["gold=premium", "bulk=best-effort"])
    assert objective_priority("bulk", table) == generation_pb2.PRIORITY_BEST_EFFORT
    assert objective_priority("sheddable", table) == generation_pb2.PRIORITY_BEST_EFFORT
    assert objective_priority("critical", table) == generation_pb2.PRIORITY_PREMIUM
    assert objective_priority("best-effort", table) == generation_pb2.PRIORITY_BEST_EFFORT
    assert objective_priority("gold", table) == generation_pb2.PRIORITY_PREMIUM
    assert objective_priority("unknown", table) is None
    assert parse_tier("best-effort") == parse_tier("best_effort") == tiers.BEST_EFFORT
