"""Every metric family Continuum exports, once: name, type, labels, help and buckets, in
the table of the process that exports it (``REPLICA``: scheduler_svc/metrics.py;
``GATEWAY``: gateway/metrics.py). The naming rule and the readers of each family are in
docs/usage.md "Metrics"; tests/test_metric_names.py holds the pages and the docs to this.
"""

from __future__ import annotations

from runtime.metrics import COUNTER, GAUGE, HISTOGRAM, Family

# vLLM's buckets (vllm/v1/metrics/loggers.py), so dashboards and alerts carry over.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
               7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                   50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)

# -- the replica's page: vLLM's families, names and buckets ----------------------------------
# The GIE endpoint picker and llm-d read the first four: their bytes are a contract.

RUNNING = Family("vllm:num_requests_running", GAUGE, "Requests running on the executor.")
WAITING = Family("vllm:num_requests_waiting", GAUGE, "Requests waiting to start.")
KV_USAGE = Family("vllm:kv_cache_usage_perc", GAUGE, "Fraction of KV blocks in use (0-1).")
CACHE_CONFIG = Family("vllm:cache_config_info", GAUGE, "KV cache configuration.",
                      ("model_name", "block_size", "num_gpu_blocks"))
PREEMPTIONS = Family("vllm:num_preemptions", COUNTER, "Preemptions.")
PROMPT_TOKENS = Family("vllm:prompt_tokens", COUNTER, "Prompt tokens of ended requests.")
GENERATION_TOKENS = Family("vllm:generation_tokens", COUNTER, "Generated tokens.")
PREFIX_QUERIES = Family("vllm:prefix_cache_queries", COUNTER,
                        "Prompt tokens looked up in the prefix cache.")
PREFIX_HITS = Family("vllm:prefix_cache_hits", COUNTER, "Prompt tokens found in the prefix cache.")
SUCCESS = Family("vllm:request_success", COUNTER, "Requests ended, by reason.",
                 ("model_name", "finished_reason"))
TTFT = Family("vllm:time_to_first_token_seconds", HISTOGRAM, "Time to first token.",
              buckets=TTFT_BUCKETS)
ITL = Family("vllm:inter_token_latency_seconds", HISTOGRAM, "Gaps between tokens.",
             buckets=ITL_BUCKETS)
TPOT = Family("vllm:time_per_output_token_seconds", HISTOGRAM, "Mean gap per request.",
              buckets=ITL_BUCKETS)
E2E = Family("vllm:e2e_request_latency_seconds", HISTOGRAM, "Arrival to last token.",
             buckets=REQUEST_BUCKETS)
QUEUE = Family("vllm:request_queue_time_seconds", HISTOGRAM, "Arrival to first step.",
               buckets=REQUEST_BUCKETS)

# -- the replica's page: ours ----------------------------------------------------------------

RUNNING_BY_TIER = Family("continuum:num_requests_running_by_tier", GAUGE, "Running, per tier.",
                         ("model_name", "tier"))
WAITING_BY_TIER = Family("continuum:num_requests_waiting_by_tier", GAUGE, "Waiting, per tier.",
                         ("model_name", "tier"))
PREEMPTIONS_BY_REASON = Family(
    "continuum:num_preemptions_by_reason", COUNTER,
    "Preemptions by cause (kv_full, priority, ...) and kind (swap, recompute).",
    ("model_name", "reason", "kind"))
PREFILL_ALERTS = Family("continuum:prefill_alert_steps", COUNTER,
                        "Steps whose prefill tokens passed prefill_alert_tokens.")
SWAP_CAP_FALLBACKS = Family(
    "continuum:swap_cap_fallbacks", COUNTER,
    "Preemptions that recomputed because max_swapped sequences were swapped.")
SHED = Family("continuum:num_requests_shed", COUNTER,
              "Queued requests refused after waiting past twice their tier's bound.")
FAILED_STEPS = Family("continuum:failed_steps", COUNTER,
                      "Steps the executor failed as a whole (raised, hung, died).")
RESYNCS = Family("continuum:resyncs", COUNTER,
                 "Refused or failed plans after which every running sequence recomputed.")
RECOMPUTED_TOKENS = Family("continuum:recomputed_tokens", COUNTER,
                           "Tokens whose KV was dropped and computed again.")
ROW_FAILURES = Family("continuum:row_failures", COUNTER,
                      "Requests ended alone by a failure of their own row inside a step.")
TELEMETRY_DROPPED = Family("continuum:telemetry_dropped", COUNTER,
                           "Telemetry records dropped (the writer's queue was full).")
PLANS_SENT = Family(
    "continuum:plans_sent", COUNTER,
    "Batch plans sent to the executor, by channel (shm: through the shared-memory ring; "
    "zmq: over ZeroMQ, where no ring is attached or one did not take it).",
    ("model_name", "channel"))
KV_EVENTS_DROPPED = Family("continuum:kv_events_dropped", COUNTER,
                           "KV cache events not published (the publisher's queue was full).")
SUBMIT_MANY_CALLS = Family(
    "continuum:submit_many_calls", GAUGE,
    "SubmitMany calls open (gateways sending their requests on one call each).")
SUBMIT_MANY_STREAMS = Family(
    "continuum:submit_many_streams", COUNTER,
    "Requests queued from SubmitMany streams (the rest came on Submit calls).")
GC_COLLECTIONS = Family(
    "continuum:gc_collections", COUNTER,
    "Garbage collections run off the step path, by generation (gc_pacing.py).",
    ("model_name", "generation"))
GC_SECONDS = Family("continuum:gc_seconds", COUNTER, "Time those collections took.")
PUBLISHED_AT = Family("continuum:metrics_published_timestamp_seconds", GAUGE,
                      "When this page was rendered (Unix time).")

