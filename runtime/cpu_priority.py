"""Lowering a process's CPU share, as the kernel actually divides it.

Linux with autogroup (the default on desktops and plain hosts) shares the CPU between
*sessions* first and by nice value only inside one; every Continuum service starts a
session of its own, so a nice value alone changes nothing between them. A process
that must yield to the others lowers both: its session's autogroup share
(``/proc/self/autogroup``) and its own nice value, which is what counts where a
container's cgroup groups the processes instead (Kubernetes). Raising either needs
privileges, so this only lowers.
"""

from __future__ import annotations

import os

LOWEST = 19


def lower(nice: int) -> int:
    """Sets this process's autogroup share and nice value to ``nice`` (0-19) where that
    lowers them; returns the nice value in force. Threads started later inherit it."""
    nice = max(0, min(LOWEST, nice))
    try:
        with open("/proc/self/autogroup", "w") as group:
            group.write(str(nice))
    except OSError:  # no autogroup (not Linux, or disabled): the nice value still counts
        pass
    try:
        current = os.nice(0)
        return os.nice(nice - current) if nice > current else current
    except OSError:
        return nice
