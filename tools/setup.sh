#!/usr/bin/env bash
# Sets up everything in ./.venv (idempotent; a re-run rebuilds incrementally):
# torch, the build tools, and roundpipe itself with its test and lint extras.
#   ROUNDPIPE_TORCH       torch requirement to install; overrides the choice below
#   ROUNDPIPE_CUDA_TORCH  torch to install where a GPU is present and no torch is (default
#                         torch==2.11.0, the CUDA build CI tests)
#   ROUNDPIPE_VENV        the virtual environment's folder (default .venv); may be an existing
#                         environment, a system one included
#   ROUNDPIPE_OFFLINE=1   install from no package index (what is installed must suffice)
#   ROUNDPIPE_BUILD_BENCHMARKS=1  also build the C++ microbenchmarks (benchmarks/cpp) into the
#                         build folder
#   TORCH_CUDA_ARCH_LIST  GPU architectures for a CUDA build (default 9.0: roundpipe compiles no
#                         kernels, but torch's CMake fails to detect them without it)
#
# Which torch, without ROUNDPIPE_TORCH:
#   * a CUDA torch already in the environment is kept. A new environment sees the system's
#     packages (--system-site-packages) when python3 already has a CUDA torch, and is then
#     installed without any package index: a GPU machine without network works as is;
#   * no torch and a working nvidia-smi: ROUNDPIPE_CUDA_TORCH;
#   * otherwise the CPU build, torch==2.13.0 (CPU machines and CI).
# With a CUDA torch the CUDA path is compiled too; that needs the CUDA toolkit (nvcc and headers,
# found by tools/cuda_env.sh; set CUDA_PATH to choose one).
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=cuda_env.sh
source tools/cuda_env.sh
venv="${ROUNDPIPE_VENV:-.venv}"
torch_spec="${ROUNDPIPE_TORCH:-}"
cuda_torch_of() { "$1" -c 'import torch; print(torch.version.cuda or "")' 2>/dev/null || true; }

offline=()
if [ ! -x "$venv/bin/python" ]; then
  if [ -z "$torch_spec" ] && [ -n "$(cuda_torch_of python3)" ]; then
    echo "python3 has a CUDA torch: $venv sees the system's packages and installs offline"
    python3 -m venv --system-site-packages "$venv"
    offline=(--no-index)
  else
    python3 -m venv "$venv"
  fi
elif [ -z "$torch_spec" ] && grep -qs 'include-system-site-packages = true' "$venv/pyvenv.cfg" &&
  [ -n "$(cuda_torch_of "$venv/bin/python")" ]; then
  offline=(--no-index)  # made by the branch above on an earlier run
fi
[ "${ROUNDPIPE_OFFLINE:-0}" = 0 ] || offline=(--no-index)
python="$venv/bin/python"
pip=("$python" -m pip install --quiet --disable-pip-version-check "${offline[@]}")

installed_cuda=$(cuda_torch_of "$python")
if [ -n "$torch_spec" ]; then
  "${pip[@]}" "$torch_spec"
elif [ -n "$installed_cuda" ]; then
  echo "keeping torch $("$python" -c 'import torch; print(torch.__version__)') (CUDA $installed_cuda)"
elif ! "$python" -c 'import torch' 2>/dev/null && nvidia-smi >/dev/null 2>&1; then
  echo "a GPU is present: installing ${ROUNDPIPE_CUDA_TORCH:-torch==2.11.0} (a CUDA build)"
  "${pip[@]}" "${ROUNDPIPE_CUDA_TORCH:-torch==2.11.0}"
else
  "${pip[@]}" torch==2.13.0
fi
torch_cuda=$(cuda_torch_of "$python")
if [ -n "$torch_cuda" ] && ! roundpipe_find_cuda "$python"; then
  cat >&2 <<MSG
torch $("$python" -c 'import torch; print(torch.__version__)') was built with CUDA $torch_cuda, so
roundpipe compiles its CUDA path, which needs the CUDA toolkit $torch_cuda: nvcc and its headers
(cuda_runtime_api.h). Install it and point CUDA_PATH at it (e.g. CUDA_PATH=/usr/local/cuda-$torch_cuda),
or build for the CPU with a CPU torch: ROUNDPIPE_TORCH=torch==2.13.0 and a fresh ROUNDPIPE_VENV.
MSG
  exit 1
fi
if [ -n "$torch_cuda" ]; then
  export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}"
  echo "CUDA build for TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST"
fi

# The build backend next: the package is built without isolation against this torch.
"${pip[@]}" "scikit-build-core>=0.10" ninja
extras="test,lint"
if [ ${#offline[@]} -gt 0 ]; then
  extras="test"  # ruff and clang-format are not on such machines: lint where there is an index
  echo "offline: installing without the lint extras (ruff, clang-format)"
fi
# One build folder per environment, so a CPU and a CUDA variant can live side by side.
build_options=(--config-settings=build-dir="build/$(basename "$venv")")
[ "${ROUNDPIPE_BUILD_BENCHMARKS:-0}" = 0 ] ||
  build_options+=(--config-settings=cmake.define.ROUNDPIPE_BUILD_BENCHMARKS=ON)
"${pip[@]}" --no-build-isolation "${build_options[@]}" ".[$extras]"
"$python" -c "import roundpipe; from roundpipe._native import BUILD_INFO as b
print('roundpipe', roundpipe.__version__, 'ready in $venv, torch', b['torch_version'],
      'CUDA', b['cuda_version'] or 'off')"
