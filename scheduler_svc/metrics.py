"""The replica's own ``/metrics``, in vLLM's names, for inference gateways and load tools.

The Gateway API Inference Extension's endpoint picker and llm-d scrape every model-server
pod for ``vllm:num_requests_waiting``, ``vllm:num_requests_running``,
``vllm:kv_cache_usage_perc`` and ``vllm:cache_config_info`` (every 50 ms; a pod whose
metrics are older than 200 ms counts as saturated), and inference-perf reads vLLM's
latency histograms and preemption counters. This module serves them, with vLLM's names,
``model_name`` label and histogram buckets; ``continuum:`` names only for what is ours
(per-tier gauges, shed requests, telemetry drops).

Never by waiting on the loop: the loop renders the whole page every ``PUBLISH_S`` into
bytes (``publish``) and copies them into a shared file; a stdlib HTTP server in a child
process answers every scrape with the last bytes (``MetricsServer``,
scheduler_svc/metrics_server.py), so a scrape never waits for this process's GIL either.
A blocked loop makes the page stale, never the scrape slow;
``continuum:metrics_published_timestamp_seconds`` says how stale.

Latency histograms are fed when a request's stream ends (``Histograms.request_ended``,
from the servicer), in the request's own coroutine, not per step.
"""

from __future__ import annotations

import asyncio
import bisect
import math
import os
import subprocess
import sys
import tempfile
import time

from protos import tiers
from scheduler_svc import metrics_server

PUBLISH_S = 0.05
CONTENT_TYPE = metrics_server.CONTENT_TYPE
# vLLM's buckets (vllm/v1/metrics/loggers.py), so dashboards and alerts carry over.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
               7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                   50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
FINISHED = {1: "stop", 2: "length", 3: "abort", 4: "error"}


class Histogram:
    """Cumulative-bucket histogram; ``observe`` is a bisect and two adds."""

    __slots__ = ("buckets", "counts", "sum", "count")

    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1

    def lines(self, name: str, labels: str) -> list[str]:
        out, total = [], 0
        for bound, n in zip((*self.buckets, math.inf), self.counts, strict=True):
            total += n
            le = "+Inf" if bound == math.inf else repr(float(bound))
            out.append(f'{name}_bucket{{{labels},le="{le}"}} {total}')
        out += [f"{name}_sum{{{labels}}} {self.sum!r}", f"{name}_count{{{labels}}} {self.count}"]
        return out


class Histograms:
    """Per-request latencies and counts, as vLLM reports them."""

    def __init__(self) -> None:
        self.ttft = Histogram(TTFT_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)
        self.tpot = Histogram(ITL_BUCKETS)
        self.e2e = Histogram(REQUEST_BUCKETS)
        self.queue = Histogram(REQUEST_BUCKETS)
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.success = {name: 0 for name in FINISHED.values()}

    def request_ended(self, req, token_times: list[float], finish_reason: int | None) -> None:
        """A stream ended: ``token_times`` (monotonic) of its tokens as they were sent."""
        self.prompt_tokens += req.num_prompt_tokens
        self.generation_tokens += len(token_times)
        name = FINISHED.get(finish_reason or 0)
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
    label = f'model_name="{_escape(model_name or (known.model_id if known else ""))}"'
    lines = [*_vllm_lines(loop.core, known, histograms, label),
             *_histogram_lines(histograms, label), *_continuum_lines(loop, label)]
    return ("\n".join(lines) + "\n").encode()


def _vllm_lines(core, known, histograms: Histograms, label: str) -> list[str]:
    """The families vLLM's own names, as gateways and load tools read them."""
    bm = core.block_manager
    usage = bm.usage if bm else 0.0
    block_size = bm.block_size if bm else 0
    return [
        *_metric("vllm:num_requests_running", "gauge", "Requests running on the executor.",
                 [(label, len(core.running))]),
        *_metric("vllm:num_requests_waiting", "gauge", "Requests waiting to start.",
                 [(label, len(core.waiting))]),
        *_metric("vllm:kv_cache_usage_perc", "gauge", "Fraction of KV blocks in use (0-1).",
                 [(label, usage)]),
        # Never zeros (a picker would read an empty pool): absent until an executor
        # registered, then the last one's pool.
        *_metric("vllm:cache_config_info", "gauge", "KV cache configuration.",
                 [(f'{label},block_size="{known.model.block_size}",num_gpu_blocks='
                   f'"{known.model.num_blocks}"', 1)] if known else []),
        *_metric("vllm:num_preemptions_total", "counter", "Preemptions.",
                 [(label, core.num_preemptions)]),
        *_metric("vllm:prompt_tokens_total", "counter", "Prompt tokens of ended requests.",
                 [(label, histograms.prompt_tokens)]),
        *_metric("vllm:generation_tokens_total", "counter", "Generated tokens.",
                 [(label, histograms.generation_tokens)]),
        *_metric("vllm:prefix_cache_queries_total", "counter",
                 "Prompt tokens looked up in the prefix cache.",
                 [(label, (bm.num_cache_queries if bm else 0) * block_size)]),
        *_metric("vllm:prefix_cache_hits_total", "counter",
                 "Prompt tokens found in the prefix cache.",
                 [(label, (bm.num_cache_hits if bm else 0) * block_size)]),
        *_metric("vllm:request_success_total", "counter", "Requests ended, by reason.",
                 [(f'{label},finished_reason="{k}"', v) for k, v in histograms.success.items()]),
    ]


