"""Prefix caching and swap in the simulator: shared prompts hit the cache, a tight device
pool swaps to the host pool and back, and every request still finishes."""

from __future__ import annotations

from sim.engine import Simulation, policy_config
from sim.prefix_trace import with_prefixes
from sim.workload import poisson_class
from tests.sim.test_profile import make_profile


def trace(n_per_s: float = 1.5, seconds: float = 90.0):
    return poisson_class(n_per_s, seconds, 1200, 60, "default", 1, seed=5)


def test_synthesized_contents_keep_lengths_and_share_prefixes():
    base = trace()
    shared, stats = with_prefixes(base, seed=1)
    assert [(r.arrival_s, r.num_prompt_tokens, r.num_output_tokens) for r in shared] == \
        [(r.arrival_s, r.num_prompt_tokens, r.num_output_tokens) for r in base]
    assert all(len(r.prompt_ids) == r.num_prompt_tokens for r in shared)
    assert stats.continuations > 0 and stats.with_system_prompt > 0
    assert with_prefixes(base, seed=1)[0] == shared  # deterministic in the seed
    assert "of prompt tokens are shared" in stats.line()


def test_prefix_hits_appear_only_when_prompts_share():
    base = trace()
    shared, stats = with_prefixes(base, seed=1)
    cost = make_profile()
    plain = Simulation(base, policy_config("chunked", 32), cost).run()
    hits = Simulation(shared, policy_config("chunked", 32), cost).run()
    assert plain.prefix_hit_tokens == 0
    assert 0 < hits.prefix_hit_tokens <= stats.shared_tokens
    for res in (plain, hits):  # every request finished or was refused (queue-time bound)
        assert len(res.finished) + len(res.rejected) == len(base)
        assert len(res.finished) > 0.9 * len(base)
    off = Simulation(shared, policy_config("chunked", 32, enable_prefix_caching=False),
                     cost).run()
    assert off.prefix_hit_tokens == 0


def test_swap_ins_happen_under_pressure():
    # Long answers outgrow a 300-block pool (4,800 tokens for 32 running sequences);
    # no queue-time bound, so every request is admitted and must finish.
    reqs = poisson_class(2.0, 20.0, 200, 400, "default", 1, seed=5)
    cost = make_profile()
    cfg = policy_config("continuous", 32, max_queue_time_standard_s=0)
    swapped = Simulation(reqs, cfg, cost, num_blocks=300, num_host_blocks=2000).run()
    assert swapped.num_preemptions > 0
    assert swapped.num_swapped_in_blocks > 0
    assert swapped.num_swapped_out_blocks >= swapped.num_swapped_in_blocks
    assert len(swapped.finished) == len(reqs)
    assert swapped.num_output_tokens == sum(r.num_output_tokens for r in reqs)
    recompute = Simulation(reqs, cfg, cost, num_blocks=300, num_host_blocks=0).run()
    assert recompute.num_swapped_in_blocks == recompute.num_swapped_out_blocks == 0
    assert recompute.num_preemptions > 0 and len(recompute.finished) == len(reqs)
