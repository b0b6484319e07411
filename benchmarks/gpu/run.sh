#!/usr/bin/env bash
# The GPU proof in one entry point: build with CUDA, the whole test suite on CUDA, the benchmarks,
# a profile. Made for the device machine (one H100/H200, Python 3.12 with its own CUDA torch, nvcc,
# no network), where one call may run at most 10 minutes: pick the stages of each call.
#
#   bash benchmarks/gpu/run.sh [--cpu-smoke] [STAGE ...]       (default: all)
#
# Stages, in this order whatever order they are given in:
#   build        the extension with CUDA against the running torch (TORCH_CUDA_ARCH_LIST=9.0), in a
#                persistent build folder, so a later call on the same warm machine rebuilds
#                incrementally; prints nvcc, the CUDA headers, torch and the GPU first
#   test         the whole pytest suite with ROUNDPIPE_DEVICE_KIND=cuda (junit + log)
#   bench-train  benchmarks/train_gpu.py: ours vs roundpipe 0.1.1 vs the GPU-resident bound
#   bench-micro  the C++ microbenchmarks of benchmarks/cpp (roundpipe_*_bench, built by the build
#                stage with ROUNDPIPE_BUILD_BENCHMARKS=ON into its build folder)
#   profile      the training benchmark, briefly, under nsys (else ncu on a few kernels)
#   all          every stage above
# Without `build`, a call that finds no usable build, or sources changed since it, builds first.
# A failed build skips the later stages; any other failure is recorded and the next stage runs.
#
# --cpu-smoke runs the same stages on virtual CPU devices with tiny sizes and no CUDA build (the
# already-built roundpipe of the chosen python; its build stage builds only the C++
# microbenchmarks, with cmake against that python's torch), so a typo cannot cost a GPU call.
#
# Environment:
#   OUT               where everything goes (default build/gpu-out); at exit the logs are packed
#                     into $OUT/logs.tar.gz beside $OUT/summary.txt (the device tool brings back
#                     at most 8 files)
#   ROUNDPIPE_PYTHON  python to use (default: python3 on a GPU; .venv/bin/python, else python3,
#                     with --cpu-smoke)
#   RUN_BUDGET        seconds for the whole call (default 570); each stage gets what is left
#   PYTEST_ARGS       replaces the test selection (default: tests, or a quick subset when smoke)
#   TRAIN_ARGS        extra arguments for train_gpu.py (later ones win, e.g. "--seq 16384")
#   PEER_DIR          where the 0.1.1 wheels of .whl/ are installed (default build/peer)
set -euo pipefail
cd "$(dirname "$0")/../.."
repo=$PWD
start=$SECONDS

smoke="${RUN_SMOKE:-0}"
stages=()
internal=""
if [ "${1:-}" = __stage ]; then # run.sh re-runs itself per stage, so `timeout` can bound it
  internal=$2
  shift 2
fi
for arg in "$@"; do
  case "$arg" in
    --cpu-smoke) smoke=1 ;;
    build | test | bench-train | bench-micro | profile) stages+=("$arg") ;;
    all) stages+=(build test bench-train bench-micro profile) ;;
    -h | --help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) echo "run.sh: unknown argument '$arg' (stages: build test bench-train bench-micro" \
      "profile all; option --cpu-smoke)" >&2; exit 2 ;;
  esac
