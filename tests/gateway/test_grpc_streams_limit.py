"""gRPC's per-connection stream cap (``--grpc-max-concurrent-streams``) holds: one
client connection cannot run more streams at once than the cap, and the stream past it
waits for a slot rather than failing or being served beyond the limit."""

from __future__ import annotations

import asyncio
import dataclasses

from protos.continuum.v1 import generation_pb2, sampling_pb2, scheduler_pb2

from .harness import FakeScheduler, collect, fake_scheduler, gateway, generation_stub, run

CAP = 2


@dataclasses.dataclass
class Holding(FakeScheduler):
    """Holds every stream open until released; counts the streams it holds at once."""

    release: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    holding: int = 0
    most: int = 0

    async def stream(self, request):
        self.submitted.append(request)
        self.holding += 1
        self.most = max(self.most, self.holding)
        try:
            yield scheduler_pb2.TokenEvent(token_ids=[42])
            await self.release.wait()
            yield scheduler_pb2.TokenEvent(token_ids=[43],
                                           finish_reason=sampling_pb2.FINISH_REASON_LENGTH)
        finally:
            self.holding -= 1


def test_one_connection_runs_at_most_the_cap_and_the_next_stream_waits(tokenizer):
    async def scenario():
        held = Holding()
        async with fake_scheduler(held) as address, \
                gateway(tokenizer, address, grpc_max_concurrent_streams=CAP) as (_, channel):
            stub = generation_stub(channel)
            calls = [stub.Generate(generation_pb2.GenerateRequest(prompt="hi",
                                                                  request_id=f"s{i}"),
                                   timeout=30)
                     for i in range(CAP + 1)]
            tasks = [asyncio.create_task(collect(call)) for call in calls]
            for _ in range(200):  # until the cap's worth of streams reached the scheduler
                if len(held.submitted) >= CAP:
                    break
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.5)  # room for a stream past the cap to (wrongly) start
            assert len(held.submitted) == CAP and held.most == CAP
            held.release.set()
            answers = await asyncio.gather(*tasks)
            # The one past the cap waited, then ran: every stream finished in full.
            assert len(held.submitted) == CAP + 1 and held.most <= CAP
            assert all(any(r.finish_reason for r in answer) for answer in answers)

    run(scenario())
