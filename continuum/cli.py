"""The ``continuum`` command: ``serve`` a model, ``generate`` from a running server."""

from __future__ import annotations

import argparse
import sys

from continuum import restart_guard, serve_tls
from executor_svc.flags import add_device_arguments, check_device_arguments, parse_bytes
from gateway.edge import edge_flags
from protos import tiers
from scheduler_svc import kv_event_flags, plan_channel_flags

DEFAULT_PORT = 50051
# The executor's nice value under serve (measured in docs/reliability.md, row burst).
EXECUTOR_NICE = 0


def _serve_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("serve", help="start gateway, scheduler and executor")
    p.add_argument("--model", default=None,
                   help="GGUF file or Hugging Face model directory (Llama, Qwen2, Qwen3, "
                        "Mistral, Gemma 3) (default: the bundled SmolLM2-135M-Instruct)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help="client gRPC port")
    p.add_argument("--http-port", type=int, default=8000,
                   help="OpenAI-compatible HTTP API port (-1: none)")
    p.add_argument("--scheduler-port", type=int, default=50061, help="internal scheduler port")
    p.add_argument("--metrics-port", type=int, default=-1,
                   help="serve the replica's vLLM-compatible /metrics (what inference gateways "
                        "scrape) on this loopback port (0: any; default: off)")
    kv_event_flags.add_flags(p)  # passed to the scheduler
    plan_channel_flags.add_flag(p)  # passed to the scheduler
    p.add_argument("--scheduler-host", default="127.0.0.1",
                   help="internal scheduler bind address (loopback unless gateways elsewhere "
                        "use it; it always requires the internal secret)")
    p.add_argument("--api-keys-file", default=None,
                   help="require API keys: one KEY[:TENANT[:TIERS[:GRANTS]]] per line "
                        "(docs/usage.md, API keys; also env CONTINUUM_API_KEYS)")
    p.add_argument("--ipc", default=None, help="executor channel (default: a temp ipc:// path)")
    add_device_arguments(p)  # the executor's own flags, passed on
    p.add_argument("--kv-cache-dtype", default="auto",
                   choices=("auto", "float32", "float16", "bfloat16"),
                   help="KV element type (auto: the model's); float16 halves the bytes per "
                        "token: twice the sequences in the same pool; logits move slightly, "
                        "so outputs are not token-exact against a float32 cache")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    p.add_argument("--swap-space-bytes", type=parse_bytes, default=0,
                   help="host (CPU) memory per executor rank for swapped-out KV, e.g. 4GiB, "
                        "in bytes like --kv-cache-bytes (vLLM's --swap-space is GiB); "
                        "0 (default): preempted sequences are always recomputed")
    _scheduler_arguments(p)
    p.add_argument("--threads", type=int, default=0, help="executor torch threads (0: all)")
    p.add_argument("--executor-nice", type=int, default=EXECUTOR_NICE,
                   help="the executor's lowered CPU share (nice 0-19, its session's "
                        "autogroup too), so the gateway and scheduler answer at once on a "
                        f"host the executor saturates (default {EXECUTOR_NICE}; 0: unchanged)")
    p.add_argument("--tp-size", type=int, default=1, help="tensor-parallel ranks")
    p.add_argument("--standby-executors", type=int, choices=(0, 1), default=None,
                   help="warm standby executors (loaded, idle) that take over on the next "
                        "step when the executor dies or hangs; each costs one more "
                        "executor's memory (default: 1 on a CPU-only host with 4+ cores)")
    restart_guard.add_arguments(p)
    p.add_argument("--grace-period", type=float, default=30.0,
                   help="on SIGTERM/Ctrl-C, seconds in-flight requests may finish in "
                        "(a second Ctrl-C stops at once)")
    edge = p.add_argument_group("gateway limits, switches and TLS (passed to the gateway)")
    edge_flags.add_flags(edge, pass_through=True)
    serve_tls.add_arguments(p)
    return p


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def _scheduler_arguments(p: argparse.ArgumentParser) -> None:
    """serve's flags that the supervisor passes on to the scheduler."""
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--chunk-size", type=int, default=512)
    p.add_argument("--max-num-waiting", type=int, default=None,
                   help="queue cap; beyond it requests get RESOURCE_EXHAUSTED / HTTP 429")
    p.add_argument("--max-num-waiting-per-tenant", type=int, default=None,
                   help="per-tenant queue cap")
    for tier in range(tiers.NUM_TIERS):  # dest: max_queue_time_<tier name>_s
        p.add_argument(f"--max-queue-time-{tiers.flag_word(tier)}-s", type=float, default=None,
                       help=f"refuse a {tiers.name(tier)} request (429) that would wait longer "
                            "than this for its first step, by measured throughput (0: no "
                            "bound; default: the scheduler's)")
    for tier in range(tiers.NUM_TIERS):
        p.add_argument(f"--tpot-target-{tiers.flag_word(tier)}-ms", type=float, default=None,
                       help=f"the chunked policy sizes each step's prompt work so a step "
                            f"holds this TPOT while {tiers.name(tier)} requests decode (a "
                            "step-time fit learned online; 0 or unset: the fixed --chunk-size)")
    p.add_argument("--max-step-failures", type=int, default=None,
                   help="failed steps after which a request (a poison request) ends with an "
                        "error, the last one run alone (default: the scheduler's, 2)")
    p.add_argument("--stream-interval", type=_positive_int, default=None,
                   help="tokens a stream gathers before it sends them (its first token and "
                        "its end go at once): fewer gRPC messages, so less scheduler time a "
                        "step with many streams, for burstier text (default 1: each token)")
    p.add_argument("--telemetry-dsn", default=None,
                   help="telemetry store: a SQLite path or postgresql://... (default: "
                        "$XDG_STATE_HOME/continuum/telemetry.sqlite; 'off' records nothing); "
                        "read it with `continuum report`")
    from scheduler_svc.core.policy import POLICIES
    p.add_argument("--policy", default="chunked", choices=tuple(POLICIES),
                   help="scheduling policy (benchmarks compare them): " + "; ".join(
                       f"{name}: {cls.summary}" for name, cls in POLICIES.items()))
    p.add_argument("--config-file", default=None,
                   help="scheduler config fields in TOML or JSON (wins over these flags); "
                        "re-read every 2 s and applied live (`continuum config history`)")


def _capacity_parser(sub) -> None:
    p = sub.add_parser("capacity", help="screen a declared scheduler contract against a workload")
    verbs = p.add_subparsers(dest="capacity_command", required=True)
    a = verbs.add_parser("audit", help="fluid screening model: utilization, queue delay, "
                                       "TTFT/TPOT floors, peak KV, and a decision "
                                       "(exit 0 within bound, 1 over, 2 bad input)")
    a.add_argument("contract", help="the contract (TOML or JSON), e.g. docs/capacity/contract.toml")
    a.add_argument("workload", help="per-class workload (TOML or JSON)")
    a.add_argument("--from-profile", default=None, metavar="PROFILE",
                   help="a batching contract's partitions from this machine's fitted executor "
                        "profile (python -m benchmarks.fit_profile) instead of the declared "
                        "ones")
    c = verbs.add_parser("content-id", help="a batching contract's content id, to bind a "
                                            "workload to it (contract_content_id)")
    c.add_argument("contract", help="the batching contract (TOML or JSON)")


def _generate_parser(sub) -> None:
    p = sub.add_parser("generate", help="stream an answer from a running server")
    p.add_argument("prompt", help="the user message (or raw text with --raw)")
    p.add_argument("--addr", default=f"127.0.0.1:{DEFAULT_PORT}", help="gateway host:port")
    p.add_argument("--system", default=None, help="system message (default: the model's)")
    p.add_argument("--raw", action="store_true", help="send the prompt without chat template")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds before giving up")


def _bench_parser(sub) -> None:
    from continuum.bench import __doc__ as doc
    from continuum.bench import add_arguments

    p = sub.add_parser("bench", help="load-test a running server (gRPC or OpenAI HTTP)",
                       description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)


def _ops_parsers(sub) -> None:
    """``report`` and ``gate``: read the telemetry store / bench results (docs/operations.md)."""
    from continuum import gate, report

    for name, module, helptext in (
            ("report", report, "latency per tier and tenant over a telemetry window"),
            ("gate", gate, "deploy gate: fail (exit 1) on a latency regression or unfairness")):
        p = sub.add_parser(name, help=helptext, description=module.__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        module.add_arguments(p)


def _config_parser(sub) -> None:
    from continuum import config_cli

    p = sub.add_parser("config", help="the scheduler's config: get, set live, history, rollback",
                       description=config_cli.__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    config_cli.add_arguments(p)


def build_parser() -> tuple[argparse.ArgumentParser, argparse.ArgumentParser]:
    """The ``continuum`` parser and its ``serve`` subparser."""
    parser = argparse.ArgumentParser(prog="continuum", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    serve = _serve_parser(sub)
    _generate_parser(sub)
    _capacity_parser(sub)
    _bench_parser(sub)
    _ops_parsers(sub)
    _config_parser(sub)
    return parser, serve


def main(argv: list[str] | None = None) -> None:
    parser, serve = build_parser()
    args = parser.parse_args(argv)
    if args.command == "serve":
        check_device_arguments(serve, args)
    try:
        if args.command == "bench":
            from continuum.bench import main as bench_main

            sys.exit(bench_main(args))
        if args.command in ("report", "gate"):
            from continuum import gate, report

            sys.exit((report if args.command == "report" else gate).main(args))
        if args.command == "config":
            from continuum.config_cli import main as config_main

            sys.exit(config_main(args))
        if args.command == "capacity":
            from continuum.capacity import main as capacity_main

            sys.exit(capacity_main(args))
        if args.command == "serve":
            from continuum.supervisor import ServeError, Supervisor

            try:
                sys.exit(Supervisor(args).run())
            except ServeError as exc:
                print(f"continuum: {exc}", file=sys.stderr)
                sys.exit(2)
        from continuum.client import generate

        sys.exit(generate(args))
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()
