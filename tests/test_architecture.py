"""The module map of docs/architecture.md, as a test: who may import whom.

Every ``.py`` under the first-party packages (generated ``*_pb2*.py`` excepted) is parsed
with ``ast``; every ``import`` and ``from ... import`` counts, at module level and inside
functions or ``if TYPE_CHECKING:`` alike, because a circle hidden in a function is still a
circle a reader has to hold in their head. The rules (docs/architecture.md, "Who may import
whom"):

* no service (gateway, scheduler_svc, executor_svc) imports another: they meet only at
  the wire contracts in ``protos/``;
* ``scheduler_svc/core`` imports the standard library, itself and the standard-library-only
  contract modules ``CORE_CONTRACTS`` (``protos/tiers.py``, ``protos/limits.py``,
  ``protos/seq_columns.py``), nothing
  else (it runs in the simulator unchanged; tests/scheduler/test_core.py checks the same at
  run time);
* ``kernels/`` is imported only by the executor (and harness, benchmarks); ``protos/`` and
  ``kernels/`` import no other first-party package;
* ``continuum/`` (CLI, supervisor, load generator) takes from the services only the
  modules listed in ``TOOL_IMPORTS``, each with its reason, and ``sim/`` only the core;
  nothing below them imports a tool (``MAY_IMPORT``);
* torch is loaded, even through first-party imports, only by executor_svc, kernels,
  harness and benchmarks;
* ``harness/`` (what tests and benchmarks drive the system with) is imported by tests and
  benchmarks only, never by a service or the CLI; benchmarks never import tests, and tests
  import benchmarks only where they test one (``tests/bench/``, ``tests/reliability/``);
* the first-party import graph has no cycle;
* docs/architecture.md names every module, and every path it names exists;
* the repository explains itself (docs/style.md habit 15): no tracked file outside tests/
  cites a design document outside the checkout (``../shared/DESIGN.md`` and friends: they
  are docs/design.md, docs/style.md and docs/facts.md), and no code comment cites a
  tracker issue number. ``../shared/data`` stays allowed: it is a data path.

Dynamic imports (``importlib.import_module``) are not seen; the one there is
(benchmarks/bench_scheduler.py loading a committed revision beside the tree) loads a copy of
``scheduler_svc``, not a dependency.
"""

from __future__ import annotations

import ast
import collections
import pathlib
import re
import subprocess
import sys
from collections.abc import Iterator

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("gateway", "scheduler_svc", "executor_svc", "kernels", "protos", "runtime",
            "telemetry", "continuum", "sim", "harness", "benchmarks")
FIRST_PARTY = (*PACKAGES, "tests")
SERVICES = ("gateway", "scheduler_svc", "executor_svc")
CORE = "scheduler_svc.core"
# protos/ modules the core may import: contracts it shares with the wire (the tiers, the
# request limits, the packed seq-id column), themselves standard library only, so the core
# stays pure Python.
CORE_CONTRACTS = ("protos.tiers", "protos.limits", "protos.seq_columns",
                  "runtime.config_flags")  # a config field is a flag: stdlib only
DOC = ROOT / "docs" / "architecture.md"

# What each package may import from the first-party packages (itself always). harness and
# benchmarks drive the parts from outside, so they may import any of them; nothing imports
# tests, and only tests and benchmarks import harness.
MAY_IMPORT = {
    "protos": (),
    "runtime": (),
    "telemetry": (),
    "kernels": (),
    "gateway": ("protos", "runtime"),
    "scheduler_svc": ("protos", "runtime", "telemetry"),
    "executor_svc": ("protos", "runtime", "kernels"),
    "sim": ("scheduler_svc.core",),
    "continuum": ("protos", "runtime", "telemetry", "sim"),
    "harness": ("protos", "runtime", "telemetry", "continuum", "sim", *SERVICES, "kernels"),
    "benchmarks": ("protos", "runtime", "telemetry", "continuum", "sim", *SERVICES, "kernels",
                   "harness"),
}
# The test folders that test a benchmark, so import it; every other test takes what it
# shares with the benchmarks from harness/.
TESTS_OF_BENCHMARKS = ("tests/bench/", "tests/reliability/")
# The service modules continuum/ may import besides MAY_IMPORT, and why. It starts the
# services as processes (continuum/serve/supervisor.py runs ``python -m gateway`` and friends); it
# imports a service module only for a definition that must be the same on both sides.
TOOL_IMPORTS = {
    "executor_svc.settings": "the executor's config, whose fields are `continuum serve`'s "
                             "executor flags: one definition, importable without torch",
    "gateway.config": "the gateway's config, whose fields are `continuum serve`'s gateway "
                      "flags: one definition, nothing heavy imported",
    "scheduler_svc.process_config": "the scheduler's config, whose fields are `continuum "
                                    "serve`'s scheduler flags: one definition, nothing heavy "
                                    "imported",
    "scheduler_svc.core.policy": "the policy registry `continuum serve --policy` offers: one "
                                 "list, pure Python",
}
# Cycles that exist today and are being removed, as sets of modules. Empty is the goal.
KNOWN_CYCLES: tuple[frozenset[str], ...] = ()


