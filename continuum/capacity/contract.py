"""The inputs of ``continuum capacity audit``: a contract and a workload bound to it.

A *contract* declares one replica's scheduler limits (``max_num_seqs``, ``chunk_size``,
``max_num_batched_tokens``), its KV memory, the SLOs and a utilization bound, and names
in its ``[model]`` table the service model the audit assumes, with that model's
parameters (``MODELS``). A *workload* declares request classes and names its contract
by ``contract`` (the contract's name) and, optionally, ``contract_content_id``: the
SHA-256 of the contract's values (canonical JSON of the parsed file, so comments and
layout do not change it, any value does). A workload whose name or content id differs
is refused: a plan audited against a contract that has changed since is not a plan.

Parsing collects every problem a user must fix, one per line, before it gives up:
unknown keys (with the nearest known one), missing or out-of-range numbers, bounds that
contradict each other, class fields the named model does not read. Numbers are kept as
the file holds them; the partitioned model makes them exact fractions.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
import tomllib
from pathlib import Path


class AuditError(ValueError):
    """Input a user must fix: one problem per line."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("\n".join(problems))
        self.problems = problems


@dataclasses.dataclass(frozen=True)
class ServiceCurve:
    """``service-curve``: a prefill rate and a decode step time that grows with the batch."""

    prefill_tokens_per_s: float
    decode_step_ms: tuple[tuple[float, float], ...]  # (batch, ms) at zero context
    kv_read_bytes_per_s: float
    name: str = "service-curve"


@dataclasses.dataclass(frozen=True)
class Partitions:
    """``partitioned``: a token/s budget split into a prefill and a decode partition, served
    in iterations of a fixed period."""

    token_budget_per_s: float
    prefill_partition_per_s: float
    decode_partition_per_s: float
    iteration_ms: float
    block_size: int
    max_fairness_ratio: float  # the worst tier's queue over the aggregate's
    name: str = "partitioned"


# model name -> (its parameters, which of them are integers, the class fields it reads)
MODELS = {
    "service-curve": (ServiceCurve, (), {"prompt_tokens_p99", "output_tokens_p99",
                                         "cancel_fraction", "cancel_lag_ms", "best_effort"}),
    "partitioned": (Partitions, ("block_size",), set()),
}


@dataclasses.dataclass(frozen=True)
class Contract:
    name: str
    content_id: str
    model: ServiceCurve | Partitions
    max_num_seqs: int
    chunk_size: int  # most prompt tokens one sequence computes per iteration
    max_num_batched_tokens: int
    kv_bytes_per_token: int
    kv_memory_bytes: int
    max_utilization: float
    slo_ttft_ms: float
    slo_tpot_ms: float
    slo_queue_ms: float
    example: str | None = None  # a label printed first, e.g. "illustrative_only"


@dataclasses.dataclass(frozen=True)
class RequestClass:
    name: str
    tier: int  # 0 first; lower tiers are served before higher ones
    rate_per_s: float
    prompt_tokens: float  # mean
    output_tokens: float  # mean
    prompt_tokens_p99: float
    output_tokens_p99: float
    cancel_fraction: float = 0.0
    cancel_lag_ms: float = 0.0
    best_effort: bool = False  # no latency SLO: only utilization, slots and KV bind it


@dataclasses.dataclass(frozen=True)
class Workload:
    contract: str
    contract_content_id: str | None
    classes: tuple[RequestClass, ...]


_SLO = ("ttft_ms", "tpot_ms", "queue_ms")
_LIMITS = ("max_num_seqs", "chunk_size", "max_num_batched_tokens", "kv_bytes_per_token",
           "kv_memory_bytes")
_CLASS_OPTIONAL = {"prompt_tokens_p99", "output_tokens_p99", "cancel_fraction",
                   "cancel_lag_ms", "best_effort"}


def load(path: Path) -> dict:
    try:
        text = path.read_text()
    except OSError as exc:
        raise AuditError([f"{path}: cannot read: {exc.strerror}"]) from None
    try:
        return json.loads(text) if path.suffix == ".json" else tomllib.loads(text)
    except (json.JSONDecodeError, tomllib.TOMLDecodeError) as exc:
        raise AuditError([f"{path}: not valid {path.suffix[1:] or 'TOML'}: {exc}"]) from None


def content_id(data: dict) -> str:
    """``sha256:<hex>`` of the contract's values in canonical JSON."""
    canonical = json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return "sha256:" + hashlib.sha256(canonical.encode()).hexdigest()


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


def _table(where: str, data: dict, key: str, problems: list[str]) -> dict:
    value = data.get(key, {})
    if not isinstance(value, dict):
        problems.append(f"{where}: {key} must be a table")
        return {}
    return value


def parse_contract(data: dict, where: str = "contract") -> Contract:
    problems: list[str] = []
    _check_keys(where, data, {"name", "example", "max_utilization", "slo", "model", *_LIMITS},
                problems)
    v: dict = {"name": data.get("name"), "content_id": content_id(data),
               "example": data.get("example")}
    if not isinstance(v["name"], str) or not v["name"]:
        problems.append(f"{where}: name must be a non-empty string")
    if v["example"] is not None and not isinstance(v["example"], str):
        problems.append(f"{where}: example must be a string")
    for key in _LIMITS:
        default = None
        if key == "max_num_batched_tokens":  # a chunk plus one decode per sequence
            default = (data.get("chunk_size", 0) or 0) + (data.get("max_num_seqs", 0) or 0)
        v[key] = _number(where, data, key, problems, integer=True, default=default or None)
    v["max_utilization"] = _number(where, data, "max_utilization", problems, default=0.85)
    slo = _table(where, data, "slo", problems)
    _check_keys(f"{where}.slo", slo, set(_SLO), problems)
    for key in _SLO:
        v[f"slo_{key}"] = _number(f"{where}.slo", slo, key, problems)
    v["model"] = _model(f"{where}.model", _table(where, data, "model", problems), problems)
    if not problems:
        _cross_checks(where, v, problems)
    if problems:
        raise AuditError(problems)
    return Contract(**v)


