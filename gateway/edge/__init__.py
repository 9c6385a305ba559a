"""The edge both front ends stand behind: connection-level defences of the HTTP server
(header and body timeouts, connection caps, `http_edge.py`), per-client-address caps on
connections and streams (`client_limits.py`), the flags that set them, shared with
`continuum serve` (`edge_flags.py`), and the liveness and readiness probes with their own
small listener (`probes.py`). Nothing here reads a request's body.
"""
