"""The scheduler process's one frozen config: its sockets, telemetry, /metrics, KV events,
TLS, and the scheduling limits (``core.SchedulerConfig``). Every field is a flag of
``python -m scheduler_svc`` and of ``continuum serve`` (runtime/config_flags.py); imports
nothing heavy, so the CLI builds its parser from it."""

from __future__ import annotations

import dataclasses

from runtime.config_flags import check_bounds, knob
from scheduler_svc.core.config import ConfigError, SchedulerConfig

PLAN_CHANNELS = ("auto", "shm", "zmq")


@dataclasses.dataclass(frozen=True)
class SchedulerProcessConfig:
    ipc: str = knob(help="the executor channel, e.g. ipc:///run/continuum/replica.sock "
                        "(a ZeroMQ address; serve: a private temp ipc:// path)")
    scheduler_host: str = knob("127.0.0.1", "the scheduler's gRPC bind address (loopback "
                                            "unless gateways elsewhere use it; it always "
                                            "requires the internal secret)")
    scheduler_port: int = knob(50061, "the scheduler's gRPC port, for gateways", lo=0,
                               hi=65535)
    grace_period: float = knob(30.0, "on SIGTERM, seconds in-flight requests may finish in "
                                     "(under serve a second Ctrl-C stops at once)", lo=0)
    telemetry_dsn: str = knob("", "telemetry store: a SQLite path (WAL) or postgresql://... "
                                  "read with `continuum report` ('off' or unset: none; "
                                  "serve's default: $XDG_STATE_HOME/continuum/"
                                  "telemetry.sqlite, or $CONTINUUM_TELEMETRY_DSN)")
    telemetry_retention_days: float = knob(7.0, "days telemetry rows are kept (steps roll "
                                                "up to minutes after 1 h)", above=0)
    metrics_port: int = knob(-1, "serve the replica's vLLM-compatible /metrics (what "
                                 "inference gateways scrape) on this port (0: any; -1: off)",
                             lo=-1, hi=65535)
    metrics_host: str = knob("127.0.0.1", "address of the /metrics port (it carries no "
                                          "secrets, but stays on loopback unless asked: a "
                                          "pod exposes it with 0.0.0.0)")
    kv_events_endpoint: str = knob("", "publish KV cache events (vLLM's ZeroMQ PUB stream, "
                                       "what llm-d's precise prefix-cache scorer reads) on "
                                       "this endpoint, e.g. tcp://127.0.0.1:5557 (unset: off)")
    kv_events_topic: str = knob("", "topic of every KV event message; llm-d expects "
                                    "kv@<pod>@<model>")
    kv_events_replay_endpoint: str = knob("", "a ROUTER that re-sends buffered KV event "
                                              "batches from a sequence number (unset: none)")
    kv_events_connect: bool = knob(False, "connect the KV event PUB to a subscriber that "
                                          "binds (a central indexer) instead of binding it")
    kv_events_allow_remote: bool = knob(False, "allow binding the unauthenticated KV event "
                                               "ports off loopback (where a NetworkPolicy "
                                               "admits only routers)")
    executor_heartbeat_timeout_s: float = knob(
        5.0, "seconds an idle executor may leave a heartbeat unanswered before it is taken "
             "for hung (its standby takes over; a busy one is held to its step's deadline)",
        above=0)
    plan_channel: str = knob(
        "auto", "how plans reach the executor: shm (a shared-memory ring the executor reads "
                "in place, ZeroMQ as the doorbell; plans stay on ZeroMQ where there is no "
                "shared memory: a tcp:// channel, not x86-64, no writable /dev/shm), zmq, or "
                "auto: shm on a host with 4 CPUs or more to spare a core for the ring's "
                "reader, else zmq (docs/gpu.md)", choices=PLAN_CHANNELS)
    scheduler_tls_cert_file: str | None = knob(
        None, "serve the scheduler port over TLS with this certificate chain (PEM, re-read "
              "when it changes; gateways check it against --scheduler-tls-ca-file)")
    scheduler_tls_key_file: str | None = knob(None, "the scheduler certificate's private key")
    scheduler_tls_client_ca_file: str | None = knob(
        None, "mutual TLS: gateways (and serve) must present a certificate signed by this "
              "CA (theirs: --scheduler-tls-client-cert-file)")
    config_file: str = knob("", "scheduler config fields in TOML or JSON (e.g. a Kubernetes "
                                "ConfigMap), winning over the flags; re-read every 2 s and "
                                "applied live as a new config version (`continuum config "
                                "history`)")
    core: SchedulerConfig = dataclasses.field(default_factory=SchedulerConfig)

    def __post_init__(self) -> None:
        check_bounds(self, ConfigError)
