"""The client-facing gRPC server: `Generation.Generate`, health and reflection.

Each Generate call is validated, submitted to the scheduler as one
`Scheduler.Submit` server stream, and relayed back event by event. The upstream
call is cancelled in a `finally` whenever the client's call ends early (client
gone, deadline passed, stop string matched), so the scheduler frees the
request's KV blocks by its next step.
"""

from __future__ import annotations

import asyncio
import errno
import socket
import time
from dataclasses import dataclass

import grpc
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from gateway.config import GatewayConfig
from gateway.output_stream import OutputStream
from gateway.replicas import Replica, ReplicaSet
from gateway.tokenizer import Tokenizer
from gateway.upstream import ClientStatus, client_status
from gateway.validation import (
    RequestError,
    UndecodableRequest,
    ValidatedRequest,
    parse_request,
    validate,
)
from protos.continuum.v1 import (
    generation_pb2,
    generation_pb2_grpc,
    sampling_pb2,
    scheduler_pb2,
)

_log = structlog.get_logger("gateway")
GENERATION_SERVICE = generation_pb2.DESCRIPTOR.services_by_name["Generation"].full_name
# grpc reports "no deadline" as an enormous time remaining; do not forward that upstream.
_NO_DEADLINE_S = 10**7


class BindError(Exception):
    """The listening address could not be bound; the message names the fix."""


def _upstream_timeout(context: grpc.aio.ServicerContext) -> float | None:
    remaining = context.time_remaining()
    if remaining is None or remaining > _NO_DEADLINE_S:
        return None
    return max(remaining, 0.0)


# Upstream failures that mean "this replica cannot go on", not "this request
# is wrong": the request continues on another replica.
_REPLICA_FAILURES = frozenset({
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.CANCELLED,
    grpc.StatusCode.UNKNOWN,
    grpc.StatusCode.INTERNAL,
    grpc.StatusCode.UNIMPLEMENTED,
})


class _EndedEarly(Exception):
    """The upstream stream ended without a finish reason (the replica went away)."""


def continuation(request: ValidatedRequest, output: OutputStream) -> scheduler_pb2.SubmitRequest:
    """What to submit so generation resumes right after the tokens already
    streamed: prompt + those tokens, the remaining max_tokens. Seeded sampling
    is keyed by position, so the continuation draws what the lost replica would."""
    submit = request.to_submit()
    done = output.token_ids
    if done:
        submit.prompt_token_ids.extend(done)
        submit.max_tokens -= len(done)
        submit.num_resumed_output_tokens = len(done)
    return submit


class GenerationServicer(generation_pb2_grpc.GenerationServicer):
    """Serves Generate for one model by relaying to scheduler replicas."""

    def __init__(self, tokenizer: Tokenizer, model_name: str, replicas: ReplicaSet):
        self._tokenizer = tokenizer
        self._model_name = model_name
        self._replicas = replicas

    async def Generate(self, request, context: grpc.aio.ServicerContext) -> None:
        validated = await self._validate_or_abort(request, context)
        log = _log.bind(request_id=validated.request_id)
        log.info(
            "request accepted",
            tenant=validated.tenant,
            priority_tier=validated.priority_tier,
            prompt_tokens=len(validated.prompt_token_ids),
            max_tokens=validated.max_tokens,
        )
        await self._relay(validated, context, log)

    async def _validate_or_abort(
        self, request: generation_pb2.GenerateRequest | UndecodableRequest, context
    ) -> ValidatedRequest:
        try:
            # Tokenizing a long prompt takes milliseconds; keep the event loop streaming.
            return await asyncio.to_thread(validate, request, self._tokenizer, self._model_name)
        except RequestError as exc:
            _log.info(
                "request rejected",
                request_id=getattr(request, "request_id", ""),
                code=exc.code.name,
                reason=exc.message,
            )
            await context.abort(exc.code, exc.message)  # raises: ends the call
            raise AssertionError("unreachable") from exc

    async def _relay(
        self,
        request: ValidatedRequest,
        context: grpc.aio.ServicerContext,
        log: structlog.typing.FilteringBoundLogger,
    ) -> None:
        started = time.monotonic()
        output = OutputStream(request, self._tokenizer)
        tried: set[str] = set()
        failure = ClientStatus(grpc.StatusCode.UNAVAILABLE,
                               f"no scheduler replica at {self._replicas.addresses}")
        while not output.finished:
            replica = self._replicas.pick(tried)
            if replica is None:  # every replica failed: say how the last one did
                await context.abort(failure.code, failure.message, failure.trailing_metadata)
            tried.add(replica.address)
            submit = continuation(request, output)
            if submit.max_tokens <= 0:  # the replica died between the last token and its end
                await context.write(output.on_event(scheduler_pb2.TokenEvent(
                    finish_reason=sampling_pb2.FINISH_REASON_LENGTH)))
                break
            try:
                await self._stream(replica, submit, output, context)
            except grpc.aio.AioRpcError as exc:
                if exc.code() not in _REPLICA_FAILURES:
                    status = client_status(exc, replica.address)
                    log.warning("upstream failed", code=exc.code().name, details=exc.details())
                    await context.abort(status.code, status.message, status.trailing_metadata)
                failure = client_status(exc, replica.address)
                log.warning("replica failed; continuing elsewhere", replica=replica.address,
                            code=exc.code().name, streamed=len(output.token_ids))
            except _EndedEarly:
                failure = ClientStatus(grpc.StatusCode.UNAVAILABLE, f"the scheduler at "
                                       f"{replica.address} ended the stream without finishing")
                log.warning("replica ended the stream early; continuing elsewhere",
                            replica=replica.address, streamed=len(output.token_ids))
        log.info(
            "request finished",
            finish_reason=sampling_pb2.FinishReason.Name(output.finish_reason),
            stop_string=output.stopped_by_string,
            completion_tokens=output.num_generated_tokens,
            replicas=len(tried),
            elapsed_s=round(time.monotonic() - started, 4),
        )

    async def _stream(self, replica: Replica, submit: scheduler_pb2.SubmitRequest,
                      output: OutputStream, context: grpc.aio.ServicerContext) -> None:
        """Relays one upstream Submit stream; raises on failure."""
        call = replica.stub.Submit(submit, timeout=_upstream_timeout(context))
        try:
            async for event in call:
                await context.write(output.on_event(event))
                if output.finished:
                    return
        except asyncio.CancelledError:
            # The client left, its deadline passed, or shutdown's grace ran out.
            _log.info("call cancelled; cancelling upstream", request_id=submit.request_id)
            raise
        finally:
            # Idempotent after a normal finish; essential on every early exit.
            call.cancel()
        raise _EndedEarly


