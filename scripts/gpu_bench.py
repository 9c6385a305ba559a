"""The GPU check's performance part: an 8B-shaped Llama with random bf16 weights, built on
the device (executor_svc/random_model.py: nothing downloaded or carried), run through the
executor's own Runner, KV cache, Triton attention and decode CUDA graphs.

Rows (``name|status|figure``, one a line, for scripts/gpu_check.sh's table):

* decode step time at batch 1 / 32 / 128 (context 1024 each), graph and eager, against
  the HBM roofline: the bytes a step must read (every weight but the embedding table,
  plus the batch's KV) at --hbm-tb-s (H200: 4.8 TB/s);
* graph vs eager logits on the same step (the graphs' correctness on the real model);
* prefill MFU: one 2048-token prompt, model FLOPs (2 x weights x tokens + causal
  attention) over the time, against --peak-tflops (H200 dense bf16: 989);
* tokens/s with 128 requests in flight on the Azure conversation trace's length mix
  (--trace, a sample gpu_bundle.py carries), through real BatchPlans.

``--tiny``: the same code on the CPU with a toy shape and small batches, in seconds, so
CI catches this script's rot (tests/scripts/test_gpu_bench.py); its figures mean nothing.

    python scripts/gpu_bench.py [--tiny] [--trace .gpu/azure_sample.csv]
"""

from __future__ import annotations

import argparse
import csv
import pathlib
import random
import statistics
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from executor_svc.batch import SequenceState, build_inputs  # noqa: E402
from executor_svc.device import decode_graphs  # noqa: E402
from executor_svc.kv_cache import KVCache, KVCacheSpec  # noqa: E402
from executor_svc.random_model import (  # noqa: E402
    LLAMA_8B,
    parameter_count,
    random_config,
    random_model,
)
from executor_svc.runner import Runner, synchronize  # noqa: E402
from executor_svc.sampler import SamplingConfig  # noqa: E402
from kernels import make_backend  # noqa: E402
from kernels.native import NativeOptions  # noqa: E402
from protos import wire  # noqa: E402
from protos.continuum.v1 import executor_pb2 as pb  # noqa: E402
from protos.continuum.v1 import sampling_pb2  # noqa: E402

TINY = dict(hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
            head_dim=16, vocab_size=256, max_position_embeddings=4096)
BLOCK = 16


def row(name: str, status: str, figure: str) -> None:
    print(f"{name}|{status}|{figure}", flush=True)


