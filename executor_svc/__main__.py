"""``python -m executor_svc --model PATH --ipc ipc:///run/continuum/replica.sock``

Loads the model, sizes the KV cache from a byte budget, measures prefill throughput and
copy bandwidth (for the scheduler's preemption cost model), connects to the scheduler and
serves plans until SIGTERM/SIGINT (exit 0). A model that cannot be served exits 2 with
one line on stderr.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import signal
import sys
import time
import uuid
from dataclasses import dataclass

import torch
import zmq

from executor_svc.kv_cache import KVCache, KVCacheSpec
from executor_svc.link import SchedulerLink, ServeLoop
from executor_svc.model import LlamaModel
from executor_svc.model_files import ModelError, resolve_model
from executor_svc.runner import Runner, measure_prefill_tokens_per_s
from kernels import BACKEND_NAMES, make_backend
from protos import wire
from protos.continuum.v1 import executor_pb2 as pb

log = logging.getLogger("executor")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


@dataclass(frozen=True)
class ExecutorConfig:
    """Validated once in parse_args; components get the fields they need."""

    model: str | None
    ipc: str
    kv_cache_bytes: int
    host_kv_cache_bytes: int
    block_size: int
    dtype: str
    threads: int | None
    model_id: str | None
    warmup_tokens: int
    attention_backend: str


def parse_bytes(text: str) -> int:
    """'1073741824', '1GiB', '512M', '64k' -> bytes (binary units)."""
    match = re.fullmatch(r"\s*(\d+)\s*([kmgt]?)(i?b)?\s*", text.lower())
    if not match:
        raise argparse.ArgumentTypeError(f"not a byte size: {text!r} (e.g. 1GiB, 512MiB)")
    return int(match.group(1)) * _UNITS[match.group(2)]


def parse_args(argv: list[str] | None) -> ExecutorConfig:
    p = argparse.ArgumentParser(prog="python -m executor_svc", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="", help="GGUF file or HF dir; empty: bundled SmolLM2")
    p.add_argument("--ipc", required=True, help="scheduler address, e.g. ipc:///tmp/c.sock")
    p.add_argument("--kv-cache-bytes", type=parse_bytes, default=1 << 30)
    p.add_argument("--host-kv-cache-bytes", type=parse_bytes, default=0,
                   help="host (swap) pool; 0 disables swapping")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--model-id", default=None,
                   help="served name (default: the model directory's name, as the gateway's)")
    p.add_argument("--warmup-tokens", type=int, default=128,
                   help="prefill length timed at start for the cost model")
    p.add_argument("--attention-backend", choices=BACKEND_NAMES, default="torch")
    a = p.parse_args(argv)
    if a.block_size < 1 or (a.threads is not None and a.threads < 1) or a.warmup_tokens < 1:
        p.error("--block-size, --threads and --warmup-tokens must be positive")
    if not a.ipc.startswith(("ipc://", "tcp://", "inproc://")):
        p.error(f"--ipc must be a zmq address such as ipc:///tmp/continuum.sock, got {a.ipc!r}")
    return ExecutorConfig(a.model or None, a.ipc, a.kv_cache_bytes, a.host_kv_cache_bytes,
                          a.block_size, a.dtype, a.threads, a.model_id, a.warmup_tokens,
                          a.attention_backend)


def build(config: ExecutorConfig, incarnation: str) -> tuple[Runner, pb.Hello]:
    """Loads everything; raises ModelError / ValueError for what a user must fix."""
    if config.threads:
        torch.set_num_threads(config.threads)
    start = time.perf_counter()
    path = resolve_model(config.model)
    print(f"loading model from {path}", file=sys.stderr)
    model = LlamaModel.load(path, dtype=DTYPES[config.dtype])
    print(f"model loaded in {time.perf_counter() - start:.2f} s", file=sys.stderr)
    c = model.config
    spec = KVCacheSpec(c.num_layers, c.num_kv_heads, c.head_dim, DTYPES[config.dtype],
                       config.block_size)
    kv = KVCache(spec, spec.num_blocks(config.kv_cache_bytes),
                 spec.num_blocks(config.host_kv_cache_bytes))
    backend = make_backend(config.attention_backend)
    prefill_tps = measure_prefill_tokens_per_s(model, kv, backend, config.warmup_tokens)
    hello = pb.Hello(
        schema_version=wire.SCHEMA_VERSION, incarnation=incarnation,
        model_id=config.model_id or path.name, dtype=config.dtype, block_size=config.block_size,
        num_device_blocks=kv.num_blocks, num_host_blocks=kv.num_host_blocks, tp_size=1,
        max_model_len=c.max_position_embeddings, vocab_size=c.vocab_size,
        eos_token_ids=list(c.eos_token_ids), prefill_tokens_per_s=prefill_tps,
        swap_bytes_per_s=kv.measure_copy_bytes_per_s(), block_bytes=spec.block_bytes,
        pid=os.getpid(),
    )
    log.info("ready in %.2f s: %s, %d blocks x %d tokens (%.0f MiB KV), prefill %.0f tokens/s, "
             "%d threads", time.perf_counter() - start, hello.model_id, kv.num_blocks,
             config.block_size, kv.num_blocks * spec.block_bytes / 2**20, prefill_tps,
             torch.get_num_threads())
    return Runner(model, kv, backend, incarnation), hello


class _Stop:
    """SIGTERM/SIGINT: exit at once while starting, after the current step while serving."""

    def __init__(self) -> None:
        self.requested = False
        self.serving = False

    def __call__(self, signum, frame) -> None:
        self.requested = True
        if not self.serving:
            raise SystemExit(0)


def main(argv: list[str] | None = None) -> int:
    config = parse_args(argv)
    logging.basicConfig(stream=sys.stderr, level=logging.INFO,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    stop = _Stop()
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    try:
        runner, hello = build(config, uuid.uuid4().hex)
    except (ModelError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        link = SchedulerLink(config.ipc)
    except zmq.ZMQError as exc:
        print(f"error: cannot connect to {config.ipc}: {exc}", file=sys.stderr)
        return 2
    stop.serving = True
    try:
        ServeLoop(link, runner, hello, lambda: stop.requested).run()
    finally:
        link.close()
    log.info("stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
