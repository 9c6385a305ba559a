"""nano-vllm's scheduler as bench_scheduler's yardstick, run from its own checkout.

nano-vllm (GeeeekExplorer/nano-vllm) is not on PyPI and nothing of it is copied here:
``load`` imports its ``nanovllm/engine`` modules from a checkout the caller names
(``--nano-vllm DIR``), without running its package ``__init__`` (which loads torch and
flash-attn for the model runner) and with a stand-in for its ``Config`` (which reads a
model directory); its block manager needs ``xxhash`` (``pip install xxhash``).

``DecodeOnly`` is its decode-only step at N running: every sequence decodes one token,
``Scheduler.schedule`` then ``Scheduler.postprocess`` with the sampled ids, the part of
its engine step that is scheduling (its model runner's tensor building is not counted,
where ours counts building and serializing the plan). Both schedulers run with the same
KV block size: block work (allocation, hashing, the prefix index) is most of either's
cost per token, and nano-vllm's native 256-token blocks make it 16x rarer than our
executor's 16-token ones.
"""

from __future__ import annotations

import importlib
import pathlib
import statistics
import sys
import time
import types

# nano-vllm's own (its Config asserts a multiple of 256, for flash-attn's paged KV); its
# scheduler and block manager take any size, which the comparison sets to ours.
NATIVE_BLOCK_SIZE = 256


def load(checkout: pathlib.Path) -> types.SimpleNamespace:
    """nano-vllm's Scheduler, Sequence and SamplingParams from ``checkout``."""
    src = checkout / "nanovllm"
    if not (src / "engine" / "scheduler.py").is_file():
        raise SystemExit(f"--nano-vllm {checkout}: no nanovllm/engine/scheduler.py there "
                         "(a checkout of github.com/GeeeekExplorer/nano-vllm)")
    try:
        importlib.import_module("xxhash")
    except ImportError:
        raise SystemExit("nano-vllm's block manager needs xxhash: pip install xxhash") from None
    for name, path in (("nanovllm", src), ("nanovllm.engine", src / "engine")):
        package = types.ModuleType(name)
        package.__path__ = [str(path)]
        sys.modules.setdefault(name, package)
    config = types.ModuleType("nanovllm.config")
    config.Config = object  # only a type annotation in the scheduler
    sys.modules.setdefault("nanovllm.config", config)
    return types.SimpleNamespace(
        Scheduler=importlib.import_module("nanovllm.engine.scheduler").Scheduler,
        Sequence=importlib.import_module("nanovllm.engine.sequence").Sequence,
        SamplingParams=importlib.import_module("nanovllm.sampling_params").SamplingParams)


class DecodeOnly:
    """``num_seqs`` sequences with ``prompt_lens`` prompts, prefilled, then decoding and
    never finishing; ``step`` times one decode step in µs."""

    def __init__(self, nano: types.SimpleNamespace, num_seqs: int,
                 prompt_lens: list[int], max_steps: int,
                 block_size: int = NATIVE_BLOCK_SIZE) -> None:
        longest = max(prompt_lens) + max_steps
        blocks = num_seqs * (-(-longest // block_size) + 1)
        config = types.SimpleNamespace(
            max_num_seqs=num_seqs, max_num_batched_tokens=max(8192, longest), eos=-1,
            kvcache_block_size=block_size, num_kvcache_blocks=blocks)
        # Its Sequence reads the block size from a class attribute (its config's value).
        nano.Sequence.block_size = block_size
        self.sched = nano.Scheduler(config)
        params = nano.SamplingParams(max_tokens=10**9, ignore_eos=True)
        for i in range(num_seqs):
            n = prompt_lens[i % len(prompt_lens)]
            self.sched.add(nano.Sequence([1000 + (i * 7 + j) % 30000 for j in range(n)],
                                         params))
        while True:  # prefills, untimed
            seqs, is_prefill = self.sched.schedule()
            if not is_prefill:
                self.sched.postprocess(seqs, [7] * len(seqs), False)
                break
            self.sched.postprocess(seqs, [7] * len(seqs), True)

    def step(self) -> float:
        t0 = time.perf_counter()
        seqs, is_prefill = self.sched.schedule()
        self.sched.postprocess(seqs, [7] * len(seqs), is_prefill)
        return (time.perf_counter() - t0) * 1e6


def interleaved_p50s(runs, steps: int, warmup: int) -> list[float]:
    """Each of ``runs`` (a step: ``run(record) -> µs``) stepped round-robin, the order
    rotating each round so all see the same machine phases; each one's p50 after
    ``warmup`` rounds."""
    times: list[list[float]] = [[] for _ in runs]
    for i in range(steps + warmup):
        for j in range(len(runs)):
            k = (i + j) % len(runs)
            dt = runs[k](i >= warmup)
            if i >= warmup:
                times[k].append(dt)
    return [statistics.median(t) for t in times]