def _model(where: str, data: dict, problems: list[str]):
    name = data.get("name")
    if name not in MODELS:
        problems.append(f"{where}: name must be one of {', '.join(MODELS)}, got {name!r}")
        return None
    cls, integers, _ = MODELS[name]
    fields = [f.name for f in dataclasses.fields(cls) if f.name != "name"]
    _check_keys(where, data, {"name", *fields}, problems)
    v = {}
    for key in fields:
        if key == "decode_step_ms":
            v[key] = _decode_table(where, data.get(key), problems)
        else:
            v[key] = _number(where, data, key, problems, integer=key in integers)
    return None if None in v.values() else cls(**v)


def _cross_checks(where: str, v: dict, problems: list[str]) -> None:
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
    m = v["model"]
    if isinstance(m, Partitions):
        parts = m.prefill_partition_per_s + m.decode_partition_per_s
        if parts > m.token_budget_per_s:
            problems.append(f"{where}.model: prefill_partition_per_s + decode_partition_per_s "
                            f"({parts:g}) must be <= token_budget_per_s "
                            f"({m.token_budget_per_s:g})")
        if m.max_fairness_ratio < 1:
            problems.append(f"{where}.model: max_fairness_ratio must be >= 1 (the worst "
                            f"tier's queue over the aggregate's), got {m.max_fairness_ratio}")


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


def parse_workload(data: dict, where: str = "workload", model: str | None = None) -> Workload:
    """``model`` (the contract's) refuses class fields it does not read; the partitioned
    model reads whole token counts only."""
    problems: list[str] = []
    _check_keys(where, data, {"contract", "contract_content_id", "classes"}, problems)
    if not isinstance(data.get("contract"), str):
        problems.append(f"{where}: contract must name the contract it was written for")
    cid = data.get("contract_content_id")
    if cid is not None and not isinstance(cid, str):
        problems.append(f"{where}: contract_content_id must be a string "
                        "(`continuum capacity content-id CONTRACT` prints it)")
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
        n = len(problems)
        name = c.get("name")
        if not isinstance(name, str) or not name:
            problems.append(f"{at}: name must be a non-empty string")
        elif name in names:
            problems.append(f"{at}: name is used twice")
        names.add(name)
        one = _class(at, c, problems, model)
        if len(problems) == n and name:
            classes.append(RequestClass(name=name, **one))
    if problems:
        raise AuditError(problems)
    return Workload(data["contract"], cid, tuple(classes))


def _class(at: str, c: dict, problems: list[str], model: str | None) -> dict:
    allowed = {"name", "tier", "rate_per_s", "prompt_tokens", "output_tokens", *_CLASS_OPTIONAL}
    _check_keys(at, c, allowed, problems)
    if model in MODELS:
        for key in sorted(_CLASS_OPTIONAL - MODELS[model][2]):
            if key in c:
                problems.append(f"{at}: {key} is not read by the {model} model")
    whole = model == "partitioned"
    v = {"tier": _number(at, c, "tier", problems, integer=True, strict=False),
         "rate_per_s": _number(at, c, "rate_per_s", problems, strict=False),
         "cancel_fraction": _number(at, c, "cancel_fraction", problems, strict=False,
                                    default=0.0),
         "cancel_lag_ms": _number(at, c, "cancel_lag_ms", problems, strict=False, default=0.0),
         "best_effort": c.get("best_effort", False)}
    for key in ("prompt_tokens", "output_tokens"):
        v[key] = mean = _number(at, c, key, problems, integer=whole)
        v[f"{key}_p99"] = p99 = _number(at, c, f"{key}_p99", problems, default=mean or 1)
        if mean and p99 and p99 < mean:
            problems.append(f"{at}: {key}_p99 ({p99:g}) must be >= {key} ({mean:g})")
    if not isinstance(v["best_effort"], bool):
        problems.append(f"{at}: best_effort must be true or false")
    if v["cancel_fraction"] is not None and v["cancel_fraction"] > 1:
        problems.append(f"{at}: cancel_fraction must be in [0, 1], got {v['cancel_fraction']}")
    return v


def read_plan(contract_path: Path, workload_path: Path) -> tuple[Contract, Workload]:
    """Both files parsed and the workload bound to the contract; every problem of both in
    one AuditError."""
    problems: list[str] = []
    contract = workload = None
    try:
        contract = parse_contract(load(contract_path), str(contract_path))
    except AuditError as exc:
        problems += exc.problems
    try:
        workload = parse_workload(load(workload_path), str(workload_path),
                                  contract.model.name if contract else None)
    except AuditError as exc:
        problems += exc.problems
    if contract and workload:
        if workload.contract != contract.name:
            problems.append(f"{workload_path}: written for contract {workload.contract!r}, "
                            f"but {contract_path} declares {contract.name!r}")
        elif workload.contract_content_id not in (None, contract.content_id):
            problems.append(
                f"{workload_path}: written for another version of contract "
                f"{contract.name!r}: content id {workload.contract_content_id}, the "
                f"contract's is {contract.content_id} (re-audit the workload against this "
                "contract and update its contract_content_id)")
    if problems:
        raise AuditError(problems)
    return contract, workload
