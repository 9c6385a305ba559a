"""What streaming a step's tokens to the gateway costs the scheduler's event loop
(docs/benchmarks.md).

The scheduler's own SubmitMany code (``ManyCall`` on a stand-in loop) serves N streams on
one call to a real gRPC client in another process that reads them through the gateway's
multiplexer (gateway/routing/mux.py); per step, one event into each stream's sink and the
loop turn that writes them, timed. ``--behind K``: K events a stream a step (streams that
fell behind); ``--interval N``: as ``--stream-interval N``.

    .venv/bin/python -m benchmarks.bench_stream_fanout [--streams 64 256 1024] [--steps 300]
        [--behind 1] [--interval 1]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import statistics
import time
import types

import grpc

from gateway.routing.mux import Mux
from protos.continuum.v1 import scheduler_pb2, scheduler_pb2_grpc
from scheduler_svc import streams as scheduler_streams
from sim.metrics import percentile


async def _read_to_end(stream, cpu: list[float]) -> None:
    """Reads ``stream`` (a gateway SchedulerStream) as the relay does, to its finish or
    its end; ``cpu`` gets the process's CPU time at its first message."""
    first = True
    while True:
        item = await stream.read()
        if first:
            first = False
            cpu.append(time.process_time())
        if not isinstance(item, scheduler_pb2.TokenEvent) or item.finish_reason:
            return


def _drain(port: int, streams: int, out) -> None:
    """The gateway's side: ``streams`` streams of the gateway's SubmitMany multiplexer,
    each read to its end; puts the process's CPU seconds from the first message to the
    end on ``out``."""

    async def run() -> float:
        cpu: list[float] = []
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            mux = Mux(scheduler_pb2_grpc.SchedulerStub(channel))
            calls = [mux.submit(scheduler_pb2.SubmitRequest(request_id=str(i)), None)
                     for i in range(streams)]
            await asyncio.gather(*(_read_to_end(call, cpu) for call in calls))
            used = time.process_time() - min(cpu)
            await mux.close()
        return used

    out.put(asyncio.run(run()))


async def _one_turn(sinks, step: int, behind: int, req) -> float:
    """One step's events (``behind`` of them) into every sink, then the loop turn that
    writes them, in ms."""
    started = time.perf_counter()
    for sink in sinks:
        for _ in range(behind):
            sink.put_nowait((req, step, None, None))
    await asyncio.sleep(0)
    return (time.perf_counter() - started) * 1e3


def _client(port: int, streams: int):
    """The gateway's process (spawned, not forked: this process runs gRPC) and where it
    puts its CPU time."""
    context = multiprocessing.get_context("spawn")
    out = context.Queue()
    client = context.Process(target=_drain, args=(port, streams, out))
    client.start()
    return client, out


class _Many(scheduler_pb2_grpc.SchedulerServicer):
    """SubmitMany's own code on a stand-in loop: ``streams`` streams opened on the call
    (``ManyCall.opened``, as a submit of each would), each step's events into their
    sinks, what ``ManyCall.take`` gathers written in one response."""

    def __init__(self, streams: int, interval: int) -> None:
        config = types.SimpleNamespace(stream_interval=interval)
        self.loop = types.SimpleNamespace(core=types.SimpleNamespace(config=config),
                                          abort=lambda key: False, recorder=None,
                                          histograms=types.SimpleNamespace(
                                              request_ended=lambda *a: None))
        self.call = scheduler_streams.ManyCall(self.loop)
        req = self.req = types.SimpleNamespace(
            request_id="r", num_prompt_tokens=8, num_output_tokens=1,
            first_scheduled_time=None, arrival_time=0.0, error="")
        self.sinks = [self.call.opened(i, req) for i in range(1, streams + 1)]
        self.started = asyncio.Event()
        self.writing = False
        self.messages = 0  # stream messages

    async def SubmitMany(self, request_iterator, context):  # noqa: N802
        self.started.set()
        async for response in scheduler_streams.respond(self.call,
                                                        _opened_here(request_iterator)):
            self.writing = True
            # Counted before the write: once it has the last (the streams' ends) the
            # gateway closes the call, and this may never resume.
            self.messages += len(response.events)
            yield response
            self.writing = False

    def settled(self) -> bool:
        """Every stream's events taken and written (or held back)."""
        return not self.writing and not self.call.ready


async def _opened_here(request_iterator):
    """The gateway's messages, read and dropped: the streams they open (ids 1..N, as the
    multiplexer numbers them) are the ones ``_Many`` opened already."""
    async for _ in request_iterator:
        pass
    return
    yield


async def many_fanout(streams: int, steps: int, behind: int = 1,
                      interval: int = 1) -> tuple[list[float], int, float]:
    """Serves ``_Many`` to the gateway's process; once its call is open, each step's
    events into the sinks and the loop turn that writes them, until every write is done;
    then each stream's end. Each step's time in ms, the stream messages in all, the
    gateway's CPU seconds."""
    servicer = _Many(streams, interval)
    server = grpc.aio.server()
    scheduler_pb2_grpc.add_SchedulerServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    client, out = _client(port, streams)
    try:
        deadline = time.monotonic() + 60
        while not servicer.started.is_set():
            if time.monotonic() > deadline or not client.is_alive():
                raise RuntimeError(f"the client did not open its {streams} streams")
            await asyncio.sleep(0.01)
        times = []
        for step in range(steps):
            times.append(await _one_turn(servicer.sinks, step, behind, servicer.req))
            deadline = time.monotonic() + 60
            while not servicer.settled():  # every write done
                if time.monotonic() > deadline:
                    raise RuntimeError(f"step {step}: not written")
                await asyncio.sleep(0)
        for sink in servicer.sinks:
            sink.put_nowait((servicer.req, None, 1, None))
        deadline = time.monotonic() + 60
        while client.is_alive() and time.monotonic() < deadline:  # its streams end
            await asyncio.sleep(0.05)
    finally:
        await server.stop(0)
        client.join(10)
    return times, servicer.messages, out.get(timeout=10)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_stream_fanout",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--streams", type=int, nargs="+", default=[64, 256, 1024])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--behind", type=int, default=1,
                        help="events per stream per step (streams that fell behind)")
    parser.add_argument("--interval", type=int, default=1,
                        help="tokens a message waits for (the scheduler's --stream-interval)")
    args = parser.parse_args(argv)
    if min(args.streams) < 1 or args.steps < 2 or args.behind < 1 or args.interval < 1:
        parser.error("--streams, --behind and --interval must be positive and --steps at "
                     "least 2")
    print(f"{'streams':>7} {'gRPC p50 ms':>11} {'p90':>6} {'mean':>6} {'µs/stream':>9} "
          f"{'messages/step':>13} {'gateway CPU ms/step':>19}")
    for n in args.streams:
        fan, messages, cpu = asyncio.run(many_fanout(n, args.steps, args.behind,
                                                     args.interval))
        mean = statistics.fmean(fan)
        print(f"{n:>7} {statistics.median(fan):>11.2f} "
              f"{percentile(fan, 90):>6.2f} {mean:>6.2f} "
              f"{mean * 1e3 / n:>9.1f} {messages / args.steps:>13.0f} "
              f"{cpu * 1e3 / args.steps:>19.2f}")


if __name__ == "__main__":
    main()
