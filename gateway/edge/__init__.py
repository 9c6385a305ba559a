"""The edge both front ends stand behind: connection-level defences of the HTTP server
(header and body timeouts, connection caps, `http_edge.py`), per-client-address caps on
connections and streams (`client_limits.py`), and the liveness and readiness probes with
their own small listener (`probes.py`); their flags are gateway/config.py's fields. Nothing
here reads a request's body.
"""
