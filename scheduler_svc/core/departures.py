"""How fast requests leave a scheduler: the departure-rate estimates admission uses.

Three estimates, from what the core sees on its own clock (no clock of their own, so
the simulator's virtual one works the same): ``ThroughputMeter`` (departures over time
while saturated), ``ServiceTimes`` (Little's law from finished requests), and, before
either has data, ``StepPace`` (the running requests' remaining token budgets at the
measured seconds per step). core/admission.py says how each is used and why.
"""

from __future__ import annotations

import math

TAU_S = 10.0
MIN_DEPARTURES = 8
MIN_SAMPLE_S = 0.05  # Submit bursts: sample the counters at most this often
SERVICE_WEIGHT = 0.05  # ServiceTimes: about the last 20 finished requests
MAX_STEP_GAP_S = 5.0  # StepPace: a longer gap between steps is not a step's time
PACE_WEIGHT = 0.25  # StepPace: about the last 4 steps


class ThroughputMeter:
    """Departures per second while saturated, from counters sampled on the core's clock."""

    def __init__(self) -> None:
        self._t: float | None = None
        self._departed = 0
        self._saturated = False
        self._weighted_departures = 0.0
        self._weighted_time = 0.0
        self.measured_departures = 0

    @property
    def rate(self) -> float | None:
        """Departures per second, or None before enough were measured."""
        if self.measured_departures < MIN_DEPARTURES or self._weighted_time <= 0:
            return None
        return self._weighted_departures / self._weighted_time

    def sample(self, now: float, departed: int, saturated: bool) -> None:
        """``departed``: the core's running count of departures; ``saturated``: whether
        capacity, not arrivals, limits departures from now on."""
        if self._t is not None and now - self._t < MIN_SAMPLE_S:
            self._saturated = self._saturated and saturated
            return
        # Only an interval saturated at both ends counts: one that starts saturated
        # and ends idle may hold an idle spell (the queue drained, no Submit since).
        if self._t is not None and self._saturated and saturated and now > self._t:
            dt, n = now - self._t, departed - self._departed
            decay = math.exp(-dt / TAU_S)
            self._weighted_departures = self._weighted_departures * decay + n
            self._weighted_time = self._weighted_time * decay + dt
            self.measured_departures += n
        self._t, self._departed, self._saturated = now, departed, saturated


class StepPace:
    """Seconds per step while requests run: the gaps between admission steps (one per
    step), exponentially weighted; gaps with nothing running, or longer than
    MAX_STEP_GAP_S (an idle spell, an executor restart), do not count."""

    def __init__(self) -> None:
        self._last: float | None = None
        self.step_s: float | None = None

    def tick(self, now: float, num_running: int) -> None:
        if self._last is not None and num_running and 0 < now - self._last < MAX_STEP_GAP_S:
            gap = now - self._last
            self.step_s = gap if self.step_s is None else self.step_s + PACE_WEIGHT * (
                gap - self.step_s)
        self._last = now

    def rate(self, running) -> float | None:
        """Departures per second if every running request ran to its max_tokens."""
        if self.step_s is None or not running:
            return None
        remaining = sum(max(1, r.max_tokens - r.num_output_tokens) for r in running)
        return len(running) / (remaining / len(running) * self.step_s)


class ServiceTimes:
    """How long finished requests ran (first step to finish) and how many ran beside
    them when they finished, exponentially weighted: Little's law's W and L."""

    def __init__(self) -> None:
        self.count = 0
        self._mean = 0.0
        self._mean_running = 0.0

    def add(self, seconds: float, num_running: int) -> None:
        self.count += 1
        weight = max(1.0 / self.count, SERVICE_WEIGHT)
        self._mean += weight * (max(0.0, seconds) - self._mean)
        self._mean_running += weight * (num_running - self._mean_running)

    def rate(self) -> float | None:
        """Departures per second, L / W at the operating point the measured requests
        ran at (L: how many ran when they finished). Not extrapolated to more
        concurrency: on a compute-bound executor a batch of 64 takes far longer per
        request than one of 16, so running / W at the flood's concurrency would admit
        several times what drains. None before MIN_DEPARTURES requests finished."""
        if self.count < MIN_DEPARTURES:
            return None
        return max(self._mean_running, 1.0) / max(self._mean, 1e-3)


def departure_rate(measured: float | None, little: float | None) -> float | None:
    """The admission estimate: the smaller of the two, or whichever exists."""
    if measured is None or little is None:
        return little if measured is None else measured
    return min(measured, little)
