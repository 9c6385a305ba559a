"""A step-time model fitted online, and the prefill budget that holds a TPOT target.

    step_ms ≈ a + b · decodes + c · prefill_tokens + d · kv_tokens

(weights streamed once per step, a per-sequence cost, a per-prompt-token cost, the KV
attention reads). ``StepCost`` fits it by recursive least squares with forgetting (O(1)
a step, about 1,000 steps of memory, so it follows the machine: no profile file) and
keeps the spread of its residuals. No clock of its own: the caller ``observe``s each
answered step.

``prefill_limit`` inverts the fit: the most prompt tokens a step with ``decodes`` running
may carry so that its predicted time plus two residual SDs stays within the target.
Until ``ready`` it answers None and the static chunk applies.

``TtftGuard``: a TPOT cap makes a burst's prompts wait many steps for their first token.
ITL p99 is the 1 % tail of the gaps, TTFT p99 that of the requests, so a step given the
whole budget at most once in ``BOOST_EVERY_STEPS`` (0.5 % of the gaps), for a prompt that
has waited the recent TTFTs' p95, shortens the TTFT tail without reaching the gaps'.
"""

from __future__ import annotations

import collections
import itertools
import math

# Feature scales keep the normal equations well conditioned (x is O(1) for usual plans).
_SCALES = (1.0, 1 / 64, 1 / 512, 1 / 65536)
FORGET = 0.999
MIN_STEPS = 32  # observations before the fit is trusted...
MIN_PREFILL_STEPS = 8  # ...of which this many carried prompt tokens
MIN_PREFILL_TOKENS = 32  # a step always gives prompts this much: TTFT must progress too
_MAX_TRACE = 4e4  # the covariance's bound (its start is 1e4 per feature)


class StepCost:
    """Online fit of step time (ms) against (decodes, prefill tokens, KV tokens)."""

    __slots__ = ("theta", "p", "num_steps", "num_prefill_steps", "resid_var")

    def __init__(self) -> None:
        self.theta = [0.0, 0.0, 0.0, 0.0]
        self.p = [[1e4 if i == j else 0.0 for j in range(4)] for i in range(4)]
        self.num_steps = 0
        self.num_prefill_steps = 0
        self.resid_var = 0.0

    def predict_ms(self, decodes: int, prefill_tokens: int, kv_tokens: int) -> float:
        t = self.theta
        return (t[0] + t[1] * decodes * _SCALES[1] + t[2] * prefill_tokens * _SCALES[2]
                + t[3] * kv_tokens * _SCALES[3])

    def observe(self, decodes: int, prefill_tokens: int, kv_tokens: int,
                elapsed_ms: float) -> None:
        """One answered step. A step far off the fit (a GC pause, a page fault) moves it
        as if it were 4 residual deviations off: one outlier cannot skew the budget."""
        if not elapsed_ms > 0:
            return
        x1, x2, x3 = decodes * _SCALES[1], prefill_tokens * _SCALES[2], kv_tokens * _SCALES[3]
        p, theta = self.p, self.theta
        px = [r[0] + r[1] * x1 + r[2] * x2 + r[3] * x3 for r in p]  # unrolled: ~4x cheaper
        g = 1.0 / (FORGET + px[0] + px[1] * x1 + px[2] * x2 + px[3] * x3)
        predicted = theta[0] + theta[1] * x1 + theta[2] * x2 + theta[3] * x3
        err = elapsed_ms - predicted
        if self.num_steps >= MIN_STEPS:  # the fit has settled: track its spread
            bound = max(4.0 * self.resid_var ** 0.5, 0.05 * abs(predicted))
            err = max(-bound, min(bound, err))
            self.resid_var = 0.98 * self.resid_var + 0.02 * err * err
        ge = g * err
        self.theta = [theta[i] + px[i] * ge for i in range(4)]
        inv = 1.0 / FORGET
        p0, p1, p2, p3 = px
        self.p = p = [[(r[0] - ki * p0) * inv, (r[1] - ki * p1) * inv, (r[2] - ki * p2) * inv,
                       (r[3] - ki * p3) * inv] for r, ki in zip(p, [v * g for v in px],
                                                                strict=True)]
        trace = p[0][0] + p[1][1] + p[2][2] + p[3][3]
        if trace > _MAX_TRACE:  # a feature unseen for long (no prompts): no wind-up
            scale = _MAX_TRACE / trace
            self.p = [[v * scale for v in r] for r in p]
        self.num_steps += 1
        if prefill_tokens:
            self.num_prefill_steps += 1

    @property
    def ready(self) -> bool:
        return (self.num_steps >= MIN_STEPS and self.num_prefill_steps >= MIN_PREFILL_STEPS
                and self.theta[2] > 0)

    def prefill_limit(self, target_ms: float, decodes: int, kv_tokens: int,
                      ceiling: int) -> int | None:
        """Prompt tokens a step may carry to hold ``target_ms``, in
        [MIN_PREFILL_TOKENS, ceiling]; None while the fit is not ``ready``."""
        if not self.ready:
            return None
        per_token = self.theta[2] * _SCALES[2]
        room = target_ms - 2.0 * self.resid_var ** 0.5 - self.predict_ms(decodes, 0, kv_tokens)
        tokens = int(room / per_token) if room > 0 else 0
        return max(min(tokens, ceiling), min(MIN_PREFILL_TOKENS, ceiling))


