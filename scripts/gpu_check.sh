#!/usr/bin/env bash
# The GPU check (bench/gpu_check.py): learner tokens/s and MFU, vLLM generation tokens/s, weight-sync
# time against the device's copy bandwidth, logprob mismatch after a sync, peak memory of the train and
# generate phases with the engine asleep and awake, and a few M2PO updates. At most 8 minutes on one
# GPU; without a GPU it runs the same steps at tiny size and lists what it skipped.
#   scripts/gpu_check.sh [--out DIR]     (uses .venv; install with scripts/install.sh --gpu)
set -euo pipefail
cd "$(dirname "$0")/.."
python=${M2PO_PYTHON:-.venv/bin/python}
side=$(mktemp -d -t m2po-gpu-check-XXXXXX)
trap 'rm -rf "$side"' EXIT
# vLLM's side files (sockets, compile caches) stay out of the user's folders; one GPU only.
export VLLM_CACHE_ROOT="$side/vllm" VLLM_RPC_BASE_PATH="$side/rpc" TORCHINDUCTOR_CACHE_DIR="$side/inductor"
export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0} PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export VLLM_LOGGING_LEVEL=${VLLM_LOGGING_LEVEL:-ERROR} TOKENIZERS_PARALLELISM=false PYTHONWARNINGS=ignore
# 8 minutes on a GPU; the CPU mode gets longer on a small, busy machine.
limit=480
"$python" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null || limit=1200
exec timeout "$limit" "$python" bench/gpu_check.py "$@"
