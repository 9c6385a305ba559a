"""``continuum serve`` and its internal secret: configured or generated per run, handed
to the children by environment only, and an ipc directory others may write is refused."""

from __future__ import annotations

import os
import shutil

import pytest

from continuum.cli import build_parser
from continuum.serve.supervisor import ServeError, Supervisor, check_ipc_dir, internal_secret
from runtime import internal_auth

ENV, FILE, INSECURE = internal_auth.ENV_SECRET, internal_auth.ENV_SECRET_FILE, \
    internal_auth.ENV_INSECURE


def test_a_secret_is_generated_per_run_when_none_is_configured():
    first, env = internal_secret({"PATH": "/bin"})
    second, _ = internal_secret({"PATH": "/bin"})
    assert first != second and internal_auth.load_secret(env) == first
    assert env["PATH"] == "/bin"


def test_a_configured_secret_or_file_is_used_as_is(tmp_path):
    secret, env = internal_secret({ENV: "s" * 20})
    assert secret == b"s" * 20 and env == {ENV: "s" * 20}
    (tmp_path / "secret").write_text("f" * 32 + "\n")
    secret, env = internal_secret({FILE: str(tmp_path / "secret")})
    assert secret == b"f" * 32 and env == {FILE: str(tmp_path / "secret")}


def test_an_unusable_secret_is_a_serve_error():
    with pytest.raises(ServeError, match="at least 16 characters"):
        internal_secret({ENV: "short"})


def test_the_opt_out_runs_without_one():
    assert internal_secret({INSECURE: "1"}) == (None, {INSECURE: "1"})


def test_the_secret_is_never_on_a_childs_argv(monkeypatch):
    monkeypatch.delenv(ENV)
    args, _ = build_parser()[0].parse_known_args(["serve", "--port", "1", "--http-port", "2"])
    sup = Supervisor(args)
    try:
        secret = sup.secret.decode()
        assert sup.child_env[ENV] == secret
        for name in ("scheduler", "executor", "gateway"):
            assert not any(secret in arg for arg in sup.configs.argv(name)), name
        assert sup.scheduler.scheduler_host == "127.0.0.1"  # the scheduler stays on loopback
        assert stat_mode(sup.workdir) == 0o700
    finally:
        shutil.rmtree(sup.workdir)


def stat_mode(path) -> int:
    return os.stat(path).st_mode & 0o777


@pytest.mark.parametrize("mode,ok", [(0o700, True), (0o755, True), (0o770, False),
                                     (0o777, False), (0o1777, False)])
def test_an_ipc_directory_others_may_write_is_refused(tmp_path, mode, ok):
    directory = tmp_path / "ipc"
    directory.mkdir()
    directory.chmod(mode)
    if ok:
        check_ipc_dir(f"ipc://{directory}/executor.sock")
    else:
        with pytest.raises(ServeError, match="writable by other users"):
            check_ipc_dir(f"ipc://{directory}/executor.sock")
    check_ipc_dir("tcp://127.0.0.1:5555")  # not a path: nothing to check
    check_ipc_dir(f"ipc://{directory}/missing/executor.sock")  # the scheduler creates it


@pytest.mark.parametrize("flag", ["--http-body-timeout", "--stream-progress-timeout",
                                  "--slow-reader-timeout"])
def test_a_limit_that_is_not_a_positive_time_is_one_clear_error(tmp_path, flag, capsys):
    from gateway.__main__ import parse_args

    with pytest.raises(SystemExit) as exc:
        parse_args(["--model-dir", str(tmp_path), "--scheduler", "127.0.0.1:1", flag, "0"])
    assert exc.value.code == 2 and f"{flag} must be > 0, got 0.0" in capsys.readouterr().err


@pytest.mark.parametrize("value", ["0", "-2"])
def test_a_stream_interval_that_is_not_a_positive_integer_stops_serve(value):
    args = build_parser()[0].parse_args(["serve", "--stream-interval", value])
    with pytest.raises(ServeError, match="stream_interval must be a positive integer"):
        Supervisor(args)


def test_a_stream_interval_that_is_no_integer_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exc:
        build_parser()[0].parse_args(["serve", "--stream-interval", "four"])
    assert exc.value.code == 2 and "--stream-interval" in capsys.readouterr().err