def _histogram_lines(histograms: Histograms, label: str) -> list[str]:
    lines = []
    for name, text, hist in (
            ("vllm:time_to_first_token_seconds", "Time to first token.", histograms.ttft),
            ("vllm:inter_token_latency_seconds", "Gaps between tokens.", histograms.itl),
            ("vllm:time_per_output_token_seconds", "Mean gap per request.", histograms.tpot),
            ("vllm:e2e_request_latency_seconds", "Arrival to last token.", histograms.e2e),
            ("vllm:request_queue_time_seconds", "Arrival to first step.", histograms.queue)):
        lines += [f"# HELP {name} {text}", f"# TYPE {name} histogram", *hist.lines(name, label)]
    return lines


def _continuum_lines(loop, label: str) -> list[str]:
    """Continuum's own families: tiers, preemption causes, faults, channels, drops."""
    core, recorder, plans = loop.core, loop.recorder, loop.link.plans
    running_by_tier, waiting_by_tier = [0] * tiers.NUM_TIERS, [0] * tiers.NUM_TIERS
    last = tiers.NUM_TIERS - 1
    for req in core.running:
        running_by_tier[min(req.priority_tier, last)] += 1
    for req in core.waiting:
        waiting_by_tier[min(req.priority_tier, last)] += 1
    return [
        *_metric("continuum:num_requests_running_by_tier", "gauge", "Running, per tier.",
                 [(f'{label},tier="{t}"', n) for t, n in zip(tiers.NAMES, running_by_tier,
                                                             strict=True)]),
        *_metric("continuum:num_requests_waiting_by_tier", "gauge", "Waiting, per tier.",
                 [(f'{label},tier="{t}"', n) for t, n in zip(tiers.NAMES, waiting_by_tier,
                                                             strict=True)]),
        *_metric("continuum:num_preemptions_by_reason_total", "counter",
                 "Preemptions by cause (kv_full, priority, ...) and kind (swap, recompute).",
                 [(f'{label},reason="{r}",kind="{k}"', n) for (r, k), n in sorted(
                     (tuple(key.split(":", 1)), n)
                     for key, n in core.preemptions_by_reason.items())]),
        *_metric("continuum:prefill_alert_steps_total", "counter",
                 "Steps whose prefill tokens passed prefill_alert_tokens.",
                 [(label, core.num_prefill_alerts)]),
        *_metric("continuum:swap_cap_fallbacks_total", "counter",
                 "Preemptions that recomputed because max_swapped sequences were swapped.",
                 [(label, core.lifecycle.num_swap_cap_fallbacks)]),
        *_metric("continuum:num_requests_shed_total", "counter",
                 "Queued requests refused after waiting past twice their tier's bound.",
                 [(label, core.admission.num_shed)]),
        *_metric("continuum:failed_steps_total", "counter",
                 "Steps the executor failed as a whole (raised, hung, died).",
                 [(label, loop.faults.num_failed_steps)]),
        *_metric("continuum:resyncs_total", "counter",
                 "Refused or failed plans after which every running sequence recomputed.",
                 [(label, loop.faults.num_resyncs)]),
        *_metric("continuum:recomputed_tokens_total", "counter",
                 "Tokens whose KV was dropped and computed again.",
                 [(label, core.num_recomputed_tokens)]),
        *_metric("continuum:row_failures_total", "counter",
                 "Requests ended alone by a failure of their own row inside a step.",
                 [(label, loop.faults.num_row_failures)]),
        *_metric("continuum:telemetry_dropped_total", "counter",
                 "Telemetry records dropped (the writer's queue was full).",
                 [(label, recorder.writer.num_dropped if recorder else 0)]),
        *_metric("continuum:plans_sent_total", "counter",
                 "Batch plans sent to the executor, by channel (shm: through the shared-memory "
                 "ring; zmq: over ZeroMQ, where no ring is attached or one did not take it).",
                 [(f'{label},channel="shm"', plans.num_ring_plans),
                  (f'{label},channel="zmq"', plans.num_zmq_plans)]),
        *_metric("continuum:kv_events_dropped_total", "counter",
                 "KV cache events not published (the publisher's queue was full).",
                 [(label, core.kv_events.num_dropped if core.kv_events else 0)]),
        *_stream_lines(loop.streams, label),
        *_gc_lines(loop.gc, label),
        *_metric("continuum:metrics_published_timestamp_seconds", "gauge",
                 "When this page was rendered (Unix time).", [(label, time.time())]),
    ]


def _stream_lines(streams, label: str) -> list[str]:
    """How gateways' requests arrive: SubmitMany's calls and streams."""
    return [
        *_metric("continuum:submit_many_calls", "gauge",
                 "SubmitMany calls open (gateways sending their requests on one call each).",
                 [(label, streams.num_many_calls)]),
        *_metric("continuum:submit_many_streams_total", "counter",
                 "Requests queued from SubmitMany streams (the rest came on Submit calls).",
                 [(label, streams.num_many_streams)]),
    ]


def _gc_lines(gc, label: str) -> list[str]:
    """The scheduler's paced garbage collections (scheduler_svc/gc_pacing.py)."""
    return [
        *_metric("continuum:gc_collections_total", "counter",
                 "Garbage collections run off the step path, by generation (gc_pacing.py).",
                 [(f'{label},generation="{g}"', n) for g, n in enumerate(gc.collections)]),
        *_metric("continuum:gc_seconds_total", "counter",
                 "Time those collections took.", [(label, gc.seconds)]),
    ]


def _metric(name: str, kind: str, text: str, samples) -> list[str]:
    return [f"# HELP {name} {text}", f"# TYPE {name} {kind}",
            *(f"{name}{{{labels}}} {float(value)!r}" for labels, value in samples)]


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


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
