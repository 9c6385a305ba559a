"""``python -m benchmarks.fit_profile``: measure our executor on this machine, fit, save a profile.

In this process, with the executor's own parts (``DecoderModel``, ``KVCache``, the attention
backend, ``Runner.execute`` on real ``BatchPlan`` protos, sampling included), it times
synthetic steps: decode batches by size and context, prefill chunks by size (fresh and
over a cached context), and mixes of the two. Each point is the median of ``--repeats``
steps. Sequences the timed step continues are introduced by an untimed step first, so
the timed plan carries them as cached deltas, as the scheduler sends them. Then it fits
``sim.profile``'s linear model on four points in five, states its error on the fifth,
refits on all, and writes the JSON with the machine, the weight format and kernel path,
and the git revision it came from.

    .venv/bin/python -m benchmarks.fit_profile --out profiles/$(hostname).json   # ~1-2 minutes
    .venv/bin/python -m benchmarks.fit_profile --quick --out /tmp/p.json          # a few points
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

from sim.profile import ExecutorProfile, errors_pct, fit_coefficients, plan_counts

BLOCK = 16
INCARNATION = "fit-profile"

# (q, c, samples) per sequence; a point is one step.
Point = list[tuple[int, int, bool]]


def grid(quick: bool) -> list[Point]:
    """Decode batches × contexts, prefill chunks (fresh, over context, non-final), mixes."""
    if quick:
        return [[(1, 64, True)] * 4, [(1, 128, True)] * 8, [(32, 0, True)], [(128, 0, True)],
                [(1, 64, True)] * 4 + [(64, 0, False)], [(1, 16, True)],
                [(1, 256, True)] * 2, [(64, 128, True)]]
    points: list[Point] = []
    for batch, context in ((1, 16), (1, 512), (2, 64), (4, 128), (8, 128), (8, 1024),
                           (16, 32), (16, 512), (32, 128), (32, 512), (48, 256), (64, 64),
                           (64, 256)):
        points.append([(1, context, True)] * batch)
    for q, c, last in ((16, 0, True), (64, 0, True), (128, 0, False), (256, 0, True),
                       (512, 0, True), (1024, 0, True), (2048, 0, False), (512, 512, True),
                       (256, 1024, False), (1024, 1024, True)):
        points.append([(q, c, last)])
    # A few decodes beside a prompt is what a lightly loaded server steps most (the
    # validation's low rates); many beside a chunk, what a saturated one does.
    for batch, context, q in ((1, 128, 32), (2, 64, 128), (3, 128, 256), (2, 256, 384),
                              (4, 256, 64), (8, 512, 512), (16, 128, 256), (32, 256, 128),
                              (32, 64, 1024), (48, 128, 512)):
        points.append([(1, context, True)] * batch + [(q, 0, False)])
    points.append([(1, 256, True)] * 8 + [(256, 0, True), (256, 256, False)])
    return points


def load_executor(kv_bytes: int, kv_dtype: str):
    """(model, kv, backend, description) as ``python -m executor_svc`` builds them."""
    import torch

    from executor_svc.kv_cache import KVCache, KVCacheSpec
    from executor_svc.model_files import resolve_model
    from executor_svc.models import decoder
    from executor_svc.models.decoder import DecoderModel
    from executor_svc.settings import Switches
    from kernels import backend_for, make_backend

    switches = Switches.from_env()
    path = resolve_model(None, switches.cache_dir)
    model = DecoderModel.load(path, **decoder.model_options(switches))
    c = model.config
    dtype = {"float32": torch.float32, "float16": torch.float16,
             "bfloat16": torch.bfloat16}[kv_dtype]
    spec = KVCacheSpec(c.num_layers, c.num_kv_heads, c.head_dim, dtype, BLOCK)
    kv = KVCache(spec, spec.num_blocks(kv_bytes), native_options=decoder.native_options(switches))
    backend_name = backend_for(None, torch.device("cpu"))
    backend = make_backend(backend_name, native_options=decoder.native_options(switches))
    wqkv = model.layers[0].wqkv
    describe = {
        "model": path.name, "layers": c.num_layers, "hidden": c.hidden_size,
        "weight_format": f"{type(wqkv).__name__} {str(wqkv.dtype).removeprefix('torch.')}",
        "native_decoder": model._decoder is not None, "attention_backend": backend_name,
        "kv_cache_dtype": kv_dtype, "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "switches": {k: os.environ[k] for k in sorted(os.environ)
                     if k.startswith(("CONTINUUM_NATIVE", "OMP_", "GOMP_"))},
    }
    return model, kv, backend, spec, describe


class Timer:
    """Drives a ``Runner`` with synthetic plans; each ``time(point)`` is one timed step."""

    def __init__(self, model, kv, backend) -> None:
        from executor_svc.runner import Runner

        self.runner = Runner(model, kv, backend, INCARNATION)
        self.num_blocks = kv.num_blocks
        self.step_id = 0
        self.vocab = model.config.vocab_size

    def _plan(self):
        from protos.continuum.v1 import executor_pb2 as pb

        self.step_id += 1
        return pb.BatchPlan(incarnation=INCARNATION, step_id=self.step_id)

    def _execute(self, plan) -> float:
        start = time.perf_counter()
        result = self.runner.execute(plan)
        elapsed = time.perf_counter() - start
        if result.error_code:
            raise RuntimeError(f"synthetic plan refused: {result.error_message}")
        return elapsed

    def time(self, point: Point) -> float:
        from protos.continuum.v1 import sampling_pb2

        greedy = sampling_pb2.SamplingParams(temperature=0.0)
        warm, timed = self._plan(), self._plan()
        next_block = 0
        for seq_id, (q, c, samples) in enumerate(point):
            length = c + q if (samples or q == 1) else c + q + 1
            n = -(-(length + 2) // BLOCK)
            blocks = range(next_block, next_block + n)
            next_block += n
            if next_block > self.num_blocks:
                raise ValueError(f"point needs {next_block} KV blocks, the pool has "
                                 f"{self.num_blocks}: raise --kv-cache-bytes")
            tokens = [3 + (seq_id * 7919 + j) % (self.vocab - 3) for j in range(length)]
            if c == 0:  # a fresh prompt: its first chunk arrives in full, in the timed step
                timed.new_seqs.add(seq_id=seq_id, token_ids=tokens, num_computed_tokens=0,
                                   num_scheduled_tokens=q, block_ids=blocks, sampling=greedy,
                                   num_prompt_tokens=length)
                continue
            # Cached: introduced one token short of c, then continued as a delta.
            prompt = length if q > 1 else c
            warm.new_seqs.add(seq_id=seq_id, token_ids=tokens[:prompt],
                              num_computed_tokens=c - 1, num_scheduled_tokens=1,
                              block_ids=blocks, sampling=greedy, num_prompt_tokens=prompt)
            timed.cached_seq_ids.append(seq_id)
            timed.cached_num_scheduled_tokens.append(q)
            timed.cached_num_new_blocks.append(0)
        if warm.new_seqs:
            self._execute(warm)
        else:
            self.step_id -= 1
            timed.step_id = self.step_id
        seconds = self._execute(timed)
        done = self._plan()
        done.finished_seq_ids.extend(range(len(point)))
        self._execute(done)
        return seconds


def measure(timer: Timer, points: list[Point], repeats: int, log) -> list[dict]:
    out = []
    for i, point in enumerate(points):
        timer.time(point)  # warm-up: first use of these shapes
        seconds = statistics.median(timer.time(point) for _ in range(repeats))
        pairs = [(q, c) for q, c, _ in point]
        counts = plan_counts(pairs, sum(s or q == 1 for q, _, s in point))
        out.append({"counts": [*counts, any(q > 1 for q, _ in pairs)], "seconds": seconds,
                    "point": _label(point)})
        log(f"  [{i + 1}/{len(points)}] {_label(point)}: {seconds * 1e3:.1f} ms")
    return out


def _label(point: Point) -> str:
    parts: dict[str, int] = {}
    for q, c, s in point:
        key = f"decode@{c}" if q == 1 else f"prefill {q}@{c}{'' if s else ' (no sample)'}"
        parts[key] = parts.get(key, 0) + 1
    return " + ".join(f"{n}×{k}" if n > 1 else k for k, n in parts.items())


def machine() -> dict:
    cpu, flags = platform.processor() or platform.machine(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and cpu in ("", platform.machine()):
                cpu = line.split(":", 1)[1].strip()
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    except OSError:
        pass
    isa = [f for f in ("avx512f", "avx512_vnni", "avx_vnni", "avx2", "fma", "f16c") if f in flags]
    return {"host": socket.gethostname(), "cpu": cpu, "cores": os.cpu_count(),
            "isa": ",".join(isa) or platform.machine(), "git_rev": _git_rev(),
            "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "python": platform.python_version()}


def _git_rev() -> str:
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return rev + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def fit(points: list[dict]) -> tuple[dict, dict]:
    """(coefficients on all points, fit report: held-out error of a 4-in-5 fit)."""
    held = points[2::5]
    train = [p for i, p in enumerate(points) if i % 5 != 2]
    holdout = errors_pct(fit_coefficients(train), held)
    coefficients = fit_coefficients(points)
    train_err = errors_pct(coefficients, points)
    abs_held = sorted(abs(e) for e in holdout)
    report = {
        "num_points": len(points), "num_holdout": len(held),
        "holdout_median_abs_error_pct": statistics.median(abs_held) if abs_held else float("nan"),
        "holdout_max_abs_error_pct": max(abs_held) if abs_held else float("nan"),
        "all_points_median_abs_error_pct": statistics.median(abs(e) for e in train_err),
        "points": [{**p, "fit_error_pct": e} for p, e in zip(points, train_err, strict=True)],
    }
    return coefficients, report


def parse_args(argv) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.fit_profile", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("profiles") / f"{socket.gethostname()}.json")
    p.add_argument("--quick", action="store_true", help="eight points (CI): seconds, not minutes")
    p.add_argument("--repeats", type=int, default=3, help="timed steps per point (median)")
    p.add_argument("--kv-cache-bytes", type=int, default=1 << 30,
                   help="the device pool to profile with (the CPU executor's default, 1 GiB)")
    p.add_argument("--kv-cache-dtype", choices=("float32", "float16", "bfloat16"),
                   default="float32")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: all)")
    p.add_argument("--link-overhead-ms", type=float, default=0.0,
                   help="per-step scheduler + link time to add (measured elsewhere)")
    args = p.parse_args(argv)
    if args.repeats < 1 or args.kv_cache_bytes < 1 or args.link_overhead_ms < 0:
        p.error("--repeats and --kv-cache-bytes must be >= 1, --link-overhead-ms >= 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    import torch

    from executor_svc.runner import measure_prefill_tokens_per_s

    if args.threads:
        torch.set_num_threads(args.threads)

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    load_before = os.getloadavg()
    model, kv, backend, spec, describe = load_executor(args.kv_cache_bytes, args.kv_cache_dtype)
    prefill_tps = measure_prefill_tokens_per_s(model, kv, backend, 128)  # the Hello's figure
    copy_bps = kv.measure_copy_bytes_per_s(max_blocks=64)
    log(f"measuring {describe['model']} ({describe['weight_format']}), "
        f"{describe['torch_threads']} threads, load {load_before[0]:.2f}")
    points = measure(Timer(model, kv, backend), grid(args.quick), args.repeats, log)
    coefficients, report = fit(points)
    report["load_avg_1m"] = [load_before[0], os.getloadavg()[0]]
    report["seconds"] = time.perf_counter() - started
    profile = ExecutorProfile(
        coefficients=coefficients, kv_bytes_per_token=spec.token_bytes,
        kv_pool_bytes=kv.num_blocks * spec.block_bytes, copy_bytes_per_s=copy_bps,
        prefill_tokens_per_s=prefill_tps, machine=machine(), executor=describe, fit=report,
        link_overhead_s=args.link_overhead_ms / 1e3)
    profile.save(args.out)
    print(f"{profile.describe()}\nwrote {args.out} ({len(points)} points, "
          f"{report['seconds']:.0f} s)")
    for name, value in coefficients.items():
        print(f"  {name:<18} {value * 1e3:10.5f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
