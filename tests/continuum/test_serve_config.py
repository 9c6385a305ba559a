"""One frozen config per service is its command line (runtime/config_flags.py): every field
is exactly one flag of its service, ``continuum serve`` takes each field it does not set
itself under the same name, and hands every child every field as one document that the
child parses with its own code."""

from __future__ import annotations

import argparse
import dataclasses
import json
import typing

import pytest

from continuum.cli import build_parser
from continuum.serve.config import SERVICES, Configs, ServeConfig, ServeConfigError
from executor_svc import __main__ as executor_main
from executor_svc.settings import ExecutorConfig
from gateway import __main__ as gateway_main
from gateway.config import GatewayConfig
from runtime import config_flags
from scheduler_svc import __main__ as scheduler_main
from scheduler_svc.process_config import SchedulerProcessConfig

IPC = "ipc:///tmp/continuum-test-serve-config.sock"
CHILDREN = {GatewayConfig: ("gateway", gateway_main.parse_args),
            SchedulerProcessConfig: ("scheduler", scheduler_main.parse_args),
            ExecutorConfig: ("executor", lambda argv: executor_main.parse_args(argv, {}))}
# Fields that are no flag, and why: set by the process itself or read from the environment.
NOT_FLAGS = {GatewayConfig: {"http_lingering_s"},  # a protocol detail, not a knob
             SchedulerProcessConfig: {"core"},  # nested: its fields are the flags
             ExecutorConfig: {"switches"}}  # the environment's (executor_svc/settings.py)
# A value serve may take for the fields the rule in `_other` cannot pick, with the flags
# it needs beside it.
SPECIAL = {
    "tls_cert_file": ("c.pem", ["--tls-key-file", "k.pem"]),
    "tls_key_file": ("k.pem", ["--tls-cert-file", "c.pem"]),
    "tls_client_ca_file": ("ca.pem", ["--tls-cert-file", "c.pem", "--tls-key-file", "k.pem"]),
    "scheduler_tls_cert_file": ("c.pem", ["--scheduler-tls-key-file", "k.pem",
                                          "--scheduler-tls-ca-file", "ca.pem"]),
    "scheduler_tls_key_file": ("k.pem", ["--scheduler-tls-cert-file", "c.pem",
                                         "--scheduler-tls-ca-file", "ca.pem"]),
    "scheduler_tls_client_ca_file": ("ca.pem", [
        "--scheduler-tls-cert-file", "c.pem", "--scheduler-tls-key-file", "k.pem",
        "--scheduler-tls-ca-file", "ca.pem", "--scheduler-tls-client-cert-file", "cc.pem",
        "--scheduler-tls-client-key-file", "ck.pem"]),
    "scheduler_tls_ca_file": ("ca.pem", ["--scheduler-tls-cert-file", "c.pem",
                                         "--scheduler-tls-key-file", "k.pem"]),
    "scheduler_tls_server_name": ("sched.internal", ["--scheduler-tls-ca-file", "ca.pem",
                                                     "--scheduler-tls-cert-file", "c.pem",
                                                     "--scheduler-tls-key-file", "k.pem"]),
    "scheduler_tls_client_cert_file": ("cc.pem", [
        "--scheduler-tls-client-key-file", "ck.pem", "--scheduler-tls-ca-file", "ca.pem",
        "--scheduler-tls-cert-file", "c.pem", "--scheduler-tls-key-file", "k.pem"]),
    "scheduler_tls_client_key_file": ("ck.pem", [
        "--scheduler-tls-client-cert-file", "cc.pem", "--scheduler-tls-ca-file", "ca.pem",
        "--scheduler-tls-cert-file", "c.pem", "--scheduler-tls-key-file", "k.pem"]),
    "trusted_proxies": ("10.0.0.0/8", []),
    "objective_tiers": (("batch=best_effort",), []),
    "tool_call_parser": ("json", []),
    "device": ("cpu", []),
    "ipc": (IPC, []),  # serve's own temp path unless given
    "telemetry_dsn": ("postgresql://db/t", []),
    "max_num_waiting_per_tenant": (8, []),
    "policy": ("sjf", []),
    "max_num_batched_tokens": (4096, []),
    "chunk_size": (256, []),
}


def _text(value) -> list[str]:
    return [str(v) for v in value] if isinstance(value, tuple) else [str(value)]


def _other(field: dataclasses.Field, kind) -> object:
    """A value of ``field`` other than its default that its config accepts."""
    if field.name in SPECIAL:
        return SPECIAL[field.name][0]
    meta, default = field.metadata["knob"], field.default
    if meta["choices"]:
        return next(c for c in meta["choices"] if c != default)
    if kind is bool:
        return not default
    if kind is int:
        return max(7 if default in (None, -1, 0) else default + 1, 2 * (meta["lo"] or 0))
    if kind is float:
        return 0.5 if default in (None, 0.0) or meta["hi"] == 1 and default != 0.5 else default * 2
    return "x" if kind is str else f"{field.name}.file"


