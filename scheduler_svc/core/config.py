"""One frozen scheduler config, validated once where it is built.

Replaceable at run time between steps (``Scheduler.reconfigure``): every
component reads the config object it is handed at the start of a step.
"""

from __future__ import annotations

import dataclasses

from protos import tiers
from runtime.config_flags import check_bounds, knob
from scheduler_svc.core.policy import POLICIES

# Per priority tier (protos/tiers.py, premium first): its queue-time bound field, and its
# TPOT target (ms; 0: none). The fields themselves are spelled out below (a config file's
# keys); tests/test_tiers.py holds them to these.
QUEUE_TIME_FIELDS = tuple(f"max_queue_time_{name}_s" for name in tiers.NAMES)
TPOT_TARGET_FIELDS = tuple(f"tpot_target_{name}_ms" for name in tiers.NAMES)
QUEUE_TIME_HELP = ("refuse a {} request (429) that would wait longer than this many seconds "
                   "for its first step, by measured throughput (0: no bound)")
TPOT_TARGET_HELP = ("the chunked policy sizes each step's prompt work so a step holds this "
                    "TPOT (ms) while {} requests decode (0: the fixed --chunk-size)")


class ConfigError(ValueError):
    """A config value a user must change; the message says which and why."""


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    """Limits of one iteration, of the queues, and the scheduling policy. Each field is a
    flag of the scheduler and of ``continuum serve`` and a key of the live config file;
    why the defaults are what they are:

    policy: one of core/policy.py's POLICIES ("chunked", "chunked-slo", "continuous",
        "static", "sjf", ...).
    aging_s: a request of tier t is "starving" after (t + 1) x aging_s (queue.py's bound).
    max_queue_time_*_s (core/admission.py): premium's 2 s is the queue share of the 3 s
        TTFT SLO of the capacity contract (docs/simulator.md); standard 5 s keeps an
        interactive answer interactive; best effort 20 s stays below the 30 s at which
        aging makes it starving (3 x aging_s) and so passes everyone.
    prefill_alert_tokens: pick it from the TPOT SLO and the measured prefill rate.
    max_swapped: swap-ins compete with the step for the copy bandwidth.
    tpot_target_*_ms: sizes each step's prompt tokens to hold the tightest running tier's
        target (core/step_cost.py); chunked with a target is chunked-slo.
    max_step_failures: a failed request runs in steps of its own until one succeeds, so a
        poisoned batch's culprit is found in this many failures, healthy ones fail once.
    stream_interval: each gRPC message costs the event loop ~20 µs (~5 ms a step at 256
        streams, one token a message); 4 sends a quarter. Read by the servicer only.
    """

    policy: str = knob("chunked", "scheduling policy (core/policy.py's POLICIES; benchmarks "
                       "compare them)", choices=tuple(POLICIES))
    max_num_batched_tokens: int = knob(2048, "tokens computed per step across all sequences")
    max_num_seqs: int = knob(64, "sequences running at once (each decodes one token a step)")
    chunk_size: int = knob(512, "most prompt tokens one sequence computes in one step")
    long_prefill_token_threshold: int = knob(
        0, "a prompt longer than this gets at most this many tokens a step, so one long "
           "prompt cannot take the whole budget (0: chunk_size alone caps it)")
    max_num_waiting: int = knob(1024, "requests that may queue; beyond them a request gets "
                                      "RESOURCE_EXHAUSTED / HTTP 429")
    max_num_waiting_per_tenant: int = knob(0, "per-tenant share of that queue (0: no cap)")
    watermark: float = knob(0.01, "fraction of device blocks admission keeps free for "
                                  "running sequences' decodes")
    aging_s: float = knob(10.0, "seconds of waiting that raise a request one priority tier "
                                "(up to standard)")
    max_preemptions: int = knob(3, "the thrash guard: a sequence's this-many-th preemption "
                                   "within --preemption-window-s protects it until it ends")
    preemption_window_s: float = knob(60.0, "the thrash guard's window in seconds")
    enable_prefix_caching: bool = knob(True, "share full KV blocks between identical prefixes")
    async_scheduling: bool = knob(True, "build and send step N+1 while step N runs")
    max_queue_time_premium_s: float = knob(2.0, QUEUE_TIME_HELP.format("premium"))
    max_queue_time_standard_s: float = knob(5.0, QUEUE_TIME_HELP.format("standard"))
    max_queue_time_best_effort_s: float = knob(20.0, QUEUE_TIME_HELP.format("best effort"))
    max_step_failures: int = knob(2, "failed steps after which a request (a poison request) "
                                     "ends with an error, the last one run alone")
    prefill_alert_tokens: int = knob(0, "count (and log) a step with more prompt tokens than "
                                        "this: a prefill storm stalling decodes (0: off)")
    max_prefill_tokens_per_step: int = knob(0, "prompt tokens one step may carry in all; the "
                                               "rest of the budget stays for decodes (0: off)")
    max_swapped: int = knob(0, "sequences swapped out to the host pool at once; beyond it a "
                               "preemption recomputes (0: the pool's size bounds it)")
    tpot_target_premium_ms: float = knob(0.0, TPOT_TARGET_HELP.format("premium"))
    tpot_target_standard_ms: float = knob(0.0, TPOT_TARGET_HELP.format("standard"))
    tpot_target_best_effort_ms: float = knob(0.0, TPOT_TARGET_HELP.format("best effort"))
    stream_interval: int = knob(1, "tokens a stream gathers before it sends them (its first "
                                   "token and its end go at once): fewer messages, burstier "
                                   "text")

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
        check_bounds(self, ConfigError)  # a field's own lo / hi / above


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
