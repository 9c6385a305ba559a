"""The KV event stream's flags: one definition for ``python -m scheduler_svc`` and for
``continuum serve``, which takes them and passes them on (nothing heavy imported)."""

from __future__ import annotations

import argparse


def add_flags(p: argparse.ArgumentParser) -> None:
    """vLLM's KV event stream for prefix-aware routers (scheduler_svc/kv_events.py)."""
    p.add_argument("--kv-events-endpoint", default="",
                   help="publish KV cache events (vLLM's ZeroMQ PUB stream, what llm-d's "
                        "precise prefix-cache scorer reads) on this endpoint, e.g. "
                        "tcp://127.0.0.1:5557 (default: off)")
    p.add_argument("--kv-events-topic", default="",
                   help="topic of every message; llm-d expects kv@<pod>@<model>")
    p.add_argument("--kv-events-replay-endpoint", default="",
                   help="a ROUTER that re-sends buffered batches from a sequence number "
                        "(default: none)")
    p.add_argument("--kv-events-connect", action="store_true",
                   help="connect the PUB to a subscriber that binds (a central indexer) "
                        "instead of binding it")
    p.add_argument("--kv-events-allow-remote", action="store_true",
                   help="allow binding the unauthenticated event ports off loopback "
                        "(where a NetworkPolicy admits only routers)")


def argv(a: argparse.Namespace) -> list[str]:
    """The flags of ``a`` that were set, as the scheduler takes them."""
    if not a.kv_events_endpoint:
        return []
    return ["--kv-events-endpoint", a.kv_events_endpoint, "--kv-events-topic",
            a.kv_events_topic,
            *(["--kv-events-replay-endpoint", a.kv_events_replay_endpoint]
              if a.kv_events_replay_endpoint else []),
            *(["--kv-events-connect"] if a.kv_events_connect else []),
            *(["--kv-events-allow-remote"] if a.kv_events_allow_remote else [])]
