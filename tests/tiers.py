"""Test tiers: what starts a service process says so, and `make test-fast` leaves it out.

A fixture that starts one is declared with ``@spawns_processes`` under its
``@pytest.fixture``: every test that uses it, directly or through another fixture, is
marked ``spawns``. A module whose tests start one themselves carries
``pytestmark = pytest.mark.spawns`` (or ``integration``). tests/conftest.py deselects
them under --fast; a service process started for a test that is not marked is skipped
under --fast and fails a full run, naming the test, so a missing mark cannot hide.
"""

from __future__ import annotations

SPAWNING_FIXTURES: set[str] = set()


def spawns_processes(fixture):
    """Declares a fixture that starts service processes (put it under @pytest.fixture)."""
    SPAWNING_FIXTURES.add(fixture.__name__)
    return fixture