def timed(device, fn, repeats: int) -> float:
    """Median seconds of ``fn()`` over ``repeats`` calls after one warm-up."""
    fn()
    times = []
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def decode_seqs(batch: int, context: int, first_block: int) -> list[SequenceState]:
    """``batch`` sequences whose next step decodes position ``context - 1``."""
    per = -(-context // BLOCK)
    return [SequenceState(i, [1] * context, context - 1,
                          list(range(first_block + i * per, first_block + (i + 1) * per)),
                          SamplingConfig(), 1, 0) for i in range(batch)]


def bench_decode(runner: Runner, graphs, batches, context, hbm: float) -> None:
    model, kv, device = runner.model, runner.kv, runner.model.embed.device
    c = model.config
    weight_bytes = (parameter_count(c) - c.vocab_size * c.hidden_size) * model.embed.element_size()
    for batch in batches:
        inputs = build_inputs([(s, 1) for s in decode_seqs(batch, context, 0)], BLOCK, device)
        kv_bytes = batch * context * kv.spec.token_bytes
        roof = (weight_bytes + kv_bytes) / hbm
        runner.graphs = None
        eager = timed(device, lambda inputs=inputs: runner.forward(inputs), 10)
        figure = f"eager {eager * 1e3:.2f} ms"
        if graphs is not None:
            runner.graphs = graphs
            replay = timed(device, lambda inputs=inputs: runner.forward(inputs), 20)
            figure = f"graph {replay * 1e3:.2f} ms, " + figure
            eager = min(eager, replay)
        row(f"decode step, batch {batch}, context {context}", "PASS",
            f"{figure}; roofline {roof * 1e3:.2f} ms ({roof / eager:.0%} of HBM peak)")
    runner.graphs = graphs


def check_graph_parity(runner: Runner, graphs, batch: int, context: int) -> None:
    if graphs is None:
        row("graph = eager logits", "SKIP", "no CUDA graphs on this device")
        return
    device = runner.model.embed.device
    inputs = build_inputs([(s, 1) for s in decode_seqs(batch, context, 0)], BLOCK, device)
    runner.graphs = None
    want = runner.forward(inputs).clone()
    runner.graphs = graphs
    got = runner.forward(inputs).clone()
    diff = float((got - want).abs().max())
    same = float((got.argmax(-1) == want.argmax(-1)).float().mean())
    scale = float(want.abs().max())
    ok = diff <= 0.05 * scale + 1e-3 and same >= 0.9
    row(f"graph = eager logits, batch {batch}", "PASS" if ok else "FAIL",
        f"max |diff| {diff:.3g} of max |logit| {scale:.3g}; argmax agrees {same:.0%}")


def bench_prefill(runner: Runner, tokens: int, peak: float) -> None:
    model, device = runner.model, runner.model.embed.device
    c = model.config
    seq = SequenceState(0, [1] * tokens, 0, list(range(-(-tokens // BLOCK))), SamplingConfig(),
                        tokens, 0)
    inputs = build_inputs([(seq, tokens)], BLOCK, device)
    seconds = timed(device, lambda: runner.forward(inputs), 3)
    dense = 2 * (parameter_count(c) - c.vocab_size * c.hidden_size) * tokens
    attention = 2 * c.num_layers * tokens * tokens * c.num_heads * c.head_dim  # causal
    flops = dense + attention
    row(f"prefill {tokens} tokens", "PASS",
        f"{seconds * 1e3:.1f} ms, {tokens / seconds:,.0f} tokens/s, "
        f"MFU {flops / seconds / peak:.1%} of {peak / 1e12:.0f} TFLOP/s")


def trace_mix(path: pathlib.Path | None, limit: int, count: int,
              seed: int = 0) -> list[tuple[int, int]]:
    """(prompt, output) lengths: the trace's rows (each side capped at ``limit``) or, with
    no trace, a fixed toy mix."""
    rng = random.Random(seed)
    if path is None or not path.exists():
        return [(rng.randint(8, limit), rng.randint(4, limit)) for _ in range(count)]
    with open(path) as f:
        rows = [(min(limit, int(r["num_prefill_tokens"])), min(limit, int(r["num_decode_tokens"])))
                for r in csv.DictReader(f)]
    return [rows[i % len(rows)] for i in range(count)]


class _Serving:
    """Just enough of a scheduler for tokens/s: ``concurrency`` requests in flight, each
    step a --max-num-batched-tokens budget, decodes first, then prompt chunks."""

    def __init__(self, runner: Runner, mix: list[tuple[int, int]], concurrency: int,
                 budget: int) -> None:
        self.runner, self.queue = runner, list(mix)
        self.concurrency, self.budget = concurrency, budget
        self.free = list(range(runner.kv.num_blocks))
        self.active: dict[int, dict] = {}
        self.finished: list[int] = []
        self.next_id, self.step_id, self.generated = 1, 0, 0
        self.vocab = runner.model.config.vocab_size

    def _admit(self) -> None:
        while self.queue and len(self.active) < self.concurrency:
            prompt, out = self.queue[0]
            need = -(-(prompt + out) // BLOCK)
            if need > len(self.free):
                return
            self.queue.pop(0)
            blocks = [self.free.pop() for _ in range(need)]
            tokens = [random.randrange(self.vocab) for _ in range(prompt)]
            self.active[self.next_id] = dict(prompt=prompt, out=out, done=0, computed=0,
                                             blocks=blocks, tokens=tokens, sent=False)
            self.next_id += 1

    def step(self) -> None:
        self._admit()
        self.step_id += 1
        plan = pb.BatchPlan(incarnation="bench", step_id=self.step_id,
                            finished_seq_ids=self.finished)
        self.finished = []
        budget = self.budget
        prefilling = lambda item: item[1]["computed"] < item[1]["prompt"]  # noqa: E731
        for seq_id, s in sorted(self.active.items(), key=prefilling):  # decodes first
            left = s["prompt"] + s["done"] - s["computed"]
            n = min(left, budget)
            if n <= 0:
                continue
            budget -= n
            if not s["sent"]:
                plan.new_seqs.add(seq_id=seq_id, token_ids=s["tokens"], num_scheduled_tokens=n,
                                  block_ids=s["blocks"], num_prompt_tokens=s["prompt"],
                                  sampling=sampling_pb2.SamplingParams(temperature=0.0))
                s["sent"] = True
            else:
                plan.cached_seq_ids.append(seq_id)
                plan.cached_num_scheduled_tokens.append(n)
                plan.cached_num_new_blocks.append(0)
            s["computed"] += n
        result = self.runner.execute(plan)
        if result.error_code:
            raise RuntimeError(f"step {self.step_id}: {result.error_message}")
        for seq_id in wire.result_seq_ids(result):
            s = self.active[seq_id]
            s["done"] += 1
            self.generated += 1
            if s["done"] >= s["out"]:
                self.free.extend(s["blocks"])
                del self.active[seq_id]
                self.finished.append(seq_id)


def bench_serving(runner: Runner, mix, concurrency: int, seconds: float, budget: int) -> None:
    serving = _Serving(runner, mix, concurrency, budget)
    device = runner.model.embed.device
    start = time.perf_counter()
    steps = in_flight = 0
    while time.perf_counter() - start < seconds and (serving.active or serving.queue):
        serving.step()
        steps += 1
        in_flight += len(serving.active)
    synchronize(device)
    elapsed = time.perf_counter() - start
    row(f"serving, {concurrency} in flight, trace length mix", "PASS",
        f"{serving.generated / elapsed:,.0f} output tokens/s over {elapsed:.0f} s, {steps} steps, "
        f"{serving.next_id - 1} requests started, {in_flight / max(steps, 1):.0f} in flight "
        "on average")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tiny", action="store_true", help="toy shape on the CPU (CI's check)")
    p.add_argument("--trace", type=pathlib.Path, default=ROOT / ".gpu" / "azure_sample.csv")
    p.add_argument("--hbm-tb-s", type=float, default=4.8)
    p.add_argument("--peak-tflops", type=float, default=989.0)
    p.add_argument("--serve-seconds", type=float, default=60.0)
    p.add_argument("--kv-gib", type=float, default=40.0, help="KV pool for the serving run")
    a = p.parse_args(argv)
    if a.tiny:
        device, dtype, shape = torch.device("cpu"), torch.float32, TINY
        torch.set_num_threads(1)
        batches, context, prefill, concurrency, seconds, limit = (1, 2, 4), 64, 64, 4, 2.0, 48
    else:
        if not torch.cuda.is_available():
            row("8B-shaped model", "FAIL", "no CUDA device (use --tiny on the CPU)")
            return 1
        device, dtype, shape = torch.device("cuda", 0), torch.bfloat16, LLAMA_8B
        batches, context, prefill, concurrency, seconds, limit = ((1, 32, 128), 1024, 2048, 128,
                                                                  a.serve_seconds, 4096)
    config = random_config("llama", **shape)
    # The tiny run leaves the C++ library out (its build would dominate CI's seconds).
    native = NativeOptions(enabled=not a.tiny)
    model = random_model(config, dtype=dtype, device=device, native_gemm=False,
                         native_options=native)
    spec = KVCacheSpec(config.num_layers, config.num_kv_heads, config.head_dim, dtype, BLOCK)
    # The serving run admits a request only when its blocks are free, so the pool needs
    # to hold the longest one, not every one in flight at its longest.
    num_blocks = max(int(a.kv_gib * 2**30) // spec.block_bytes if not a.tiny else 0,
                     max(batches) * -(-context // BLOCK), -(-prefill // BLOCK),
                     (1 if not a.tiny else concurrency) * -(-2 * limit // BLOCK))
    kv = KVCache(spec, num_blocks, device=device, native_options=native)
    backend = make_backend("torch" if a.tiny else None, device)
    runner = Runner(model, kv, backend, "bench")
    row("8B-shaped model" if not a.tiny else "tiny model (CPU)", "PASS",
        f"{parameter_count(config) / 1e9:.2f} B parameters, {dtype}, {type(backend).__name__}, "
        f"KV {num_blocks} blocks = {num_blocks * spec.block_bytes / 2**30:.1f} GiB")
    graphs = decode_graphs(model, kv, enforce_eager=False)
    runner.graphs = graphs
    bench_decode(runner, graphs, batches, context, a.hbm_tb_s * 1e12)
    check_graph_parity(runner, graphs, batches[-1], context)
    bench_prefill(runner, prefill, a.peak_tflops * 1e12)
    bench_serving(runner, trace_mix(a.trace, limit, 20_000), concurrency, seconds,
                  budget=2048 if not a.tiny else 64)
    return 0


if __name__ == "__main__":
    sys.exit(main())
