"""The telemetry store (docs/operations.md): what the scheduler records, where, and for how long.

A cross-process contract like the rest of ``protos/``: the scheduler process
writes it through ``writer.TelemetryWriter`` (off the step path), the
``continuum report`` and ``continuum gate`` commands read it through
``store.TelemetryStore``. ``schema`` defines the tables and migrations once for
SQLite and PostgreSQL; ``records`` the row types; ``retention`` the size bound.
Imports nothing first-party outside ``protos``.
"""

from telemetry.records import (
    BlockTableSnapshot,
    ConfigRecord,
    IterationRecord,
    IterationRollup,
    SequenceRecord,
)
from telemetry.retention import Retention
from telemetry.store import SchemaError, StoreError, TelemetryStore
from telemetry.writer import TelemetryWriter

__all__ = [
    "BlockTableSnapshot", "ConfigRecord", "IterationRecord", "IterationRollup",
    "Retention", "SchemaError", "SequenceRecord", "StoreError", "TelemetryStore",
    "TelemetryWriter",
]
