"""A service's frozen config is its command line: each field declared with ``knob`` (its
help, default and bounds) is one flag, named after the field, for the service's own
``python -m`` and for ``continuum serve``, which takes the flags of all three services and
hands each child its config as one JSON document (``--config-json``).

The standard library only: the CLI builds every service's parser without loading one.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import pathlib
import types
import typing
from collections.abc import Callable, Iterator
from typing import Any

DOCUMENT_FLAG = "--config-json"
METAVARS = {int: "N", float: "X", pathlib.Path: "PATH"}


def knob(default: Any = dataclasses.MISSING, help: str = "", *, flag: str | None = None,
         parse: Callable[[str], Any] | None = None, choices: tuple | None = None,
         lo: float | None = None, hi: float | None = None, above: float | None = None,
         metavar: str | None = None, aliases: tuple[str, ...] = (), serve: bool = True,
         hidden: bool = False) -> Any:
    """A config field that is a flag. ``flag``: its name when the field's own would not
    read (default ``--field-name``); ``parse``: the text-to-value function (default: the
    annotation's type); ``lo``/``hi``: inclusive bounds, ``above``: an exclusive lower
    bound, checked by ``check_bounds``; ``serve=False``: ``continuum serve`` sets the field
    itself (a path it resolves, a name it derives), so it is no flag of serve's;
    ``hidden``: set by a process for the processes it starts, not by users; ``aliases``:
    other servers' names for the same flag (vLLM's ``--ssl-certfile``)."""
    meta = {"help": help, "flag": flag, "parse": parse, "choices": choices, "lo": lo,
            "hi": hi, "above": above, "metavar": metavar, "aliases": aliases, "serve": serve,
            "hidden": hidden}
    return dataclasses.field(default=default, metadata={"knob": meta})


def flag_of(field: dataclasses.Field) -> str:
    return field.metadata["knob"]["flag"] or "--" + field.name.replace("_", "-")


def knobs(cls: type) -> Iterator[tuple[dataclasses.Field, Any]]:
    """(field, its type without ``| None``) for every knob of ``cls`` and of the config
    dataclasses it nests, in declaration order."""
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        kind = _base(hints[field.name])
        if dataclasses.is_dataclass(kind) and "knob" not in field.metadata:
            yield from knobs(kind)
        elif "knob" in field.metadata:
            yield field, kind


def _base(hint: Any) -> Any:
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        (hint,) = [arg for arg in typing.get_args(hint) if arg is not type(None)]
    return hint


def add_flags(parser: argparse._ActionsContainer, cls: type, *, for_serve: bool = False,
              skip: set[str] | frozenset[str] = frozenset()) -> list[str]:
    """One flag per knob of ``cls`` not in ``skip`` (``for_serve``: those serve takes).
    Flags not given leave no attribute behind (``from_args`` leaves those fields at their
    defaults, declared once, on the field). Returns the field names added."""
    added = []
    for field, kind in knobs(cls):
        meta = field.metadata["knob"]
        if field.name in skip or (for_serve and not meta["serve"]):
            continue
        default = field.default
        shown = ("" if default in (dataclasses.MISSING, None, "", ()) or kind is bool
                 else f" (default: {default:g})" if isinstance(default, float)
                 else f" (default: {default})")
        kw: dict[str, Any] = {"dest": field.name, "default": argparse.SUPPRESS,
                              "help": argparse.SUPPRESS if meta["hidden"] else meta["help"] + shown}
        if kind is bool:
            kw["action"] = argparse.BooleanOptionalAction
        elif typing.get_origin(kind) is tuple:
            kw.update(action="append", metavar=meta["metavar"])
        else:
            kw.update(type=meta["parse"] or kind, choices=meta["choices"],
                      metavar=meta["metavar"] or (None if meta["choices"] else METAVARS.get(
                          kind, "TEXT")))
        parser.add_argument(flag_of(field), *meta["aliases"], **kw)
        added.append(field.name)
    return added


def values(cls: type, args: argparse.Namespace) -> dict[str, Any]:
    """The knobs of ``cls`` given on the command line ``args`` was parsed from."""
    return {field.name: getattr(args, field.name) for field, _ in knobs(cls)
            if hasattr(args, field.name)}


def build(cls: type, flat: dict[str, Any], errors: type[Exception] = ValueError) -> Any:
    """``cls`` from knob values by field name (nested configs from theirs); fields not in
    ``flat`` keep their defaults, and one without a default is ``errors`` naming its flag.
    Tuples and paths come back from a document's lists and strings."""
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for field in dataclasses.fields(cls):
        kind = _base(hints[field.name])
        if dataclasses.is_dataclass(kind) and "knob" not in field.metadata:
            kwargs[field.name] = build(kind, flat, errors)
        elif field.name not in flat and field.default is dataclasses.MISSING is \
                field.default_factory and "knob" in field.metadata:
            raise errors(f"{flag_of(field)} is required")
        elif field.name in flat:
            value = flat[field.name]
            if value is not None and typing.get_origin(kind) is tuple:
                value = tuple(value)
            elif value is not None and kind is pathlib.Path:
                value = pathlib.Path(value)
            kwargs[field.name] = value
    return cls(**kwargs)


def document(config: Any) -> str:
    """Every knob of ``config`` (nested ones flattened) as one JSON object."""
    flat = {}
    for field, _ in knobs(type(config)):
        value = _lookup(config, field.name)
        flat[field.name] = str(value) if isinstance(value, pathlib.Path) else value
    return json.dumps(flat, sort_keys=True)


def _lookup(config: Any, name: str) -> Any:
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        if field.name == name and "knob" in field.metadata:
            return value
        if dataclasses.is_dataclass(value) and "knob" not in field.metadata:
            try:
                return _lookup(value, name)
            except KeyError:
                pass
    raise KeyError(name)


def parse(cls: type, parser: argparse.ArgumentParser, argv: list[str] | None,
          errors: type[Exception] = ValueError, **fixed: Any) -> Any:
    """``cls`` from a service's command line: its flags, or one ``--config-json``
    document (what ``continuum serve`` passes) and nothing else. ``fixed``: fields the
    process sets itself. A value the config refuses is ``parser.error`` (exit 2)."""
    parser.usage = parser.usage or f"{parser.prog} [flags]"
    add_flags(parser, cls)
    parser.add_argument(DOCUMENT_FLAG, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    given = values(cls, args)
    if args.config_json is not None:
        if given:
            parser.error(f"{DOCUMENT_FLAG} is the whole config: no other flags with it")
        given = json.loads(args.config_json)
    try:
        return build(cls, given | fixed, errors)
    except (errors, TypeError) as exc:
        parser.error(str(exc))


def check_bounds(config: Any, error: type[Exception]) -> None:
    """``error`` naming the flag for a knob outside its ``lo``/``hi``/``above`` (None,
    an unset optional, passes)."""
    for field in dataclasses.fields(config):
        meta = field.metadata.get("knob")
        value = getattr(config, field.name)
        if meta is None or isinstance(value, bool) or not isinstance(value, int | float):
            continue
        lo, hi, above = meta["lo"], meta["hi"], meta["above"]
        if (not math.isfinite(value) or (lo is not None and value < lo)
                or (hi is not None and value > hi) or (above is not None and value <= above)):
            bounds = " and ".join(b for b in (
                f">= {lo:g}" if lo is not None else "", f"> {above:g}" if above is not None
                else "", f"<= {hi:g}" if hi is not None else "") if b)
            raise error(f"{flag_of(field)} must be {bounds}, got {value!r}")
