"""The scheduler replicas and the relay to them: replica choice, upstream status, failover
as a continuation, per-stream progress deadlines."""
