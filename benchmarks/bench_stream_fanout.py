"""What streaming a step's tokens to the gateway costs the scheduler's event loop.

Each step, the scheduler loop hands one event per running request to that request's
``Submit`` stream (``EngineLoop._dispatch``: an ``asyncio.Queue`` per stream); each stream's
coroutine then wakes and writes one ``TokenEvent`` through grpc.aio. That runs on the
loop's thread, between a step's update and the next plan, so it is part of the loop's
cycle: a device step shorter than the cycle waits on it.

This benchmark times that part alone, with the scheduler's own messages and queues and
a real gRPC client in another process (as the gateway is): N server-streaming calls on
loopback, then per step one event into each stream's queue, and the time until every
stream's coroutine has written its message (the loop runs them in one turn). It also
times the queues and wake-ups without gRPC, to say which part costs. ``--behind K`` puts
K events into each queue per step instead, as when the streams fell K steps behind: the
servicer sends what a stream owes in one message (``streams.take_ready``). ``--interval N``
streams as ``--stream-interval N`` does: a message waits for N tokens (the first and the
end go at once; ``streams.next_batch``). ``--many`` times SubmitMany as well, the
scheduler's own code (scheduler_svc/submit_many.py): the same streams on one call, each
step's events put into their sinks and written in one response.

    .venv/bin/python -m benchmarks.bench_stream_fanout [--streams 64 256 1024] [--steps 300]
        [--behind 1] [--interval 1] [--many]
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
from scheduler_svc import submit_many
from scheduler_svc.streams import next_batch


async def _read_to_end(call, cpu: list[float]) -> None:
    """Reads ``call`` (a Submit call or a gateway ManyStream) as the relay does, to its
    EOF; ``cpu`` gets the process's CPU time at its first message."""
    first = True
    while await call.read() is not grpc.aio.EOF:
        if first:
            first = False
            cpu.append(time.process_time())


def _drain(port: int, streams: int, many: bool, out) -> None:
    """The gateway's side: ``streams`` Submit calls (``many``: streams of the gateway's
    SubmitMany multiplexer, gateway/routing/mux.py), each read to its end; puts the
    process's CPU seconds from the first message to the end on ``out``."""

    async def run() -> float:
        cpu: list[float] = []
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = scheduler_pb2_grpc.SchedulerStub(channel)
            mux = Mux(stub) if many else None
            calls = [mux.submit(scheduler_pb2.SubmitRequest(request_id=str(i)), None) if many
                     else stub.Submit(scheduler_pb2.SubmitRequest(request_id=str(i)))
                     for i in range(streams)]
            await asyncio.gather(*(_read_to_end(call, cpu) for call in calls))
            used = time.process_time() - min(cpu)
            if mux is not None:
                await mux.close()
        return used

    out.put(asyncio.run(run()))


class _Streams(scheduler_pb2_grpc.SchedulerServicer):
    """Submit as the scheduler's servicer streams it: a queue of events per call, what is
    queued sent in one TokenEvent, held for ``interval`` tokens after the first
    (``next_batch``), the call's end on an event with a reason."""

    def __init__(self, interval: int = 1) -> None:
        self.interval = interval
        self.queues: list[asyncio.Queue] = []
        self.written = 0  # tokens
        self.messages = 0
        self.writing = 0  # streams between taking their events and their write's end

    async def Submit(self, request, context):  # noqa: N802
        queue: asyncio.Queue = asyncio.Queue()
        self.queues.append(queue)
        first = True
        while True:  # events: (req, token, end, lp)
            batch = await next_batch(queue, self.interval, first)
            first = False
            tokens = [token for _, token, _, _ in batch if token is not None]
            if tokens:
                self.writing += 1
                yield scheduler_pb2.TokenEvent(token_ids=tokens)
                self.writing -= 1
                self.written += len(tokens)
                self.messages += 1
            if batch[-1][2] is not None:
                return

    def settled(self) -> bool:
        """Every stream took its events and wrote what it sends (or holds them back)."""
        return not self.writing and all(queue.empty() for queue in self.queues)


async def _one_turn(queues: list[asyncio.Queue], step: int, behind: int = 1,
                    req=None) -> float:
    """One step's events (``behind`` of them) into every queue, then the loop turn that runs
    the streams' coroutines, in ms."""
    started = time.perf_counter()
    for queue in queues:
        for _ in range(behind):
            queue.put_nowait((req, step, None, None))
    await asyncio.sleep(0)
    return (time.perf_counter() - started) * 1e3


def _client(port: int, streams: int, many: bool):
    """The gateway's process (spawned, not forked: this process runs gRPC) and where it
    puts its CPU time."""
    context = multiprocessing.get_context("spawn")
    out = context.Queue()
    client = context.Process(target=_drain, args=(port, streams, many, out))
    client.start()
    return client, out


async def _fan(servicer, streams: int, steps: int, behind: int, many: bool, opened,
               sinks, req, end) -> tuple[list[float], float]:
    """Serves ``servicer`` to the gateway's process; once ``opened()``, each step's events
    into ``sinks()`` and the loop turn that writes them, until ``servicer.settled()``; then
    ``end`` into each. Each step's time in ms, and the gateway's CPU seconds."""
    server = grpc.aio.server()
    scheduler_pb2_grpc.add_SchedulerServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    client, out = _client(port, streams, many)
    try:
        deadline = time.monotonic() + 60
        while not opened():
            if time.monotonic() > deadline or not client.is_alive():
                raise RuntimeError(f"the client did not open its {streams} streams")
            await asyncio.sleep(0.01)
        times = []
        for step in range(steps):
            times.append(await _one_turn(sinks(), step, behind, req))
            deadline = time.monotonic() + 60
            while not servicer.settled():  # every write done
                if time.monotonic() > deadline:
                    raise RuntimeError(f"step {step}: not written")
                await asyncio.sleep(0)
        for sink in sinks():
            sink.put_nowait(end)
        deadline = time.monotonic() + 60
        while client.is_alive() and time.monotonic() < deadline:  # its calls end
            await asyncio.sleep(0.05)
    finally:
        await server.stop(0)
        client.join(10)
    return times, out.get(timeout=10)


