"""A fitted step-time profile of our own executor: load it, price a plan, fit one.

``python -m benchmarks.fit_profile`` measures the executor in-process and writes a JSON profile
(``profiles/<host>.json``); ``ExecutorProfile.load`` reads it back as an object with the
interface the simulator prices steps with (``StepCostModel``'s: ``step_time(seqs,
num_sampled)``, ``num_kv_blocks``, ``decode_step_time``, ``prefill_time``, plus the swap
cost and the scheduler's preemption ``CostModel``).

Linear in a handful of counts of the plan, so each coefficient is "seconds per one of
these" and ``predict`` is a dot product of seven numbers, cheap enough for every step:

    step = c_step + c_tok·T + Σ_k c_k·max(0, T − k) + c_seq·S + c_smp·sampled
           + c_kv·(KV tokens the decodes read) + c_att·(prefill query×key pairs ÷ 1000)
           + c_mix·[the step holds a prefill]

T = tokens in the step, S = sequences; hinges at ``TOKEN_KNOTS`` (small batches read
weights, large ones are FLOP-bound); ``mixed``: the native decoder does decode-only steps.
Fitted by non-negative least squares (no negative cost). Pure Python: the scheduler may
import it.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Iterable, Sequence
from pathlib import Path

from scheduler_svc.core import CostModel

SCHEMA = "continuum.executor_profile.v1"
TOKEN_KNOTS = (64, 256)
FEATURES = ("step", "tokens", *(f"tokens_over_{k}" for k in TOKEN_KNOTS), "seqs", "sampled",
            "decode_kv_tokens", "prefill_kpairs", "mixed")


def plan_counts(seqs: Iterable[tuple[int, int]],
                num_sampled: int | None = None) -> tuple[int, int, int, int, float]:
    """(tokens, sequences, sampled, decode KV tokens read, prefill kilo-pairs) of a step;
    ``seqs`` are (new tokens q, cached tokens c) per sequence, as ``StepCostModel`` takes."""
    tokens = num = decode_kv = 0
    pairs = 0.0
    for q, c in seqs:
        num += 1
        tokens += q
        if q == 1:
            decode_kv += c + 1
        else:
            pairs += q * (c + (q + 1) / 2)
    return tokens, num, num if num_sampled is None else num_sampled, decode_kv, pairs / 1e3


def features(tokens: int, seqs: int, sampled: int, decode_kv: int, kpairs: float,
             mixed: bool) -> list[float]:
    """The regressors, in ``FEATURES`` order (zero tokens: an empty step)."""
    return [1.0, float(tokens), *(float(max(0, tokens - k)) for k in TOKEN_KNOTS),
            float(seqs), float(sampled), float(decode_kv), kpairs, float(mixed)]


@dataclasses.dataclass
class ExecutorProfile:
    """A fitted profile; see the module docstring. Times in seconds."""

    coefficients: dict[str, float]
    kv_bytes_per_token: int  # K and V of every layer, at the profiled KV dtype
    kv_pool_bytes: int  # the device pool the executor was profiled with
    copy_bytes_per_s: float  # device -> host memcpy: the swap bandwidth
    prefill_tokens_per_s: float  # what the executor's Hello would report
    machine: dict = dataclasses.field(default_factory=dict)
    executor: dict = dataclasses.field(default_factory=dict)  # model, weight format, kernels
    fit: dict = dataclasses.field(default_factory=dict)  # points, held-out error
    link_overhead_s: float = 0.0  # per step, scheduler + link, when measured from a server
    # ...and per sequence sampled in the step (the scheduler's and the gateway's work per
    # streamed token, which takes CPU from a CPU executor's threads)
    link_overhead_per_seq_s: float = 0.0
    # ...and per prompt starting its prefill in the step (a first chunk: q > 1 over no
    # cached tokens): the gateway's and the scheduler's work to admit a request, which
    # lands on the cores of the step that prefills it
    link_overhead_per_prompt_s: float = 0.0
    # The fitted model's time × this: the machine's speed in a server run against the
    # fit's, measured from lone prefills there (the same machine drifts 10-15 % in an hour)
    speed_scale: float = 1.0

    def __post_init__(self) -> None:
        missing = [f for f in FEATURES if f not in self.coefficients]
        if missing:
            raise ValueError(f"profile lacks coefficients {missing} (schema {SCHEMA})")
        if not 0 < self.speed_scale < math.inf:
            raise ValueError(f"speed_scale {self.speed_scale}: a positive factor")
        self._c = [float(self.coefficients[f]) for f in FEATURES]

    # -- pricing ----------------------------------------------------------------------

    def predict(self, tokens: int, seqs: int, sampled: int, decode_kv: int,
                kpairs: float, mixed: bool) -> float:
        """Seconds for a step with these counts (``plan_counts``); 0 for an empty one."""
        if tokens <= 0:
            return 0.0
        x = features(tokens, seqs, sampled, decode_kv, kpairs, mixed)
        return (self.speed_scale * sum(c * v for c, v in zip(self._c, x, strict=True))
                + self.link_overhead_s + self.link_overhead_per_seq_s * sampled)

    def step_time(self, seqs: Iterable[tuple[int, int]],
                  num_sampled: int | None = None) -> float:
        seqs = list(seqs)
        counts = plan_counts(seqs, num_sampled)
        step = self.predict(*counts, mixed=any(q > 1 for q, _ in seqs))
        if self.link_overhead_per_prompt_s and step:
            step += self.link_overhead_per_prompt_s * sum(q > 1 and not c for q, c in seqs)
        return step

    def decode_step_time(self, batch: int, context: int) -> float:
        return self.step_time([(1, context)] * batch)

    def prefill_time(self, num_tokens: int) -> float:
        return self.step_time([(num_tokens, 0)])

    # -- memory and swap --------------------------------------------------------------

    def block_bytes(self, block_size: int) -> int:
        return block_size * self.kv_bytes_per_token

    def num_kv_blocks(self, block_size: int) -> int:
        return self.kv_pool_bytes // self.block_bytes(block_size)

    def swap_time(self, num_blocks: int, block_size: int) -> float:
        """Copying ``num_blocks`` between the device pool and the host pool."""
        return num_blocks * self.block_bytes(block_size) / self.copy_bytes_per_s

    def core_cost_model(self, block_size: int) -> CostModel:
        """The preemption cost model the executor's Hello gives the scheduler."""
        return CostModel(self.prefill_tokens_per_s, self.copy_bytes_per_s,
                         self.block_bytes(block_size))

    def describe(self) -> str:
        m, e = self.machine, self.executor
        return (f"profile of {e.get('model', '?')} ({e.get('weight_format', '?')}, "
                f"{e.get('attention_backend', '?')} attention) on {m.get('cpu', '?')} "
                f"({m.get('cores', '?')} cores, {m.get('isa', '?')}), git "
                f"{m.get('git_rev', '?')}, {m.get('date', '?')}; held-out median error "
                f"{self.fit.get('holdout_median_abs_error_pct', float('nan')):.1f} %")

    # -- files ------------------------------------------------------------------------

    def to_json(self) -> dict:
        out = {"schema": SCHEMA, **dataclasses.asdict(self)}
        out["features"] = list(FEATURES)
        return out

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_json(), indent=1) + "\n")

    @classmethod
    def load(cls, path: Path) -> ExecutorProfile:
        """Raises ValueError naming the file for one that is not a profile."""
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"{path}: cannot read a profile ({exc})") from exc
        if not isinstance(data, dict) or data.get("schema") != SCHEMA:
            raise ValueError(f"{path}: not a {SCHEMA} file (make one with "
                             "`python -m benchmarks.fit_profile`)")
        fields = {f.name for f in dataclasses.fields(cls)}
        try:
            return cls(**{k: v for k, v in data.items() if k in fields})
        except TypeError as exc:
            raise ValueError(f"{path}: {exc}") from exc


