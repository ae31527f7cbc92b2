#!/usr/bin/env bash
# The first GPU run in one call (bench/gpu_check.py): `m2po train` of the 8B colocated recipe at
# Qwen3-8B's shapes with 4 layers, three M2PO updates with the engine asleep and woken between them;
# learner tokens/s and MFU, weight-sync seconds against the bytes pushed, the logprob gap after each
# push, device memory free after each wake, generation tokens/s of one engine (CUDA graphs); with 2+
# GPUs a 2-rank run and the NCCL weight-transport test. Without vLLM (or with --learner-only) the
# learner alone: three M2PO updates on a synthetic batch of the same sizes. Writes its table to
# docs/performance.md after every phase (a run stopped at its limit leaves what it measured). At most
# 8 minutes on one GPU; without a GPU it runs the same steps at tiny size.
#   scripts/gpu_check.sh [--out DIR] [--no-write-doc] [--report FILE] [--learner-only]
# Uses .venv: scripts/install.sh --gpu (with --dev for the 2-GPU transport test, which needs pytest).
set -euo pipefail
cd "$(dirname "$0")/.."
python=${M2PO_PYTHON:-.venv/bin/python}
side=$(mktemp -d -t m2po-gpu-check-XXXXXX)
trap 'rm -rf "$side"' EXIT
# vLLM's side files (sockets, compile caches) stay out of the user's folders.
export VLLM_CACHE_ROOT="$side/vllm" VLLM_RPC_BASE_PATH="$side/rpc" TORCHINDUCTOR_CACHE_DIR="$side/inductor"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# vLLM's warnings stay visible (a reload that skipped a parameter says so there first).
export VLLM_LOGGING_LEVEL=${VLLM_LOGGING_LEVEL:-WARNING} TOKENIZERS_PARALLELISM=false PYTHONWARNINGS=ignore
# 8 minutes on one GPU, 15 with the 2-GPU run; the CPU mode gets longer on a small, busy machine.
gpus=$("$python" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)
case "$gpus" in 0) limit=1200 ;; 1) limit=480 ;; *) limit=900 ;; esac
exec timeout "$limit" "$python" bench/gpu_check.py "$@"
