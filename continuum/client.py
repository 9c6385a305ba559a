"""``continuum generate``: stream one answer over gRPC to stdout.

The channel runs the contract's service config (protos/service_config.py): a refusal
(RESOURCE_EXHAUSTED, UNAVAILABLE) before the first token is retried by gRPC itself, after
the server's pushback; once tokens have been printed, a failure ends the command.
"""

from __future__ import annotations

import argparse
import sys

import grpc

from protos import service_config
from protos.continuum.v1 import generation_pb2 as gen
from protos.continuum.v1 import generation_pb2_grpc


def build_request(args: argparse.Namespace) -> gen.GenerateRequest:
    req = gen.GenerateRequest(max_tokens=args.max_tokens)
    if args.raw:
        req.prompt = args.prompt
    else:
        if args.system is not None:
            req.chat.messages.add(role="system", content=args.system)
        req.chat.messages.add(role="user", content=args.prompt)
    req.sampling.temperature = args.temperature
    if args.top_p is not None:
        req.sampling.top_p = args.top_p
    if args.seed is not None:
        req.sampling.seed = args.seed
    return req


def generate(args: argparse.Namespace) -> int:
    with grpc.insecure_channel(args.addr, options=service_config.channel_options()) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        try:
            for resp in stub.Generate(build_request(args), timeout=args.timeout):
                sys.stdout.write(resp.text)
                sys.stdout.flush()
        except grpc.RpcError as err:
            print(file=sys.stderr)
            if err.code() == grpc.StatusCode.UNAVAILABLE:
                print(f"continuum: no server answers at {args.addr} ({err.details()}); start "
                      "one with `continuum serve`", file=sys.stderr)
            else:
                print(f"continuum: {err.code().name}: {err.details()}", file=sys.stderr)
            return 1
    sys.stdout.write("\n")
    return 0
