#!/usr/bin/env bash
# The executor's CUDA path, on a machine with an NVIDIA GPU: run from anywhere in the
# repository once its virtualenv is set up (.venv, or PYTHON=/path/to/python). One PASS,
# FAIL or SKIP line per check, then the verdict; exits 1 when a check failed. Each check has
# a time limit; all together at most 8 minutes (about 2-4 on one GPU).
set -euo pipefail

cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
failed=0

# Without a GPU every test below would skip and prove nothing: stop here.
if timeout 60 "$PY" - <<'PYEOF'
import torch

assert torch.cuda.is_available(), f"torch {torch.__version__} sees no CUDA device"
free, total = torch.cuda.mem_get_info(0)
print(f"torch {torch.__version__} (CUDA {torch.version.cuda}), {torch.cuda.device_count()} "
      f"GPU(s); cuda:0 {torch.cuda.get_device_name(0)}: {free / 2**30:.1f} of "
      f"{total / 2**30:.1f} GiB free")
PYEOF
then
    echo "PASS: torch sees a CUDA device"
else
    echo "FAIL: torch sees no CUDA device (a CPU-only torch build, or no driver)"
    echo "gpu_check: FAIL"
    exit 1
fi

# Greedy tokens against transformers and the CPU executor, sampling, KV sizing, pinned
# swaps and the process on cuda. A skipped test here means it did not run: a failure.
if timeout 300 "$PY" -m pytest -q -rs -p no:cacheprovider tests/executor/test_cuda.py \
        2>&1 | tee "$out/cuda.txt"; then
    if grep -q "skipped" "$out/cuda.txt"; then
        echo "FAIL: tests/executor/test_cuda.py skipped tests (see above)"
        failed=1
    else
        echo "PASS: tests/executor/test_cuda.py"
    fi
else
    echo "FAIL: tests/executor/test_cuda.py (exit status $?)"
    failed=1
fi

# Flags, device choice and sizing arithmetic with a GPU present (its CUDA-less cases skip).
if timeout 120 "$PY" -m pytest -q -p no:cacheprovider tests/executor/test_device.py; then
    echo "PASS: tests/executor/test_device.py"
else
    echo "FAIL: tests/executor/test_device.py (exit status $?)"
    failed=1
fi

echo "SKIP: benchmarks.bench_executor (it has no --device flag: a CPU benchmark)"
if [ "$failed" -eq 0 ]; then
    echo "gpu_check: PASS"
else
    echo "gpu_check: FAIL"
fi
exit "$failed"
