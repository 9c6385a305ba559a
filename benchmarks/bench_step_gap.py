"""The executor's idle gap between steps, with and without async scheduling.

The scheduler's engine loop in this process, a real executor process (over ipc://), N
concurrent greedy requests streamed to the end; each StepResult's ``idle_ms`` is how long
the executor waited for its next plan. Each ``--plan-channel`` (ZeroMQ, the shared-memory
ring) runs with async scheduling off and on.

    make bench-step-gap   # or: .venv/bin/python -m benchmarks.bench_step_gap [--streams 64]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import subprocess
import tempfile
import time

from harness import servers
from scheduler_svc.core import Request, SchedulerConfig
from scheduler_svc.loop import EngineLoop
from sim.metrics import percentile


async def run(model_dir: str, async_on: bool, streams: int, max_tokens: int,
              repeats: int, channel: str = "zmq") -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        ipc = f"ipc://{tmp}/executor.sock"
        config = SchedulerConfig(max_num_seqs=max(streams, 1), max_num_batched_tokens=2048,
                                 async_scheduling=async_on)
        loop = EngineLoop(config, ipc, plan_channel=channel)
        loop.start()
        executor = servers.spawn("executor_svc", [
            "--model", model_dir, "--ipc", ipc, "--kv-cache-bytes", str(256 << 20)],
            stderr=subprocess.DEVNULL)
        try:
            while loop.executor is None:
                if executor.poll() is not None:
                    raise RuntimeError("the executor exited while starting")
                await asyncio.sleep(0.1)
            await generate(loop, 8, 8, "warmup")  # first-step costs out of the way
            assert (channel == "shm") == loop.link.plans.confirmed, "the plan channel"
            figures = []
            for r in range(repeats):
                loop.steps.executor_idle_ms.clear()
                steps = loop.steps.num_steps
                started = time.perf_counter()
                tokens = await generate(loop, streams, max_tokens, f"run{r}")
                wall = time.perf_counter() - started
                idle = list(loop.steps.executor_idle_ms)[1:]  # the first waited for the clients
                figures.append({
                    "steps": loop.steps.num_steps - steps,
                    "idle_p50_ms": statistics.median(idle),
                    "idle_mean_ms": statistics.mean(idle),
                    "idle_p90_ms": percentile(idle, 90),
                    "step_ms": wall * 1e3 / (loop.steps.num_steps - steps),
                    "tokens_per_s": tokens / wall,
                })
            return {k: statistics.median(f[k] for f in figures) for k in figures[0]}
        finally:
            await loop.stop()
            servers.stop(executor, grace_s=10)


async def generate(loop: EngineLoop, streams: int, max_tokens: int, tag: str) -> int:
    rng = random.Random(0)
    queues = []
    for i in range(streams):
        prompt = [rng.randrange(100, 20000) for _ in range(rng.randint(16, 48))]
        req = Request(f"{tag}-{i}", 0, prompt, len(prompt), max_tokens, ignore_eos=True)
        queues.append(loop.submit(req))
    tokens = 0
    for queue in queues:
        while True:
            _, token, reason = (await queue.get())[:3]
            tokens += token is not None
            if reason is not None:
                break
    return tokens


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--streams", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--model", default="", help="HF dir; default: the bundled model")
    p.add_argument("--plan-channel", nargs="+", choices=("zmq", "shm"), default=["zmq", "shm"])
    args = p.parse_args()
    servers.ensure_secret()  # the loop here and the executor child sign Hellos with it
    from executor_svc.model_files import resolve_model
    from executor_svc.settings import Switches
    model_dir = str(resolve_model(args.model or None, Switches.from_env().cache_dir))
    print(f"{args.streams} streams × {args.max_tokens} tokens, greedy, median of "
          f"{args.repeats} runs")
    print(f"{'plans':>5} {'async scheduling':>16} {'steps':>6} {'idle p50 ms':>11} "
          f"{'idle mean':>9} {'idle p90':>8} {'step ms':>8} {'tokens/s':>9}")
    for async_on in (False, True):
        for channel in args.plan_channel:
            r = asyncio.run(run(model_dir, async_on, args.streams, args.max_tokens,
                                args.repeats, channel))
            print(f"{channel:>5} {'on' if async_on else 'off':>16} {r['steps']:>6.0f} "
                  f"{r['idle_p50_ms']:>11.2f} "
                  f"{r['idle_mean_ms']:>9.2f} {r['idle_p90_ms']:>8.2f} {r['step_ms']:>8.2f} "
                  f"{r['tokens_per_s']:>9.0f}")


if __name__ == "__main__":
    main()
