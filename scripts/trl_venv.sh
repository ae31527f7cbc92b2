#!/usr/bin/env bash
# A venv of its own for TRL (.venv-trl), for bench/bench_peer_trl.py only: TRL is never a
# dependency of m2po. It takes the torch, transformers and math-verify versions of the project's
# .venv (run scripts/install.sh first), so the two tools differ in the trainer, not the libraries.
set -euo pipefail
cd "$(dirname "$0")/.."
TRL_VERSION="${TRL_VERSION:-1.16.0}"
[ -x .venv/bin/python ] || { echo "trl_venv.sh: no .venv; run scripts/install.sh first" >&2; exit 2; }
version() { .venv/bin/python -c "import importlib.metadata as m; print(m.version('$1'))"; }
torch_v=$(version torch); torch_v=${torch_v%%+*}
pins=("torch==$torch_v" "transformers==$(version transformers)" "math-verify==$(version math-verify)")
[ -x .venv-trl/bin/python ] || python3 -m venv .venv-trl
.venv-trl/bin/python -m pip install --quiet --disable-pip-version-check "${pins[@]}" "trl==$TRL_VERSION" psutil
echo "TRL $TRL_VERSION installed in .venv-trl (${pins[*]})"