# -- the import graph ------------------------------------------------------------------------


def module_files() -> dict[str, pathlib.Path]:
    """Dotted module name -> file, for every parsed first-party module."""
    mods = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            if "_pb2" in path.name or "__pycache__" in path.parts:
                continue
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            mods[".".join(parts)] = path
    return mods


def generated_modules() -> set[str]:
    """The protobuf modules ``make protos`` writes (leaves: nothing first-party in them)."""
    return {".".join(p.relative_to(ROOT).with_suffix("").parts)
            for p in (ROOT / "protos").rglob("*_pb2*.py")}


def imports_of(source: str, module: str, is_package: bool,
               known: set[str]) -> Iterator[tuple[str, int]]:
    """(imported module, line) for every import statement anywhere in ``source``.

    ``from X import n`` is an import of ``X.n`` when that is a module, else of ``X``
    (import-linter's convention); relative imports are resolved against ``module``.
    """
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = module.split(".")[: None if is_package else -1]
                parent = parent[: len(parent) - (node.level - 1)]
                base = ".".join(parent + ([base] if base else []))
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                yield (sub if sub in known else base), node.lineno


def all_imports() -> dict[str, dict[str, int]]:
    """module -> {imported module: first line importing it}, for every parsed module."""
    files = module_files()
    known = set(files) | generated_modules()
    found: dict[str, dict[str, int]] = {}
    for mod, path in files.items():
        edges = found.setdefault(mod, {})
        for target, line in imports_of(path.read_text(), mod, path.name == "__init__.py",
                                       known):
            if target != mod:
                edges.setdefault(target, line)
    return found


FILES = module_files()
IMPORTS = all_imports()
GRAPH = {mod: {t: line for t, line in edges.items() if t.split(".")[0] in FIRST_PARTY}
         for mod, edges in IMPORTS.items()}  # the first-party import graph


def _where(mod: str, target: str) -> str:
    return f"{FILES[mod].relative_to(ROOT)}:{IMPORTS[mod][target]} imports {target}"


def _edge(mod: str, node: str) -> str:
    """Where ``mod`` imports the module ``node`` (or a name from it)."""
    target = min((t for t in GRAPH[mod] if _node(t) == node), key=GRAPH[mod].get)
    return _where(mod, target)


def _within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def _node(target: str) -> str | None:
    """The parsed module an import lands on (the longest known prefix), if any."""
    parts = target.split(".")
    for end in range(len(parts), 0, -1):
        if ".".join(parts[:end]) in GRAPH:
            return ".".join(parts[:end])
    return None


# -- the rules -------------------------------------------------------------------------------


def test_the_parser_sees_function_level_relative_and_type_checking_imports():
    source = ("import a.b\nfrom typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
              "    from p import q\n"
              "def f():\n    from . import sib\n    from .sib import thing\n")
    found = sorted(imports_of(source, "pkg.mod", False, {"pkg.sib"}), key=lambda f: f[1])
    assert found == [("a.b", 1), ("typing", 2), ("p", 4), ("pkg.sib", 6), ("pkg.sib", 7)]
    assert "scheduler_svc.core.scheduler" in GRAPH and len(GRAPH) > 100


def test_no_service_imports_another_service():
    """Services meet at protos/ only: a gRPC call or a ZeroMQ frame, never a Python call."""
    bad = [_where(mod, t) for mod, edges in GRAPH.items() for t in edges
           if mod.split(".")[0] in SERVICES and t.split(".")[0] in SERVICES
           and t.split(".")[0] != mod.split(".")[0]]
    assert not bad, "a service imports another service:\n" + "\n".join(bad)


def _stdlib(target: str) -> bool:
    return target.split(".")[0] in sys.stdlib_module_names


def test_the_scheduler_core_imports_only_the_standard_library_and_itself():
    """So it runs unchanged in the simulator and in tests with no model or network. The
    contract modules it may import (CORE_CONTRACTS) import the standard library only."""
    bad = [f"{FILES[mod].relative_to(ROOT)}:{line} imports {target}"
           for mod, edges in IMPORTS.items() if _within(mod, CORE)
           for target, line in edges.items()
           if not (_within(target, CORE) or target in CORE_CONTRACTS or _stdlib(target))]
    bad += [f"{FILES[mod].relative_to(ROOT)}:{line} imports {target} (a core contract)"
            for mod in CORE_CONTRACTS for target, line in IMPORTS[mod].items()
            if not _stdlib(target)]
    assert not bad, "scheduler_svc/core imports beyond the standard library:\n" + "\n".join(bad)