done
[ ${#stages[@]} -gt 0 ] || stages=(build test bench-train bench-micro profile)
wanted() { [[ " ${stages[*]} " == *" $1 "* ]]; }

OUT="${OUT:-$repo/build/gpu-out}"
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
logs="$OUT/logs"
mkdir -p "$logs"
summary="$OUT/summary.txt"
deadline="${RUN_DEADLINE:-$(($(date +%s) + ${RUN_BUDGET:-570}))}"
peer_dir="${PEER_DIR:-$repo/build/peer}"
if [ -n "${ROUNDPIPE_PYTHON:-}" ]; then
  python="$ROUNDPIPE_PYTHON"
elif [ "$smoke" = 1 ] && [ -x .venv/bin/python ]; then
  python="$repo/.venv/bin/python"
else
  python=python3
fi
export PYTHONUNBUFFERED=1
py_tag=$("$python" -c 'import sys; print("py%d%d" % sys.version_info[:2])')
build_dir="build/gpu-$([ "$smoke" = 0 ] || echo smoke-)$py_tag"

stamp() { echo "=== $(date -u +%H:%M:%S) [+$((SECONDS - start))s] $*"; }
note() { echo "$*" | tee -a "$summary"; }

# Seconds the next stage may take: what is left of the budget, less a margin for packing up.
stage_limit() {
  local left=$((deadline - $(date +%s) - 15))
  [ "$left" -gt 10 ] || left=10
  echo "$left"
}

# run_stage NAME: banner, time limit, log, exit status into the summary. 3 means "skipped".
run_stage() {
  local name=$1 limit t0=$SECONDS rc=0
  limit=$(stage_limit)
  stamp "stage $name (limit ${limit}s)" | tee -a "$logs/$name.log"
  RUN_SMOKE=$smoke RUN_DEADLINE=$deadline OUT=$OUT ROUNDPIPE_PYTHON=$python \
    timeout -s INT -k 20 "$limit" bash "$0" __stage "$name" 2>&1 | tee -a "$logs/$name.log" ||
    rc=${PIPESTATUS[0]}
  local verdict=ok
  [ "$rc" = 0 ] || verdict="FAILED (exit $rc$([ "$rc" = 124 ] && echo ', timed out'))"
  [ "$rc" != 3 ] || verdict="skipped (see its log)"
  note "stage $name: $verdict in $((SECONDS - t0))s"
  return "$rc"
}

# ---------------------------------------------------------------- environment
# shellcheck source=../../tools/cuda_env.sh
source tools/cuda_env.sh

describe_environment() {
  echo "python: $(command -v "$python") ($("$python" --version 2>&1))"
  "$python" - <<'PY'
import torch
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, available {torch.cuda.is_available()}")
for i in range(torch.cuda.device_count()):
    p = torch.cuda.get_device_properties(i)
    print(f"GPU {i}: {p.name}, {p.total_memory / 2**30:.1f} GiB, {p.multi_processor_count} SMs, "
          f"sm_{p.major}{p.minor}")
PY
  roundpipe_find_cuda "$python" || echo "CUDA toolkit: NOT usable (see above); set CUDA_PATH"
  if [ "$smoke" = 0 ]; then
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem \
      --format=csv 2>&1 || echo "nvidia-smi failed"
    for tool in nsys ncu compute-sanitizer; do
      echo "$tool: $(command -v "$tool" || echo 'not on PATH')"
    done
  fi
  echo "cores: $(nproc), memory: $(awk '/MemTotal/ {printf "%.0f GiB", $2 / 2^20}' /proc/meminfo)"
}

# Prints build_info of the importable roundpipe; fails when none loads (or lacks CUDA on a GPU).
check_built() {
  "$python" - "$smoke" <<'PY'
import sys

from roundpipe._native import BUILD_INFO

print("roundpipe build:", BUILD_INFO)
if sys.argv[1] == "0" and not BUILD_INFO["cuda"]:
    sys.exit("roundpipe was built without CUDA")
PY
}

# The installed package is a copy: a later call with edited sources (C++ or Python) rebuilds.
source_hash() {
  find csrc python benchmarks/cpp CMakeLists.txt pyproject.toml -type f ! -name '*.so' ! -name '*.pyc' -print0 |
    sort -z | xargs -0 sha1sum | sha1sum | cut -d' ' -f1
}

# The C++ microbenchmarks alone, configured with cmake against the python's torch (cpu-smoke: the
# GPU build makes them through pip with the extension).
build_benchmarks() {
  local generator=() prefix
  command -v ninja >/dev/null && generator=(-G Ninja)
  prefix=$("$python" -c 'import torch.utils; print(torch.utils.cmake_prefix_path)')
  echo "C++ microbenchmarks in $build_dir (cmake, torch from $prefix)"
  cmake -S . -B "$build_dir" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release \
    -DROUNDPIPE_BUILD_BENCHMARKS=ON -DPython_EXECUTABLE="$(command -v "$python")" \
    -DCMAKE_PREFIX_PATH="$prefix" >"$build_dir.cmake.log" 2>&1 || {
    tail -n 40 "$build_dir.cmake.log"
    return 1
  }
  cmake --build "$build_dir" --parallel --target roundpipe_copy_bench roundpipe_dispatch_bench
}

# ---------------------------------------------------------------- stages
stage_build() {
  describe_environment
  if [ "$smoke" = 1 ]; then
    echo "cpu-smoke: no CUDA build; using the roundpipe that $python imports"
    check_built
    mkdir -p build
    build_benchmarks
    return
  fi
  roundpipe_find_cuda "$python" || {
    echo "set CUDA_PATH to the CUDA toolkit (nvcc and headers) matching torch's CUDA"
    return 1
  }
  export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}"
  export CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}"
  echo "building in $build_dir with CUDA_PATH=$CUDA_PATH TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST"
  "$python" -m pip install --no-build-isolation --no-deps --no-index --disable-pip-version-check \
    --config-settings=build-dir="$build_dir" \
    --config-settings=cmake.define.ROUNDPIPE_BUILD_BENCHMARKS=ON . &&
    check_built &&
    source_hash >"$build_dir/source-hash"
}

