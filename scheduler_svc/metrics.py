"""The replica's own ``/metrics``, in vLLM's names, for inference gateways and load tools.

The Inference Extension's endpoint picker and llm-d scrape every pod for vLLM's queue and
KV gauges (every 50 ms; metrics older than 200 ms read as saturated), inference-perf its
latency histograms and preemption counters: served here with vLLM's names, labels and
buckets; ``continuum:`` only for what is ours (runtime/metric_names.py ``REPLICA``).

Never by waiting on the loop: the loop renders the page every ``PUBLISH_S`` into a shared
file, and a child process answers scrapes from it (scheduler_svc/metrics_server.py). A
blocked loop makes the page stale (``continuum:metrics_published_timestamp_seconds``),
never the scrape slow. Latency histograms are fed as a stream ends, not per step.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import tempfile
import time

from protos import tiers
from runtime import metric_names as names
from runtime.metrics import Histogram
from scheduler_svc import metrics_server
from scheduler_svc.telemetry import FINISH_NAMES

PUBLISH_S = 0.05


class Histograms:
    """Per-request latencies and counts, as vLLM reports them (unlabelled here: the page
    labels them with the model's name when it renders)."""

    def __init__(self) -> None:
        self.ttft = Histogram(names.TTFT.buckets)
        self.itl = Histogram(names.ITL.buckets)
        self.tpot = Histogram(names.TPOT.buckets)
        self.e2e = Histogram(names.E2E.buckets)
        self.queue = Histogram(names.QUEUE.buckets)
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.success = {name: 0 for name in FINISH_NAMES.values()}

    def request_ended(self, req, token_times: list[float], finish_reason: int | None) -> None:
        """A stream ended: ``token_times`` (monotonic) of its tokens as they were sent."""
        self.prompt_tokens += req.num_prompt_tokens
        self.generation_tokens += len(token_times)
        name = FINISH_NAMES.get(finish_reason or 0)
        if name is not None:
            self.success[name] += 1
        if req.first_scheduled_time is not None:
            self.queue.observe(req.first_scheduled_time - req.arrival_time)
        if not token_times:
            return
        self.ttft.observe(token_times[0] - req.arrival_time)
        self.e2e.observe(token_times[-1] - req.arrival_time)
        for a, b in zip(token_times, token_times[1:], strict=False):
            self.itl.observe(b - a)
        if len(token_times) > 1:
            self.tpot.observe((token_times[-1] - token_times[0]) / (len(token_times) - 1))


def render(loop, histograms: Histograms, model_name: str) -> bytes:
    """The whole page, from the loop's state at this moment (call on the loop)."""
    known = loop.executor or loop.last_executor  # the pool a restarting executor returns with
    model = (model_name or (known.model_id if known else ""),)
    return "".join([*_vllm_lines(loop.core, known, histograms, model),
                    *_continuum_lines(loop, model)]).encode()


def _vllm_lines(core, known, histograms: Histograms, model: tuple[str]) -> list[str]:
    """The families in vLLM's own names, as gateways and load tools read them."""
    bm = core.block_manager
    block_size = bm.block_size if bm else 0
    # Never zeros (a picker would read an empty pool): absent until an executor
    # registered, then the last one's pool.
    pool = [((*model, str(known.model.block_size), str(known.model.num_blocks)), 1)
            ] if known else []
    return [
        names.RUNNING.lines([(model, len(core.running))]),
        names.WAITING.lines([(model, len(core.waiting))]),
        names.KV_USAGE.lines([(model, bm.usage if bm else 0.0)]),
        names.CACHE_CONFIG.lines(pool),
        names.PREEMPTIONS.lines([(model, core.num_preemptions)]),
        names.PROMPT_TOKENS.lines([(model, histograms.prompt_tokens)]),
        names.GENERATION_TOKENS.lines([(model, histograms.generation_tokens)]),
        names.PREFIX_QUERIES.lines(
            [(model, (bm.num_cache_queries if bm else 0) * block_size)]),
        names.PREFIX_HITS.lines([(model, (bm.num_cache_hits if bm else 0) * block_size)]),
        names.SUCCESS.lines([((*model, k), v) for k, v in histograms.success.items()]),
        names.TTFT.lines([(model, histograms.ttft)]),
        names.ITL.lines([(model, histograms.itl)]),
        names.TPOT.lines([(model, histograms.tpot)]),
        names.E2E.lines([(model, histograms.e2e)]),
        names.QUEUE.lines([(model, histograms.queue)]),
    ]


def _continuum_lines(loop, model: tuple[str]) -> list[str]:
    """Continuum's own families: tiers, preemption causes, faults, channels, drops."""
    core, recorder, plans = loop.core, loop.recorder, loop.link.plans
    running_by_tier, waiting_by_tier = [0] * tiers.NUM_TIERS, [0] * tiers.NUM_TIERS
    last = tiers.NUM_TIERS - 1
    for req in core.running:
        running_by_tier[min(req.priority_tier, last)] += 1
    for req in core.waiting:
        waiting_by_tier[min(req.priority_tier, last)] += 1
    by_reason = sorted((tuple(key.split(":", 1)), n)
                       for key, n in core.preemptions_by_reason.items())
    streams, gc = loop.streams, loop.gc
    return [
        names.RUNNING_BY_TIER.lines(
            [((*model, t), n) for t, n in zip(tiers.NAMES, running_by_tier, strict=True)]),
        names.WAITING_BY_TIER.lines(
            [((*model, t), n) for t, n in zip(tiers.NAMES, waiting_by_tier, strict=True)]),
        names.PREEMPTIONS_BY_REASON.lines([((*model, *cause), n) for cause, n in by_reason]),
        names.PREFILL_ALERTS.lines([(model, core.num_prefill_alerts)]),
        names.SWAP_CAP_FALLBACKS.lines([(model, core.lifecycle.num_swap_cap_fallbacks)]),
        names.SHED.lines([(model, core.admission.num_shed)]),
        names.FAILED_STEPS.lines([(model, loop.faults.num_failed_steps)]),
        names.RESYNCS.lines([(model, loop.faults.num_resyncs)]),
        names.RECOMPUTED_TOKENS.lines([(model, core.num_recomputed_tokens)]),
        names.ROW_FAILURES.lines([(model, loop.faults.num_row_failures)]),
        names.TELEMETRY_DROPPED.lines(
            [(model, recorder.writer.num_dropped if recorder else 0)]),
        names.PLANS_SENT.lines([((*model, "shm"), plans.num_ring_plans),
                                ((*model, "zmq"), plans.num_zmq_plans)]),
        names.KV_EVENTS_DROPPED.lines(
            [(model, core.kv_events.num_dropped if core.kv_events else 0)]),
        # How gateways' requests arrive: SubmitMany's calls and streams.
        names.SUBMIT_MANY_CALLS.lines([(model, streams.num_many_calls)]),
        names.SUBMIT_MANY_STREAMS.lines([(model, streams.num_many_streams)]),
        # The scheduler's paced garbage collections (scheduler_svc/gc_pacing.py).
        names.GC_COLLECTIONS.lines(
            [((*model, str(g)), n) for g, n in enumerate(gc.collections)]),
        names.GC_SECONDS.lines([(model, gc.seconds)]),
        names.PUBLISHED_AT.lines([(model, time.time())]),
    ]


class MetricsServer:
    """``GET /metrics`` from the last published page, served by a child process
    (scheduler_svc/metrics_server.py: no scrape waits for this process's GIL).

    Binds at construction: OSError (with errno and strerror) when it cannot. Setting
    ``page`` publishes; the child exits with this process or at ``stop``."""

    def __init__(self, host: str, port: int) -> None:
        shm = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
        fd, path = tempfile.mkstemp(prefix="continuum-metrics-", dir=shm)
        # Unnamed at once: the child gets the descriptor, and nothing is left in /dev/shm
        # however either process ends (a kill during start-up included).
        os.unlink(path)
        try:
            self._file = metrics_server.PageFile(fd, create=True)
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "scheduler_svc.metrics_server", "--page-file",
                 f"/dev/fd/{fd}", "--host", host, "--port", str(port),
                 "--parent-pid", str(os.getpid())],
                stdout=subprocess.PIPE, text=True, pass_fds=(fd,))
        finally:
            os.close(fd)
        first = self._proc.stdout.readline().split(" ", 2)
        if first[0] != "listening":
            self.stop()
            raise OSError(int(first[1]) if len(first) > 1 else 0,
                          first[2].strip() if len(first) > 2 else "the server did not start")
        self.port = int(first[1])
        self._page = b""

    @property
    def page(self) -> bytes:
        return self._page

    @page.setter
    def page(self, page: bytes) -> None:
        self._page = page
        self._file.write(page)

    def start(self) -> None:
        """Serving since construction (kept for the callers' start/stop pairing)."""

    def stop(self) -> None:
        if self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._proc.stdout.close()
        self._file.close()


async def publish(loop, histograms: Histograms, server: MetricsServer,
                  model_name: str = "") -> None:
    """Renders the page every PUBLISH_S (a task on the loop; runs until cancelled)."""
    while True:
        server.page = render(loop, histograms, model_name)
        await asyncio.sleep(PUBLISH_S)
