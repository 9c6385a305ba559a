"""Preemption on the real engine: a KV pool too small for the batch forces
recompute preemptions, and greedy outputs stay identical to a roomy pool."""

from __future__ import annotations

import concurrent.futures

import pytest

from tests.integration.conftest import start_server
from tests.integration.test_serve import chat, collect, wait_until_idle

pytestmark = pytest.mark.integration

QUESTIONS = [f"List {i + 3} fruits." for i in range(6)]


def answers(server) -> list[list[int]]:
    with concurrent.futures.ThreadPoolExecutor(len(QUESTIONS)) as pool:
        runs = pool.map(lambda q: collect(server, chat(q, max_tokens=40, ignore_eos=True)),
                        QUESTIONS)
        return [[t for r in responses for t in r.token_ids] for responses in runs]


def test_recompute_preemption_keeps_greedy_outputs_identical(server, tmp_path, model_dir):
    roomy = answers(server)
    # 6 sequences × ~80 tokens need ~30 blocks of 16; give the pool 20.
    small = start_server(tmp_path, model_dir, "--kv-cache-bytes", str(20 * 16 * 46080),
                         "--max-num-seqs", "8")
    try:
        tight = answers(small)
        stats = wait_until_idle(small)
        assert stats.num_preemptions > 0, "the small pool should have forced preemption"
        assert stats.num_free_blocks == stats.num_total_blocks
    finally:
        assert small.stop() == 0
    assert tight == roomy