stage_test() {
  local args
  if [ -n "${PYTEST_ARGS:-}" ]; then
    read -r -a args <<<"$PYTEST_ARGS"
  elif [ "$smoke" = 1 ]; then
    args=(tests/test_cuda.py tests/test_package.py)
  else
    args=(tests)
  fi
  local kind=cuda
  [ "$smoke" = 0 ] || kind=cpu
  echo "ROUNDPIPE_DEVICE_KIND=$kind pytest ${args[*]}"
  ROUNDPIPE_DEVICE_KIND=$kind "$python" -m pytest -p no:cacheprovider -ra -q \
    --junitxml="$logs/junit.xml" "${args[@]}"
}

install_peer() {
  local wheels=(.whl/roundpipe-0.1.1-*.whl)
  if [ ! -f "${wheels[0]}" ]; then
    echo "no .whl/roundpipe-0.1.1 wheel: run tools/fetch_gpu_wheels.sh here and carry .whl"
    return 0
  fi
  [ -d "$peer_dir/roundpipe" ] && return 0
  "$python" -m pip install -q --no-index --no-deps --no-compile --disable-pip-version-check \
    --target "$peer_dir" .whl/*.whl
  echo "roundpipe 0.1.1 installed in $peer_dir"
}

train_args() {
  if [ "$smoke" = 1 ]; then
    echo --cpu-smoke --params 400K --width 64 --heads 4 --vocab 256 --tokens 256 --iters 1
  else
    echo --params 1G --seq 1024,4096,16384 --rounds 2 --iters 3
  fi
}

stage_bench_train() {
  install_peer
  local args
  read -r -a args <<<"$(train_args) ${TRAIN_ARGS:-}"
  [ "$smoke" = 0 ] || args+=(--seq 32 --rounds 1 --timeout 120)
  export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$repo/build/torch_extensions}"
  "$python" benchmarks/train_gpu.py "${args[@]}" --peer-path "$peer_dir" \
    --log-dir "$logs/train" --budget "$(($(stage_limit) > 60 ? $(stage_limit) - 30 : 30))" |
    tee "$logs/train_table.txt"
}

stage_bench_micro() {
  local found=()
  mapfile -t found < <(find "$build_dir" -maxdepth 1 -type f -executable \
    -name 'roundpipe_*bench*' 2>/dev/null | sort)
  if [ ${#found[@]} -eq 0 ]; then
    echo "no C++ microbenchmarks built (expected roundpipe_*bench* executables in $build_dir," \
      "made by the build stage with ROUNDPIPE_BUILD_BENCHMARKS=ON): run the build stage"
    return 1
  fi
  local bench rc=0
  for bench in "${found[@]}"; do
    echo "--- $bench"
    "$bench" || rc=$?
  done
  return "$rc"
}

stage_profile() {
  local args
  read -r -a args <<<"$(train_args) ${TRAIN_ARGS:-}"
  if [ "$smoke" = 1 ]; then
    args+=(--seq 32 --rounds 1 --systems ours)
  else
    args+=(--params 300M --seq 4096 --rounds 1 --iters 2 --systems ours)
  fi
  local workload=("$python" benchmarks/train_gpu.py "${args[@]}" --timeout 240)
  local nsys ncu
  nsys=$(command -v nsys || ls /opt/nvidia/nsight-systems*/bin/nsys 2>/dev/null | head -n 1 ||
    true)
  ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute*/ncu 2>/dev/null | head -n 1 || true)
  if [ -n "$nsys" ]; then
    echo "nsys: $nsys"
    "$nsys" profile --trace=cuda,nvtx,osrt --sample=none --force-overwrite=true \
      -o "$OUT/train_profile" "${workload[@]}" || true
    if [ -f "$OUT/train_profile.nsys-rep" ]; then
      "$nsys" stats --report nvtx_sum,cuda_gpu_kern_sum,cuda_gpu_mem_time_sum \
        "$OUT/train_profile.nsys-rep" >"$logs/nsys_stats.txt" 2>&1 || true
      rm -f "$OUT/train_profile.sqlite"
      return 0
    fi
    echo "nsys made no report; trying ncu"
  fi
  if [ -n "$ncu" ]; then
    echo "ncu: $ncu (a few kernels after warm-up, clocks as found)"
    "$ncu" --clock-control none --target-processes all --nvtx --launch-skip 200 \
      --launch-count 10 --section SpeedOfLight --force-overwrite \
      -o "$OUT/train_kernels" "${workload[@]}" &&
      "$ncu" --import "$OUT/train_kernels.ncu-rep" --print-summary per-kernel \
        >"$logs/ncu_summary.txt" 2>&1
    return
  fi
  echo "neither nsys nor ncu found: install Nsight Systems or Nsight Compute to profile;" \
    "running the workload unprofiled so its arguments are still checked"
  "${workload[@]}"
  return 3
}

