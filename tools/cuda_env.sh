# Sourced by tools/setup.sh and benchmarks/gpu/run.sh: finds the CUDA toolkit a CUDA build needs.
#
# roundpipe_find_cuda PYTHON
#   Looks for nvcc in CUDACXX, CUDA_PATH, CUDA_HOME, /usr/local/cuda, PATH, /usr/local/cuda-*,
#   /opt/cuda and PYTHON's nvidia/cu* wheels; takes the toolkit's root from nvcc itself (wrappers
#   such as a /usr/local/bin/nvcc script are followed) and checks for cuda_runtime_api.h. On
#   success exports CUDACXX, CUDA_PATH and CUDA_HOME, puts nvcc's folder first on PATH and prints
#   what it found; otherwise prints what is missing on stderr and returns 1.
roundpipe_find_cuda() {
  local python=$1 candidate nvcc="" root="" include=""
  local site
  site=$("$python" -c 'import site; print(site.getsitepackages()[0])' 2>/dev/null || true)
  for candidate in "${CUDACXX:-}" ${CUDA_PATH:+"$CUDA_PATH/bin/nvcc"} \
    ${CUDA_HOME:+"$CUDA_HOME/bin/nvcc"} /usr/local/cuda/bin/nvcc "$(command -v nvcc || true)" \
    /usr/local/cuda-*/bin/nvcc /opt/cuda/bin/nvcc ${site:+"$site"/nvidia/cu*/bin/nvcc}; do
    if [ -n "$candidate" ] && [ -x "$candidate" ]; then
      nvcc=$candidate
      break
    fi
  done
  if [ -z "$nvcc" ]; then
    echo "no nvcc found (looked at CUDACXX, CUDA_PATH, CUDA_HOME, /usr/local/cuda, PATH)" >&2
    return 1
  fi
  root=$("$nvcc" --dryrun -x cu -c /dev/null -o /dev/null 2>&1 | sed -n 's/^#\$ TOP=//p' | head -n 1)
  [ -n "$root" ] || root="$(dirname "$nvcc")/.."
  root=$(cd "$root" && pwd -P)
  for candidate in "$root/include" "$root/targets/x86_64-linux/include" \
    "$root/targets/sbsa-linux/include"; do
    if [ -f "$candidate/cuda_runtime_api.h" ]; then
      include=$candidate
      break
    fi
  done
  if [ -z "$include" ]; then
    echo "nvcc $nvcc (toolkit $root) has no CUDA headers: cuda_runtime_api.h is missing" >&2
    return 1
  fi
  export CUDACXX="$root/bin/nvcc" CUDA_PATH="$root" CUDA_HOME="$root" PATH="$root/bin:$PATH"
  echo "CUDA toolkit: $root (nvcc $("$CUDACXX" --version | sed -n 's/.*release \([0-9.]*\).*/\1/p')," \
    "headers $include)"
}
