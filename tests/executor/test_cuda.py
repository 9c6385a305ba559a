"""The executor on a CUDA GPU: token-exact greedy decoding, sampling, GPU KV sizing, swaps
through pinned memory and the process end to end. scripts/gpu_check.sh runs this file;
every test is skipped where torch sees no GPU."""

from __future__ import annotations

import gc
import signal

import pytest
import torch

from executor_svc import __main__ as executor_main
from executor_svc.kv_cache import KVCache, KVCacheSpec
from executor_svc.models.decoder import DecoderModel
from executor_svc.runner import profile_activation_bytes
from executor_svc.sampler import Sampler, SampleRow, SamplingConfig
from harness.mini_scheduler import MiniScheduler, hf_greedy, make_runner
from harness.precision import compare, greedy_sequences
from harness.prompts import PROMPTS
from kernels import make_backend
from protos.continuum.v1 import executor_pb2 as pb
from protos.continuum.v1 import sampling_pb2
from tests.executor.test_process import FakeScheduler, start_executor

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
CUDA = torch.device("cuda", 0)
IPC = ["--ipc", "ipc:///tmp/continuum-test-cuda.sock"]


@pytest.fixture(scope="module")
def cuda_model(model_dir):
    return DecoderModel.load(model_dir, device=CUDA)  # float32, as the CPU reference


def _release_gpu_memory() -> None:
    gc.collect()
    torch.cuda.empty_cache()


def _greedy_outputs(model, prompts: list[list[int]], max_new: int) -> list[list[int]]:
    # 4-token blocks and 5-token chunks: steps mix prompt chunks with decodes.
    sched = MiniScheduler(make_runner(model, num_blocks=128, block_size=4), chunk_size=5)
    for i, prompt in enumerate(prompts):
        sched.add(i, prompt, max_new=max_new)
    sched.run()
    return [sched.outputs(i) for i in range(len(prompts))]


def test_greedy_tokens_on_cuda_equal_transformers_and_the_cpu_executor(
        cuda_model, model, hf_model, tok):
    assert cuda_model.embed.device.type == "cuda" and cuda_model.dtype == torch.float32
    prompts = [tok.encode(text).ids for text in (PROMPTS[0], PROMPTS[2], PROMPTS[4])]
    expected = [hf_greedy(hf_model, p, 16) for p in prompts]
    on_cuda = _greedy_outputs(cuda_model, prompts, 16)
    on_cpu = _greedy_outputs(model, prompts, 16)
    for i, want in enumerate(expected):
        assert len(want) >= 8
        assert on_cuda[i][: len(want)] == want, PROMPTS[i]
        assert on_cuda[i][: len(want)] == on_cpu[i][: len(want)]


def test_bf16_on_cuda_stays_within_the_stated_tolerance_of_fp32(cuda_model, model_dir, tok):
    """What --dtype auto serves on a GPU: bf16 weights and activations, within the tolerance
    harness/precision.py states (and the CPU's bf16 meets, test_precision.py)."""
    sequences = greedy_sequences(cuda_model, [tok.encode(t).ids for t in PROMPTS], 24)
    bf16 = DecoderModel.load(model_dir, dtype=torch.bfloat16, device=CUDA)
    try:
        result = compare(cuda_model, bf16, sequences)
    finally:
        del bf16
        _release_gpu_memory()
    print(result.row())  # the check's figure
    assert result.within_tolerance(), result.row()


def test_swap_out_and_in_on_cuda_matches_transformers(cuda_model, hf_model, tok):
    prompt = tok.encode(PROMPTS[2]).ids
    expected = hf_greedy(hf_model, prompt, 10)
    runner = make_runner(cuda_model, num_blocks=32, block_size=4, num_host_blocks=8)
    assert runner.kv.host_pool.is_pinned()
    sched = MiniScheduler(runner, chunk_size=8)
    sched.add(1, prompt, max_new=10)
    sched.add(2, tok.encode(PROMPTS[4]).ids, max_new=10)
    for _ in range(5):
        sched.step()
    sched.swap_out(1)
    sched.step()  # seq 2 runs alone; seq 1's KV sits in the pinned host pool
    sched.swap_in(1)
    sched.run()
    assert sched.outputs(1)[: len(expected)] == expected


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swap_round_trip_on_cuda_preserves_the_kv_bytes(dtype):
    spec = KVCacheSpec(num_layers=2, num_kv_heads=3, head_dim=8, dtype=dtype, block_size=4)
    kv = KVCache(spec, num_blocks=6, num_host_blocks=3, device=CUDA)
    assert kv.device_pool.is_cuda and kv.host_pool.is_pinned()
    kv.device_pool.copy_(torch.randn(kv.device_pool.shape, device=CUDA).to(dtype))
    original = kv.device_pool.clone()
    kv.swap([4, 1], [0, 2], [], [])
    assert torch.equal(kv.host_pool[:, :, 0], original[:, :, 4].cpu())
    kv.device_pool.zero_()
    kv.swap([], [], [2, 0], [3, 5])  # block 1 -> host 2 -> device 3; 4 -> host 0 -> device 5
    assert torch.equal(kv.device_pool[:, :, 3], original[:, :, 1])
    assert torch.equal(kv.device_pool[:, :, 5], original[:, :, 4])
    # One step both ways through the same blocks: every read happens before any write.
    kv.host_pool.copy_(torch.randn(kv.host_pool.shape).to(dtype))  # unlike any device block
    device, host = kv.device_pool.clone(), kv.host_pool.clone()
    kv.swap([3, 5], [2, 1], [2], [3])
    assert torch.equal(kv.host_pool[:, :, 2], device[:, :, 3].cpu())
    assert torch.equal(kv.host_pool[:, :, 1], device[:, :, 5].cpu())
    assert torch.equal(kv.device_pool[:, :, 3], host[:, :, 2].to(CUDA))
    assert kv.measure_copy_bytes_per_s() > 1e8  # DMA into pinned memory: GB/s, not MB/s


