"""gateway/api/openai_schema.py lists every body key the HTTP readers read.

The keys are found in the readers' source (every gateway module with a function that
takes a ``body``): ``body.get("k")``, ``body["k"]``, ``"k" in body``, a reader call
``fields.integer(body, "k", ...)``, and ``body.get(name)`` inside ``for name in (...)``
(a tuple literal, or a module-level tuple of names); a ``Bound`` of
protos/sampling_checks.py (``bounded(body, checks.N)``, or a loop over ``checks.NUMBERS``)
reads its ``name``. A key read from ``body`` itself must be a top-level key of some
endpoint; a key read from any other object (a message, a tool, stream_options) must be a
key of some object nested in the schema. So a field
added to a reader and not to the schema fails here, and so is never left unfuzzed.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

from gateway.api import openai_schema as schema
from protos import sampling_checks

GATEWAY = pathlib.Path(__file__).resolve().parents[2] / "gateway"


def _reader_modules() -> list[pathlib.Path]:
    found = []
    for path in sorted(GATEWAY.rglob("*.py")):
        tree = ast.parse(path.read_text())
        if any(isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
               and any(a.arg == "body" for a in node.args.args) for node in ast.walk(tree)):
            found.append(path)
    return found


def _bound_names(node: ast.expr) -> list[str]:
    """``checks.N`` / ``checks.NUMBERS``: the names of protos/sampling_checks.py's bounds."""
    found = getattr(sampling_checks, node.attr, None) if isinstance(node, ast.Attribute) else None
    bounds = found if isinstance(found, tuple) else (found,)
    return [b.name for b in bounds if isinstance(b, sampling_checks.Bound)]


def _names_of(node: ast.expr, constants: dict[str, list[str]]) -> list[str]:
    """The strings a loop iterates: a literal tuple/list (with *NAME spliced), NAME, or
    a tuple of sampling_checks bounds."""
    if isinstance(node, ast.Name):
        return constants.get(node.id, [])
    if isinstance(node, ast.Attribute):
        return _bound_names(node)
    if not isinstance(node, ast.Tuple | ast.List):
        return []
    out: list[str] = []
    for elt in node.elts:
        if isinstance(elt, ast.Constant) and isinstance(elt.value, str):
            out.append(elt.value)
        elif isinstance(elt, ast.Starred):
            out += _names_of(elt.value, constants)
    return out


def _module_constants(tree: ast.Module) -> dict[str, list[str]]:
    constants: dict[str, list[str]] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and \
                isinstance(node.targets[0], ast.Name):
            constants[node.targets[0].id] = _names_of(node.value, constants)
    return constants


def _readers(tree: ast.Module) -> set[str]:
    """Functions that read one named field: ``def integer(body, name, ...)``, or the field
    a bound names: ``def bounded(body, bound)``."""
    return {node.name for node in tree.body if isinstance(node, ast.FunctionDef)
            and [a.arg for a in node.args.args[:2]] in (["body", "name"], ["body", "bound"])}


def _loop_names(tree: ast.Module, constants: dict[str, list[str]]) -> dict[str, list[str]]:
    """What each loop variable (``for``, comprehensions) may hold, module-wide."""
    loops: dict[str, list[str]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.For | ast.comprehension) and isinstance(node.target, ast.Name):
            loops.setdefault(node.target.id, []).extend(_names_of(node.iter, constants))
    return loops


