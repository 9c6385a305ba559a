"""``continuum serve``'s command line: its own fields (``ServeConfig``) and every field of the
three services' configs that serve does not set itself, grouped by service in ``--help``,
each flag named and defaulted once, on its field (runtime/config_flags.py). A field two
services share (``--grace-period``, ``--ipc``, ``--max-num-batched-tokens``) is one flag
whose value both get. ``Configs.of`` builds and checks every child's config before anything
starts; each child is then handed its config as one document (``Configs.argv``)."""

from __future__ import annotations

import argparse
import dataclasses
import os
import pathlib

from continuum.serve import local_state
from executor_svc.settings import ExecutorConfig
from gateway.config import GatewayConfig
from runtime import config_flags
from runtime.config_flags import check_bounds, knob
from scheduler_svc.process_config import SchedulerProcessConfig

SERVICES: tuple[tuple[str, type], ...] = (
    ("gateway: the client ports, their limits and TLS (python -m gateway)", GatewayConfig),
    ("scheduler: queues, limits, policy, telemetry, metrics (python -m scheduler_svc)",
     SchedulerProcessConfig),
    ("executor: the model, device and KV pool (python -m executor_svc)", ExecutorConfig))


class ServeConfigError(ValueError):
    """A serve flag (or a pairing of them) that cannot work; the message names it."""


@dataclasses.dataclass(frozen=True)
class ServeConfig:
    """What ``continuum serve`` itself decides: how many executors, and when to give up
    replacing them (the crash-loop guard, continuum/serve/restart_guard.py)."""

    standby_executors: int | None = knob(
        None, "warm standby executors (loaded, idle) that take over on the next step when the "
              "executor dies or hangs; each costs one more executor's memory (default: 1 on a "
              "CPU-only host with 4+ cores)", choices=(0, 1))
    max_executor_restarts: int = knob(
        5, "executor deaths (cold restarts and standby takeovers alike) replaced within "
           "--restart-window-s; one more stops the server as a crash loop (0: never "
           "restart, the first death stops it)", lo=0)
    restart_window_s: float = knob(120.0, "the crash-loop guard's window in seconds", above=0)

    def __post_init__(self) -> None:
        check_bounds(self, ServeConfigError)


def add_flags(parser: argparse.ArgumentParser) -> None:
    seen = set(config_flags.add_flags(parser.add_argument_group("serve"), ServeConfig))
    for title, cls in SERVICES:
        seen.update(config_flags.add_flags(parser.add_argument_group(title), cls,
                                           for_serve=True, skip=seen))


def telemetry_dsn(given: str | None) -> str:
    """The scheduler's store under serve: the flag, else $CONTINUUM_TELEMETRY_DSN, else the
    state directory's SQLite file (created private); "off": none."""
    dsn, _ = local_state.telemetry_store(given, "--telemetry-dsn")
    if dsn in ("", "off"):
        return ""
    if "://" not in dsn:
        os.makedirs(os.path.dirname(os.path.abspath(dsn)), mode=0o700, exist_ok=True)
    return dsn


@dataclasses.dataclass(frozen=True)
class Configs:
    """Serve's config and each child's, built from one command line."""

    serve: ServeConfig
    gateway: GatewayConfig
    scheduler: SchedulerProcessConfig
    executor: ExecutorConfig

    @classmethod
    def of(cls, args: argparse.Namespace, *, ipc: str, model_name: str) -> Configs:
        """Raises ServeConfigError naming the flag for a value a child would refuse. The
        model directory is set once resolved (``with_model``)."""
        scheduler = config_flags.values(SchedulerProcessConfig, args)
        scheduler |= {"ipc": ipc, "telemetry_dsn": telemetry_dsn(scheduler.get("telemetry_dsn"))}
        host = scheduler.get("scheduler_host", "127.0.0.1")
        port = scheduler.get("scheduler_port", 50061)
        try:
            return cls(
                config_flags.build(ServeConfig, config_flags.values(ServeConfig, args)),
                config_flags.build(GatewayConfig, config_flags.values(GatewayConfig, args) | {
                    "model_dir": pathlib.Path("."), "model_name": model_name,
                    "scheduler_address": f"{connect_host(host)}:{port}"}),
                config_flags.build(SchedulerProcessConfig, scheduler),
                config_flags.build(ExecutorConfig, config_flags.values(ExecutorConfig, args)
                                   | {"ipc": ipc, "model_id": model_name}))
        except ValueError as exc:  # each service's ConfigError is one
            raise ServeConfigError(str(exc)) from None

    def with_model(self, model_dir: str) -> Configs:
        return dataclasses.replace(
            self, gateway=dataclasses.replace(self.gateway, model_dir=pathlib.Path(model_dir)),
            executor=dataclasses.replace(self.executor, model=model_dir))

    def argv(self, name: str) -> list[str]:
        """The command line of the child ``name`` (scheduler, executor, standby, gateway)."""
        config = {"gateway": self.gateway, "scheduler": self.scheduler,
                  "executor": self.executor,
                  "standby": dataclasses.replace(self.executor, standby=True)}[name]
        return [config_flags.DOCUMENT_FLAG, config_flags.document(config)]


def connect_host(host: str) -> str:
    """Where this host reaches a server bound to ``host`` (a wildcard: loopback)."""
    return "127.0.0.1" if host in ("0.0.0.0", "") else "[::1]" if host == "::" else host
