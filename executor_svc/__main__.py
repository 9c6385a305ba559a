"""``python -m executor_svc --model PATH --ipc ipc:///run/continuum/replica.sock``

Loads the model, sizes the KV cache (executor_svc/device.py), measures prefill throughput
and copy bandwidth (the preemption cost model's), connects to the scheduler and serves
plans until SIGTERM/SIGINT (exit 0). A model or device that cannot be served exits 2 with
one line on stderr; so does a missing internal secret (runtime/internal_auth.py) without
the explicit opt-out. ``--tp-size N``: this is rank 0; it spawns ranks 1..N-1
(executor_svc/tp_ranks.py) and alone talks to the scheduler (tp_serve.py); a lost rank
exits 3 (EXIT_RANK_LOST). ``--standby``: a warm standby (executor_svc/standby.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import signal
import sys
import time
import uuid

import torch
import zmq

from executor_svc.device import decode_graphs, fit_gpu_kv_cache, resolve_device, resolve_dtype
from executor_svc.guided import Guides
from executor_svc.kv_cache import KVCache, KVCacheSpec
from executor_svc.link import IncarnationFile, SchedulerLink, ServeLoop
from executor_svc.model_files import ModelError, resolve_model
from executor_svc.models import decoder, registry
from executor_svc.models.decoder import DecoderModel
from executor_svc.runner import Runner, measure_prefill_tokens_per_s
from executor_svc.settings import ExecutorConfig, Switches
from executor_svc.standby import StandbyRunner
from executor_svc.tp_comm import TPComm
from executor_svc.tp_ranks import WorkerRanks
from executor_svc.tp_serve import EXIT_RANK_LOST, RankLost, TPRunner, make_sampler, serve_worker
from executor_svc.tp_shard import shard_layout
from kernels import backend_for, make_backend
from protos import wire
from protos.continuum.v1 import executor_pb2 as pb
from runtime import config_flags, cpu_priority, internal_auth
from runtime.gc_freeze import freeze_start_up
from runtime.log_setup import configure_logging

log = logging.getLogger("executor")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
CPU_KV_CACHE_BYTES = 1 << 30  # --kv-cache-bytes on the CPU, where nothing sizes it better


def parse_args(argv: list[str] | None, environ=os.environ) -> ExecutorConfig:
    p = argparse.ArgumentParser(prog="python -m executor_svc", description=__doc__.split("\n")[0])
    config = config_flags.parse(ExecutorConfig, p, argv)
    try:
        switches = Switches.from_env(environ, weight_format=config.weight_format)
    except ValueError as exc:
        p.error(str(exc))
    return dataclasses.replace(config, switches=switches)


def build(
    config: ExecutorConfig, path, incarnation: str, tp_init_method: str | None = None,
    device: torch.device | str = "cpu",  # this rank's, from resolve_device
) -> tuple[Runner, pb.Hello]:
    """Loads everything; raises ModelError / ValueError for what a user must fix. Under
    tensor parallelism every rank calls this (it joins the group and times a prefill, which
    are collectives)."""
    start = time.perf_counter()
    device = torch.device(device)
    config = dataclasses.replace(config, dtype=resolve_dtype(config.dtype, device))  # auto
    if device.type == "cuda":
        torch.cuda.set_device(device)  # NCCL and every default-device allocation follow it
    print(f"loading model from {path}", file=sys.stderr)
    model, sampler, pool_kv_heads = _load(config, path, device)
    print(f"model loaded in {time.perf_counter() - start:.2f} s", file=sys.stderr)
    c = model.config
    kv_dtype = config.dtype if config.kv_cache_dtype == "auto" else config.kv_cache_dtype
    spec = KVCacheSpec(c.num_layers, model.num_kv_heads, c.head_dim, DTYPES[kv_dtype],
                       config.block_size)
    # Under tp every rank sizes its pool by the largest KV share, so a block id means the
    # same on every rank; the byte budget is per rank.
    sizing = dataclasses.replace(spec, num_kv_heads=pool_kv_heads)
    native = decoder.native_options(config.switches)
    backend = make_backend(config.attention_backend, device, native)
    fit_to_gpu = device.type == "cuda" and config.kv_cache_bytes is None
    if model.tp is not None and fit_to_gpu:  # the profiling step makes collectives
        model.tp.connect(tp_init_method, config.tp_timeout_s, device)
    num_blocks = (fit_gpu_kv_cache(model, spec, backend, config.max_num_batched_tokens,
                                   config.gpu_memory_utilization) if fit_to_gpu else
                  sizing.num_blocks(config.kv_cache_bytes or CPU_KV_CACHE_BYTES))
    kv = _allocate_kv(config, spec, num_blocks, sizing.num_blocks(config.swap_space_bytes),
                      device, native)
    if model.tp is not None and not fit_to_gpu:
        # Joined only now: the slowest rank's load must not time out.
        model.tp.connect(tp_init_method, config.tp_timeout_s, device)
    prefill_tps = measure_prefill_tokens_per_s(model, kv, backend, config.warmup_tokens)
    hello = pb.Hello(
        schema_version=wire.SCHEMA_VERSION, incarnation=incarnation,
        model_id=config.model_id or path.name, dtype=config.dtype, block_size=config.block_size,
        num_device_blocks=kv.num_blocks, num_host_blocks=kv.num_host_blocks,
        tp_size=config.tp_size, max_model_len=c.max_position_embeddings,
        vocab_size=c.vocab_size, eos_token_ids=list(c.eos_token_ids),
        prefill_tokens_per_s=prefill_tps, swap_bytes_per_s=kv.measure_copy_bytes_per_s(),
        # Per rank (ranks swap their shares in parallel): the cost model's bytes per block.
        block_bytes=sizing.block_bytes, pid=os.getpid(), standby=config.standby,
        kv_window=c.kv_window,
    )
    log.info("ready in %.2f s: %s, %d blocks x %d tokens (%.0f MiB KV), prefill %.0f tokens/s, "
             "%d threads", time.perf_counter() - start, hello.model_id, kv.num_blocks,
             config.block_size, kv.num_blocks * spec.block_bytes / 2**20, prefill_tps,
             torch.get_num_threads())
    guides = Guides(path, c.vocab_size, c.eos_token_ids)
    guides.warm()
    runner = Runner(model, kv, backend, incarnation, sampler=sampler,
                    faults=config.switches.faults, guides=guides)
    runner.graphs = decode_graphs(model, kv, config.enforce_eager)  # before any sequence
    return runner, hello


def _allocate_kv(config: ExecutorConfig, spec: KVCacheSpec, num_blocks: int,
                 num_host_blocks: int, device: torch.device, native) -> KVCache:
    try:
        return KVCache(spec, num_blocks, num_host_blocks, device, native_options=native)
    except torch.OutOfMemoryError as exc:
        if device.type != "cuda":
            raise
        given = (f"--kv-cache-bytes {config.kv_cache_bytes}" if config.kv_cache_bytes
                 else f"--gpu-memory-utilization {config.gpu_memory_utilization:g}")
        raise ValueError(f"{given}: {num_blocks} KV blocks of {spec.block_bytes} bytes do not "
                         f"fit on {device} ({str(exc).splitlines()[0]}); lower it") from exc


def _load(config: ExecutorConfig, path, device: torch.device):
    """(model, sampler or None for the default, KV heads that size the pool)."""
    dtype, options = DTYPES[config.dtype], decoder.model_options(config.switches)
    if config.tp_size == 1:
        if config.standby:  # one core while it loads and waits (StandbyRunner restores them)
            torch.set_num_threads(1)
        elif config.threads:
            torch.set_num_threads(config.threads)
        model = DecoderModel.load(path, dtype=dtype, device=device, **options)
        return model, None, model.num_kv_heads
    # Ranks share the cores unless told otherwise.
    torch.set_num_threads(config.threads or max(1, len(os.sched_getaffinity(0)) // config.tp_size))
    model_config = registry.read_config(path)
    layout = shard_layout(model_config, config.tp_size, config.tp_rank)
    comm = TPComm(layout)
    model = DecoderModel.load(path, dtype, device, comm, **options)
    return model, make_sampler(model_config.eos_token_ids, comm), layout.max_kv_heads


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
    if config.executor_nice:  # before torch starts its threads: they inherit it
        cpu_priority.lower(config.executor_nice)
    configure_logging("executor", **({"rank": config.tp_rank} if config.tp_size > 1 else {}))
    if config.tp_rank:
        return _worker_main(config)
    stop = _Stop()
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    try:
        secret = internal_auth.load_secret()
    except internal_auth.SecretError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        device = resolve_device(config.device, 0, config.tp_size)
        backend_for(config.attention_backend, device)  # before the minutes a model may take
        path = resolve_model(config.model, config.switches.cache_dir)
        if config.tp_size > 1:  # refuse an impossible split before starting anyone
            shard_layout(registry.read_config(path), config.tp_size, 0)
    except (ModelError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    incarnation = uuid.uuid4().hex
    if config.tp_size == 1:
        return _serve(config, path, incarnation, stop, device, secret)
    workers = WorkerRanks(config, incarnation, str(path))
    code = 1
    try:
        code = _serve(config, path, incarnation, stop, device, secret, workers.init_method)
        return code
    finally:
        # Only a rank 0 that returned 0 has told the workers to STOP; otherwise kill them.
        told = code == 0
        if not workers.stop(told) and told:
            log.warning("some tensor-parallel ranks did not exit cleanly")


def _serve(config: ExecutorConfig, path, incarnation: str, stop: _Stop, device: torch.device,
           secret: bytes | None, tp_init_method: str | None = None) -> int:
    """Rank 0 (or the only rank): build, connect, serve until stopped; the exit status."""
    serving_threads = config.threads or torch.get_num_threads()
    try:
        runner, hello = build(config, path, incarnation, tp_init_method, device)
    except (ModelError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        link = SchedulerLink(config.ipc)
    except zmq.ZMQError as exc:
        print(f"error: cannot connect to {config.ipc}: {exc}", file=sys.stderr)
        return 2
    tp = runner.model.tp
    if tp is None:
        front, should_stop = runner, lambda: stop.requested
        if config.standby:
            front = StandbyRunner(runner, serving_threads)
    else:
        front = TPRunner(runner, tp, keepalive_s=min(5.0, config.tp_timeout_s / 4))

        def should_stop() -> bool:  # ServeLoop calls this every poll: the idle keepalive
            front.keepalive()
            return stop.requested
    log.info("start-up heap frozen: %d objects that garbage collection skips from now on",
             freeze_start_up())
    stop.serving = True
    marker = IncarnationFile(config.incarnation_file) if config.incarnation_file else None
    try:
        ServeLoop(link, front, hello, should_stop, secret=secret,
                  renew_incarnation=tp is None, on_hello=marker).run()
        if tp is not None:
            front.stop()
            tp.close()
    except RankLost as exc:  # only raised under tp
        log.error("%s; exiting %d", exc, EXIT_RANK_LOST)
        return EXIT_RANK_LOST
    finally:
        link.close()
        if marker is not None:
            marker.remove()
    log.info("stopped")
    return 0


def _worker_main(config: ExecutorConfig) -> int:
    """Ranks 1..N-1: no scheduler link; rank 0's commands until STOP."""
    # Rank 0 stops the group; a terminal's Ctrl-C reaches every rank, so ignore it here.
    # SIGTERM keeps its default, immediate death: it is also what PDEATHSIG sends.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        device = resolve_device(config.device, config.tp_rank, config.tp_size)
        path = resolve_model(config.model, config.switches.cache_dir)
        runner, _ = build(config, path, config.incarnation, config.tp_init_method, device)
    except (ModelError, ValueError) as exc:
        print(f"error: rank {config.tp_rank}: {exc}", file=sys.stderr)
        return 2
    freeze_start_up()  # the model's modules and tensors: never traversed again
    code = serve_worker(runner, runner.model.tp)
    if code == 0:
        runner.model.tp.close()
    return code


if __name__ == "__main__":
    sys.exit(main())
