"""``continuum capacity audit`` with a service-curve contract: input validation and the
decisions it reaches."""

from __future__ import annotations

import pathlib

import pytest

from continuum.capacity.audit import OVER, SHED, WITHIN, decide, evaluate
from continuum.capacity.contract import AuditError, RequestClass, parse_contract, read_plan
from continuum.cli import main as cli_main

DOCS = pathlib.Path(__file__).resolve().parents[2] / "docs" / "capacity"

CONTRACT = """
name = "c1"
max_num_batched_tokens = 512
max_num_seqs = 100
chunk_size = 512
kv_bytes_per_token = 1000
kv_memory_bytes = 1000000000
[slo]
ttft_ms = 5000
tpot_ms = 100
queue_ms = 4000
[model]
name = "service-curve"
prefill_tokens_per_s = 10000
decode_step_ms = [[1, 10.0], [100, 20.0]]
kv_read_bytes_per_s = 1e30
"""


def one_class(rate: float, tier: int = 0, **kw) -> RequestClass:
    fields = dict(name=f"c{tier}", tier=tier, rate_per_s=rate, prompt_tokens=1000,
                  prompt_tokens_p99=1000, output_tokens=100, output_tokens_p99=100)
    fields.update(kw)
    return RequestClass(**fields)


def contract():
    import tomllib

    return parse_contract(tomllib.loads(CONTRACT))


def audit(contract_path, workload_path):
    contract, workload = read_plan(contract_path, workload_path)
    return contract, workload, decide(contract, workload.classes)


def write(tmp_path, name: str, text: str) -> pathlib.Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_utilization_matches_the_hand_computed_fluid_model():
    # Per request: 1,000 prompt tokens ÷ 10,000/s = 0.1 s; 100 output tokens in full
    # batches of 100 at 20 ms a step = 100 × 0.2 ms = 0.02 s. At 2 req/s: 0.2 + 0.04.
    ev = evaluate(contract(), [one_class(2.0)])
    assert ev.prefill_utilization == pytest.approx(0.2)
    assert ev.decode_utilization == pytest.approx(0.04)
    assert ev.utilization == pytest.approx(0.24)
    # Iteration time: t(N) ÷ (1 − 0.2), N solved by Little's law; a floor of 10 ms.
    assert ev.tpot_ms >= 10 / 0.8
    assert ev.ok


def test_load_raises_every_estimate():
    low, high = (evaluate(contract(), [one_class(r)]) for r in (1.0, 4.0))
    assert high.utilization == pytest.approx(4 * low.utilization)
    assert high.classes[0].queue_ms > low.classes[0].queue_ms
    assert high.peak_kv_bytes > low.peak_kv_bytes
    assert high.tpot_ms > low.tpot_ms


def test_over_bound_names_the_bound_when_shedding_cannot_help():
    d = decide(contract(), [one_class(20.0)])  # 2.4 × the device: one class, nothing to shed
    assert d.verdict == OVER
    assert "utilization" in d.offered.violated()


def test_kv_bound_alone():
    # Outputs of up to 200 k tokens: ≈ 7 sequences at once × 201 k tokens × 1 kB > 1 GB.
    d = decide(contract(), [one_class(4.0, output_tokens_p99=200_000)])
    assert d.verdict == OVER
    assert d.offered.violated() == ["kv_memory"]


def test_background_is_shed_before_interactive_bounds_fail():
    classes = [one_class(2.0, 0), one_class(1.0, 1),
               one_class(30.0, 2, best_effort=True, prompt_tokens=2000,
                         prompt_tokens_p99=2000)]
    d = decide(contract(), classes)
    assert d.verdict == SHED
    assert d.kept == ["c0", "c1"]
    (name, admitted, offered), = d.shed
    assert name == "c2" and 0 < admitted < offered
    assert d.admitted.ok and d.admitted.utilization <= 0.85 + 1e-6
    assert not d.offered.ok


def test_example_files_within_bound_and_shed_background():
    c, _, within = audit(DOCS / "contract.toml", DOCS / "workload.toml")
    assert within.verdict == WITHIN
    _, _, shed = audit(DOCS / "contract.toml", DOCS / "workload-with-background.toml")
    assert shed.verdict == SHED
    assert shed.kept == ["interactive", "standard"]
    assert [s[0] for s in shed.shed] == ["background"]
    inter = next(x for x in shed.admitted.classes if x.name == "interactive")
    assert inter.ttft_floor_ms <= c.slo_ttft_ms
    assert shed.admitted.worst_iteration_ms <= c.slo_tpot_ms
    assert shed.admitted.peak_kv_bytes <= c.kv_memory_bytes