REPLICA = (RUNNING, WAITING, KV_USAGE, CACHE_CONFIG, PREEMPTIONS, PROMPT_TOKENS,
           GENERATION_TOKENS, PREFIX_QUERIES, PREFIX_HITS, SUCCESS, TTFT, ITL, TPOT, E2E, QUEUE,
           RUNNING_BY_TIER, WAITING_BY_TIER, PREEMPTIONS_BY_REASON, PREFILL_ALERTS,
           SWAP_CAP_FALLBACKS, SHED, FAILED_STEPS, RESYNCS, RECOMPUTED_TOKENS, ROW_FAILURES,
           TELEMETRY_DROPPED, PLANS_SENT, KV_EVENTS_DROPPED, SUBMIT_MANY_CALLS,
           SUBMIT_MANY_STREAMS, GC_COLLECTIONS, GC_SECONDS, PUBLISHED_AT)

# -- the gateway's page: what it measures, per request --------------------------------------

_REQUEST = ("model_name", "priority")  # priority: the tier's name (protos/tiers.py NAMES)
GATEWAY_MODEL_INFO = Family("continuum_gateway_model_info", GAUGE,
                            "The served model: always 1, its facts in labels.",
                            ("model_name", "max_model_len"))
GATEWAY_TTFT = Family("continuum_gateway_time_to_first_token_seconds", HISTOGRAM,
                      "Time from the gateway accepting a request to its first token.",
                      _REQUEST, TTFT_BUCKETS)
GATEWAY_ITL = Family("continuum_gateway_inter_token_latency_seconds", HISTOGRAM,
                     "Time between consecutive token messages of a stream.",
                     _REQUEST, ITL_BUCKETS)
GATEWAY_E2E = Family("continuum_gateway_e2e_request_latency_seconds", HISTOGRAM,
                     "Time from accepting a request to its last message.",
                     _REQUEST, REQUEST_BUCKETS)
GATEWAY_QUEUE = Family("continuum_gateway_request_queue_time_seconds", HISTOGRAM,
                       "Time waited in the scheduler queue before the first step.",
                       _REQUEST, REQUEST_BUCKETS)
GATEWAY_PROMPT_TOKENS = Family("continuum_gateway_prompt_tokens", COUNTER,
                               "Prompt tokens of accepted requests.", _REQUEST)
GATEWAY_GENERATION_TOKENS = Family("continuum_gateway_generation_tokens", COUNTER,
                                   "Tokens generated and sent to clients.", _REQUEST)
GATEWAY_SUCCESS = Family("continuum_gateway_request_success", COUNTER,
                         "Completions finished, by finish reason (stop, length, abort).",
                         (*_REQUEST, "finished_reason"))
GATEWAY_ERRORS = Family("continuum_gateway_request_errors", COUNTER,
                        "Requests ended with an error, by gRPC status code name.",
                        ("model_name", "code"))
GATEWAY_PARSE_ERRORS = Family(
    "continuum_gateway_request_parse_errors", COUNTER,
    "Requests whose parsing or validation raised something unexpected (answered 400 by "
    "gateway/admit/parse_guard.py); any growth is a gap in a check, worth a look.",
    ("model_name", "api"))
GATEWAY_INTERVENTIONS = Family(
    "continuum_gateway_stream_interventions", COUNTER,
    "Streams the gateway ended or moved on its own: replica_stalled (moved to another "
    "replica), slow_reader (client stopped reading: cancelled), shutdown (still running "
    "when drain's grace period ran out: ended with an error).",
    ("model_name", "reason"))

# -- the gateway's page: each replica's Stats, as it last read them ------------------------
# Several gateways report the same replicas: aggregate with `max by (replica)`, not `sum`.

_REPLICA = ("model_name", "replica")
GATEWAY_REPLICA_RUNNING = Family("continuum:num_requests_running", GAUGE,
                                 "Sequences in the replica's running batch.",
                                 ("model_name", "priority", "replica"))
GATEWAY_REPLICA_WAITING = Family("continuum:num_requests_waiting", GAUGE,
                                 "Requests queued (or swapped out) at the replica.",
                                 ("model_name", "priority", "replica"))
GATEWAY_REPLICA_KV_USAGE = Family("continuum:kv_cache_usage_perc", GAUGE,
                                  "Fraction of the replica's KV blocks in use (1 = full).",
                                  _REPLICA)
GATEWAY_REPLICA_PREEMPTIONS = Family("continuum:num_preemptions", COUNTER,
                                     "Preemptions at the replica since it started.", _REPLICA)
GATEWAY_REPLICA_UPDATE_FALLBACKS = Family(
    "continuum:scheduler_update_fallbacks", COUNTER,
    "Executor answers that did not list the samples the plan asked for (applied one "
    "sequence at a time); steady growth means an executor answers out of plan.", _REPLICA)
GATEWAY_REPLICA_HEALTHY = Family("continuum:replica_healthy", GAUGE,
                                 "1 if the gateway routes to the replica, else 0.", _REPLICA)

GATEWAY = (GATEWAY_MODEL_INFO, GATEWAY_TTFT, GATEWAY_ITL, GATEWAY_E2E, GATEWAY_QUEUE,
           GATEWAY_PROMPT_TOKENS, GATEWAY_GENERATION_TOKENS, GATEWAY_SUCCESS, GATEWAY_ERRORS,
           GATEWAY_PARSE_ERRORS, GATEWAY_INTERVENTIONS, GATEWAY_REPLICA_RUNNING,
           GATEWAY_REPLICA_WAITING, GATEWAY_REPLICA_KV_USAGE, GATEWAY_REPLICA_PREEMPTIONS,
           GATEWAY_REPLICA_UPDATE_FALLBACKS, GATEWAY_REPLICA_HEALTHY)
