"""SchedulerConfig values as text and as a file (the live config reload).

``parse_value`` turns an admin RPC's text value into the field's type (ConfigError naming
the field otherwise). ``--config-file PATH`` (a mounted ConfigMap, TOML or JSON): ``load``
reads it, ``overlay`` puts it over the flags (the file is the declared state, so it wins;
fields it does not name keep their flag values). ``watch`` re-stats and re-reads the path
every ``POLL_S``, never holding it open: a ConfigMap volume updates by swapping a symlink.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import math
import os
import tomllib
from collections.abc import Callable, Mapping

import structlog

from scheduler_svc.core import ConfigError, SchedulerConfig

POLL_S = 2.0
# Bigger than any sane config file: a wrong path (a log, a device) is refused unread.
MAX_FILE_BYTES = 64 * 1024
_TRUE, _FALSE = ("true", "1", "yes", "on"), ("false", "0", "no", "off")
FIELDS = {f.name: str(f.type) for f in dataclasses.fields(SchedulerConfig)}
log = structlog.get_logger("scheduler.config_file")


def format_value(value: object) -> str:
    """A config value as text that ``parse_value`` reads back unchanged."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def parse_value(name: str, value: object) -> object:
    """``value`` (text, or a TOML/JSON scalar) as field ``name``'s type; ConfigError
    for an unknown field or a value of the wrong kind. Range checks are the config's
    own (SchedulerConfig.__post_init__), so they are the same as at start."""
    kind = FIELDS.get(name)
    if kind is None:
        raise ConfigError(f"unknown config field {name!r}; the fields are: "
                          f"{', '.join(FIELDS)}")
    text = value.strip().lower() if isinstance(value, str) else None
    if kind == "bool":
        if isinstance(value, bool):
            return value
        if text in _TRUE or text in _FALSE:
            return text in _TRUE
        raise ConfigError(f"{name} must be true or false, got {value!r}")
    if kind == "str":
        if isinstance(value, str):
            return value.strip()
        raise ConfigError(f"{name} must be text, got {value!r}")
    try:
        if isinstance(value, bool):
            raise ValueError
        if kind == "int":
            if isinstance(value, float):
                raise ValueError
            return int(value)
        parsed = float(value)
        if not math.isfinite(parsed):  # NaN passes every range check: refuse it here
            raise ValueError
    except (TypeError, ValueError):
        raise ConfigError(f"{name} must be {'an integer' if kind == 'int' else 'a finite number'}"
                          f", got {value!r}") from None
    return parsed


def parse_values(values: Mapping[str, object]) -> dict[str, object]:
    return {name: parse_value(name, value) for name, value in values.items()}


def load(path: str) -> tuple[dict[str, object], bytes]:
    """The fields ``path`` sets (parsed) and its bytes; ConfigError saying what is wrong
    with it. ``.json`` is JSON, anything else TOML (a flat table of fields)."""
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_FILE_BYTES + 1)
    except OSError as exc:
        raise ConfigError(f"cannot read the config file {path}: {exc.strerror}") from None
    if len(data) > MAX_FILE_BYTES:
        raise ConfigError(f"the config file {path} is over {MAX_FILE_BYTES} bytes")
    try:
        text = data.decode("utf-8")
        table = json.loads(text) if path.endswith(".json") else tomllib.loads(text)
    except (UnicodeDecodeError, ValueError) as exc:  # JSONDecodeError, TOMLDecodeError
        raise ConfigError(f"the config file {path} is not valid "
                          f"{'JSON' if path.endswith('.json') else 'TOML'}: {exc}") from None
    if not isinstance(table, dict):
        raise ConfigError(f"the config file {path} must hold a table of config fields")
    try:
        return parse_values(table), data
    except ConfigError as exc:
        raise ConfigError(f"the config file {path}: {exc}") from None


def overlay(base: SchedulerConfig, values: Mapping[str, object]) -> SchedulerConfig:
    """``base`` with ``values`` replaced, validated as at start (ConfigError)."""
    return dataclasses.replace(base, **values)


def _stat_key(path: str) -> tuple | None:
    try:
        st = os.stat(path)  # follows the symlink anew each time
    except OSError:
        return None
    return st.st_ino, st.st_mtime_ns, st.st_size


async def watch(path: str, seen: bytes, apply: Callable[[dict[str, object]], None],
                poll_s: float = POLL_S) -> None:
    """Calls ``apply(fields)`` each time ``path``'s content changes from ``seen`` (the
    bytes read at start). A file that cannot be read or parsed, or that ``apply``
    refuses (ConfigError), is logged with the reason once per content and changes
    nothing; the next good content is applied."""
    key, digest = _stat_key(path), hashlib.sha256(seen).digest()
    while True:
        await asyncio.sleep(poll_s)
        now = _stat_key(path)
        if now == key:
            continue
        key = now
        try:
            values, data = load(path)
        except ConfigError as exc:
            new_digest = hashlib.sha256(repr(exc).encode()).digest()
            if new_digest != digest:
                log.error("config file refused; the config is unchanged", path=path,
                          why=str(exc))
            digest = new_digest
            continue
        new_digest = hashlib.sha256(data).digest()
        if new_digest == digest:
            continue  # touched, or a symlink swap to the same content
        digest = new_digest
        try:
            apply(values)
        except ConfigError as exc:
            log.error("config file refused; the config is unchanged", path=path,
                      why=str(exc))
        except Exception:  # a bug must not end the watching: the next change may apply
            log.exception("config file not applied", path=path)
