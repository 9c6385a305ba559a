"""The inputs of ``continuum capacity audit``: a scheduler contract and a workload.

Types and their parsing only, so that the fluid model (``capacity_model``) and the
command (``capacity``) both import down to here and never each other in a circle.
Parsing collects every problem a user must fix, one per line, before it gives up:
unknown keys (with the nearest known one), missing or out-of-range numbers, and
bounds that contradict each other.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import tomllib
from pathlib import Path


class AuditError(ValueError):
    """Input a user must fix: one problem per line."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("\n".join(problems))
        self.problems = problems


@dataclasses.dataclass(frozen=True)
class Contract:
    name: str
    max_num_batched_tokens: int
    max_num_seqs: int
    chunk_size: int
    prefill_tokens_per_s: float
    decode_step_ms: tuple[tuple[float, float], ...]  # (batch, ms) at zero context
    kv_read_bytes_per_s: float
    kv_bytes_per_token: int
    kv_memory_bytes: int
    slo_ttft_ms: float
    slo_tpot_ms: float
    slo_queue_delay_ms: float
    max_utilization: float = 0.85


@dataclasses.dataclass(frozen=True)
class RequestClass:
    name: str
    priority: int
    rate_per_s: float
    prompt_tokens_mean: float
    prompt_tokens_p99: float
    output_tokens_mean: float
    output_tokens_p99: float
    cancel_fraction: float = 0.0
    cancel_lag_ms: float = 0.0
    best_effort: bool = False  # no latency SLO: only utilization, slots and KV bind it


@dataclasses.dataclass(frozen=True)
class Workload:
    contract: str
    classes: tuple[RequestClass, ...]


_CONTRACT_SLO = {"ttft_ms": "slo_ttft_ms", "tpot_ms": "slo_tpot_ms",
                 "queue_delay_ms": "slo_queue_delay_ms"}


def load(path: Path) -> dict:
    try:
        text = path.read_text()
    except OSError as exc:
        raise AuditError([f"{path}: cannot read: {exc.strerror}"]) from None
    try:
        return json.loads(text) if path.suffix == ".json" else tomllib.loads(text)
    except (json.JSONDecodeError, tomllib.TOMLDecodeError) as exc:
        raise AuditError([f"{path}: not valid {path.suffix[1:] or 'TOML'}: {exc}"]) from None


def _check_keys(where: str, data: dict, allowed: set[str], problems: list[str]) -> None:
    for key in data:
        if key not in allowed:
            near = difflib.get_close_matches(key, sorted(allowed), n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            problems.append(f"{where}: unknown key {key!r}{hint}")


def _number(where: str, data: dict, key: str, problems: list[str], *, integer: bool = False,
            minimum: float = 0.0, strict: bool = True, default=None):
    if key not in data:
        if default is not None:
            return default
        problems.append(f"{where}: missing {key!r}")
        return None
    value = data[key]
    kind = int if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kind):
        problems.append(f"{where}: {key} must be {'an integer' if integer else 'a number'}, "
                        f"got {value!r}")
        return None
    if value < minimum or (strict and value == minimum):
        problems.append(f"{where}: {key} must be {'>' if strict else '>='} {minimum:g}, "
                        f"got {value!r}")
        return None
    return value


