#!/usr/bin/env bash
# The executor's CUDA path, on a machine with an NVIDIA GPU: run from anywhere in the
# repository, with its virtualenv (.venv), PYTHON=/path/to/python, or the machine's python3.
# One PASS, FAIL or SKIP line per check, then the verdict; exits 1 when a check failed. Each
# check has a time limit; all together at most 8 minutes (about 2-4 on one GPU).
#
# On the device tool's lent machine (no network, 64 MiB carried): first, here,
#   .venv/bin/python scripts/gpu_bundle.py       # .gpu/: wheels + a 6-layer model, ~45 MiB
# then run `bash scripts/gpu_check.sh` there with carry [".gpu", "protos/continuum/v1"].
# The wheels go to /tmp/site; the tests use .gpu/model.gguf (CONTINUUM_TEST_MODEL).
set -euo pipefail

cd "$(dirname "$0")/.."
if [ -n "${PYTHON:-}" ]; then PY=$PYTHON
elif [ -x .venv/bin/python ]; then PY=.venv/bin/python
else PY=python3
fi
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
failed=0

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