def test_kernels_belong_to_the_executor_and_protos_imports_no_service():
    """kernels/ is the executor's (gateway, scheduler and tools never import it); protos/
    is below every service, so it imports none of them."""
    bad = [_where(mod, t) for mod, edges in GRAPH.items() for t in edges
           if _within(t, "kernels")
           and mod.split(".")[0] not in ("kernels", "executor_svc", "harness", "benchmarks")]
    bad += [_where(mod, t) for mod, edges in GRAPH.items() if _within(mod, "protos")
            for t in edges if t.split(".")[0] in SERVICES]
    assert not bad, "kernels/ outside the executor, or protos/ over a service:\n" + "\n".join(bad)


def test_every_package_imports_only_what_the_map_allows():
    """MAY_IMPORT and TOOL_IMPORTS, which docs/architecture.md states: protos and kernels
    import no first-party package, no service imports a tool, tools import services'
    modules only as listed."""
    bad = []
    for mod, edges in GRAPH.items():
        pkg = mod.split(".")[0]
        allowed = (pkg, *MAY_IMPORT[pkg], *(TOOL_IMPORTS if pkg == "continuum" else ()))
        bad += [_where(mod, t) for t in edges
                if not any(_within(t, a) for a in allowed)]
    assert not bad, ("imports the module map does not allow (docs/architecture.md):\n"
                     + "\n".join(bad))


def _loads(mod: str) -> set[str]:
    """Every parsed module that importing ``mod`` may load: what it imports, their
    imports, and the package ``__init__`` of each (first-party closure)."""
    seen, todo = {mod}, [mod]
    while todo:
        current = todo.pop()
        parts = current.split(".")
        parents = [".".join(parts[:end]) for end in range(1, len(parts))]  # their __init__
        for node in [*parents, *(_node(t) for t in GRAPH[current])]:
            if node in GRAPH and node not in seen:
                seen.add(node)
                todo.append(node)
    return seen


def test_tests_import_benchmarks_only_where_they_test_one():
    """A test takes its servers, streams, fakes and fuzz strategies from harness/, as the
    benchmarks do; only a test of a benchmark imports it (TESTS_OF_BENCHMARKS)."""
    bad = []
    for path in sorted((ROOT / "tests").rglob("*.py")):
        rel = str(path.relative_to(ROOT))
        if rel.startswith(TESTS_OF_BENCHMARKS):
            continue
        mod = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        bad += [f"{rel}:{line} imports {target}" for target, line in
                imports_of(path.read_text(), mod, path.name == "__init__.py", set())
                if _within(target, "benchmarks")]
    assert not bad, ("a test imports benchmarks/ (take it from harness/):\n"
                     + "\n".join(bad))


def test_only_the_executor_kernels_and_benchmarks_load_torch():
    """The gateway and scheduler are CPU processes (docs/design.md §1) and the CLI parses its
    flags before anything heavy loads: none of them reaches torch, even through a
    first-party import."""
    bad = []
    for mod in GRAPH:
        if mod.split(".")[0] in ("executor_svc", "kernels", "harness", "benchmarks"):
            continue
        for loaded in sorted(_loads(mod)):
            bad += [f"{mod} loads {_where(loaded, t)}" for t in IMPORTS[loaded]
                    if t.split(".")[0] == "torch"]
    assert not bad, "torch reached outside the executor:\n" + "\n".join(sorted(set(bad)))


