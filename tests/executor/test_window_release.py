"""Blocks behind every layer's sliding window go back to the pool, and nothing changes.

A tiny random Mistral (every layer windowed to 6 tokens) is served by the real scheduler
core and the real Runner, two plans in flight as in serving, 12 streams in a pool far too
small for their whole contexts. With the window announced (ModelInfo.kv_window, as the
executor's Hello sends it) the scheduler releases each sequence's blocks that fall wholly
before its window; other sequences take them while it still runs, every block no sequence
owns is filled with NaN between steps (so reading a released entry would show), and every
stream stays token-exact against transformers. The same pool without the window announced
holds fewer streams at once.
"""

from __future__ import annotations

import collections
import random
import shutil

import pytest
import torch
from tokenizers import Tokenizer

from executor_svc.models.decoder import DecoderModel
from harness.mini_scheduler import INCARNATION, hf_greedy, make_runner
from kernels import make_backend
from protos import wire
from protos.continuum.v1 import sampling_pb2
from scheduler_svc.core import ModelInfo, Request, Scheduler, SchedulerConfig
from scheduler_svc.plan import build_plan
from tests.executor.test_models import CONFIGS, TOKENIZER_FILES, randomize

transformers = pytest.importorskip("transformers")

BLOCK, WINDOW, POOL, NEW_TOKENS = 4, 6, 40, 14


@pytest.fixture(scope="module")
def mistral(model_dir, tmp_path_factory):
    vocab = Tokenizer.from_file(str(model_dir / "tokenizer.json")).get_vocab_size()
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(CONFIGS["mistral"](vocab),
                                                       dtype=torch.float32).eval()
    randomize(hf)
    assert hf.config.sliding_window == WINDOW
    path = tmp_path_factory.mktemp("tiny-mistral")
    hf.save_pretrained(path)
    for name in TOKENIZER_FILES:
        shutil.copy(model_dir / name, path / name)
    torch.set_num_threads(2)
    model = DecoderModel.load(path)
    assert model.config.kv_window == WINDOW  # what the Hello announces
    rng = random.Random(3)
    prompts = [[1] + [rng.randrange(100, 5000) for _ in range(rng.randrange(8, 30))]
               for _ in range(12)]
    return model, prompts, [hf_greedy(hf, p, NEW_TOKENS) for p in prompts]


def _serve(model, prompts, kv_window: int, backend: str | None, poison: float):
    """Every prompt to the end; returns (outputs, most running at once, blocks released,
    steps where a running sequence's released block was another running one's)."""
    runner = make_runner(model, num_blocks=POOL, block_size=BLOCK,
                         backend=make_backend(backend, "cpu"))
    c = model.config
    core = Scheduler(SchedulerConfig(watermark=0.0, max_num_batched_tokens=16, max_num_seqs=12,
                                     chunk_size=5, enable_prefix_caching=False,
                                     max_queue_time_premium_s=0.0,
                                     max_queue_time_standard_s=0.0,
                                     max_queue_time_best_effort_s=0.0))
    core.attach_executor(ModelInfo(BLOCK, POOL, c.max_position_embeddings, c.vocab_size,
                                   frozenset(c.eos_token_ids), kv_window=kv_window))
    greedy = sampling_pb2.SamplingParams(temperature=0.0)
    for i, p in enumerate(prompts):
        core.add_request(Request(f"r{i}", i + 1, list(p), len(p), NEW_TOKENS, sampling=greedy))
    tokens = collections.defaultdict(list)
    in_flight = collections.deque()
    most = released = reused = 0
    while True:
        while len(in_flight) < 2:  # scheduling ahead, as the serving loop does
            out = core.schedule()
            if out.is_empty:
                break
            result = runner.execute(build_plan(out, INCARNATION, core.block_manager))
            assert result.error_code == 0, result.error_message
            in_flight.append((out, result))
        if not in_flight:
            break
        out, result = in_flight.popleft()
        for ev in filter(None, core.update(out, *wire.result_columns(result))):
            if ev[1] is not None:
                tokens[ev[0].request_id].append(ev[1])
        core.assert_invariants()
        bm = core.block_manager
        most = max(most, len(core.running))
        gone = {b for r in core.running for b in bm.block_table(r.seq_id)[:bm.num_released(
            r.seq_id)]}
        owned = {b for r in core.running for b in bm.block_table(r.seq_id)[bm.num_released(
            r.seq_id):]}
        released = max(released, sum(bm.num_released(r.seq_id) for r in core.running))
        reused += bool(gone & owned)
        # What no sequence owns holds nothing valid (no prefix cache here): poisoned, so
        # a kernel that attended to a released entry would change its row.
        runner.kv.device_pool[:, :, sorted(set(range(POOL)) - owned)] = poison
    assert core.block_manager.num_free_blocks == POOL
    return [tokens[f"r{i}"] for i in range(len(prompts))], most, released, reused


# The native kernels never touch a position outside a row's window: NaN there must not
# matter. The torch backend gathers whole blocks and masks what is outside (a masked NaN
# would still reach the output as 0 * NaN, also in the unwritten tail of a row's last
# block), so its poison is finite and large: it changes a row only if it is attended to.
@pytest.mark.parametrize(("backend", "poison"), [(None, float("nan")), ("torch", 1e3)])
def test_released_blocks_serve_others_and_every_stream_stays_exact(mistral, backend, poison):
    model, prompts, expected = mistral
    outputs, most, released, reused = _serve(model, prompts, WINDOW, backend, poison)
    assert outputs == expected
    assert released > 0 and reused > 0  # released blocks were written by others meanwhile
    plain, fewer, none, _ = _serve(model, prompts, 0, backend, poison)
    assert plain == expected and none == 0
    # Contexts of 23 to 43 tokens hold 6 to 11 blocks each without release; under the
    # window a sequence holds at most ceil((6 + 16) / 4) + 1 = 7, most of the time ~3.
    assert most > fewer, (most, fewer)
