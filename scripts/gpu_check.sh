#!/usr/bin/env bash
# The executor's CUDA path, on a machine with an NVIDIA GPU: run from anywhere in the
# repository, with its virtualenv (.venv), PYTHON=/path/to/python, or the machine's python3.
# A PASS, FAIL or SKIP line per check as it ends, then ONE table of every check and figure
# (paste it into docs/gpu.md), then the verdict; exits 1 when a check failed. Each check
# has a time limit; together at most 8 minutes on one H200 (the limits below sum to 480 s).
#
#   1. torch sees a CUDA device
#   2. the Triton kernels against the reference, on the GPU (python -m kernels.triton_check)
#   3. tests/executor/test_cuda.py: the bundled model's greedy tokens on cuda = transformers
#      = the CPU executor; sampling, KV sizing, pinned swaps, the process on cuda
#   4. tests/executor/test_device.py: flags, device choice and sizing with a GPU present
#   5. scripts/gpu_bench.py: an 8B-shaped Llama (random bf16 weights, built on the device):
#      decode step time at batch 1/32/128 vs the HBM roofline, graph = eager logits,
#      prefill MFU, tokens/s at 128 in flight on the Azure trace's length mix
#   6. the plan round trip over ZeroMQ and through the shared-memory ring at 64/256/1,024
#      running (python -m benchmarks.bench_channel) on this host's cores: where the default
#      transport is decided (docs/gpu.md)
#
# On the device tool's lent machine (no network, 64 MiB carried): first, here,
#   .venv/bin/python scripts/gpu_bundle.py       # .gpu/: wheels, a 6-layer model, a trace sample
# then run `bash scripts/gpu_check.sh` there with carry [".gpu", "protos/continuum/v1"].
# The wheels go to /tmp/site; the tests use .gpu/model.gguf (CONTINUUM_TEST_MODEL).
# DRY_RUN=1: the same script on the CPU (CI: tests/scripts/test_gpu_check.py): the GPU
# checks are SKIP rows and gpu_bench.py runs --tiny; the verdict is "dry run".
set -euo pipefail

cd "$(dirname "$0")/.."
if [ -n "${PYTHON:-}" ]; then PY=$PYTHON
elif [ -x .venv/bin/python ]; then PY=.venv/bin/python
else PY=python3
fi
DRY_RUN=${DRY_RUN:-0}
GPU_KERNEL_TESTS=${GPU_KERNEL_TESTS:-tests/kernels/test_triton_cuda.py}
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
rows="$out/rows"
: >"$rows"
failed=0

# add NAME STATUS FIGURE: one row of the table, and its line now.
add() {
    printf '%s|%s|%s\n' "$1" "$2" "$3" >>"$rows"
    echo "$2: $1${3:+ ($3)}"
    if [ "$2" = FAIL ]; then failed=1; fi
}

# pytest_check NAME LIMIT_S FILE...: scripts/gpu_check_lib.sh.
# shellcheck source=scripts/gpu_check_lib.sh
source scripts/gpu_check_lib.sh

