"""The gateway: Continuum's only client-facing process (docs/design.md §1).

It owns everything textual and relays token streams from a scheduler replica. The
modules are grouped by role (docs/architecture.md maps each one):

    __main__.py   CLI, startup errors (exit 2), SIGTERM/SIGINT drain
    app.py        start_gateway: binds the ports, wires gRPC + HTTP + probes, drains
    config.py     GatewayConfig, the one frozen config
    validation.py GenerateRequest → ValidatedRequest, or RequestError (status + message)
    metrics.py    its /metrics (families: runtime/metric_names.py); log_sampling.py: a
                  repeated line once a second
    rpc/          the gRPC front: Generation servicer, interceptors, the cap on calls
    api/          the OpenAI-compatible HTTP API: routes, dialects, fields, schema
    edge/         connection-level defences, per-client caps, their flags, probes
    admit/        the admit step both fronts run: API keys, routing headers, parse guard
    text/         tokenizer, chat template, special tokens, detokenizer, stop strings
    tools/        tool calling: reading tools in, parsing calls out
    structured/   structured-output specs compiled before admission, in worker processes
    routing/      scheduler replicas, the relay and failover, upstream status, watchdog
"""
