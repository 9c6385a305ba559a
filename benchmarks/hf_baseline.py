"""The transformers baseline for bench_executor: generate() timed per token.

Static batch, fp32, greedy, the model directory the executor serves. Decoding starts from
a ``DynamicCache`` already holding the context (zeros: the cost of a step is the same), so
a 128 x 512-token point does not pay two minutes of prefill first.
"""

from __future__ import annotations

import statistics

import torch


def best_seconds(fn, clock, repeats: int) -> float:
    """The fastest of ``repeats`` calls after one warm-up call, by ``clock``."""
    fn()
    times = []
    for _ in range(repeats):
        start = clock()
        fn()
        times.append(clock() - start)
    return min(times)


def hf_decode_seconds(hf, batch: int, context: int, warmup: int, steps: int, clock) -> float:
    """Median seconds per generate() step, timed per token with a streamer, from a
    DynamicCache that already holds ``context`` positions (zeros: the cost is the same)."""
    from transformers import DynamicCache
    from transformers.generation.streamers import BaseStreamer

    class Ticks(BaseStreamer):
        def __init__(self) -> None:
            self.ticks: list[float] = []

        def put(self, value) -> None:
            self.ticks.append(clock())

        def end(self) -> None:
            pass

    c = hf.config
    shape = (batch, c.num_key_value_heads, context, c.hidden_size // c.num_attention_heads)
    cache = DynamicCache(config=c)
    for layer in range(c.num_hidden_layers):
        cache.update(torch.zeros(shape), torch.zeros(shape), layer)
    ids = torch.randint(3, c.vocab_size, (batch, context + 1), generator=torch.Generator())
    streamer, n = Ticks(), warmup + steps
    with torch.no_grad():
        hf.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=cache,
                    max_new_tokens=n, min_new_tokens=n, do_sample=False, streamer=streamer)
    intervals = [b - a for a, b in zip(streamer.ticks, streamer.ticks[1:], strict=False)]
    return statistics.median(intervals[warmup:])


def hf_prefill_tokens_per_s(hf, num_tokens: int, clock) -> float:
    ids = torch.randint(3, hf.config.vocab_size, (1, num_tokens), generator=torch.Generator())

    def once():
        with torch.no_grad():
            hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=1,
                        do_sample=False)

    return num_tokens / best_seconds(once, clock, repeats=2)
