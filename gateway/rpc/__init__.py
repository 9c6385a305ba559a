"""The gRPC front: `continuum.v1.Generation.Generate` for clients, with health and
reflection. `server.py` builds the grpc.aio server (servicer, interceptors, channel
options) and `rpc_limit.py` caps the calls in flight; gateway/app.py binds and starts it.
Each call goes through the same admit step as the HTTP API (gateway/admit/) and is run on
the replicas by the relay (gateway/routing/).
"""
