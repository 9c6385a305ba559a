"""The plan channel's flag: one definition for ``python -m scheduler_svc`` and for
``continuum serve``, which takes it and passes it on (nothing heavy imported)."""

from __future__ import annotations

import argparse

CHANNELS = ("shm", "zmq")


def add_flag(p: argparse.ArgumentParser) -> None:
    """How plans reach the executor (scheduler_svc/plan_channel.py)."""
    # zmq by default: on the 2-core machine measured (docs/gpu.md) the ring's spinning
    # reader and its per-frame HMAC cost more than ZeroMQ's hop.
    p.add_argument("--plan-channel", choices=CHANNELS, default="zmq",
                   help="zmq (default): plans over ZeroMQ. shm: each plan through a "
                        "shared-memory ring the executor reads in place, ZeroMQ as the "
                        "doorbell and for what the ring cannot take; where there is no "
                        "shared memory (a tcp:// channel, not x86-64, no writable /dev/shm) "
                        "plans stay on ZeroMQ")


def argv(a: argparse.Namespace) -> list[str]:
    """The flag as the scheduler takes it."""
    return ["--plan-channel", a.plan_channel]
