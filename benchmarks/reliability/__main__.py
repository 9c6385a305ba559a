"""``make reliability [ARGS=--short|--long]``: every row, one summary table (docs/reliability.md).

    .venv/bin/python -m benchmarks.reliability [--short | --long] [--only ROWS] [--json PATH]

Rows, in this order (capacity on a fresh server; the rogue ZeroMQ peers last): overload,
burst, hostile, bad_specs, soak, chaos, schema_fuzz, openapi, fuzz. The default form runs
on one ``continuum serve`` plus the chaos matrix's own replicas and gateways; ``--short``
is the CI form (one chaos row on the serve); ``--long`` is bigger everywhere. The markdown
table goes to stdout, every figure to ``--json``; exit status 0 when every row met its
target.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
import tempfile
import time

from benchmarks.reliability import (
    bad_specs,
    burst,
    chaos,
    chaos_layouts,
    fuzz,
    fuzz_schema,
    hostile,
    overload,
    report,
    soak,
)
from harness import openapi_run, servers

ROWS = ("overload", "burst", "hostile", "bad_specs", "soak", "chaos", "schema_fuzz", "openapi",
        "fuzz")


def run_rows(tmp: pathlib.Path, size: str, only: set[str], log=print,
             per_kind: bool = False) -> list[dict]:
    """Runs the chosen rows in order; a row that fails to run is reported, not fatal."""
    results: list[dict] = []
    on_serve = only - ({"chaos"} if size != "short" else set())
    serve = servers.start_serve(tmp / "serve") if on_serve else None
    try:
        steps = [("overload", lambda: [overload.run(serve, size)]),
                 ("burst", lambda: burst.run(serve, size)),
                 ("hostile", lambda: hostile.run(serve, size, per_kind)),
                 ("bad_specs", lambda: [bad_specs.run(serve, size)]),
                 ("soak", lambda: [soak.run(serve, size)]),
                 ("chaos", lambda: chaos.run_serve(serve, size) if size == "short" else None),
                 ("schema_fuzz", lambda: [fuzz_schema.run(serve, size, log)]),
                 ("openapi", lambda: [openapi_run.run(serve, size, log)]),
                 ("fuzz", lambda: [fuzz.run(serve, tmp, size)])]
        for name, step in steps:
            if name not in on_serve:
                continue
            started = time.monotonic()
            log(f"[reliability] {name} ...", file=sys.stderr, flush=True)
            try:
                rows = step()
            except Exception as exc:  # one row that cannot run must not hide the others
                rows = [{"row": name, "error": f"{type(exc).__name__}: {exc}"[:500]}]
            if rows:
                results += rows
            log(f"[reliability] {name} done in {time.monotonic() - started:.0f} s",
                file=sys.stderr, flush=True)
    finally:
        if serve is not None:
            serve.stop()
    if "chaos" in only and size != "short":
        started = time.monotonic()
        log("[reliability] chaos matrix ...", file=sys.stderr, flush=True)
        try:
            results += chaos_layouts.run_matrix(tmp / "chaos", size)
        except Exception as exc:
            results.append({"row": "chaos", "error": f"{type(exc).__name__}: {exc}"[:500]})
        log(f"[reliability] chaos matrix done in {time.monotonic() - started:.0f} s",
            file=sys.stderr, flush=True)
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.reliability",
                                description=__doc__.split("\n\n")[0])
    form = p.add_mutually_exclusive_group()
    form.add_argument("--short", action="store_true", help="the CI sizes (~2-3 minutes)")
    form.add_argument("--long", action="store_true", help="bigger everywhere (~1 hour)")
    p.add_argument("--only", default=",".join(ROWS),
                   help=f"comma-separated subset of {','.join(ROWS)}")
    p.add_argument("--per-kind", action="store_true",
                   help="hostile row: each costly kind alone against its twin, not the mixes")
    p.add_argument("--json", type=pathlib.Path,
                   default=pathlib.Path(tempfile.gettempdir()) / "continuum-reliability.json",
                   help="where every figure goes (default: %(default)s)")
    a = p.parse_args(argv)
    size = "short" if a.short else "long" if a.long else "default"
    only = set(a.only.split(","))
    unknown = only - set(ROWS)
    if unknown:
        p.error(f"unknown rows {sorted(unknown)}; choose from {','.join(ROWS)}")
    servers.ensure_secret()
    os.environ.setdefault("PYTHONPATH", os.getcwd())  # children import the benchmarks too
    with tempfile.TemporaryDirectory(prefix="continuum-reliability-") as tmp:
        rows = run_rows(pathlib.Path(tmp), size, only, per_kind=a.per_kind)
    print(report.markdown(rows, size))
    report.write_json(rows, size, a.json)
    print(f"\nevery figure: {a.json}")
    return 0 if all(report.summarize(r)[3] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
