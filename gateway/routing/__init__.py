"""The scheduler replicas and the relay to them: the replica set, its polled Stats and
least-loaded choice (`replicas.py`), the channel options and the mapping of upstream
status to client status (`upstream.py`), the relay that runs a validated request on a
replica with failover as a continuation (`relay.py`), and per-stream progress deadlines
(`watchdog.py`). Both front ends hand their admitted requests to the relay.
"""
