"""The command lines ``continuum serve`` gives its children: which of serve's flags the
scheduler, an executor (or standby) and the gateway each get, under their own names."""

from __future__ import annotations

import argparse
import os

from continuum import local_state, serve_tls
from gateway.edge import edge_flags
from protos import tiers
from scheduler_svc import kv_event_flags, plan_channel_flags


def telemetry_flags(a: argparse.Namespace) -> list[str]:
    dsn, _ = local_state.telemetry_store(a.telemetry_dsn, "--telemetry-dsn")
    if dsn in ("", "off"):
        return []
    if "://" not in dsn:
        os.makedirs(os.path.dirname(os.path.abspath(dsn)), mode=0o700, exist_ok=True)
    return ["--telemetry-dsn", dsn]


def queue_time_flags(args) -> list[str]:
    """The scheduler's per-tier queue-time bounds that were given on serve's command line."""
    flags = []
    for tier, name in enumerate(tiers.NAMES):
        value = getattr(args, f"max_queue_time_{name}_s", None)
        if value is not None:
            flags += [f"--max-queue-time-{tiers.flag_word(tier)}-s", str(value)]
        target = getattr(args, f"tpot_target_{name}_ms", None)  # the SLO-aware budget
        if target is not None:
            flags += [f"--tpot-target-{tiers.flag_word(tier)}-ms", str(target)]
    return flags


def scheduler_argv(a: argparse.Namespace, ipc: str) -> list[str]:
    return ["--ipc", ipc, "--host", a.scheduler_host, "--port", str(a.scheduler_port),
            "--max-num-seqs", str(a.max_num_seqs),
            "--max-num-batched-tokens", str(a.max_num_batched_tokens),
            "--chunk-size", str(a.chunk_size), "--policy", a.policy,
            "--grace-period", str(a.grace_period),
            *(["--max-num-waiting", str(a.max_num_waiting)]
              if a.max_num_waiting is not None else []),
            *(["--max-num-waiting-per-tenant", str(a.max_num_waiting_per_tenant)]
              if a.max_num_waiting_per_tenant is not None else []),
            *(["--max-step-failures", str(a.max_step_failures)]
              if a.max_step_failures is not None else []),
            *(["--stream-interval", str(a.stream_interval)]
              if a.stream_interval is not None else []),
            *queue_time_flags(a), *telemetry_flags(a),
            *(["--config-file", os.path.abspath(a.config_file)]
              if getattr(a, "config_file", None) else []),
            *(["--metrics-port", str(a.metrics_port)] if a.metrics_port >= 0 else []),
            *kv_event_flags.argv(a), *plan_channel_flags.argv(a),
            *serve_tls.scheduler_argv(a)]


def executor_argv(a: argparse.Namespace, *, standby: bool, model_dir: str, model_name: str,
                  ipc: str) -> list[str]:
    argv = ["--standby"] if standby else []
    argv += ["--model", model_dir, "--ipc", ipc, "--model-id", model_name,
             "--block-size", str(a.block_size), "--kv-cache-dtype", a.kv_cache_dtype,
             "--device", a.device,
             "--gpu-memory-utilization", str(a.gpu_memory_utilization),
             # A GPU executor profiles a step of the scheduler's largest size.
             "--max-num-batched-tokens", str(a.max_num_batched_tokens)]
    if a.kv_cache_bytes is not None:  # else the executor's default for its device
        argv += ["--kv-cache-bytes", str(a.kv_cache_bytes)]
    if getattr(a, "weight_format", None):
        argv += ["--weight-format", a.weight_format]
    if getattr(a, "swap_space_bytes", 0):  # the host (swap) pool: 0 disables swap
        argv += ["--host-kv-cache-bytes", str(a.swap_space_bytes)]
    argv += ["--tp-size", str(a.tp_size)]
    argv += ["--cpu-nice", str(getattr(a, "executor_nice", 0))]
    return argv + (["--threads", str(a.threads)] if a.threads else [])


def gateway_argv(a: argparse.Namespace, *, model_dir: str, model_name: str,
                 scheduler_addr: str) -> list[str]:
    return ["--model-dir", model_dir, "--model-name", model_name,
            "--scheduler", scheduler_addr,
            "--host", a.host, "--port", str(a.port), "--grace-period", str(a.grace_period),
            "--http-port", str(a.http_port),
            *(["--api-keys-file", a.api_keys_file] if a.api_keys_file else []),
            *edge_flags.to_argv(a)]

