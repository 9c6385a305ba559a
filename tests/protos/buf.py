"""buf, as `make setup` installs it (tools/package.json, pinned), and the contract's checks.

The checks are the ones docs/grpc.md describes: ``buf lint`` (buf.yaml), the public files'
breaking check at FILE (buf.yaml) and every file's at WIRE (buf.internal.yaml), both
against the release baseline. buf is a quick local binary, no service: tests that run it
stay in the fast tier (tests/conftest.py stops only service processes there).
"""

from __future__ import annotations

import dataclasses
import pathlib
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
BUF = ROOT / "tools" / "node_modules" / ".bin" / "buf"
BASELINE = "protos/baseline/v1.binpb"
INTERNAL_CONFIG = "buf.internal.yaml"
# What buf reads: its two configs, the protos and the baseline image.
CONTRACT = ("buf.yaml", INTERNAL_CONFIG, "protos/continuum", BASELINE)


@dataclasses.dataclass(frozen=True)
class Outcome:
    code: int
    output: str  # stdout and stderr: buf prints findings on stdout, failures on stderr


def buf_or_skip() -> pathlib.Path:
    """buf's path; a skip where npm is absent, a failure where setup did not install it."""
    if BUF.exists():
        return BUF
    if shutil.which("npm") is None:
        pytest.skip("npm is not installed: `make setup` installs buf (tools/package.json) "
                    "with npm")
    pytest.fail(f"{BUF.relative_to(ROOT)} is missing: run `make setup` (npm ci in tools/)")


def buf(root: pathlib.Path, *args: str) -> Outcome:
    done = subprocess.run([str(buf_or_skip()), *args], cwd=root, capture_output=True,
                          text=True, timeout=120, check=False)
    return Outcome(done.returncode, done.stdout + done.stderr)


def lint(root: pathlib.Path = ROOT) -> Outcome:
    return buf(root, "lint")


def breaking_public(root: pathlib.Path = ROOT) -> Outcome:
    """generation.proto and sampling.proto at FILE (buf.yaml ignores the internal files)."""
    return buf(root, "breaking", "--against", BASELINE)


def breaking_internal(root: pathlib.Path = ROOT) -> Outcome:
    """Every file at WIRE."""
    return buf(root, "breaking", "--against", BASELINE, "--config", INTERNAL_CONFIG)


def copy_contract(dest: pathlib.Path) -> pathlib.Path:
    """The configs, .proto files and baseline copied under ``dest`` (nothing generated)."""
    for name in CONTRACT:
        source, target = ROOT / name, dest / name
        target.parent.mkdir(parents=True, exist_ok=True)
        if source.is_dir():
            shutil.copytree(source, target,
                            ignore=shutil.ignore_patterns("*.py", "*.pyi", "__pycache__"))
        else:
            shutil.copy2(source, target)
    return dest


def edit(path: pathlib.Path, old: str, new: str) -> None:
    text = path.read_text(encoding="utf-8")
    assert text.count(old) == 1, f"{old!r} is not in {path} exactly once"
    path.write_text(text.replace(old, new), encoding="utf-8")
