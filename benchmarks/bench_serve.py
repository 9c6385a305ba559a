"""End-to-end streaming throughput of a running server, at fixed concurrency.

Each of C clients sends one chat request after another (greedy, ignore_eos,
fixed output length) for R rounds; prints output tokens/s, TTFT and TPOT
(vllm-bench definitions: TPOT = (E2E − TTFT) / (output tokens − 1)).

    .venv/bin/continuum serve &       # in another terminal
    .venv/bin/python -m benchmarks.bench_serve --concurrency 1 8 16 --max-tokens 64
    .venv/bin/python -m benchmarks.bench_serve --api openai   # the same over HTTP/SSE
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


def one_openai_request(client, max_tokens: int, i: int) -> tuple[float, float, int]:
    """The same request through the official openai client, streamed over SSE."""
    start = time.perf_counter()
    ttft = None
    stream = client.chat.completions.create(
        model="", stream=True, max_tokens=max_tokens, temperature=0,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
        messages=[{"role": "user", "content": f"Tell me fact number {i} about the ocean."}])
    n = 0
    for chunk in stream:
        if ttft is None and chunk.choices and chunk.choices[0].delta.content:
            ttft = time.perf_counter() - start
        if chunk.usage is not None:
            n = chunk.usage.completion_tokens
    return ttft, time.perf_counter() - start, n


def run(addr: str, concurrency: int, rounds: int, max_tokens: int,
        base_url: str | None = None) -> dict[str, float]:
    if base_url is not None:
        import openai

        target = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)
        request = one_openai_request
    else:
        channel = grpc.insecure_channel(addr)
        target = generation_pb2_grpc.GenerationStub(channel)
        request = one_request
    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        jobs = [pool.submit(request, target, max_tokens, i)
                for i in range(concurrency * rounds)]
        results = [j.result() for j in jobs]
    wall = time.perf_counter() - start
    if base_url is None:
        channel.close()
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
    p.add_argument("--addr", default="127.0.0.1:50051", help="gRPC address")
    p.add_argument("--api", choices=("grpc", "openai"), default="grpc")
    p.add_argument("--base-url", default="http://127.0.0.1:8000/v1",
                   help="OpenAI API base URL (with --api openai)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 16])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=64)
    a = p.parse_args()
    print(f"{'clients':>7} {'output tok/s':>12} {'TTFT p50 ms':>11} {'TTFT p99 ms':>11} "
          f"{'TPOT p50 ms':>11}")
    for c in a.concurrency:
        r = run(a.addr, c, a.rounds, a.max_tokens,
                a.base_url if a.api == "openai" else None)
        print(f"{c:>7} {r['tok_s']:>12.1f} {r['ttft_p50'] * 1e3:>11.0f} "
              f"{r['ttft_p99'] * 1e3:>11.0f} {r['tpot_p50'] * 1e3:>11.0f}")


if __name__ == "__main__":
    main()
