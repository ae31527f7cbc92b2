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
# vLLM's side files (sockets, compile caches) stay out of the user's folders.
export VLLM_CACHE_ROOT="$side/vllm" VLLM_RPC_BASE_PATH="$side/rpc" TORCHINDUCTOR_CACHE_DIR="$side/inductor"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export VLLM_LOGGING_LEVEL=${VLLM_LOGGING_LEVEL:-ERROR} TOKENIZERS_PARALLELISM=false PYTHONWARNINGS=ignore
# 8 minutes on one GPU, 15 with the 2-GPU run; the CPU mode gets longer on a small, busy machine.
gpus=$("$python" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)
case "$gpus" in 0) limit=1200 ;; 1) limit=480 ;; *) limit=900 ;; esac
exec timeout "$limit" "$python" bench/gpu_check.py "$@"
