"""One frozen scheduler config, validated once where it is built.

Replaceable at run time between steps (``Scheduler.reconfigure``): every
component reads the config object it is handed at the start of a step.
"""

from __future__ import annotations

import dataclasses

from protos import tiers
from scheduler_svc.core.policy import POLICIES

# Per priority tier (protos/tiers.py, premium first): its queue-time bound field, and its
# TPOT target (ms; 0: none). The fields themselves are spelled out below (a config file's
# keys); tests/test_tiers.py holds them to these.
QUEUE_TIME_FIELDS = tuple(f"max_queue_time_{name}_s" for name in tiers.NAMES)
TPOT_TARGET_FIELDS = tuple(f"tpot_target_{name}_ms" for name in tiers.NAMES)


class ConfigError(ValueError):
    """A config value a user must change; the message says which and why."""


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    """Limits of one iteration, of the queues, and the scheduling policy.

    policy: a name in core/policy.py's ``POLICIES``: "chunked" (default: long prompts
        prefill in chunks beside decodes), "chunked-slo" (chunked with the SLO-aware
        budget of tpot_target_*_ms), "continuous" (a prompt prefills in as few steps as
        the budget allows, no per-step chunk cap), "static" (admit a batch, run it to
        completion), "sjf" (chunked, shortest prompt first within a tier), ...
    max_num_batched_tokens: tokens computed per step across all sequences.
    max_num_seqs: sequences running at once (each decodes one token a step).
    chunk_size: most prompt tokens one sequence computes in one step.
    long_prefill_token_threshold: a prompt longer than this gets at most this
        many tokens a step, so one long prompt cannot take the whole budget
        (0: chunk_size alone caps it).
    max_num_waiting: requests that may queue before Submit is refused.
    max_num_waiting_per_tenant: per-tenant share of that queue (0: no cap).
    watermark: fraction of device blocks admission keeps free for running
        sequences' decodes, so admitting does not force an immediate preemption.
    aging_s: seconds of waiting that raise a request one priority tier (up to
        standard: only starvation passes premium); a request of tier t is
        "starving" after (t + 1) × aging_s and then goes before every request
        that is not (see docs in queue.py for the bound).
    max_preemptions / preemption_window_s: the thrash guard. A sequence's
        max_preemptions-th preemption within the window (not the one after it)
        makes it protected until it finishes: no further preemption by choice.
    enable_prefix_caching: share full KV blocks between identical prefixes.
    async_scheduling: build and send step N+1 while step N runs (two plans in flight),
        so scheduler CPU time overlaps device time instead of adding to it.
    max_queue_time_{premium,standard,best_effort}_s: the longest a request of that
        tier may be expected to wait for its first step; one that would wait longer,
        by the throughput measured so far, is refused at Submit with a retry hint
        (core/admission.py; 0 disables the tier's bound, and before any throughput is
        measured only max_num_waiting applies). Premium's 2 s is the queue share of
        the 3 s TTFT SLO of the capacity contract (docs/simulator.md); standard 5 s
        keeps an interactive answer interactive; best effort 20 s stays below the
        30 s at which aging makes it starving (3 x aging_s) and so passes everyone.
    prefill_alert_tokens: a step whose prompt (prefill) tokens pass this many is counted
        (``Scheduler.num_prefill_alerts``, logged at the first and every 1000th): the
        seed's "prefill storm" alert, a sign that long prompts are stalling decodes. 0
        (default): off; pick it from the TPOT SLO and the measured prefill rate.
    max_prefill_tokens_per_step: the clamp: prompt tokens one step may carry in all
        (running prefills and admissions), the rest of max_num_batched_tokens stays for
        decodes. 0 (default): off (chunk_size and the token budget alone bound it).
    max_swapped: sequences swapped out to the host pool at once; a preemption beyond
        it recomputes instead (host-pool pressure: swap-ins compete with the step for
        the copy bandwidth). 0 (default): the host pool's size alone bounds it.
    The other guards of the seed's failure table: per-tier queue-wait shedding is
        max_queue_time_*_s (core/admission.py refuses at Submit and sheds requests that
        waited twice their bound, 429 at the gateway); the thrash guard is
        max_preemptions; a client that went silent is cancelled by the gateway's
        watchdog (gateway/routing/watchdog.py), a vanished gateway by gRPC keepalive.
    tpot_target_*_ms: the SLO-aware token budget (core/step_cost.py): with a target set
        for a tier that has running sequences, the chunked-slo policy (and chunked, which
        with a target is chunked-slo) sizes each step's prompt
        tokens from an online fit of the measured step time so the step holds the tightest
        such target: spare time goes to prefill when decodes are few, decodes are
        protected when they are many, and chunk_size no longer caps a prompt (the step's
        budget does). 0 (default): off for that tier (chunk_size applies).
    max_step_failures: failed steps (the executor raised, hung or died in them) after
        which a request is ended alone with an error; a request that failed runs in
        steps of its own until one succeeds, so the culprit of a poisoned batch is
        found in this many failures and healthy requests fail at most once.
    stream_interval: tokens a request's stream gathers before it sends them (its first
        token and its end go at once): each gRPC message costs the scheduler's event loop
        ~20 µs, so at 256 streams one token per message takes ~5 ms of it a step; 4
        sends a quarter of the messages, in bursts of 4 tokens. 1 (default): every
        token as it comes. Not read by the core: the servicer reads it per message.
    """

    policy: str = "chunked"
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    chunk_size: int = 512
    long_prefill_token_threshold: int = 0
    max_num_waiting: int = 1024
    max_num_waiting_per_tenant: int = 0
    watermark: float = 0.01
    aging_s: float = 10.0
    max_preemptions: int = 3
    preemption_window_s: float = 60.0
    enable_prefix_caching: bool = True
    async_scheduling: bool = True
    max_queue_time_premium_s: float = 2.0
    max_queue_time_standard_s: float = 5.0
    max_queue_time_best_effort_s: float = 20.0
    max_step_failures: int = 2
    prefill_alert_tokens: int = 0
    max_prefill_tokens_per_step: int = 0
    max_swapped: int = 0
    tpot_target_premium_ms: float = 0.0
    tpot_target_standard_ms: float = 0.0
    tpot_target_best_effort_ms: float = 0.0
    stream_interval: int = 1

    def tpot_targets(self) -> tuple[float, ...]:
        """The per-tier TPOT targets in ms, premium first (0: none)."""
        return tuple(getattr(self, f) for f in TPOT_TARGET_FIELDS)

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ConfigError(f"policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        _positive(self, "max_num_batched_tokens", "max_num_seqs", "chunk_size",
                  "max_num_waiting", "max_preemptions", "max_step_failures",
                  "stream_interval")
        _non_negative(self, "long_prefill_token_threshold", "max_num_waiting_per_tenant",
                      "prefill_alert_tokens", "max_prefill_tokens_per_step", "max_swapped")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ConfigError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs "
                f"({self.max_num_seqs}); otherwise running decodes cannot all get their token "
                "each step"
            )
        if self.chunk_size > self.max_num_batched_tokens:
            raise ConfigError(
                f"chunk_size ({self.chunk_size}) must be <= max_num_batched_tokens "
                f"({self.max_num_batched_tokens})"
            )
        if not 0.0 <= self.watermark < 0.5:
            raise ConfigError(f"watermark must be in [0, 0.5), got {self.watermark}")
        for tier in QUEUE_TIME_FIELDS:
            value = getattr(self, tier)
            if not isinstance(value, int | float) or not 0 <= value < float("inf"):
                raise ConfigError(f"{tier} must be a number of seconds >= 0 (0: no bound), "
                                  f"got {value!r}")
        for tier in TPOT_TARGET_FIELDS:
            value = getattr(self, tier)
            if isinstance(value, bool) or not isinstance(value, int | float) or \
                    not 0 <= value < float("inf"):
                raise ConfigError(f"{tier} must be a number of milliseconds >= 0 (0: no "
                                  f"target), got {value!r}")
        if self.aging_s <= 0 or self.preemption_window_s <= 0:
            raise ConfigError("aging_s and preemption_window_s must be > 0 seconds")


def queue_time_bound(cfg: SchedulerConfig, tier: int) -> float:
    """Tier ``tier``'s queue-time bound in seconds (0: none); tiers past best effort
    share its bound."""
    return getattr(cfg, QUEUE_TIME_FIELDS[min(max(tier, 0), len(QUEUE_TIME_FIELDS) - 1)])


def _positive(cfg: SchedulerConfig, *names: str) -> None:
    for name in names:
        value = getattr(cfg, name)
        if not isinstance(value, int) or value <= 0:
            raise ConfigError(f"{name} must be a positive integer, got {value!r}")


def _non_negative(cfg: SchedulerConfig, *names: str) -> None:
    for name in names:
        value = getattr(cfg, name)
        if not isinstance(value, int) or value < 0:
            raise ConfigError(f"{name} must be an integer >= 0, got {value!r}")