def _cycles() -> list[tuple[set[str], list[str]]]:
    """(component, one cycle a -> ... -> a in it) per strongly connected component of more
    than one module: Tarjan's algorithm, then the shortest way back inside the component."""
    nodes = {m: sorted({n for t in GRAPH[m] if (n := _node(t)) and n != m}) for m in GRAPH}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in nodes[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                components.append(comp)

    for v in sorted(nodes):
        if v not in index:
            visit(v)
    return [(comp, _shortest_cycle(min(comp), comp, nodes)) for comp in components]


def _shortest_cycle(start: str, comp: set[str], nodes: dict[str, list[str]]) -> list[str]:
    """start -> ... -> start inside ``comp`` (breadth first, so the shortest)."""
    prev: dict[str, str] = {}
    queue = collections.deque([start])
    while queue:
        v = queue.popleft()
        for w in nodes[v]:
            if w == start:
                path = [v]
                while path[-1] != start:
                    path.append(prev[path[-1]])
                return [*reversed(path), start]
            if w in comp and w not in prev and w != start:
                prev[w] = v
                queue.append(w)
    raise AssertionError(f"no cycle through {start}")  # a component of >1 always has one


def test_there_is_no_import_cycle():
    """A DAG can be read bottom-up; a cycle means two modules that only make sense together
    (move what they share down into a module of its own)."""
    found = [(comp, c) for comp, c in _cycles() if frozenset(comp) not in KNOWN_CYCLES]
    lines = []
    for comp, cycle in found:
        if len(comp) > len(cycle) - 1:
            lines.append(f"(one cycle of {len(comp)} modules tied together: {sorted(comp)})")
        lines.append(" -> ".join(cycle))
        lines += [f"    {_edge(a, b)}" for a, b in zip(cycle, cycle[1:], strict=False)]
    assert not found, "import cycles among first-party modules:\n" + "\n".join(lines)


# -- the map itself --------------------------------------------------------------------------

TOP = "|".join((*FIRST_PARTY, "docs", "deploy", "scripts"))
PATH_IN_DOC = re.compile(rf"`((?:{TOP})/[\w./-]*)(?:::(\w+))?`")


def test_the_map_names_every_module_and_every_path_it_names_exists():
    """Every module has its line; every `path` (and `path::test_name`) named there or in
    docs/design.md's invariants table exists."""
    named = PATH_IN_DOC.findall(DOC.read_text() + (ROOT / "docs" / "design.md").read_text())
    paths = {p for p, _ in named}
    missing = sorted(str(p.relative_to(ROOT)) for p in FILES.values()
                     if str(p.relative_to(ROOT)) not in paths
                     and not (p.name == "__init__.py" and not p.read_text().strip()))
    assert not missing, ("docs/architecture.md has no line for (add one under its package's "
                         "heading: `path`: what it owns):\n" + "\n".join(missing))
    gone = sorted(p for p in paths if not (ROOT / p).exists())
    gone += sorted(f"{p}::{name}" for p, name in set(named) if name and (ROOT / p).is_file()
                   and not re.search(rf"^\s*(async )?def {name}\(", (ROOT / p).read_text(),
                                     re.MULTILINE))
    assert not gone, "docs/architecture.md names what does not exist:\n" + "\n".join(gone)


# -- the repository explains itself ----------------------------------------------------------

# A design document outside the checkout: ``../shared/<anything but data>``, or DESIGN.md,
# STYLE.md and FACTS.md by name (also "DESIGN §7", "STYLE habit 7", "FACTS:"). The data
# directory ``../shared/data`` (sim/data.py) is where benchmarks read data, not a citation.
OUTSIDE_DOC = re.compile(r"\.\./shared(?!/data\b)|\b(?:DESIGN|STYLE|FACTS)(?:\.md)?\b")
# A tracker issue cited by number: "issue 17", "Issue 17's", "issue #17", "issues 15 and",
# "(issue: ...". A public upstream thread spelled owner/repo#N is a link a reader can follow.
ISSUE_NUMBER = re.compile(r"\bissues?\s*#?\s*\d+|\(issue\b", re.IGNORECASE)
CODE_SUFFIXES = (".py", ".pyi", ".proto", ".cpp", ".cc", ".c", ".h", ".hpp", ".cu", ".sh",
                 ".toml", ".cfg", ".ini", ".yaml", ".yml")
CODE_NAMES = ("Makefile", "Dockerfile")


def _tracked_text_files() -> list[tuple[str, str]]:
    """(path, text) of every tracked file outside tests/ that is text."""
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True,
                             check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        import pytest
        pytest.skip("not a git checkout")
    files = []
    for rel in out.decode().split("\0"):
        path = ROOT / rel
        if not rel or rel.startswith("tests/") or not path.is_file():
            continue
        data = path.read_bytes()
        if b"\0" in data:
            continue  # binary (images, generated blobs)
        files.append((rel, data.decode("utf-8", errors="replace")))
    return files


def _hits(pattern: re.Pattern[str], files: list[tuple[str, str]]) -> list[str]:
    return [f"{rel}:{n}: {line.strip()}" for rel, text in files
            for n, line in enumerate(text.splitlines(), 1) if pattern.search(line)]


def test_nothing_cites_a_design_document_outside_the_repository():
    """Code and docs cite docs/design.md, docs/style.md and docs/facts.md; a clone elsewhere
    has no ../shared/DESIGN.md to follow."""
    hits = _hits(OUTSIDE_DOC, _tracked_text_files())
    assert not hits, ("cites a document outside the repository (cite docs/design.md §N, "
                      "docs/style.md habit N or docs/facts.md instead):\n" + "\n".join(hits))


def test_no_code_comment_cites_an_issue_number():
    """A reader has no access to the tracker: a comment states the reason itself."""
    code = [(rel, text) for rel, text in _tracked_text_files()
            if rel.endswith(CODE_SUFFIXES) or rel.rsplit("/", 1)[-1] in CODE_NAMES]
    hits = _hits(ISSUE_NUMBER, code)
    assert not hits, ("cites a tracker issue (say the reason instead):\n" + "\n".join(hits))
