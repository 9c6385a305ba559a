"""A cap on the gRPC calls the gateway serves at once, answered so a client can act on it
(docs/reliability.md, "Bounds no client can outlast").

HTTP/2's ``max_concurrent_streams`` bounds one connection only, and grpc's own
``maximum_concurrent_rpcs`` answers with no retry hint and counts health checks too, so a
full gateway would fail its probes. So two pools: every call but health (``max_rpcs``,
``--grpc-max-concurrent-rpcs``) and health (``MAX_HEALTH_RPCS``). A call past its pool's
cap ends RESOURCE_EXHAUSTED naming the flag, with the retry pushback trailers, before its
request is parsed; grpc's own cap at the sum is the backstop. One event loop runs every
handler, so the counts need no lock."""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable

import grpc

from gateway.edge.client_limits import RETRY_AFTER_MS
from protos import pushback

# Probes and load balancers open a handful of health calls each.
MAX_HEALTH_RPCS = 256

_MAKE = {
    "unary_unary": grpc.unary_unary_rpc_method_handler,
    "unary_stream": grpc.unary_stream_rpc_method_handler,
    "stream_unary": grpc.stream_unary_rpc_method_handler,
    "stream_stream": grpc.stream_stream_rpc_method_handler,
}


def _kind(handler) -> str:
    return next(k for k in _MAKE if getattr(handler, k) is not None)


def rebuild(handler, behavior) -> grpc.RpcMethodHandler:
    """``handler`` with ``behavior`` in place of its own, same kind and serializers."""
    return _MAKE[_kind(handler)](behavior, request_deserializer=handler.request_deserializer,
                                 response_serializer=handler.response_serializer)


class RpcLimit(grpc.aio.ServerInterceptor):
    """Counts the calls in flight per pool; refuses one past its pool's cap.
    ``on_refuse``: called with the status name of each refused call but health."""

    def __init__(self, max_rpcs: int, health_prefix: str,
                 max_health_rpcs: int = MAX_HEALTH_RPCS,
                 on_refuse: Callable[[str], None] | None = None) -> None:
        self._health_prefix = health_prefix
        self.on_refuse = on_refuse
        self._caps = {False: max_rpcs, True: max_health_rpcs}
        self.active = {False: 0, True: 0}  # health? -> calls in flight

    @property
    def total(self) -> int:
        """Both caps: grpc's own backstop cap for the server."""
        return self._caps[False] + self._caps[True]

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None:  # UNIMPLEMENTED: grpc answers at once
            return None
        health = details.method.startswith(self._health_prefix)
        kind = _kind(handler)
        if self.active[health] >= self._caps[health]:  # before the request is parsed
            return _MAKE[kind](self._refusal(health))
        behavior = getattr(handler, kind)
        return rebuild(handler, (self._counted_stream if inspect.isasyncgenfunction(behavior)
                                 else self._counted_call)(behavior, health))

    def _refusal(self, health: bool):
        async def refuse(request_or_iterator, context):
            await self._abort(context, health)
        return refuse

    async def _abort(self, context, health: bool) -> None:
        if self.on_refuse is not None and not health:  # requests only
            self.on_refuse(grpc.StatusCode.RESOURCE_EXHAUSTED.name)
        what = "health calls" if health else "calls (--grpc-max-concurrent-rpcs)"
        await context.abort(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"the gateway is serving its limit of {self._caps[health]} concurrent {what}; "
            f"retry in {RETRY_AFTER_MS} ms (trailing metadata {pushback.PUSHBACK_KEY})",
            pushback.trailers(RETRY_AFTER_MS))

    def _enter(self, health: bool) -> bool:
        # Checked again here: calls admitted by intercept_service in the same loop turn
        # start one by one, so the cap holds exactly.
        if self.active[health] >= self._caps[health]:
            return False
        self.active[health] += 1
        return True

    def _counted_call(self, behavior, health: bool):
        async def call(request_or_iterator, context):
            if not self._enter(health):
                await self._abort(context, health)
            try:
                return await behavior(request_or_iterator, context)
            finally:
                self.active[health] -= 1
        return call

    def _counted_stream(self, behavior, health: bool):
        async def stream(request_or_iterator, context):
            if not self._enter(health):
                await self._abort(context, health)
            try:
                async with contextlib.aclosing(behavior(request_or_iterator, context)) as it:
                    async for response in it:
                        yield response
            finally:
                self.active[health] -= 1
        return stream
