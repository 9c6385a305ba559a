"""benchmarks/bench_grammar.py walks each schema's valid instance through the grammar
engine on the bundled model's tokenizer: every token of the instance must stay allowed
by the mask (the benchmark asserts it), and the table has a row per schema."""

from __future__ import annotations

import json

from benchmarks import bench_grammar


def test_llguidance_walks_every_instance_and_reports_figures(tmp_path, capsys):
    out = tmp_path / "g.json"
    assert bench_grammar.main(["--rounds", "1", "--engines", "llguidance",
                               "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert {r["schema"] for r in data["rows"]} == set(bench_grammar.SCHEMAS)
    for r in data["rows"]:
        assert r["tokens"] > 5 and r["mask_ms_p50"] > 0 and r["compile_ms"] > 0
    assert capsys.readouterr().out.count("| llguidance |") == len(bench_grammar.SCHEMAS)
