"""How many long-context sequences one KV pool holds when every layer is windowed.

The real scheduler core, no model: each step's plan is answered at once with a token for
every sequence it completes (never EOS). The workload is long-context chat against a
model whose every layer attends to its last ``--window`` tokens (Mistral 7B v0.1: 4096):
``--requests`` prompts of 16k to 32k tokens arrive together, each decodes ``--output``
tokens. The same pool is run twice, once with the window announced (the executor's Hello
sends it as ``kv_window``: the block manager releases blocks behind every window) and
once without (every block held to the end, as for a model with a global layer). Printed
per run: the most sequences running at once, the mean while any decodes, the peak of
blocks held, and the steps to drain the workload.

    .venv/bin/python -m benchmarks.bench_window_pool
    .venv/bin/python -m benchmarks.bench_window_pool --blocks 8192 --window 4096
"""

from __future__ import annotations

import argparse
import random
import statistics

from scheduler_svc.core import ModelInfo, Request, Scheduler, SchedulerConfig
from scheduler_svc.core.config import QUEUE_TIME_FIELDS


def run(window: int, args: argparse.Namespace) -> dict[str, float]:
    config = SchedulerConfig(max_num_batched_tokens=args.budget, max_num_seqs=256,
                             max_num_waiting=4096, **dict.fromkeys(QUEUE_TIME_FIELDS, 0.0))
    core = Scheduler(config)
    core.attach_executor(ModelInfo(args.block_size, args.blocks, 65536, 32000,
                                   frozenset({2}), kv_window=window))
    rng = random.Random(0)
    for i in range(args.requests):
        n = rng.randrange(16384, 32768)
        prompt = [rng.randrange(3, 32000) for _ in range(n)]
        core.add_request(Request(f"r{i}", i + 1, prompt, n, args.output))
    steps = most = held = 0
    decoding = []
    while core.has_work():
        out = core.schedule()
        steps += 1
        done = [r.seq_id for r, _, _ in out.scheduled() if r.num_computed_tokens == r.num_tokens]
        core.update(out, done, [7] * len(done))
        running = len(core.running)
        most = max(most, running)
        held = max(held, args.blocks - core.block_manager.num_free_blocks)
        if any(r.num_output_tokens for r in core.running):
            decoding.append(running)
        if steps > 200_000:
            raise RuntimeError("the workload did not drain")
    return {"most": most, "mean": statistics.fmean(decoding) if decoding else 0.0,
            "held": held, "steps": steps}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=16384, help="device KV blocks")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--window", type=int, default=4096, help="every layer's window")
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--output", type=int, default=2048, help="tokens decoded each")
    parser.add_argument("--budget", type=int, default=2048, help="max_num_batched_tokens")
    args = parser.parse_args(argv)
    print(f"pool {args.blocks} blocks x {args.block_size} tokens "
          f"({args.blocks * args.block_size} positions), {args.requests} prompts of 16k-32k "
          f"tokens, {args.output} decoded each, window {args.window}")
    print(f"{'blocks behind the window':<26} {'most running':>12} {'mean decoding':>14} "
          f"{'peak blocks':>12} {'steps':>7}")
    for label, window in (("kept (no window known)", 0), ("released", args.window)):
        r = run(window, args)
        print(f"{label:<26} {r['most']:>12} {r['mean']:>14.1f} {r['held']:>12} {r['steps']:>7}")


if __name__ == "__main__":
    main()
