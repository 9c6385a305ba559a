"""``continuum config get|set|history|rollback``: the scheduler's config, live.

Talks to one scheduler replica's admin service (``continuum.v1.SchedulerAdmin``)
with the deployment's internal secret from the environment, as gateways do
(CONTINUUM_INTERNAL_SECRET or CONTINUUM_INTERNAL_SECRET_FILE), or, without one, the
secret a ``continuum serve`` of the same user generated for that scheduler port
(continuum/serve/local_state.py: so it works against ``make run`` as is). A change is
validated by the scheduler with the same rules as at start, applied between two
steps, and recorded as a new version with its author and reason.

  continuum config get
  continuum config set max_num_seqs=96 chunk_size=256 --reason "peak traffic"
  continuum config history --format json
  continuum config rollback 3
  continuum config snapshot-blocks --format json

Exit status: 0 done; 1 the scheduler refused the change (its reason is printed);
2 a usage error, or the scheduler could not be reached or refused the secret.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys

import grpc

from continuum.serve import local_state
from protos.continuum.v1 import scheduler_pb2 as pb
from protos.continuum.v1 import scheduler_pb2_grpc
from runtime import internal_auth

DEFAULT_SCHEDULER = "127.0.0.1:50061"
REFUSED = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION,
           grpc.StatusCode.NOT_FOUND)


class UsageError(Exception):
    pass


def add_arguments(p: argparse.ArgumentParser) -> None:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--scheduler", default=DEFAULT_SCHEDULER,
                        help=f"the scheduler's HOST:PORT (default {DEFAULT_SCHEDULER})")
    common.add_argument("--timeout", type=float, default=10.0, help="seconds per call")
    verbs = p.add_subparsers(dest="config_command", required=True)
    g = verbs.add_parser("get", parents=[common], help="the config in force and its version")
    g.add_argument("--format", choices=("table", "json"), default="table")
    s = verbs.add_parser("set", parents=[common], help="change fields: FIELD=VALUE ...")
    s.add_argument("assignments", nargs="+", metavar="FIELD=VALUE")
    s.add_argument("--reason", default="", help="why (recorded with the version)")
    s.add_argument("--author", default="cli", help="who (recorded; default: cli)")
    h = verbs.add_parser("history", parents=[common], help="every version, oldest first")
    h.add_argument("--format", choices=("table", "json"), default="table")
    r = verbs.add_parser("rollback", parents=[common],
                         help="make an earlier version's values current (a new version)")
    r.add_argument("version", type=int)
    r.add_argument("--author", default="cli", help="who (recorded; default: cli)")
    b = verbs.add_parser("snapshot-blocks", parents=[common],
                         help="block tables of the running and swapped sequences, now "
                              "(also written to the telemetry store), for fragmentation")
    b.add_argument("--format", choices=("table", "json"), default="table")


def parse_assignments(items: list[str]) -> dict[str, str]:
    values = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not name.strip():
            raise UsageError(f"expected FIELD=VALUE (e.g. max_num_seqs=96), got {item!r}")
        values[name.strip()] = value.strip()
    return values


def _when(t: float) -> str:
    return datetime.datetime.fromtimestamp(t, datetime.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def version_dict(v: pb.ConfigVersion) -> dict:
    return {"version": v.version, "author": v.author, "set_at": v.set_at,
            "reason": v.reason, "values": dict(sorted(v.values.items()))}


def print_version(v: pb.ConfigVersion, fmt: str = "table") -> None:
    if fmt == "json":
        print(json.dumps(version_dict(v), indent=2))
        return
    print(f"version {v.version}, set {_when(v.set_at)} by {v.author}: {v.reason}")
    width = max(map(len, v.values), default=0)
    for name, value in sorted(v.values.items()):
        print(f"  {name:<{width}}  {value}")


def print_history(versions, fmt: str) -> None:
    if fmt == "json":
        print(json.dumps([version_dict(v) for v in versions], indent=2))
        return
    print(f"{'version':>7}  {'set at':<23}  {'author':<12}  changes / reason")
    previous: dict[str, str] = {}
    for v in versions:
        changes = ", ".join(f"{k} {previous[k]}->{val}" for k, val in sorted(v.values.items())
                            if k in previous and previous[k] != val)
        detail = "; ".join(x for x in (changes, v.reason) if x)
        print(f"{v.version:>7}  {_when(v.set_at):<23}  {v.author:<12}  {detail}")
        previous = dict(v.values)


def print_blocks(snap: pb.SnapshotBlockTablesResponse, fmt: str) -> None:
    tables = [{"tenant": t.tenant, "request_id": t.request_id, "is_swapped": t.is_swapped,
               "block_ids": list(t.block_ids)} for t in snap.tables]
    if fmt == "json":
        print(json.dumps({"snapshot_id": snap.snapshot_id, "taken_at": snap.taken_at,
                          "num_total_blocks": snap.num_total_blocks,
                          "num_free_blocks": snap.num_free_blocks, "tables": tables},
                         indent=2))
        return
    print(f"snapshot {snap.snapshot_id} at {_when(snap.taken_at)}: {len(tables)} sequences, "
          f"{snap.num_free_blocks} of {snap.num_total_blocks} device blocks free")
    for t in tables:
        where = "host" if t["is_swapped"] else "device"
        print(f"  {t['tenant']}/{t['request_id']} ({where}): "
              f"{' '.join(map(str, t['block_ids']))}")


def run(args: argparse.Namespace, stub) -> int:
    kw = {"timeout": args.timeout, "metadata": args.metadata}
    cmd = args.config_command
    if cmd == "get":
        print_version(stub.GetConfig(pb.GetConfigRequest(), **kw), args.format)
    elif cmd == "history":
        print_history(stub.ConfigHistory(pb.ConfigHistoryRequest(), **kw).versions,
                      args.format)
    elif cmd == "set":
        values = parse_assignments(args.assignments)
        before = stub.GetConfig(pb.GetConfigRequest(), **kw).version
        v = stub.SetConfig(pb.SetConfigRequest(values=values, author=args.author,
                                               reason=args.reason), **kw)
        if v.version == before:
            print(f"unchanged: version {v.version} already has these values")
        else:
            print(f"version {v.version}: " + ", ".join(f"{k}={v.values[k]}" for k in values))
    elif cmd == "snapshot-blocks":
        print_blocks(stub.SnapshotBlockTables(pb.SnapshotBlockTablesRequest(), **kw),
                     args.format)
    else:
        v = stub.Rollback(pb.RollbackRequest(version=args.version, author=args.author), **kw)
        print(f"version {v.version}: {v.reason}")
    return 0


def _secret(scheduler: str) -> bytes | None:
    """The deployment's secret from the environment; without one, the secret a
    ``continuum serve`` of this user generated for the scheduler on that port
    (continuum/serve/local_state.py)."""
    try:
        return internal_auth.load_secret()
    except internal_auth.SecretError:
        _, _, port = scheduler.rpartition(":")
        path = local_state.secret_file(int(port)) if port.isdigit() else None
        if path is None or not path.is_file():
            raise
        return internal_auth.load_secret({internal_auth.ENV_SECRET_FILE: str(path)})


def main(args: argparse.Namespace) -> int:
    try:
        args.metadata = internal_auth.metadata(_secret(args.scheduler))
        if args.config_command == "set":
            parse_assignments(args.assignments)  # before any call
        with grpc.insecure_channel(args.scheduler) as channel:
            return run(args, scheduler_pb2_grpc.SchedulerAdminStub(channel))
    except (internal_auth.SecretError, UsageError) as exc:
        print(f"continuum config: {exc}", file=sys.stderr)
        return 2
    except grpc.RpcError as exc:
        code, details = exc.code(), exc.details()
        if code in REFUSED:
            print(f"continuum config: refused: {details}", file=sys.stderr)
            return 1
        if code == grpc.StatusCode.UNIMPLEMENTED:
            details = "it has no admin service (an older scheduler?)"
        what = ("refused the call" if code == grpc.StatusCode.UNAUTHENTICATED
                else "did not answer")
        print(f"continuum config: the scheduler at {args.scheduler} {what} "
              f"({code.name}): {details}", file=sys.stderr)
        return 2