def _probe_bind(host: str, port: int) -> None:
    """Raises BindError if (host, port) cannot be listened on.

    Probing with a plain socket first gives a precise reason and keeps grpc's
    own multi-line bind error off stderr. SO_REUSEADDR matches grpc, so sockets
    left in TIME_WAIT by a previous run do not count as "in use".
    """
    try:
        addresses = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise BindError(f"cannot listen on {host}:{port}: {exc.strerror}; pass --host") from exc
    for family, kind, proto, _, sockaddr in addresses:
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(sockaddr)
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    raise BindError(f"port {port} is already in use; pass --port") from exc
                raise BindError(f"cannot listen on {host}:{port}: {exc.strerror}") from exc


def _bind(server: grpc.aio.Server, host: str, port: int) -> int:
    if port != 0:
        _probe_bind(host, port)
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        bound = server.add_insecure_port(address)
    except RuntimeError as exc:  # lost a race for the port since the probe
        raise BindError(f"cannot listen on {address}; is port {port} in use? pass --port") from exc
    if bound == 0:
        raise BindError(f"cannot listen on {address}; is port {port} in use? pass --port")
    return bound


def _generation_handler(servicer: GenerationServicer) -> grpc.GenericRpcHandler:
    """Like the generated add_GenerationServicer_to_server, but with a deserializer that
    lets undecodable requests reach validation (INVALID_ARGUMENT, not UNKNOWN)."""
    generate = grpc.unary_stream_rpc_method_handler(
        servicer.Generate,
        request_deserializer=parse_request,
        response_serializer=generation_pb2.GenerateResponse.SerializeToString,
    )
    return grpc.method_handlers_generic_handler(GENERATION_SERVICE, {"Generate": generate})


@dataclass
class RunningGateway:
    """A started gateway; `stop()` drains it (health first, then calls, then upstream)."""

    server: grpc.aio.Server
    health: health.aio.HealthServicer
    replicas: ReplicaSet
    port: int

    async def stop(self, grace_s: float) -> None:
        await self.health.enter_graceful_shutdown()
        # New calls are refused from here on; in-flight ones get grace_s to finish.
        await self.server.stop(grace_s)
        await self.replicas.close()


async def start_gateway(config: GatewayConfig, tokenizer: Tokenizer) -> RunningGateway:
    """Binds, starts serving and marks health SERVING; raises BindError."""
    # SO_REUSEPORT (grpc's default on Linux) would let a second gateway bind a
    # port that is already in use and silently share its traffic.
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    port = _bind(server, config.host, config.port)
    replicas = ReplicaSet(config.scheduler_addresses)
    servicer = GenerationServicer(tokenizer, config.model_name, replicas)
    server.add_generic_rpc_handlers((_generation_handler(servicer),))
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (GENERATION_SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME), server
    )
    await server.start()
    replicas.start()
    for service in ("", GENERATION_SERVICE):
        await health_servicer.set(service, health_pb2.HealthCheckResponse.SERVING)
    return RunningGateway(server, health_servicer, replicas, port)