def _serve_flags() -> list[tuple[dataclasses.Field, typing.Any, str]]:
    fields = {}
    for cls in (ServeConfig, *(cls for _, cls in SERVICES)):
        for field, kind in config_flags.knobs(cls):
            if field.metadata["knob"]["serve"]:
                fields.setdefault(field.name, (field, kind))
    return [(field, kind, config_flags.flag_of(field)) for field, kind in fields.values()]


@pytest.mark.parametrize("cls", [GatewayConfig, SchedulerProcessConfig, ExecutorConfig,
                                 ServeConfig])
def test_every_field_is_exactly_one_flag(cls):
    own = {f.name for f in dataclasses.fields(cls)}
    flags = {f.name for f, _ in config_flags.knobs(cls)}
    assert own - flags == NOT_FLAGS.get(cls, set())
    parser = argparse.ArgumentParser()
    config_flags.add_flags(parser, cls)  # argparse refuses a flag declared twice
    names = [config_flags.flag_of(f) for f, _ in config_flags.knobs(cls)]
    assert len(names) == len(set(names))
    for action in parser._actions[1:]:
        assert action.dest in flags and action.default is argparse.SUPPRESS  # one default


def test_a_field_two_services_share_means_one_thing():
    seen: dict[str, tuple] = {}
    for cls in (ServeConfig, *(cls for _, cls in SERVICES)):
        for field, kind in config_flags.knobs(cls):
            kept = seen.setdefault(field.name, (kind, field.default, config_flags.flag_of(field)))
            assert kept == (kind, field.default, config_flags.flag_of(field)), field.name
    shared = {"grace_period", "ipc", "max_num_batched_tokens"}
    assert shared <= set(seen)


@pytest.mark.parametrize("field,kind,flag", _serve_flags(), ids=lambda x: getattr(x, "name", ""))
def test_serve_hands_each_child_every_field_it_was_given(field, kind, flag):
    value = _other(field, kind)
    argv = ["serve", flag] if kind is bool and value else \
        ["serve", f"--no-{flag[2:]}"] if kind is bool else \
        ["serve", *(a for v in _text(value) for a in (flag, v))]
    argv += SPECIAL.get(field.name, (None, []))[1]
    args = build_parser()[0].parse_args(argv)
    configs = Configs.of(args, ipc=IPC, model_name="m")
    owners = [cls for cls in CHILDREN if field.name in
              {f.name for f, _ in config_flags.knobs(cls)}]
    if not owners:
        assert getattr(configs.serve, field.name) == value
    for cls in owners:
        name, parse = CHILDREN[cls]
        child = parse(configs.argv(name))  # the child's own parser reads the document
        got = config_flags._lookup(child, field.name)
        assert str(got) == str(value) if not isinstance(value, tuple) else got == value
        document = json.loads(configs.argv(name)[1])
        assert set(document) == {f.name for f, _ in config_flags.knobs(cls)}


def test_the_children_of_a_plain_serve_get_their_defaults():
    configs = Configs.of(build_parser()[0].parse_args(["serve", "--telemetry-dsn", "off"]),
                         ipc=IPC, model_name="m")
    assert scheduler_main.parse_args(configs.argv("scheduler")) == SchedulerProcessConfig(ipc=IPC)
    assert gateway_main.parse_args(configs.argv("gateway")).scheduler_address == \
        "127.0.0.1:50061"
    standby = executor_main.parse_args(configs.argv("standby"), {})
    assert standby.standby and standby.model_id == "m"


def test_a_value_a_child_would_refuse_stops_serve_before_anything_starts():
    for argv, says in ((["--max-num-seqs", "0"], "max_num_seqs"),
                       (["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization"),
                       (["--http-port", "50051"], "--http-port"),
                       (["--restart-window-s", "0"], "--restart-window-s")):
        args = build_parser()[0].parse_args(["serve", *argv])
        with pytest.raises(ServeConfigError, match=says):
            Configs.of(args, ipc=IPC, model_name="m")


def test_a_document_is_the_whole_config(capsys):
    configs = Configs.of(build_parser()[0].parse_args(["serve"]), ipc=IPC, model_name="m")
    with pytest.raises(SystemExit) as info:
        scheduler_main.parse_args([*configs.argv("scheduler"), "--max-num-seqs", "3"])
    assert info.value.code == 2 and "--config-json" in capsys.readouterr().err
