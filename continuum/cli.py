"""The ``continuum`` command: ``serve`` a model, ``generate`` from a running server."""

from __future__ import annotations

import argparse
import sys

from continuum.serve.config import add_flags

DEFAULT_PORT = 50051


def _serve_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("serve", help="start gateway, scheduler and executor",
                       usage="continuum serve [flags]",
                       description="Serve a model (default: the bundled SmolLM2-135M-Instruct): "
                                   "gRPC on 127.0.0.1:50051, OpenAI's HTTP API on :8000. "
                                   "Every flag of the three services, grouped by service.")
    add_flags(p)
    return p


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
    from continuum.bench.run import __doc__ as doc
    from continuum.bench.run import add_arguments

    p = sub.add_parser("bench", help="load-test a running server (gRPC or OpenAI HTTP)",
                       description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)


def _ops_parsers(sub) -> None:
    """``report`` and ``gate``: read the telemetry store / bench results (docs/operations.md)."""
    from continuum.ops import gate, report

    for name, module, helptext in (
            ("report", report, "latency per tier and tenant over a telemetry window"),
            ("gate", gate, "deploy gate: fail (exit 1) on a latency regression or unfairness")):
        p = sub.add_parser(name, help=helptext, description=module.__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        module.add_arguments(p)


def _config_parser(sub) -> None:
    from continuum.ops import config_cli

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
    parser, _ = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.command == "bench":
            from continuum.bench.run import main as bench_main

            sys.exit(bench_main(args))
        if args.command in ("report", "gate"):
            from continuum.ops import gate, report

            sys.exit((report if args.command == "report" else gate).main(args))
        if args.command == "config":
            from continuum.ops.config_cli import main as config_main

            sys.exit(config_main(args))
        if args.command == "capacity":
            from continuum.capacity.audit import main as capacity_main

            sys.exit(capacity_main(args))
        if args.command == "serve":
            from continuum.serve.supervisor import ServeError, Supervisor

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
