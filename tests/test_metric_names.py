"""The one metrics layer: runtime/metrics.py writes what Prometheus' own parser reads back,
the gateway's page exports exactly its table in runtime/metric_names.py (the replica's:
tests/scheduler/test_replica_metrics.py), and docs/usage.md names exactly those families."""

from __future__ import annotations

import pathlib
import re
import types

from prometheus_client.parser import text_string_to_metric_families

from gateway.metrics import GatewayMetrics
from protos.continuum.v1 import scheduler_pb2
from runtime import metric_names as names
from runtime.metrics import COUNTER, GAUGE, HISTOGRAM, Family, Metric

USAGE = pathlib.Path(__file__).resolve().parents[1] / "docs" / "usage.md"


def _parsed(page: str) -> dict:
    return {f.name: f for f in text_string_to_metric_families(page)}


def test_what_we_write_prometheus_reads_back():
    counter = Family("c", COUNTER, 'odd "help"\\ here', ("model_name", "api"))
    gauge = Family("g", GAUGE, "no labels", ())
    hist = Family("h", HISTOGRAM, "h", ("model_name",), (0.1, 1.0))
    held = Metric(hist)
    for value in (0.05, 0.1, 0.5, 7.0):  # 0.1 lands in le="0.1": the bound is inclusive
        held.child(("m",)).observe(value)
    page = (counter.lines([(('a"b\\c\nd', "chat"), 3)]) + gauge.lines([((), float("inf"))])
            + held.lines())
    families = _parsed(page)
    (c,) = families["c"].samples
    assert (c.name, c.labels, c.value) == ("c_total", {"model_name": 'a"b\\c\nd', "api": "chat"},
                                           3.0)
    assert families["g"].samples[0].value == float("inf")
    buckets = {s.labels["le"]: s.value for s in families["h"].samples
               if s.name == "h_bucket"}
    assert buckets == {"0.1": 2.0, "1.0": 3.0, "+Inf": 4.0}
    assert "# TYPE c_total counter\n" in page and 'h_bucket{model_name="m",le="0.1"} 2.0' in page


def test_the_gateway_page_exports_exactly_its_table():
    stats = scheduler_pb2.StatsResponse(num_total_blocks=8, num_free_blocks=4)
    replica = types.SimpleNamespace(healthy=True, stats=stats)
    page = GatewayMetrics("m", lambda: [("10.0.0.1:50061", replica)], 4096).render().decode()
    assert {n: f.type for n, f in _parsed(page).items()} == {f.name: f.kind
                                                             for f in names.GATEWAY}


def test_no_name_is_on_both_pages_or_declared_twice():
    everything = [f.name for f in (*names.REPLICA, *names.GATEWAY)]
    assert len(everything) == len(set(everything))
    assert all(f.name.startswith(("vllm:", "continuum:")) for f in names.REPLICA)
    assert all(f.name.startswith(("continuum_gateway_", "continuum:")) for f in names.GATEWAY)


def test_the_docs_name_every_family_once_by_its_page():
    text = USAGE.read_text()
    section = text[text.index("## Metrics ("):]
    section = section[:section.index("\n## ", 1)]
    on_wire = re.compile(r"`((?:vllm:|continuum:|continuum_gateway_)[a-z0-9_:]+)(?:\{[^}`]*\})?`")
    for page, families in (("gateway", names.GATEWAY), ("replica", names.REPLICA)):
        rows = [line for line in section.splitlines() if line.startswith(f"| {page}")]
        documented = [name for row in rows for name in on_wire.findall(row.split("|")[3])]
        wire = [f.name + ("_total" if f.kind == COUNTER else "") for f in families]
        assert sorted(documented) == sorted(wire), page