async def grpc_fanout(streams: int, steps: int, behind: int = 1,
                      interval: int = 1) -> tuple[list[float], int, float]:
    """Each step's time, the messages written in all, the gateway's CPU seconds."""
    servicer = _Streams(interval)
    times, cpu = await _fan(servicer, streams, steps, behind, False,
                            lambda: len(servicer.queues) >= streams, lambda: servicer.queues,
                            None, (None, None, "end", None))
    return times, servicer.messages, cpu


class _Many(scheduler_pb2_grpc.SchedulerServicer):
    """SubmitMany's own code on a stand-in loop: ``streams`` streams opened on the call
    (``ManyCall.opened``, as a Submit of each would), each step's events into their
    sinks, what ``ManyCall.take`` gathers written in one response."""

    def __init__(self, streams: int, interval: int) -> None:
        config = types.SimpleNamespace(stream_interval=interval)
        self.loop = types.SimpleNamespace(core=types.SimpleNamespace(config=config),
                                          abort=lambda key: False, recorder=None,
                                          histograms=types.SimpleNamespace(
                                              request_ended=lambda *a: None))
        self.call = submit_many.ManyCall(self.loop)
        req = self.req = types.SimpleNamespace(
            request_id="r", num_prompt_tokens=8, num_output_tokens=1,
            first_scheduled_time=None, arrival_time=0.0, error="")
        self.sinks = [self.call.opened(i, req) for i in range(1, streams + 1)]
        self.started = asyncio.Event()
        self.writing = False
        self.messages = 0  # stream messages, as Submit's count them

    async def SubmitMany(self, request_iterator, context):  # noqa: N802
        self.started.set()
        async for response in submit_many.respond(self.call, _opened_here(request_iterator)):
            self.writing = True
            yield response
            self.writing = False
            self.messages += len(response.events)

    def settled(self) -> bool:
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
    """``grpc_fanout`` for SubmitMany: each step's time, the stream messages in all, the
    gateway's CPU seconds."""
    servicer = _Many(streams, interval)
    times, cpu = await _fan(servicer, streams, steps, behind, True, servicer.started.is_set,
                            lambda: servicer.sinks, servicer.req, (servicer.req, None, 1, None))
    return times, servicer.messages, cpu


async def queues_only(streams: int, steps: int) -> list[float]:
    queues: list[asyncio.Queue] = [asyncio.Queue() for _ in range(streams)]

    async def consume(queue: asyncio.Queue) -> None:
        while await queue.get() is not None:
            pass

    tasks = [asyncio.create_task(consume(q)) for q in queues]
    await asyncio.sleep(0)
    times = [await _one_turn(queues, step) for step in range(steps)]
    for queue in queues:
        queue.put_nowait(None)
    await asyncio.gather(*tasks)
    return times


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_stream_fanout",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--streams", type=int, nargs="+", default=[64, 256, 1024])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--behind", type=int, default=1,
                        help="events per stream per step (streams that fell behind)")
    parser.add_argument("--interval", type=int, default=1,
                        help="tokens a message waits for (the scheduler's --stream-interval)")
    parser.add_argument("--many", action="store_true",
                        help="also time the same streams on one SubmitMany call")
    args = parser.parse_args(argv)
    if min(args.streams) < 1 or args.steps < 2 or args.behind < 1 or args.interval < 1:
        parser.error("--streams, --behind and --interval must be positive and --steps at "
                     "least 2")
    print(f"{'streams':>7} {'gRPC p50 ms':>11} {'p90':>6} {'mean':>6} {'µs/stream':>9} "
          f"{'messages/step':>13} {'gateway CPU ms/step':>19} {'queues only p50 ms':>18}")
    for n in args.streams:
        fan, messages, cpu = asyncio.run(grpc_fanout(n, args.steps, args.behind,
                                                     args.interval))
        bare = asyncio.run(queues_only(n, args.steps))
        p50 = statistics.median(fan)
        mean = statistics.fmean(fan)
        print(f"{n:>7} {p50:>11.2f} {statistics.quantiles(fan, n=10)[8]:>6.2f} {mean:>6.2f} "
              f"{mean * 1e3 / n:>9.1f} {messages / args.steps:>13.0f} "
              f"{cpu * 1e3 / args.steps:>19.2f} {statistics.median(bare):>18.2f}")
        if args.many:
            fan, messages, cpu = asyncio.run(many_fanout(n, args.steps, args.behind,
                                                         args.interval))
            mean = statistics.fmean(fan)
            print(f"{'':>7} {statistics.median(fan):>11.2f} "
                  f"{statistics.quantiles(fan, n=10)[8]:>6.2f} {mean:>6.2f} "
                  f"{mean * 1e3 / n:>9.1f} {messages / args.steps:>13.0f} "
                  f"{cpu * 1e3 / args.steps:>19.2f}   (SubmitMany)")


if __name__ == "__main__":
    main()