BOOST_EVERY_STEPS = 200  # one boosted step per 200 at most
MAX_BOOST_CREDIT = 2.0  # steps saved up for a burst
TTFT_WINDOW = 512  # the recent prompts whose waits set the threshold
TTFT_QUANTILE = 0.95


class TtftGuard:
    """Rations whole-budget steps to prompts that have waited into the TTFT tail."""

    __slots__ = ("credit", "recent", "threshold_s", "num_boosts", "_fresh")

    def __init__(self) -> None:
        self.credit = 0.0
        self.recent: collections.deque[float] = collections.deque(maxlen=TTFT_WINDOW)
        self.threshold_s = math.inf  # until enough prompts finished
        self.num_boosts = 0
        self._fresh = 0

    def prompt_done(self, waited_s: float) -> None:
        """A prompt's last chunk was scheduled ``waited_s`` after it arrived (~its TTFT)."""
        self.recent.append(waited_s)
        self._fresh += 1
        if self._fresh >= 32 and len(self.recent) >= 64:  # sorted every 32 prompts
            self._fresh = 0
            ordered = sorted(self.recent)
            self.threshold_s = ordered[int(TTFT_QUANTILE * (len(ordered) - 1))]

    def boost(self, oldest_age_s: float | None) -> bool:
        """Called once a step: whether this step gives prompts the whole budget because
        the oldest prompt without a first token (``oldest_age_s`` since its arrival)
        has waited as long as the TTFT tail, and the ration allows a long step."""
        self.credit = min(self.credit + 1.0 / BOOST_EVERY_STEPS, MAX_BOOST_CREDIT)
        if oldest_age_s is None or self.credit < 1.0 or oldest_age_s < self.threshold_s:
            return False
        self.credit -= 1.0
        self.num_boosts += 1
        return True

    def note_prompts_done(self, rec, now: float) -> None:
        """Each prompt whose last chunk the step ``rec`` (a StepRecord) carries: its wait."""
        for req in itertools.chain(rec.cached_prefills, (r for r, _ in rec.new)):
            if req.num_computed_tokens >= req.num_prompt_tokens and not req.num_output_tokens:
                self.prompt_done(now - req.arrival_time)


def oldest_wait_s(waiting, prefills, now: float) -> float | None:
    """How long the longest-waiting prompt without a first token has waited: a partial
    prefill's (``prefills``: running requests) or the ``waiting`` queue's oldest."""
    oldest = waiting.oldest_arrival()
    for req in prefills:
        if req.num_output_tokens == 0 and (oldest is None or req.arrival_time < oldest):
            oldest = req.arrival_time
    return None if oldest is None else now - oldest


def kv_tokens(block_manager) -> int:
    """KV tokens the running sequences hold (whole blocks): what a step's attention reads."""
    return (block_manager.num_blocks - block_manager.num_free_blocks) * block_manager.block_size


def step_prefill_limit(cost: StepCost, targets: tuple[float, ...], per_tier, decodes: int,
                       kv: int, ceiling: int) -> int | None:
    """This step's prompt-token limit under the tightest target of a tier with running
    sequences: all of ``ceiling`` when no running decode has a target to protect, None
    while the fit is not ready (the static chunk rules then)."""
    last = len(targets) - 1
    target = min((targets[min(tier, last)] for tier, n in per_tier.items()
                  if n and targets[min(tier, last)] > 0), default=0.0) if decodes else 0.0
    return cost.prefill_limit(target, decodes, kv, ceiling) if target else ceiling


def prompt_bounds(cost: StepCost, targets: tuple[float, ...], per_tier, decodes: int,
                  block_manager, budget: int, clamp: int, cap: int,
                  boost: bool = False) -> tuple[int, int]:
    """(tokens of ``budget`` held back from prompts, the per-sequence prompt cap) for one
    step: the prefill clamp (``max_prefill_tokens_per_step``, 0: off) and the policy's
    chunk ``cap``, or, with TPOT targets, the SLO budget: the step's limit bounds prompt
    work in all and no fixed chunk caps one prompt; a ``boost`` (TtftGuard) step gives
    prompts the whole budget."""
    if targets:
        slo = budget if boost else step_prefill_limit(
            cost, targets, per_tier, decodes, kv_tokens(block_manager), budget)
        if slo is not None:
            clamp, cap = min(clamp, slo) if clamp else slo, budget
    return (budget - clamp if 0 < clamp < budget else 0), cap
