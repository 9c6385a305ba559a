"""What stands in front of both APIs before a body is read: HTTP connection defences,
per-client caps, and the liveness and readiness probes."""
