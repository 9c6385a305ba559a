"""`continuum serve` takes every KV event flag docs/usage.md shows next to it and hands
each to the scheduler, which parses them as its own."""

from __future__ import annotations

from continuum.cli import build_parser
from continuum.serve.config import Configs
from scheduler_svc.__main__ import parse_args as scheduler_args

FLAGS = ["--kv-events-endpoint", "tcp://127.0.0.1:5557", "--kv-events-topic", "kv@pod@m",
         "--kv-events-replay-endpoint", "tcp://127.0.0.1:5558", "--kv-events-connect",
         "--kv-events-allow-remote"]


def _scheduler(*flags: str):
    args = build_parser()[0].parse_args(["serve", "--telemetry-dsn", "off", *flags])
    return scheduler_args(Configs.of(args, ipc="ipc:///tmp/x.sock", model_name="m")
                          .argv("scheduler"))


def test_serve_passes_every_kv_event_flag_to_the_scheduler():
    passed = _scheduler(*FLAGS)
    assert (passed.kv_events_endpoint, passed.kv_events_topic,
            passed.kv_events_replay_endpoint) == (
        "tcp://127.0.0.1:5557", "kv@pod@m", "tcp://127.0.0.1:5558")
    assert passed.kv_events_connect and passed.kv_events_allow_remote


def test_without_the_endpoint_nothing_is_published():
    passed = _scheduler()
    assert not passed.kv_events_endpoint and not passed.kv_events_connect
