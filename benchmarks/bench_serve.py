"""End-to-end streaming throughput of a running server, at fixed concurrency.

Each of C clients sends one chat request after another (greedy, ignore_eos,
fixed output length) for R rounds; prints output tokens/s, TTFT and TPOT
(vllm-bench definitions: TPOT = (E2E − TTFT) / (output tokens − 1)).

    .venv/bin/continuum serve &       # in another terminal
    .venv/bin/python -m benchmarks.bench_serve --concurrency 1 8 16 --max-tokens 64
"""

from __future__ import annotations

import argparse
import concurrent.futures
import statistics
import time

import grpc

from protos.continuum.v1 import generation_pb2 as gen
from protos.continuum.v1 import generation_pb2_grpc


def one_request(stub, max_tokens: int, i: int) -> tuple[float, float, int]:
    req = gen.GenerateRequest(max_tokens=max_tokens)
    req.chat.messages.add(role="user", content=f"Tell me fact number {i} about the ocean.")
    req.sampling.temperature = 0.0
    req.sampling.ignore_eos = True
    start = time.perf_counter()
    ttft = None
    n = 0
    for resp in stub.Generate(req, timeout=600):
        if ttft is None and resp.token_ids:
            ttft = time.perf_counter() - start
        n += len(resp.token_ids)
    return ttft, time.perf_counter() - start, n


def run(addr: str, concurrency: int, rounds: int, max_tokens: int) -> dict[str, float]:
    with grpc.insecure_channel(addr) as ch:
        stub = generation_pb2_grpc.GenerationStub(ch)
        start = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
            jobs = [pool.submit(one_request, stub, max_tokens, i)
                    for i in range(concurrency * rounds)]
            results = [j.result() for j in jobs]
        wall = time.perf_counter() - start
    ttfts = sorted(r[0] for r in results)
    tpots = [(e2e - t) / (n - 1) for t, e2e, n in results if n > 1]
    return {
        "tok_s": sum(r[2] for r in results) / wall,
        "ttft_p50": statistics.median(ttfts),
        "ttft_p99": ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))],
        "tpot_p50": statistics.median(tpots),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--addr", default="127.0.0.1:50051")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 16])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=64)
    a = p.parse_args()
    print(f"{'clients':>7} {'output tok/s':>12} {'TTFT p50 ms':>11} {'TTFT p99 ms':>11} "
          f"{'TPOT p50 ms':>11}")
    for c in a.concurrency:
        r = run(a.addr, c, a.rounds, a.max_tokens)
        print(f"{c:>7} {r['tok_s']:>12.1f} {r['ttft_p50'] * 1e3:>11.0f} "
              f"{r['ttft_p99'] * 1e3:>11.0f} {r['tpot_p50'] * 1e3:>11.0f}")


if __name__ == "__main__":
    main()
