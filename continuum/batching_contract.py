"""Seed 002's inputs: a batching contract and the workload bound to it.

A *batching contract* (``kind = "batching"``) declares one replica's token/s budget
split into a prefill and a decode partition, the iteration period, the declared
prefill chunk, active-sequence and KV limits, SLOs and a fairness bound. A *workload*
declares request classes and names the contract it was written for by ``scope`` and
``contract_content_id``: the SHA-256 of the contract's values (canonical JSON of the
parsed file, so comments and layout do not change it, any value does). A workload
whose scope or content id differs is refused: a plan audited against a contract that
has changed since is not a plan. ``continuum capacity content-id CONTRACT`` prints the
id to paste into a workload.

Numbers are kept exact (``fractions.Fraction`` of the decimal the file holds), so the
audit's arithmetic is deterministic to the last digit. Types and parsing only;
``continuum.batching_audit`` does the arithmetic.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from fractions import Fraction

from continuum.contract import AuditError, _check_keys

KIND = "batching"


@dataclasses.dataclass(frozen=True)
class BatchingContract:
    scope: str
    content_id: str
    token_budget_per_s: Fraction
    prefill_partition_per_s: Fraction
    decode_partition_per_s: Fraction
    iteration_ms: Fraction
    max_prefill_chunk_tokens: int
    max_active_sequences: int
    block_size: int
    kv_bytes_per_token: int
    kv_capacity_bytes: int
    max_utilization_permille: int
    max_fairness_ratio: Fraction
    slo_queue_ms: Fraction
    slo_ttft_ms: Fraction
    slo_tpot_ms: Fraction
    example: str | None = None


@dataclasses.dataclass(frozen=True)
class BatchingClass:
    name: str
    tier: int  # 0 first; lower tiers are served before higher ones
    rate_per_s: Fraction
    prompt_tokens: int
    output_tokens: int


@dataclasses.dataclass(frozen=True)
class BatchingWorkload:
    scope: str
    contract_content_id: str
    classes: tuple[BatchingClass, ...]


_SLO_KEYS = {"queue_ms", "ttft_ms", "tpot_ms"}
_INTEGERS = ("max_prefill_chunk_tokens", "max_active_sequences", "block_size",
             "kv_bytes_per_token", "kv_capacity_bytes", "max_utilization_permille")
_RATES = ("token_budget_per_s", "prefill_partition_per_s", "decode_partition_per_s",
          "iteration_ms", "max_fairness_ratio")


def is_batching(data: dict) -> bool:
    return isinstance(data, dict) and data.get("kind") == KIND


def content_id(data: dict) -> str:
    """``sha256:<hex>`` of the contract's values in canonical JSON."""
    canonical = json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return "sha256:" + hashlib.sha256(canonical.encode()).hexdigest()


def _exact(where: str, data: dict, key: str, problems: list[str], *, integer: bool = False,
           minimum: int = 0):
    """An exact positive number (> ``minimum``), or None with a problem recorded."""
    value = data.get(key)
    if key not in data:
        problems.append(f"{where}: missing {key!r}")
        return None
    kind = int if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kind) or not value > minimum:
        what = "an integer" if integer else "a number"
        problems.append(f"{where}: {key} must be {what} > {minimum}, got {value!r}")
        return None
    return value if integer else Fraction(str(value))


def parse_contract(data: dict, where: str = "contract") -> BatchingContract:
    problems: list[str] = []
    allowed = {"kind", "scope", "example", "slo", *_INTEGERS, *_RATES}
    _check_keys(where, data, allowed, problems)
    slo = data.get("slo", {})
    if not isinstance(slo, dict):
        problems.append(f"{where}: slo must be a table with {', '.join(sorted(_SLO_KEYS))}")
        slo = {}
    _check_keys(f"{where}.slo", slo, _SLO_KEYS, problems)
    v: dict = {"scope": data.get("scope"), "content_id": content_id(data),
               "example": data.get("example")}
    if not isinstance(v["scope"], str) or not v["scope"]:
        problems.append(f"{where}: scope must be a non-empty string")
    if v["example"] is not None and not isinstance(v["example"], str):
        problems.append(f"{where}: example must be a string")
    for key in _INTEGERS:
        v[key] = _exact(where, data, key, problems, integer=True)
    for key in _RATES:
        v[key] = _exact(where, data, key, problems)
    for key in sorted(_SLO_KEYS):
        v[f"slo_{key}"] = _exact(f"{where}.slo", slo, key, problems)
    if not problems:
        parts = v["prefill_partition_per_s"] + v["decode_partition_per_s"]
        if parts > v["token_budget_per_s"]:
            problems.append(f"{where}: prefill_partition_per_s + decode_partition_per_s "
                            f"({float(parts):g}) must be <= token_budget_per_s "
                            f"({float(v['token_budget_per_s']):g})")
        if v["max_utilization_permille"] >= 1000:
            problems.append(f"{where}: max_utilization_permille must be < 1000 (a queue at "
                            f"full utilization grows without bound), got "
                            f"{v['max_utilization_permille']}")
        if v["max_fairness_ratio"] < 1:
            problems.append(f"{where}: max_fairness_ratio must be >= 1 (the worst class's "
                            f"queue over the aggregate's), got {float(v['max_fairness_ratio'])}")
    if problems:
        raise AuditError(problems)
    return BatchingContract(**v)


def parse_workload(data: dict, where: str = "workload") -> BatchingWorkload:
    problems: list[str] = []
    _check_keys(where, data, {"scope", "contract_content_id", "classes"}, problems)
    for key in ("scope", "contract_content_id"):
        if not isinstance(data.get(key), str) or not data.get(key):
            problems.append(f"{where}: {key} must name the contract it was written for "
                            "(`continuum capacity content-id CONTRACT` prints the id)")
    raw = data.get("classes")
    if not isinstance(raw, list) or not raw:
        problems.append(f"{where}: needs at least one [[classes]] entry")
        raw = []
    classes, names = [], set()
    for i, c in enumerate(raw):
        if not isinstance(c, dict):
            problems.append(f"{where}: classes[{i}] must be a table")
            continue
        at = f"{where}: class {c.get('name', i)!r}"
        _check_keys(at, c, {"name", "tier", "rate_per_s", "prompt_tokens", "output_tokens"},
                    problems)
        name, tier = c.get("name"), c.get("tier", 0)
        n = len(problems)
        if not isinstance(name, str) or not name or name in names:
            problems.append(f"{at}: name must be a non-empty string used once")
        names.add(name)
        if isinstance(tier, bool) or not isinstance(tier, int) or tier < 0:
            problems.append(f"{at}: tier must be an integer >= 0, got {tier!r}")
        rate = _exact(at, c, "rate_per_s", problems)
        prompt = _exact(at, c, "prompt_tokens", problems, integer=True)
        output = _exact(at, c, "output_tokens", problems, integer=True)
        if len(problems) == n:
            classes.append(BatchingClass(name, tier, rate, prompt, output))
    if problems:
        raise AuditError(problems)
    return BatchingWorkload(data["scope"], data["contract_content_id"], tuple(classes))


def bind(contract: BatchingContract, workload: BatchingWorkload) -> None:
    """Raises AuditError unless ``workload`` was written for this very contract."""
    if workload.scope != contract.scope or workload.contract_content_id != contract.content_id:
        raise AuditError([
            f"workload belongs to another batching contract: it names scope "
            f"{workload.scope!r} and content id {workload.contract_content_id}, the contract "
            f"is scope {contract.scope!r} with content id {contract.content_id} (re-audit "
            "the workload against this contract and update its contract_content_id)"])