def test_sampling_cuda_logits_picks_what_the_cpu_picks():
    # Every sampler feature on one batch: penalties, min_tokens, greedy, top-k/top-p/min-p
    # draws and logprobs, from the same logits on either device.
    logits = torch.randn(4, 1000, generator=torch.Generator().manual_seed(0)) * 3
    rows = [
        SampleRow(SamplingConfig(temperature=0.0, repetition_penalty=1.3, logprobs=3), 1, 5,
                  [1, 2, 3, 4, 5], 2),
        SampleRow(SamplingConfig(temperature=0.8, top_k=50, top_p=0.9, seed=7), 7, 10, [], 0),
        SampleRow(SamplingConfig(min_p=0.05, frequency_penalty=0.5, presence_penalty=0.2,
                                 min_tokens=3, logprobs=2), 11, 12, [9, 9, 4], 1),
        SampleRow(SamplingConfig(temperature=0.7, top_p=0.5), 3, 2, [], 0),
    ]
    sampler = Sampler(eos_token_ids=(2,))
    on_cpu = sampler.sample(logits.clone(), rows)
    on_cuda = sampler.sample(logits.to(CUDA), rows)
    assert on_cuda.token_ids == on_cpu.token_ids
    assert on_cuda.top_ids == on_cpu.top_ids
    assert on_cuda.logprobs[0] == pytest.approx(on_cpu.logprobs[0], abs=1e-4)


def test_the_activation_peak_grows_with_the_tokens_in_a_step(cuda_model):
    c = cuda_model.config
    spec = KVCacheSpec(c.num_layers, c.num_kv_heads, c.head_dim, torch.float32, 16)
    kv = KVCache(spec, 2048 // 16, device=CUDA)
    backend = make_backend("torch", CUDA)
    small = profile_activation_bytes(cuda_model, kv, backend, 128)
    large = profile_activation_bytes(cuda_model, kv, backend, 2048)
    assert 0 < small < large < 8 << 30
    del kv
    _release_gpu_memory()


def test_build_sizes_the_kv_cache_from_gpu_memory(model_dir):
    config = executor_main.parse_args([*IPC, "--device", "cuda", "--warmup-tokens", "16",
                                       "--gpu-memory-utilization", "0.5",
                                       "--swap-space-bytes", "64MiB"])  # a swap pool too
    assert config.kv_cache_bytes is None
    total = torch.cuda.mem_get_info(CUDA)[1]
    runner, hello = executor_main.build(config, model_dir, "inc", device=CUDA)
    try:
        kv = runner.kv
        block_bytes = kv.spec.block_bytes
        assert kv.device_pool.device == CUDA
        assert kv.num_host_blocks == (64 << 20) // block_bytes and kv.host_pool.is_pinned()
        # The device's default (flash-attn > triton > torch, the first importable).
        assert type(runner.backend) is type(make_backend(None, CUDA))
        # Plausible: a pool for at least one 8192-token sequence, within half the device.
        assert 8192 // 16 <= hello.num_device_blocks < total // block_bytes
        assert hello.num_device_blocks * block_bytes <= 0.5 * total
        assert kv.device_pool.numel() * kv.device_pool.element_size() == (
            hello.num_device_blocks * block_bytes)
        assert hello.prefill_tokens_per_s > 0 and hello.swap_bytes_per_s > 1e8
    finally:
        del runner, kv
        _release_gpu_memory()


def test_a_gpu_share_too_small_for_the_kv_cache_is_a_clear_error(model_dir):
    config = executor_main.parse_args([*IPC, "--device", "cuda",
                                       "--gpu-memory-utilization", "0.0001"])
    with pytest.raises(ValueError, match="no room for the KV cache") as info:
        executor_main.build(config, model_dir, "inc", device=CUDA)
    assert "Lower --max-num-batched-tokens" in str(info.value)
    del info  # its traceback holds the model
    _release_gpu_memory()


def test_the_executor_process_serves_on_cuda(model_dir, hf_model, tmp_path):
    address = f"ipc://{tmp_path}/executor.sock"
    scheduler = FakeScheduler(address)
    # float32 as transformers' reference (--dtype auto would be bfloat16 on cuda).
    proc = start_executor("--device", "cuda", "--model", str(model_dir), "--ipc", address,
                          "--gpu-memory-utilization", "0.3", "--warmup-tokens", "16",
                          "--dtype", "float32")
    try:
        kind, hello = scheduler.recv()
        assert kind == "hello" and hello.num_device_blocks >= 8192 // 16
        prompt = [1, 9690, 198, 2683]
        plan = pb.BatchPlan(incarnation=hello.incarnation, step_id=1)
        plan.new_seqs.add(seq_id=1, token_ids=prompt, num_scheduled_tokens=4,
                          block_ids=[hello.num_device_blocks - 1], num_prompt_tokens=4,
                          sampling=sampling_pb2.SamplingParams(temperature=0.0))
        scheduler.send("plan", plan)
        kind, result = scheduler.recv()
        assert kind == "result" and result.error_code == 0, result.error_message
        assert list(result.token_ids) == hf_greedy(hf_model, prompt, 1)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        _, stderr = proc.communicate()
        scheduler.close()
    assert "KV cache" in stderr and "blocks" in stderr  # the sizing breakdown was logged
