"""Where ``continuum serve`` keeps its per-user state, and how the other subcommands find
it without being told: the telemetry store ``report`` and ``gate`` read, the internal
secret ``config`` needs to talk to the scheduler.

* The telemetry store, in this order: the command's own flag (``--telemetry-dsn`` on
  serve, ``--store`` on report and gate), then ``$CONTINUUM_TELEMETRY_DSN``, then the
  user's state directory (``$XDG_STATE_HOME/continuum/telemetry.sqlite``, else
  ``~/.local/state/continuum/telemetry.sqlite``). Serve and the readers resolve it the
  same way, so a reader finds what serve wrote, and says which store it read.
* The internal secret of a serve that generated its own (none was configured): written
  while it runs to ``secret-<scheduler port>`` in the same directory (mode 0600, in a
  0700 directory, removed at exit), so ``continuum config`` from the same user reaches
  it; a configured secret is never written anywhere.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import urllib.parse
from collections.abc import Iterator, Mapping

ENV_TELEMETRY_DSN = "CONTINUUM_TELEMETRY_DSN"


def state_dir(environ: Mapping[str, str] = os.environ) -> pathlib.Path:
    base = environ.get("XDG_STATE_HOME") or os.path.expanduser("~/.local/state")
    return pathlib.Path(base) / "continuum"


def default_telemetry_store(environ: Mapping[str, str] = os.environ) -> str:
    """Where serve keeps its telemetry unless told: one SQLite file in the state dir."""
    return str(state_dir(environ) / "telemetry.sqlite")


def telemetry_store(flag: str | None, flag_name: str,
                    environ: Mapping[str, str] = os.environ) -> tuple[str, str]:
    """(the store's path or DSN, where it came from) for a command whose own flag
    ``flag_name`` holds ``flag`` (None: not given)."""
    if flag is not None:
        return flag, flag_name
    if environ.get(ENV_TELEMETRY_DSN):
        return environ[ENV_TELEMETRY_DSN], f"${ENV_TELEMETRY_DSN}"
    return default_telemetry_store(environ), "continuum serve's default"


def describe(dsn: str) -> str:
    """``dsn`` fit to print: a PostgreSQL password is masked."""
    if "://" not in dsn:
        return dsn
    parts = urllib.parse.urlsplit(dsn)
    if parts.password is None:
        return dsn
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@", 1)
    return urllib.parse.urlunsplit(parts._replace(netloc=netloc))


def secret_file(scheduler_port: int, environ: Mapping[str, str] = os.environ) -> pathlib.Path:
    return state_dir(environ) / f"secret-{scheduler_port}"


@contextlib.contextmanager
def published_secret(secret: str, scheduler_port: int,
                     environ: Mapping[str, str] = os.environ) -> Iterator[pathlib.Path | None]:
    """Writes serve's generated secret for this user's other commands while the block
    runs; yields the file (None if it could not be written: serve runs on)."""
    path = secret_file(scheduler_port, environ)
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w", encoding="ascii") as out:
            os.fchmod(out.fileno(), 0o600)
            out.write(secret)
    except OSError:
        path = None
    try:
        yield path
    finally:
        if path is not None:
            with contextlib.suppress(OSError):
                if path.read_text(encoding="ascii") == secret:  # not a newer serve's
                    path.unlink()
