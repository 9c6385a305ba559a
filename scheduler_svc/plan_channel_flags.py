"""The plan channel's flag: one definition for ``python -m scheduler_svc`` and for
``continuum serve``, which takes it and passes it on (nothing heavy imported)."""

from __future__ import annotations

import argparse

CHANNELS = ("auto", "shm", "zmq")


def add_flag(p: argparse.ArgumentParser) -> None:
    """How plans reach the executor (scheduler_svc/plan_channel.py)."""
    p.add_argument("--plan-channel", choices=CHANNELS, default="auto",
                   help="shm: each plan through a shared-memory ring the executor reads "
                        "in place, ZeroMQ as the doorbell and for what the ring cannot "
                        "take; where there is no shared memory (a tcp:// channel, not "
                        "x86-64, no writable /dev/shm) plans stay on ZeroMQ. auto "
                        "(default): shm on a host with a core to spare for the ring's "
                        "reader (4 CPUs or more), else zmq (docs/gpu.md: with fewer, the "
                        "ring is no faster). zmq: plans over ZeroMQ")


def argv(a: argparse.Namespace) -> list[str]:
    """The flag as the scheduler takes it."""
    return ["--plan-channel", a.plan_channel]