# -- fitting (pure Python: a few dozen points, nine unknowns) ------------------------------


def nnls(rows: Sequence[Sequence[float]], y: Sequence[float],
         weights: Sequence[float] | None = None) -> list[float]:
    """Non-negative least squares by active set: solve, pin the most negative coefficient
    to zero, solve again (a handful of columns, so the simple loop is enough)."""
    n = len(rows[0])
    w = weights or [1.0] * len(rows)
    active = list(range(n))
    while True:
        coef = _lstsq([[r[j] for j in active] for r in rows], y, w)
        worst = min(range(len(active)), key=lambda i: coef[i]) if active else None
        if worst is None or coef[worst] >= 0:
            out = [0.0] * n
            for j, c in zip(active, coef, strict=True):
                out[j] = c
            return out
        active.pop(worst)


def _lstsq(rows, y, w) -> list[float]:
    """Weighted normal equations, solved by Gaussian elimination with a tiny ridge."""
    n = len(rows[0]) if rows and rows[0] else 0
    if n == 0:
        return []
    # Scale columns to unit size so the ridge is scale-free.
    scale = [max(1e-12, math.sqrt(sum(wi * r[j] ** 2 for r, wi in zip(rows, w, strict=True))))
             for j in range(n)]
    a = [[sum(wi * r[i] * r[j] for r, wi in zip(rows, w, strict=True)) / (scale[i] * scale[j])
          + (1e-9 if i == j else 0.0) for j in range(n)] for i in range(n)]
    b = [sum(wi * r[i] * yi for r, yi, wi in zip(rows, y, w, strict=True)) / scale[i]
         for i in range(n)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda i: abs(a[i][col]))
        a[col], a[pivot], b[col], b[pivot] = a[pivot], a[col], b[pivot], b[col]
        for i in range(col + 1, n):
            f = a[i][col] / a[col][col]
            for j in range(col, n):
                a[i][j] -= f * a[col][j]
            b[i] -= f * b[col]
    x = [0.0] * n
    for i in reversed(range(n)):
        x[i] = (b[i] - sum(a[i][j] * x[j] for j in range(i + 1, n))) / a[i][i]
    return [x[i] / scale[i] for i in range(n)]


def fit_coefficients(points: Sequence[dict]) -> dict[str, float]:
    """``points``: dicts with ``counts`` (plan_counts' five + mixed) and ``seconds``.
    Relative error is what matters (a 5 ms step and a 2 s one alike), so each point is
    weighted by 1 / seconds²."""
    rows = [features(*p["counts"]) for p in points]
    y = [p["seconds"] for p in points]
    coef = nnls(rows, y, [1.0 / max(s, 1e-6) ** 2 for s in y])
    return dict(zip(FEATURES, coef, strict=True))


def errors_pct(coefficients: dict[str, float], points: Sequence[dict]) -> list[float]:
    c = [coefficients[f] for f in FEATURES]
    out = []
    for p in points:
        pred = sum(a * b for a, b in zip(c, features(*p["counts"]), strict=True))
        out.append(100.0 * (pred / p["seconds"] - 1.0))
    return out
