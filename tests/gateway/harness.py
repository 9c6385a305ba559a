"""A real grpc.aio gateway on loopback, and a scripted fake scheduler behind it."""

from __future__ import annotations

import asyncio
import contextlib
import pathlib
from dataclasses import dataclass, field

import grpc

from continuum.serve.procs import free_port  # noqa: F401 (the tests take it from here)
from gateway.app import start_gateway
from gateway.config import GatewayConfig
from protos.continuum.v1 import generation_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc

MODEL_NAME = "smollm2"


def run(coro, timeout_s: float = 30.0):
    """Runs one async scenario; a hang fails the test instead of stalling the suite."""
    return asyncio.run(asyncio.wait_for(coro, timeout_s))


@dataclass
class FakeScheduler(scheduler_pb2_grpc.SchedulerServicer):
    """Serves SubmitMany: each stream sends `events` (one per `delay_s`), or fails with
    `error` (code, details, trailers) after them, as a StreamError.

    Records what was submitted and whether the gateway cancelled a stream.
    """

    events: list[scheduler_pb2.TokenEvent] = field(default_factory=list)
    delay_s: float = 0.0
    error: tuple[grpc.StatusCode, str, tuple] | None = None
    submitted: list[scheduler_pb2.SubmitRequest] = field(default_factory=list)
    cancelled: asyncio.Event = field(default_factory=asyncio.Event)
    completed: asyncio.Event = field(default_factory=asyncio.Event)
    num_many_calls: int = 0

    async def stream(self, request):
        """One stream's events; raises Aborted (code, details, trailers) to end it so.
        (Subclasses script other streams; a cancel is recorded for them.)"""
        self.submitted.append(request)
        for event in self.events:
            await asyncio.sleep(self.delay_s)
            yield event
        if self.error is not None:
            raise Aborted(*self.error)
        self.completed.set()

    async def SubmitMany(self, request_iterator, context):
        self.num_many_calls += 1
        out: asyncio.Queue = asyncio.Queue()
        streams: dict[int, asyncio.Task] = {}

        async def one(stream_id: int, request) -> None:
            try:
                async with contextlib.aclosing(self.stream(request)) as events:
                    async for event in events:
                        out.put_nowait(scheduler_pb2.StreamEvent(stream_id=stream_id,
                                                                 event=event))
                        await asyncio.sleep(0)  # a fake that never awaits must not hog the loop
            except asyncio.CancelledError:  # the gateway cancelled it, or the call ended
                self.cancelled.set()
                raise
            except Aborted as end:
                code, details, trailing = end.args
                out.put_nowait(scheduler_pb2.StreamEvent(stream_id=stream_id, error=(
                    scheduler_pb2.StreamError(code=code.value[0], message=details,
                                              trailers=dict(trailing)))))

        async def read() -> None:
            async for message in request_iterator:
                if message.WhichOneof("action") == "submit":
                    streams[message.stream_id] = asyncio.create_task(
                        one(message.stream_id, message.submit))
                elif message.stream_id in streams:
                    streams.pop(message.stream_id).cancel()

        reader = asyncio.create_task(read())
        try:
            while True:
                yield scheduler_pb2.SubmitManyResponse(events=[await out.get()])
        finally:
            reader.cancel()
            for task in streams.values():
                task.cancel()

    async def Stats(self, request, context):
        # Healthy with an idle pool, so the gateway routes here and /health says serving.
        return scheduler_pb2.StatsResponse(executor_ready=True, num_total_blocks=64,
                                           num_free_blocks=64, num_running_by_tier=[0, 1, 0],
                                           submit_many=True)


class Aborted(Exception):
    """Ends a fake stream with a StreamError: (code, details, trailing metadata)."""


@contextlib.asynccontextmanager
async def fake_scheduler(scheduler: FakeScheduler):
    server = grpc.aio.server()
    scheduler_pb2_grpc.add_SchedulerServicer_to_server(scheduler, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await server.stop(0)


@contextlib.asynccontextmanager
async def gateway(tokenizer, scheduler_address: str, keys=None, **config):
    """Yields (running gateway, channel to it); `http_port=0` also serves HTTP."""
    settings = GatewayConfig(model_dir=pathlib.Path("unused"),
                             scheduler_address=scheduler_address, port=0,
                             model_name=MODEL_NAME, **{"http_port": -1, **config})
    running = await start_gateway(settings, tokenizer, keys)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{running.port}")
    try:
        yield running, channel
    finally:
        await channel.close()
        await running.stop(0)


def generation_stub(channel) -> generation_pb2_grpc.GenerationStub:
    return generation_pb2_grpc.GenerationStub(channel)


async def collect(call) -> list:
    return [response async for response in call]


@contextlib.asynccontextmanager
async def gateway_with_fake(tokenizer, scheduler: FakeScheduler):
    """A gateway in front of `scheduler`; yields (running gateway, channel to it)."""
    async with fake_scheduler(scheduler) as address, gateway(tokenizer, address) as pair:
        yield pair


async def polled(running) -> None:
    """Returns once every replica of the gateway has answered a Stats poll."""
    for replica in running.replicas.replicas:
        while replica.stats is None:
            await asyncio.sleep(0.01)
