"""Priority tiers: their names, numbers and spellings, defined once.

A request's tier decides the order it is served in (lower first; waiting ages every
tier, docs/design.md) and which queue-time bound and TPOT target apply to it. Every
process and tool speaks of tiers through this module:

* the **tier** is the number 0..2 (``PREMIUM``, ``STANDARD``, ``BEST_EFFORT``): the
  scheduler's (``SubmitRequest.priority_tier``), the telemetry store's, an API key's;
* the **priority** is the client API's ``Priority`` enum (generation.proto), where 0 is
  unspecified and means standard. Its numbers are written out here, so that this module
  needs no protobuf and the pure-Python scheduler core may import it;
  tests/test_tiers.py holds them equal to ``generation_pb2``'s;
* the **name** is how a tier is printed (``NAMES``: metric labels, telemetry reports,
  error messages, config field names such as ``max_queue_time_best_effort_s``), and
  ``parse`` reads every spelling a person may type: case-insensitive, with ``_``, ``-``
  or a space between the words (``best_effort``, ``best-effort``, ``Best Effort``);
* the **flag word** is the name in a command-line flag (``--max-queue-time-best-effort-s``).

Standard library only (docs/architecture.md, rule 2).
"""

from __future__ import annotations

PREMIUM, STANDARD, BEST_EFFORT = 0, 1, 2
NAMES = ("premium", "standard", "best_effort")  # index: the tier
NUM_TIERS = len(NAMES)
DEFAULT = STANDARD  # what a request that names no tier gets

# generation.proto's Priority values, by name (generation_pb2.PRIORITY_*).
PRIORITY_UNSPECIFIED, PRIORITY_PREMIUM, PRIORITY_STANDARD, PRIORITY_BEST_EFFORT = 0, 1, 2, 3
_PRIORITY_OF_TIER = (PRIORITY_PREMIUM, PRIORITY_STANDARD, PRIORITY_BEST_EFFORT)
_TIER_OF_PRIORITY = {PRIORITY_UNSPECIFIED: DEFAULT, PRIORITY_PREMIUM: PREMIUM,
                     PRIORITY_STANDARD: STANDARD, PRIORITY_BEST_EFFORT: BEST_EFFORT}


def from_priority(priority: int) -> int | None:
    """The tier of a Priority enum value; None for a value the enum does not define."""
    return _TIER_OF_PRIORITY.get(priority)


def to_priority(tier: int) -> int:
    """The Priority enum value of ``tier`` (0..2)."""
    return _PRIORITY_OF_TIER[tier]


def parse(text: str) -> int | None:
    """The tier a person's spelling names (``premium``, ``Standard``, ``best-effort``,
    ``best effort``, ``BEST_EFFORT``); None if it names none."""
    words = text.strip().lower().replace("-", " ").replace("_", " ").split()
    name = "_".join(words)
    return NAMES.index(name) if name in NAMES else None


def name(tier: int) -> str:
    """How ``tier`` is printed; a number past the last tier prints as the last (the
    scheduler serves such a tier as best effort, and a metric label must exist)."""
    return NAMES[min(max(tier, 0), NUM_TIERS - 1)]


def flag_word(tier: int) -> str:
    """``tier``'s name as a command-line flag spells it: ``best-effort``."""
    return NAMES[tier].replace("_", "-")


def describe() -> str:
    """The tiers for an error message: ``0 (premium), 1 (standard), 2 (best_effort)``."""
    return ", ".join(f"{tier} ({n})" for tier, n in enumerate(NAMES))