def parse_contract(data: dict, where: str = "contract") -> Contract:
    problems: list[str] = []
    fields = {f.name for f in dataclasses.fields(Contract)} - set(_CONTRACT_SLO.values())
    _check_keys(where, data, fields | {"slo"}, problems)
    slo = data.get("slo", {})
    if not isinstance(slo, dict):
        problems.append(f"{where}: slo must be a table with {', '.join(_CONTRACT_SLO)}")
        slo = {}
    _check_keys(f"{where}.slo", slo, set(_CONTRACT_SLO), problems)
    v = {"name": data.get("name")}
    if not isinstance(v["name"], str) or not v["name"]:
        problems.append(f"{where}: name must be a non-empty string")
    for key in ("max_num_batched_tokens", "max_num_seqs", "chunk_size", "kv_bytes_per_token",
                "kv_memory_bytes"):
        v[key] = _number(where, data, key, problems, integer=True)
    for key in ("prefill_tokens_per_s", "kv_read_bytes_per_s"):
        v[key] = _number(where, data, key, problems)
    v["max_utilization"] = _number(where, data, "max_utilization", problems, default=0.85)
    for key, field in _CONTRACT_SLO.items():
        v[field] = _number(f"{where}.slo", slo, key, problems)
    v["decode_step_ms"] = _decode_table(where, data.get("decode_step_ms"), problems)
    if not problems:
        if v["max_num_batched_tokens"] < v["max_num_seqs"]:
            problems.append(f"{where}: max_num_batched_tokens ({v['max_num_batched_tokens']}) "
                            f"must be >= max_num_seqs ({v['max_num_seqs']}), or running "
                            "decodes cannot all get their token each iteration")
        if v["chunk_size"] > v["max_num_batched_tokens"]:
            problems.append(f"{where}: chunk_size ({v['chunk_size']}) must be <= "
                            f"max_num_batched_tokens ({v['max_num_batched_tokens']})")
        if not v["max_utilization"] < 1:
            problems.append(f"{where}: max_utilization must be < 1 (a queue at 100 % "
                            f"utilization grows without bound), got {v['max_utilization']}")
    if problems:
        raise AuditError(problems)
    return Contract(**v)


def _decode_table(where: str, table, problems: list[str]):
    msg = (f"{where}: decode_step_ms must be a list of [batch, milliseconds] pairs with "
           "increasing batch sizes, e.g. [[1, 33.0], [128, 47.0]]")
    if not isinstance(table, list) or not table:
        problems.append(msg)
        return None
    points = []
    for pair in table:
        if not (isinstance(pair, list | tuple) and len(pair) == 2
                and all(isinstance(x, int | float) and x > 0 for x in pair)):
            problems.append(msg + f"; got {pair!r}")
            return None
        points.append((float(pair[0]), float(pair[1])))
    if any(b1 >= b2 for (b1, _), (b2, _) in zip(points, points[1:], strict=False)):
        problems.append(msg)
        return None
    return tuple(points)


def parse_workload(data: dict, where: str = "workload") -> Workload:
    problems: list[str] = []
    _check_keys(where, data, {"contract", "classes"}, problems)
    if not isinstance(data.get("contract"), str):
        problems.append(f"{where}: contract must name the contract it was written for")
    raw = data.get("classes")
    if not isinstance(raw, list) or not raw:
        problems.append(f"{where}: needs at least one [[classes]] entry")
        raw = []
    allowed = {f.name for f in dataclasses.fields(RequestClass)}
    classes, names = [], set()
    for i, c in enumerate(raw):
        at = f"{where}: classes[{i}]"
        if not isinstance(c, dict):
            problems.append(f"{at} must be a table")
            continue
        at = f"{where}: class {c.get('name', i)!r}"
        _check_keys(at, c, allowed, problems)
        name = c.get("name")
        if not isinstance(name, str) or not name:
            problems.append(f"{at}: name must be a non-empty string")
        elif name in names:
            problems.append(f"{at}: name is used twice")
        names.add(name)
        n = len(problems)
        v = {"name": name,
             "priority": _number(at, c, "priority", problems, integer=True, strict=False),
             "rate_per_s": _number(at, c, "rate_per_s", problems, strict=False),
             "cancel_fraction": _number(at, c, "cancel_fraction", problems, strict=False,
                                        default=0.0),
             "cancel_lag_ms": _number(at, c, "cancel_lag_ms", problems, strict=False,
                                      default=0.0),
             "best_effort": c.get("best_effort", False)}
        for key in ("prompt_tokens", "output_tokens"):
            v[f"{key}_mean"] = mean = _number(at, c, f"{key}_mean", problems)
            v[f"{key}_p99"] = p99 = _number(at, c, f"{key}_p99", problems, default=mean or 1)
            if mean and p99 and p99 < mean:
                problems.append(f"{at}: {key}_p99 ({p99:g}) must be >= {key}_mean ({mean:g})")
        if not isinstance(v["best_effort"], bool):
            problems.append(f"{at}: best_effort must be true or false")
        if v["cancel_fraction"] is not None and v["cancel_fraction"] > 1:
            problems.append(f"{at}: cancel_fraction must be in [0, 1], "
                            f"got {v['cancel_fraction']}")
        if len(problems) == n and name:
            classes.append(RequestClass(**v))
    if problems:
        raise AuditError(problems)
    return Workload(data["contract"], tuple(classes))
