"""Kubernetes exec probes for the replica pod, with progress semantics.

    python deploy/probe.py scheduler [--address 127.0.0.1:50061]
        0 when the scheduler's gRPC health answers at all, SERVING or NOT_SERVING:
        its event loop runs. (The kubelet's own grpc probe fails on NOT_SERVING,
        which the scheduler reports while it has work and no executor: a liveness
        probe on that would restart the replica that is waiting to resume its work.)
    python deploy/probe.py executor [--address ...] [--unreachable-ok] [--incarnation-file F]
        0 when the scheduler reports an executor attached (Stats.executor_ready); with
        ``--incarnation-file`` (the executor's own flag, set in a pod with a warm standby),
        only when the scheduler holds THAT executor in service or as its standby.
        The executor serves no port; the scheduler is what watches its progress: it
        detaches an executor that misses a heartbeat (5 s idle) or a step deadline
        (scheduler_svc/loop.py), so a hung executor fails this probe within seconds
        and the kubelet restarts that container alone. ``--unreachable-ok`` (liveness):
        a scheduler that does not answer is the scheduler's own probe's business, not
        a reason to restart a healthy executor.

Exit 1 with one line on stdout (the kubelet shows it in the pod's events) otherwise.
The Stats call carries the internal secret (runtime/internal_auth.py), read from the
environment the container already has.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # the image's sources

import grpc  # noqa: E402
from grpc_health.v1 import health_pb2, health_pb2_grpc  # noqa: E402

from protos.continuum.v1 import scheduler_pb2, scheduler_pb2_grpc  # noqa: E402
from runtime import internal_auth  # noqa: E402

DEFAULT_ADDRESS = "127.0.0.1:50061"  # scheduler_svc's --scheduler-port default, inside the pod
DEFAULT_TIMEOUT_S = 3.0  # below the manifests' timeoutSeconds (5), so we answer first


def check_scheduler(channel: grpc.Channel, timeout_s: float) -> tuple[bool, str]:
    stub = health_pb2_grpc.HealthStub(channel)
    try:
        reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=timeout_s)
    except grpc.RpcError as exc:
        return False, f"scheduler does not answer its health check: {exc.code().name}"
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    return True, f"scheduler answers ({status})"


def own_incarnation(path: str) -> tuple[str | None, str]:
    """(the incarnation in ``path``, or None and why not)."""
    try:
        incarnation = pathlib.Path(path).read_text().strip()
    except FileNotFoundError:
        return None, (f"this executor has said no Hello yet ({path} absent: loading, or "
                      "it stopped)")
    except OSError as exc:
        return None, f"cannot read {path}: {exc}"
    return (incarnation, "") if incarnation else (None, f"{path} is empty")


def check_executor(channel: grpc.Channel, timeout_s: float, unreachable_ok: bool,
                   incarnation_file: str | None = None) -> tuple[bool, str]:
    secret = internal_auth.load_secret()
    metadata = internal_auth.metadata(secret) if secret is not None else None
    stub = scheduler_pb2_grpc.SchedulerStub(channel)
    try:
        stats = stub.Stats(scheduler_pb2.StatsRequest(), timeout=timeout_s, metadata=metadata)
    except grpc.RpcError as exc:
        why = f"scheduler does not answer Stats: {exc.code().name}"
        return unreachable_ok, why + ("; not the executor's fault" if unreachable_ok else "")
    if incarnation_file is not None:
        return _this_executor(stats, incarnation_file)
    if not stats.executor_ready:
        return False, ("no executor attached to the scheduler (starting, or detached after "
                       f"a missed heartbeat or step deadline; {stats.num_executor_losses} "
                       "lost so far)")
    return True, f"executor {stats.executor_incarnation} attached"


def _this_executor(stats, incarnation_file: str) -> tuple[bool, str]:
    """With a warm standby in the pod, "an executor is attached" is true while one of the
    two hangs: each probes for its own incarnation, in service or as the standby."""
    mine, why = own_incarnation(incarnation_file)
    if mine is None:
        return False, why
    if mine == stats.executor_incarnation:
        return True, f"executor {mine} in service"
    if mine == stats.standby_executor_incarnation:
        return True, f"executor {mine} is the warm standby"
    return False, (f"the scheduler holds this executor ({mine}) neither in service (that is "
                   f"{stats.executor_incarnation or 'none'}) nor as its standby (detached "
                   "after a missed heartbeat or step deadline, or its Hello was refused; "
                   f"{stats.num_executor_losses} lost so far)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="probe.py", description=__doc__.split("\n")[0])
    parser.add_argument("target", choices=("scheduler", "executor"))
    parser.add_argument("--address", default=DEFAULT_ADDRESS, help="the scheduler's gRPC port")
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, help="seconds")
    parser.add_argument("--unreachable-ok", action="store_true",
                        help="executor: pass when the scheduler itself does not answer")
    parser.add_argument("--incarnation-file", default=None,
                        help="executor: pass only when the scheduler holds the executor that "
                             "writes this file (its --incarnation-file) in service or as its "
                             "standby")
    args = parser.parse_args(argv)
    try:
        with grpc.insecure_channel(args.address) as channel:
            if args.target == "scheduler":
                ok, why = check_scheduler(channel, args.timeout)
            else:
                ok, why = check_executor(channel, args.timeout, args.unreachable_ok,
                                         args.incarnation_file)
    except internal_auth.SecretError as exc:
        ok, why = False, f"no usable internal secret: {exc}"
    print(why)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
