"""--device and GPU KV sizing, as far as a machine without CUDA can check them: the sizing
arithmetic and its errors, the flags' validation, device and backend choice, and that the
CPU default is what it was."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from executor_svc import __main__ as executor_main
from executor_svc.batch import SequenceState, build_inputs
from executor_svc.device import gpu_kv_blocks, resolve_device
from executor_svc.kv_cache import KVCache, KVCacheSpec
from executor_svc.model_config import ModelConfig
from executor_svc.models.decoder import DecoderModel
from executor_svc.sampler import SamplingConfig
from kernels import backend_for, make_backend

GIB, MIB = 1 << 30, 1 << 20
IPC = ["--ipc", "ipc:///tmp/continuum-test-device.sock"]
# Tagged for scripts/gpu_check.sh (GPU_SKIP_TAG): on a GPU host these skip by design.
no_cuda = pytest.mark.skipif(torch.cuda.is_available(),
                             reason="CPU-only: checks what a machine without CUDA does")


def test_kv_blocks_are_what_the_utilization_leaves_after_weights_and_a_step():
    # 0.9 x 80 GiB = 72 GiB; minus 20 GiB in use and a 2 GiB step leaves 50 GiB of 1 MiB blocks.
    assert gpu_kv_blocks(80 * GIB, 20 * GIB, 2 * GIB, 0.9, MIB) == 50 * 1024
    # Whole blocks only: half a block more budget is no block more.
    assert gpu_kv_blocks(80 * GIB, 20 * GIB, 2 * GIB - MIB // 2, 0.9, MIB) == 50 * 1024
    # The same device shared with more: each term comes off the budget.
    assert gpu_kv_blocks(80 * GIB, 30 * GIB, 2 * GIB, 0.9, MIB) == 40 * 1024
    assert gpu_kv_blocks(80 * GIB, 20 * GIB, 12 * GIB, 0.9, MIB) == 40 * 1024
    assert gpu_kv_blocks(80 * GIB, 20 * GIB, 2 * GIB, 0.5, MIB) == 18 * 1024
    assert gpu_kv_blocks(80 * GIB, 20 * GIB, 2 * GIB, 1.0, 2 * MIB) == 29 * 1024
    # Exactly one max-length sequence's worth is enough.
    assert gpu_kv_blocks(80 * GIB, 20 * GIB, 2 * GIB, 0.9, MIB, min_blocks=50 * 1024) == 50 * 1024


def test_no_room_for_the_kv_cache_says_what_took_the_memory_and_what_to_change():
    # The weights alone exceed 0.9 x 24 GiB: the budget is negative.
    with pytest.raises(ValueError) as info:
        gpu_kv_blocks(24 * GIB, 22 * GIB, 3 * GIB // 2, 0.9, MIB)
    message = str(info.value)
    assert "0 KV blocks" in message
    assert "use 22.00 GiB" in message and "activations 1.50 GiB" in message
    for advice in ("--max-num-batched-tokens", "--gpu-memory-utilization", "smaller model",
                   "--tp-size"):
        assert advice in message


def test_a_pool_short_of_one_max_length_sequence_is_refused():
    # 0.9 x 10 GiB - 8 GiB - 0.5 GiB = 512 MiB = 512 blocks; a 128k-token sequence in
    # 16-token blocks needs 8192.
    assert gpu_kv_blocks(10 * GIB, 8 * GIB, GIB // 2, 0.9, MIB) == 512
    with pytest.raises(ValueError, match="leaves 512 KV blocks .* needs 8192"):
        gpu_kv_blocks(10 * GIB, 8 * GIB, GIB // 2, 0.9, MIB, min_blocks=8192)


def test_defaults_and_new_flags_parse():
    config = executor_main.parse_args(IPC)
    assert config.device == "auto" and config.gpu_memory_utilization == 0.9
    assert config.max_num_batched_tokens == 2048
    # None: 1 GiB on the CPU, a fit on a GPU; the backend follows the device.
    assert config.kv_cache_bytes is None and config.attention_backend is None
    assert executor_main.CPU_KV_CACHE_BYTES == 1 << 30
    config = executor_main.parse_args([*IPC, "--device", "cuda:1", "--kv-cache-bytes", "2GiB",
                                       "--gpu-memory-utilization", "1",
                                       "--max-num-batched-tokens", "512"])
    assert (config.device, config.kv_cache_bytes, config.gpu_memory_utilization,
            config.max_num_batched_tokens) == ("cuda:1", 2 * GIB, 1.0, 512)


@pytest.mark.parametrize("value", ["0", "1.5", "-0.5", "nan"])
def test_gpu_memory_utilization_outside_0_1_is_refused_by_the_parser(value, capsys):
    with pytest.raises(SystemExit) as info:
        executor_main.parse_args([*IPC, "--gpu-memory-utilization", value])
    assert info.value.code == 2
    assert "--gpu-memory-utilization must be > 0 and <= 1" in capsys.readouterr().err


@pytest.mark.parametrize("flags,message", [
    (["--device", "gpu"], "--device must be auto, cpu, cuda or cuda:N"),
    (["--device", "cuda:x"], "--device must be auto, cpu, cuda or cuda:N"),
    (["--max-num-batched-tokens", "0"], "--max-num-batched-tokens must be >= 1"),
])
def test_other_bad_flags_are_refused_by_the_parser(flags, message, capsys):
    with pytest.raises(SystemExit):
        executor_main.parse_args([*IPC, *flags])
    assert message in capsys.readouterr().err


@no_cuda
def test_without_cuda_auto_is_the_cpu_and_cuda_is_an_error():
    assert resolve_device("auto") == resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("cpu", tp_rank=1, tp_size=2) == torch.device("cpu")
    for spec in ("cuda", "cuda:0"):
        with pytest.raises(ValueError, match=r"torch.cuda.is_available\(\) is False.*--device cpu"):
            resolve_device(spec)


def test_each_tensor_parallel_rank_takes_its_own_gpu(monkeypatch):
    # Device arithmetic only: no tensor is placed, so two GPUs can be pretended.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert resolve_device("auto") == torch.device("cuda", 0)
    assert [resolve_device("cuda", r, 2) for r in (0, 1)] == [torch.device("cuda", 0),
                                                              torch.device("cuda", 1)]
    assert resolve_device("cuda:1") == torch.device("cuda", 1)
    with pytest.raises(ValueError, match=r"needs cuda:1\.\.cuda:2, but 2 CUDA"):
        resolve_device("cuda:1", 0, 2)
    with pytest.raises(ValueError, match="needs cuda:2, but 2 CUDA"):
        resolve_device("cuda:2")


def test_the_backend_follows_the_device_and_numba_is_refused_off_the_cpu():
    assert backend_for(None, "cpu") == "numba"
    # On a GPU: the first importable of flash-attn > triton > torch (kernels/__init__.py).
    from kernels import _importable, gpu_default

    assert backend_for(None, torch.device("cuda", 0)) == gpu_default(*_importable())
    assert backend_for("reference", "cuda") == "reference"
    with pytest.raises(ValueError, match="numba runs on the CPU only; use --attention-backend "
                                         "torch with --device cuda"):
        make_backend("numba", "cuda")


@no_cuda
@pytest.mark.spawns  # starts a service process (tests/tiers.py)
def test_device_cuda_without_cuda_exits_2_with_one_line_before_loading_anything(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "executor_svc", "--device", "cuda", "--ipc",
         f"ipc://{tmp_path}/x.sock"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith("error: --device cuda: this torch build has no CUDA device")
    assert "use --device cpu" in proc.stderr and "loading model" not in proc.stderr


def test_the_cpu_keeps_its_1_gib_pool_and_numba_backend(model_dir):
    config = executor_main.parse_args([*IPC, "--device", "cpu", "--warmup-tokens", "8",
                                       "--threads", "2"])
    runner, hello = executor_main.build(config, model_dir, "inc", device="cpu")
    assert hello.num_device_blocks == (1 << 30) // hello.block_bytes  # as before --device
    assert runner.kv.device_pool.device.type == "cpu" and not runner.kv.host_pool.is_pinned()
    assert type(runner.backend).__name__ == "NumbaAttentionBackend"
    assert hello.prefill_tokens_per_s > 0 and hello.swap_bytes_per_s > 0


def test_a_step_on_another_device_uses_no_cpu_tensor():
    # The meta device computes shapes only, and refuses any op that mixes in a CPU tensor
    # just as CUDA does: a chunk-free step (decodes) through the model, the KV write and the
    # device's default backend must stay on the model's device.
    hidden, inter, heads, kv_heads, dim, vocab = 32, 48, 4, 2, 8, 64
    config = ModelConfig(architecture="llama", hidden_size=hidden, intermediate_size=inter,
                         num_layers=2, num_heads=heads, num_kv_heads=kv_heads, head_dim=dim,
                         vocab_size=vocab, rms_norm_eps=1e-5, rope_theta=10000.0,
                         rope_scaling=None, max_position_embeddings=256,
                         tie_word_embeddings=False, eos_token_ids=(3,), name="tiny")
    shapes = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,),
              "lm_head.weight": (vocab, hidden)}
    for i in range(2):
        p = f"model.layers.{i}."
        shapes |= {p + "self_attn.q_proj.weight": (heads * dim, hidden),
                   p + "self_attn.k_proj.weight": (kv_heads * dim, hidden),
                   p + "self_attn.v_proj.weight": (kv_heads * dim, hidden),
                   p + "self_attn.o_proj.weight": (hidden, heads * dim),
                   p + "mlp.gate_proj.weight": (inter, hidden),
                   p + "mlp.up_proj.weight": (inter, hidden),
                   p + "mlp.down_proj.weight": (hidden, inter),
                   p + "input_layernorm.weight": (hidden,),
                   p + "post_attention_layernorm.weight": (hidden,)}
    meta = torch.device("meta")
    model = DecoderModel(config, {n: torch.ones(s) for n, s in shapes.items()}, torch.float32,
                       meta)
    kv = KVCache(KVCacheSpec(2, kv_heads, dim, torch.float16, 4), 16, device=meta)
    steps = [(SequenceState(i, list(range(10)), 9, [3 * i, 3 * i + 1, 3 * i + 2],
                            SamplingConfig(), 5, 0), 1) for i in range(3)]
    inputs = build_inputs(steps, 4, meta)
    logits = model.forward(inputs.input_ids, inputs.positions, inputs.slot_mapping, inputs.meta,
                           make_backend(None, meta), kv, inputs.sample_rows)
    assert logits.device == meta and logits.shape == (3, vocab)
