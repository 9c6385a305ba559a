"""Where the shared data lives, and the one reader of its request traces.

The data directory (measured operator profiles, the Azure conversation trace) is
``$CONTINUUM_DATA_DIR``, else ``../shared/data`` beside the repository; every tool
that needs it (the simulator, its cost model, ``continuum bench``, the scheduler
benchmark) asks ``data_dir()`` or ``default_trace()`` here, so setting the variable
moves all of them at once. What the data is and where it comes from: docs/facts.md,
"Data".

A trace is a CSV with a header and at least the columns ``arrived_at`` (seconds),
``num_prefill_tokens`` and ``num_decode_tokens`` (the Azure LLM inference trace's
format; other columns are ignored). ``read_trace`` returns its rows in file order and
turns every way a file can be unusable into one ``TraceError`` a user can act on.
"""

from __future__ import annotations

import csv
import os
from pathlib import Path

TRACE_COLUMNS = ("arrived_at", "num_prefill_tokens", "num_decode_tokens")


class TraceError(ValueError):
    """A trace file that cannot be used; the message names the file and what is wrong."""


def data_dir() -> Path:
    """``$CONTINUUM_DATA_DIR``, else ``../shared/data`` beside the repository."""
    env = os.environ.get("CONTINUUM_DATA_DIR")
    if env:
        return Path(env)
    return Path(__file__).resolve().parents[2] / "shared" / "data"


def default_trace() -> Path:
    """The Azure LLM conversation trace of 2023 in the data directory."""
    return data_dir() / "traces" / "azure_conv_2023.csv"


def read_trace(path: Path) -> list[tuple[float, int, int]]:
    """(arrived_at, prompt tokens, output tokens) of every row, in file order.

    Raises ``TraceError`` when the file is missing or unreadable, lacks a column,
    holds a value that is not a number, or has no rows.
    """
    try:
        with open(path, newline="") as handle:
            rows = [(float(r["arrived_at"]), int(r["num_prefill_tokens"]),
                     int(r["num_decode_tokens"])) for r in csv.DictReader(handle)]
    except FileNotFoundError:
        raise TraceError(f"{path}: no such file") from None
    except OSError as exc:
        raise TraceError(f"{path}: cannot read: {exc.strerror or exc}") from None
    except (KeyError, ValueError, TypeError) as exc:
        # KeyError: a missing column; TypeError: a short row (DictReader fills None).
        raise TraceError(f"{path}: expected columns {', '.join(TRACE_COLUMNS)} "
                         f"({exc})") from exc
    if not rows:
        raise TraceError(f"{path} has no rows")
    return rows
