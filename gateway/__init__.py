"""The gateway: Continuum's only client-facing process (docs/design.md §1).

It owns everything textual and relays token streams from a scheduler replica:

    __main__.py       CLI, startup errors (exit 2), SIGTERM/SIGINT drain
    config.py         GatewayConfig, the one frozen config
    app.py            start_gateway: binds the ports, wires gRPC + HTTP + probes, drains
    server.py         grpc.aio Generation servicer, interceptors, health, reflection
    rpc_limit.py      the cap on gRPC calls in flight (RESOURCE_EXHAUSTED + retry hint)
    validation.py     GenerateRequest → ValidatedRequest, or RequestError (status + message)
    upstream.py       scheduler channel options; upstream status → client status
    output_stream.py  TokenEvents → GenerateResponses (detokenize, stop strings, usage)
    detokenizer.py    incremental detokenization (prefix/read offsets)
    stop_strings.py   stop-string matching across deltas
    tokenizer.py      tokenizer.json / tokenizer_config.json / config.json loading
    chat_template.py  sandboxed jinja chat templates, transformers-compatible
    log_setup.py      structlog JSON lines on stderr
"""
