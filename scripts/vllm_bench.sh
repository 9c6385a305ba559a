#!/usr/bin/env bash
# vLLM's own benchmark client (`vllm bench serve`) against a running `continuum serve`
# (`make run`), on /v1/completions, then /v1/chat/completions (docs/benchmarks.md,
# "vLLM's benchmark client").
# The client gets a venv of its own: vLLM's wheel without its CUDA dependencies, the CPU
# torch, and the pure-Python packages `vllm bench serve` imports. Output: stdout.
#   BASE_URL (http://127.0.0.1:8000)  VLLM_ENV (/tmp/vllmenv)  SEED (1)  ARGS (below)
#   PIP_ARGS: extra pip options, e.g. --extra-index-url https://download.pytorch.org/whl/cpu
set -euo pipefail
cd "$(dirname "$0")/.."
ENV=${VLLM_ENV:-/tmp/vllmenv}
BASE=${BASE_URL:-http://127.0.0.1:8000}
ARGS=${ARGS:---random-input-len 64 --random-output-len 32 --num-prompts 32 --max-concurrency 8}
if [ ! -x "$ENV/bin/vllm" ]; then
  python3.11 -m venv "$ENV"
  "$ENV/bin/pip" install -q ${PIP_ARGS:-} --no-deps vllm==0.34.0 xgrammar==0.2.8
  "$ENV/bin/pip" install -q ${PIP_ARGS:-} torch==2.13.0 aiohttp numpy tqdm regex pillow \
    pybase64 'transformers>=5.16.1,<5.23.0' 'tokenizers>=0.23.3' huggingface_hub pyyaml \
    psutil cachetools msgspec pydantic requests pyzmq cbor2 pandas uvloop fastapi \
    prometheus_client openai openai-harmony cloudpickle py-cpuinfo partial_json_parser \
    uvicorn llguidance watchfiles orjson einops
fi
# The served model's tokenizer (a local directory: no hub access needed).
TOKENIZER=$(.venv/bin/python -c 'from harness.servers import model_dir; print(model_dir())')
for backend in "openai /v1/completions" "openai-chat /v1/chat/completions"; do
  set -- $backend
  # shellcheck disable=SC2086  # ARGS is a list of flags
  HF_HUB_OFFLINE=1 "$ENV/bin/vllm" bench serve --backend "$1" --endpoint "$2" \
    --base-url "$BASE" --tokenizer "$TOKENIZER" --dataset-name random --seed "${SEED:-1}" $ARGS
done
