"""``make reliability``: the evidence that Continuum survives hostile clients and bad neighbours.

One command runs five rows against real processes on loopback and prints one table
(markdown on stdout, JSON beside it): overload at 10x measured capacity, a soak with
random cancels and disconnects, hypothesis fuzzing of every entry point (HTTP, gRPC,
both ends of the ZeroMQ channel), a chaos matrix of process faults, and the
hostile-traffic ITL benchmark. ``docs/reliability.md`` says what each row measures.

Modules: ``procs`` starts and inspects servers, ``streams`` is the client side (one
outcome per stream), one module per row, ``report`` renders the table.
"""
