#!/usr/bin/env bash
# Sets up everything in ./.venv (idempotent; a re-run rebuilds incrementally):
# torch, the build tools, and roundpipe itself with its test and lint extras.
#   ROUNDPIPE_TORCH   torch requirement to install (default torch==2.13.0, the CPU build)
#   ROUNDPIPE_VENV    the virtual environment's folder (default .venv)
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${ROUNDPIPE_VENV:-.venv}"
torch_spec="${ROUNDPIPE_TORCH:-torch==2.13.0}"

[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
pip=("$venv/bin/python" -m pip install --quiet --disable-pip-version-check)
# torch and the build backend first: the package is built without isolation against this torch.
"${pip[@]}" "$torch_spec" "scikit-build-core>=0.10" ninja
# One build folder per environment, so a CPU and a CUDA variant can live side by side.
"${pip[@]}" --no-build-isolation --config-settings=build-dir="build/$(basename "$venv")" \
  ".[test,lint]"
"$venv/bin/python" -c "import roundpipe; print('roundpipe', roundpipe.__version__, 'ready in $venv')"