class _Reads(ast.NodeVisitor):
    """(object name, key) for every key read, with loop variables resolved."""

    def __init__(self, loops: dict[str, list[str]], readers: set[str]):
        self.loops = loops
        self.readers = readers
        self.reads: set[tuple[str, str]] = set()

    def _keys(self, node: ast.expr) -> list[str]:
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return [node.value]
        if isinstance(node, ast.Attribute):
            return _bound_names(node)
        return self.loops.get(node.id, []) if isinstance(node, ast.Name) else []

    def visit_Call(self, node: ast.Call) -> None:
        func, args = node.func, node.args
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
        if name == "get" and args and isinstance(func.value, ast.Name):
            self.reads.update((func.value.id, k) for k in self._keys(args[0]))
        elif name in self.readers and len(args) >= 2 and isinstance(args[0], ast.Name):
            self.reads.update((args[0].id, k) for k in self._keys(args[1]))
        self.generic_visit(node)

    def visit_Subscript(self, node: ast.Subscript) -> None:
        if isinstance(node.ctx, ast.Load) and isinstance(node.value, ast.Name):
            self.reads.update((node.value.id, k) for k in self._keys(node.slice)
                              if isinstance(node.slice, ast.Constant))
        self.generic_visit(node)

    def visit_Compare(self, node: ast.Compare) -> None:
        if isinstance(node.ops[0], ast.In) and isinstance(node.comparators[0], ast.Name) \
                and isinstance(node.left, ast.Constant) and isinstance(node.left.value, str):
            self.reads.add((node.comparators[0].id, node.left.value))
        self.generic_visit(node)


def reads(sources: dict[str, str] | None = None) -> dict[str, set[tuple[str, str]]]:
    """Per reader module (name -> source; default: the gateway's), the (object name,
    key) pairs it reads."""
    if sources is None:
        sources = {str(path.relative_to(GATEWAY)): path.read_text()
                   for path in _reader_modules()}
    trees = {name: ast.parse(text) for name, text in sources.items()}
    readers = set().union(*(_readers(tree) for tree in trees.values()))
    out = {}
    for name, tree in trees.items():
        visitor = _Reads(_loop_names(tree, _module_constants(tree)), readers)
        visitor.visit(tree)
        out[name] = visitor.reads
    return out


def test_the_readers_are_found_and_their_keys_extracted():
    found = reads()
    assert {"api/openai_api.py", "api/openai_fields.py", "tools/tool_calls.py",
            "api/http_tokenize.py"} <= set(found)
    body_keys = {k for pairs in found.values() for name, k in pairs if name == "body"}
    # one of each way a key is read: .get, a reader call, a loop over a tuple constant,
    # a loop over a literal with a splice, "k" in body
    assert {"prompt", "max_tokens", "suffix", "guided_regex", "messages"} <= body_keys


@pytest.mark.parametrize("module", sorted(reads()))
def test_every_body_key_a_reader_reads_is_in_the_schema(module):
    top, nested = schema.top_level_keys(), schema.nested_keys()
    unknown = sorted(f"{name}[{key!r}]" for name, key in reads()[module]
                     if key not in (top if name == "body" else nested))
    assert not unknown, (f"gateway/{module} reads {', '.join(unknown)}, which "
                         "gateway/api/openai_schema.py does not list: add it there (the "
                         "fuzzer then covers it)")


def test_every_top_level_key_of_the_schema_is_read_or_declared_ignored():
    read = {k for pairs in reads().values() for name, k in pairs if name == "body"}
    stale = schema.top_level_keys() - read - set(schema.IGNORED)
    assert not stale, f"the schema lists {sorted(stale)}, which no reader reads"


def test_a_key_read_in_any_of_those_ways_is_found():
    source = """
NAMES = ("n_tuple",)
def integer(body, name, low, high):
    return body.get(name)
def bounded(body, bound):
    return body.get(bound.name)
def parse(body, fields):
    fields.integer(body, "n_reader", 0, 1)
    opts = body["n_subscript"]
    opts.get("n_nested")
    if "n_in" in body:
        pass
    for name in (*NAMES, "n_loop"):
        body.get(name)
    for bound in checks.NUMBERS:
        fields.bounded(body, bound)
    fields.bounded(body, checks.N)
    return [body.get(k) for k in ("n_comprehension",)]
"""
    found = reads({"new.py": source})["new.py"]
    assert {("body", k) for k in ("n_tuple", "n_reader", "n_subscript", "n_in", "n_loop",
                                  "n_comprehension")} | {("opts", "n_nested")} <= found
    assert {("body", b.name) for b in (*sampling_checks.NUMBERS, sampling_checks.N)} <= found


def test_every_valid_body_uses_only_its_endpoints_keys():
    for path, body in schema.VALID.items():
        assert set(body) <= set(schema.ENDPOINTS[path]), path