# ---------------------------------------------------------------- main
if [ -n "$internal" ]; then
  "stage_${internal//-/_}"
  exit
fi

pack_logs() {
  # One archive instead of many files: the device tool brings back at most 8 files.
  if [ -d "$logs" ] && [ -n "$(ls -A "$logs")" ]; then
    tar czf "$OUT/logs.tar.gz" -C "$OUT" logs && rm -rf "$logs"
  fi
}
trap pack_logs EXIT
trap 'exit 130' INT TERM
note "run.sh $(date -u +%Y-%m-%dT%H:%M:%SZ) mode=$([ "$smoke" = 1 ] && echo cpu-smoke || echo gpu)" \
  "stages=${stages[*]} python=$python commit=$(git rev-parse --short HEAD 2>/dev/null || echo ?)"

build_ok=1
if wanted build; then
  run_stage build || build_ok=0
elif ! check_built >/dev/null 2>&1; then
  note "no usable roundpipe build found: running the build stage first"
  run_stage build || build_ok=0
elif [ "$smoke" = 0 ] && [ "$(source_hash)" != "$(cat "$build_dir/source-hash" 2>/dev/null)" ]; then
  note "sources changed since the last build: running the build stage first"
  run_stage build || build_ok=0
fi
for stage in test bench-train bench-micro profile; do
  wanted "$stage" || continue
  if [ "$build_ok" = 0 ]; then
    note "stage $stage: skipped (build failed)"
    continue
  fi
  run_stage "$stage" || true
done
grep -h -E '^(=+ .*(passed|failed|error).* =+$|[0-9]+ (passed|failed|error)|FAILED|ERROR)' \
  "$logs/test.log" 2>/dev/null |
  tail -n 40 >>"$summary" || true
[ ! -f "$logs/train_table.txt" ] || sed -n '/^|/p; /^- largest/p' "$logs/train_table.txt" >>"$summary"
stamp "done; summary:"
cat "$summary"
failed=$(grep -c -E '^stage .*: FAILED|skipped \(build failed\)' "$summary" || true)
[ "$failed" = 0 ]