@pytest.mark.parametrize("edit, message", [
    (("max_num_seqs = 100", "max_num_seqs = -1"), "max_num_seqs must be > 0, got -1"),
    (("max_num_seqs = 100", "max_num_seq = 100"), "unknown key 'max_num_seq' (did you mean"),
    (("max_num_batched_tokens = 512", "max_num_batched_tokens = 64"),
     "max_num_batched_tokens (64) must be >= max_num_seqs (100)"),
    (("decode_step_ms = [[1, 10.0], [100, 20.0]]", "decode_step_ms = [[100, 20.0], [1, 10.0]]"),
     "decode_step_ms must be a list of [batch, milliseconds] pairs"),
    (("prefill_tokens_per_s = 10000", "prefill_tokens_per_s = \"fast\""),
     "prefill_tokens_per_s must be a number"),
    (("ttft_ms = 5000\n", ""), "missing 'ttft_ms'"),
    (("name = \"c1\"", "name = \"c1\"\nmax_utilization = 1.2"), "max_utilization must be < 1"),
    (("name = \"service-curve\"", "name = \"fluid\""),
     "model: name must be one of service-curve, partitioned, got 'fluid'"),
])
def test_bad_contract_gets_one_actionable_line(tmp_path, edit, message):
    bad = write(tmp_path, "contract.toml", CONTRACT.replace(*edit))
    with pytest.raises(AuditError) as err:
        audit(bad, DOCS / "workload.toml")
    assert any(message in p for p in err.value.problems), err.value.problems


WORKLOAD = """
contract = "c1"
[[classes]]
name = "chat"
tier = 0
rate_per_s = 1.0
prompt_tokens = 500
prompt_tokens_p99 = 2000
output_tokens = 100
output_tokens_p99 = 400
"""


@pytest.mark.parametrize("edit, message", [
    (("prompt_tokens_p99 = 2000", "prompt_tokens_p99 = 300"),
     "prompt_tokens_p99 (300) must be >= prompt_tokens (500)"),
    (("rate_per_s = 1.0", "rate_per_s = -1.0"), "rate_per_s must be >= 0"),
    (("contract = \"c1\"", "contract = \"other\""), "written for contract 'other'"),
    (("tier = 0", "tier = 0\ncancel_fraction = 1.5"), "cancel_fraction must be in [0, 1]"),
    (("name = \"chat\"", "name = \"chat\"\nrate = 2"), "unknown key 'rate'"),
    (("[[classes]]", "[classes]"), "needs at least one [[classes]] entry"),
])
def test_bad_workload_gets_one_actionable_line(tmp_path, edit, message):
    good_contract = write(tmp_path, "c.toml", CONTRACT)
    assert audit(good_contract, write(tmp_path, "ok.toml", WORKLOAD))[2].verdict
    bad = write(tmp_path, "w.toml", WORKLOAD.replace(*edit))
    with pytest.raises(AuditError) as err:
        audit(good_contract, bad)
    assert any(message in p for p in err.value.problems), err.value.problems


def test_two_classes_with_one_name(tmp_path):
    twice = WORKLOAD + WORKLOAD.split("contract = \"c1\"")[1]
    with pytest.raises(AuditError, match="name is used twice"):
        audit(write(tmp_path, "c.toml", CONTRACT), write(tmp_path, "w.toml", twice))


def test_cli_exit_codes_and_problem_lines(tmp_path, capsys):
    with pytest.raises(SystemExit) as done:
        cli_main(["capacity", "audit", str(DOCS / "contract.toml"),
                  str(DOCS / "workload.toml")])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert "claim=FLUID_CAPACITY_MODEL_NOT_A_MEASUREMENT" in out
    assert "decision=CAPACITY_WITHIN_DECLARED_BOUND" in out

    with pytest.raises(SystemExit) as done:
        cli_main(["capacity", "audit", str(DOCS / "contract.toml"),
                  str(DOCS / "workload-with-background.toml")])
    assert done.value.code == 1
    assert "shed class=background" in capsys.readouterr().out

    bad = write(tmp_path, "c.json", '{"name": "x", "max_num_seqs": 0}')
    with pytest.raises(SystemExit) as done:
        cli_main(["capacity", "audit", str(bad), str(tmp_path / "missing.toml")])
    assert done.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert all(line.startswith("continuum capacity: ") for line in err)
    assert any("max_num_seqs must be > 0, got 0" in line for line in err)
    assert any("missing.toml: cannot read" in line for line in err)
