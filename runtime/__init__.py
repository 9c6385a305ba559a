"""Runtime code the service processes share that is no contract: the internal plane's
HMAC authentication (internal_auth), TLS for every listener (tls), ZeroMQ socket
lifetimes (zmq_sockets), a process's CPU priority (cpu_priority), its start-up heap taken
out of garbage collection (gc_freeze), the shared-memory ring plans travel through
(shm_ring, plan_ring), the log format (log_setup) and the Prometheus exposition with its
name table (metrics, metric_names). Contracts (the messages, the framing, the shared
limits and checks) are protos/'s; the telemetry store is telemetry/'s."""