# Carried by scripts/gpu_bundle.py: what the device's image lacks (a venv has it all).
if [ -d .gpu/whl ] && [ "$PY" != .venv/bin/python ]; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .gpu/whl/*.whl
    export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
if [ -f .gpu/model.gguf ] && [ -z "${CONTINUUM_TEST_MODEL:-}" ]; then
    export CONTINUUM_TEST_MODEL="$PWD/.gpu/model.gguf"
fi
if ! ls protos/continuum/v1/executor_pb2.py >/dev/null 2>&1; then
    echo "FAIL: protos/continuum/v1/*_pb2.py missing (make protos here; carry the folder)"
    echo "gpu_check: FAIL"
    exit 1
fi

# 1. Without a GPU every check below would skip and prove nothing: stop here.
if [ "$DRY_RUN" = 1 ]; then
    add "CUDA device" SKIP "dry run on the CPU"
elif device=$(timeout 30 "$PY" - 2>&1 <<'PYEOF'
import torch

assert torch.cuda.is_available(), f"torch {torch.__version__} sees no CUDA device"
free, total = torch.cuda.mem_get_info(0)
print(f"{torch.cuda.get_device_name(0)}, {free / 2**30:.0f} of {total / 2**30:.0f} GiB free, "
      f"torch {torch.__version__}, CUDA {torch.version.cuda}")
PYEOF
); then
    add "CUDA device" PASS "$device"
else
    add "CUDA device" FAIL "$(echo "$device" | tail -n 1)"
    echo "gpu_check: FAIL"
    exit 1
fi

# 2. The Triton kernels on the GPU against the reference: kernels/triton_check.py (rc 1 a
#    miss, 2 cannot run; its own table, with ms per call, is shown only when it fails: run
#    it alone for the timings), else $GPU_KERNEL_TESTS.
kernel_name="Triton kernels = reference on the GPU"
if [ "$DRY_RUN" = 1 ]; then
    add "$kernel_name" SKIP "dry run (CI runs kernels.triton_check --quick interpreted)"
elif [ -f kernels/triton_check.py ]; then
    if timeout 120 "$PY" -m kernels.triton_check >"$out/kernels.txt" 2>&1; then
        add "$kernel_name" PASS "python -m kernels.triton_check: $(tail -n 1 "$out/kernels.txt")"
    else
        code=$?
        tail -n 40 "$out/kernels.txt"
        add "$kernel_name" FAIL "python -m kernels.triton_check: exit status $code$(
            [ "$code" = 124 ] && echo ", over 120 s")"
    fi
elif [ -f "$GPU_KERNEL_TESTS" ]; then
    pytest_check "$kernel_name" 120 "$GPU_KERNEL_TESTS"
else
    add "$kernel_name" SKIP "neither kernels/triton_check.py nor $GPU_KERNEL_TESTS here"
fi

# 3-4. A skipped test in these files means it did not run: a failure, unless its reason
#    says it is meant to skip on a GPU (GPU_SKIP_TAG, scripts/gpu_check_lib.sh).
pytest_check "bundled model on cuda (tests/executor/test_cuda.py)" 130 \
    tests/executor/test_cuda.py
pytest_check "device flags and sizing (tests/executor/test_device.py)" 40 \
    tests/executor/test_device.py

# 5. The 8B-shaped model: its rows go into the table as they are.
bench_args=()
if [ "$DRY_RUN" = 1 ]; then bench_args=(--tiny); fi
if timeout 140 "$PY" scripts/gpu_bench.py "${bench_args[@]}" --serve-seconds 35 \
        >"$out/bench.txt" 2>"$out/bench.err"; then
    :
else
    code=$?
    tail -n 30 "$out/bench.err"
    add "scripts/gpu_bench.py" FAIL "exit status $code$([ "$code" = 124 ] && echo ", over 140 s")"
fi
while IFS='|' read -r name status figure; do
    [ -n "$name" ] && add "$name" "$status" "$figure"
done <"$out/bench.txt"

# 6. The plan channel, both transports interleaved (a measurement: FAIL only if it breaks).
channel_args=(--sizes 64 256 1024 --steps 300)
if [ "$DRY_RUN" = 1 ]; then channel_args=(--sizes 64 --steps 40); fi
if timeout 20 "$PY" -m benchmarks.bench_channel "${channel_args[@]}" \
        >"$out/channel.txt" 2>"$out/channel.err"; then
    while read -r n zmq shm ratio zmq90 shm90 ring; do
        add "plan round trip, $n running" PASS \
            "p50 zmq $zmq µs, shm $shm µs (shm/zmq $ratio); p90 $zmq90 / $shm90; $ring plans in the ring"
    done < <(grep -E '^ +[0-9]+ ' "$out/channel.txt")
else
    code=$?
    tail -n 20 "$out/channel.err"
    add "benchmarks.bench_channel" FAIL "exit status $code$([ "$code" = 124 ] && echo ", over 20 s")"
fi

echo
echo "| check | result | figures |"
echo "|---|---|---|"
while IFS='|' read -r name status figure; do
    echo "| $name | $status | $figure |"
done <"$rows"
echo
if [ "$failed" -ne 0 ]; then
    echo "gpu_check: FAIL"
elif [ "$DRY_RUN" = 1 ]; then
    echo "gpu_check: dry run (no GPU checked)"
else
    echo "gpu_check: PASS"
fi
exit "$failed"
