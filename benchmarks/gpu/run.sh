#!/usr/bin/env bash
# RoundPipe on your GPU in one command: build with CUDA, the tests on CUDA, the benchmarks, a
# profile. Run it from the checkout after tools/setup.sh (or in any Python environment whose torch
# is a CUDA build, with the CUDA toolkit installed: ROUNDPIPE_PYTHON=/path/to/python).
#
#   bash benchmarks/gpu/run.sh [--cpu-smoke] [--out DIR] [STAGE ...]   (default: all)
#   bash benchmarks/gpu/run.sh proof                                   (start here: ~9 minutes)
#
# Stages, in this order whatever order they are given in:
#   build        the extension with CUDA against the running torch (TORCH_CUDA_ARCH_LIST=9.0 unless
#                set), in a persistent build folder (tools/setup.sh's own for .venv), so a later
#                run rebuilds incrementally; prints nvcc, the CUDA headers, torch and the GPU first
#   test         the whole pytest suite with ROUNDPIPE_DEVICE_KIND=cuda (junit + log)
#   test-cuda    the tests marked requires_cuda
#   bench-micro  the C++ microbenchmarks of benchmarks/cpp (roundpipe_*_bench, built by the build
#                stage with ROUNDPIPE_BUILD_BENCHMARKS=ON into its build folder), through
#                benchmarks/cpp_bench.py --record
#   bench-train  benchmarks/train_gpu.py --record: ours vs roundpipe 0.1.1 vs the GPU-resident bound
#   bench-host   benchmarks/adam_state_step.py --record on 50M parameters as one tensor: the host
#                Adam step RoundPipe runs (fp32, bf16 and int8 moments) against torch's fused Adam,
#                on this machine's cores and memory
#   test-core    the cuda and cuda3 cases of the core test files (correctness, local backward,
#                fused path, step, compat, presets; cpu-smoke: their 3dev cases); reaching the
#                stage's deadline stops it with what ran, which fails only if a test failed
#   profile      the training benchmark, briefly, under nsys (else ncu on a few kernels)
#   all          build test bench-micro bench-train bench-host profile
# Without `build`, a run that finds no usable build, or sources changed since it, builds first.
# A failed build skips the later stages; any other failure is recorded and the next stage runs.
#
# proof: a first look in at most RUN_BUDGET=530 s: build, test-cuda, bench-micro, bench-train
# (1K and 4K tokens on the ~1B model, one round), bench-host (three rounds) and test-core with
# whatever is left. Each stage has a deadline of its own (build 200 s, test-cuda 90, bench-micro
# 30, bench-train 190, bench-host 30), so a hang in one leaves the later ones their time.
# roundpipe 0.1.1's Adam (compiled on first use) is compiled in the background from the start.
#
# --cpu-smoke runs the same stages on virtual CPU devices with tiny sizes and no CUDA build (the
# already-built roundpipe of the chosen python; its build stage builds only the C++
# microbenchmarks, with cmake against that python's torch): a check of this script without a GPU.
#
# Results: --out DIR (or OUT=DIR; default build/gpu-results/<UTC date-time>, git-ignored) gets
# summary.txt (one line per stage: verdict, time, figures), logs/ (every stage's log, the junit
# reports, each training run's output), results/ (the result tables the benchmarks' --record
# wrote: copy them into benchmarks/results/ to record them) and the profiler's reports.
#
# Environment:
#   ROUNDPIPE_PYTHON  python to use (default .venv/bin/python, else python3)
#   RUN_BUDGET        seconds for the whole run (proof: 530; otherwise no limit); each stage gets
#                     what is left, or its own deadline under proof if that comes first
#   PYTEST_ARGS       replaces the test selection of `test` (default: tests, or a quick subset
#                     when smoke); words are split as a shell would: -k "a and b" stays one word
#   TRAIN_ARGS        extra arguments for train_gpu.py (later ones win, e.g. "--seq 16384"),
#                     split likewise
#   PEER_DIR          where roundpipe 0.1.1 (the peer of bench-train) is installed (default
#                     build/peer): from the wheels in .whl/ if there are any (made by
#                     tools/fetch_gpu_wheels.sh for a machine without network), else from the
#                     package index
set -euo pipefail
caller=$PWD # a relative --out is taken from where the script was started
cd "$(dirname "$0")/../.."
repo=$PWD
start=$SECONDS

smoke="${RUN_SMOKE:-0}"
proof="${RUN_PROOF:-0}"
out="${OUT:-}"
stages=()
internal=""
if [ "${1:-}" = __stage ]; then # run.sh re-runs itself per stage, so `timeout` can bound it
  internal=$2
  shift 2
fi
while [ $# -gt 0 ]; do
  case "$1" in
    --cpu-smoke) smoke=1 ;;
    --out)
      [ $# -ge 2 ] || { echo "run.sh: --out needs a folder" >&2; exit 2; }
      out=$2
      shift
      ;;
    --out=*) out=${1#--out=} ;;
    build | test | test-cuda | bench-train | bench-micro | bench-host | test-core | profile)
      stages+=("$1")
      ;;
    all) stages+=(build test bench-train bench-micro bench-host profile) ;;
    proof)
      proof=1
      stages+=(build test-cuda bench-micro bench-train bench-host test-core)
      ;;
    -h | --help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) echo "run.sh: unknown argument '$1' (stages: build test test-cuda bench-micro" \
      "bench-train bench-host test-core profile all proof; options --cpu-smoke, --out DIR)" >&2
      exit 2 ;;
  esac
  shift
done
[ ${#stages[@]} -gt 0 ] || stages=(build test bench-train bench-micro bench-host profile)
wanted() { [[ " ${stages[*]} " == *" $1 "* ]]; }

[ -n "$out" ] || out="$repo/build/gpu-results/$(date -u +%Y%m%d-%H%M%S)"
case "$out" in /*) ;; *) out="$caller/$out" ;; esac
mkdir -p "$out"
OUT=$(cd "$out" && pwd)
logs="$OUT/logs"
mkdir -p "$logs"
summary="$OUT/summary.txt"
# The whole run's deadline in seconds since the epoch, or "none".
budget="${RUN_BUDGET:-$([ "$proof" = 1 ] && echo 530 || echo none)}"
[ "$budget" = none ] || budget=$(($(date +%s) + budget))
deadline="${RUN_DEADLINE:-$budget}"
peer_dir="${PEER_DIR:-$repo/build/peer}"
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$repo/build/torch_extensions}"
if [ -n "${ROUNDPIPE_PYTHON:-}" ]; then
  python="$ROUNDPIPE_PYTHON"
elif [ -x .venv/bin/python ]; then
  python="$repo/.venv/bin/python"
else
  python=python3
fi
export PYTHONUNBUFFERED=1
py_tag=$("$python" -c 'import sys; print("py%d%d" % sys.version_info[:2])')
if [ "$smoke" = 1 ]; then
  build_dir="build/gpu-smoke-$py_tag"
elif [ "$python" = "$repo/.venv/bin/python" ]; then
  build_dir="build/.venv" # tools/setup.sh's, so the build is incremental
else
  build_dir="build/gpu-$py_tag"
fi

stamp() { echo "=== $(date -u +%H:%M:%S) [+$((SECONDS - start))s] $*"; }
note() { echo "$*" | tee -a "$summary"; }

# The proof preset's deadline of each stage, in seconds (none: what is left of the budget).
proof_cap() {
  case "$1" in
    build) echo 200 ;;
    test-cuda) echo 90 ;;
    bench-micro) echo 30 ;;
    bench-train) echo 190 ;;
    bench-host) echo 30 ;;
    *) echo "" ;;
  esac
}

# Seconds stage NAME may take (0: no limit): what is left of the budget, less a margin for
# writing the summary; under proof no more than the stage's own deadline.
stage_limit() {
  local left=0 cap=""
  if [ "$deadline" != none ]; then
    left=$((deadline - $(date +%s) - 15))
    [ "$left" -gt 10 ] || left=10
  fi
  [ "$proof" = 0 ] || cap=$(proof_cap "${1:-}")
  [ -z "$cap" ] || { [ "$left" != 0 ] && [ "$cap" -ge "$left" ]; } || left=$cap
  echo "$left"
}

# run_stage NAME: banner, time limit, log, exit status into the summary. 3 means "skipped".
run_stage() {
  local name=$1 limit t0=$SECONDS rc=0
  limit=$(stage_limit "$name")
  stamp "stage $name ($([ "$limit" = 0 ] && echo 'no time limit' || echo "limit ${limit}s"))" |
    tee -a "$logs/$name.log"
  RUN_SMOKE=$smoke RUN_PROOF=$proof RUN_DEADLINE=$deadline RUN_STAGE_LIMIT=$limit OUT=$OUT \
    ROUNDPIPE_PYTHON=$python timeout -s INT -k 20 "$limit" bash "$0" __stage "$name" 2>&1 |
    tee -a "$logs/$name.log" || rc=${PIPESTATUS[0]}
  local verdict=ok
  [ "$rc" = 0 ] || verdict="FAILED (exit $rc$([ "$rc" = 124 ] && echo ', timed out'))"
  [ "$rc" != 3 ] || verdict="skipped (see its log)"
  note "stage $name: $verdict in $((SECONDS - t0))s"
  stage_results "$name"
  return "$rc"
}

# The figures of stage NAME, from its log, into the summary beside its verdict.
stage_results() {
  local log="$logs/$1.log"
  [ -f "$log" ] || return 0
  case "$1" in
    test | test-cuda | test-core)
      grep -h -E '^(=+ .*(passed|failed|error|skipped|deselected).* =+$|[0-9]+ (passed|failed|error|skipped|deselected)|FAILED|ERROR|deadline:)' \
        "$log" | tail -n 30 | sed 's/^/  /' >>"$summary" || true
      ;;
    bench-micro) grep -v -E '^(BENCH_JSON|=== )' "$log" | sed 's/^/  /' >>"$summary" || true ;;
    bench-host) sed -n '/^### Ratios/,$p' "$log" | grep '^| ' | sed 's/^/  /' >>"$summary" || true ;;
    bench-train)
      sed -n '/^|/p; /^- largest/p; /^interrupted/p; /^peer warm-up: r/p; /^wrote /p' "$log" |
        sed 's/^/  /' >>"$summary" || true
      ;;
    build) grep -E '^(roundpipe build:|CUDA toolkit:|torch [0-9]|GPU [0-9])' "$log" |
      awk '!seen[$0]++ { print "  " $0 }' >>"$summary" || true ;;
  esac
}

# read_words ARRAY VALUE: ARRAY set to VALUE's words, split as a shell would split them (quotes
# group, backslashes escape; nothing is expanded or run); fails, saying why, on unbalanced quotes.
read_words() {
  local -n words=$1
  local split='import shlex, sys
try:
    words = shlex.split(sys.argv[1])
except ValueError as error:
    sys.exit(f"cannot split {sys.argv[1]!r} into words: {error}")
sys.stdout.write("".join(w + "\0" for w in words))'
  "$python" -c "$split" "$2" >/dev/null || return 1
  mapfile -d '' -t words < <("$python" -c "$split" "$2")
}

# pytest with Ctrl-C restored (a run started in the background inherits it ignored), so the
# stage's deadline (SIGINT) ends it with its summary and junit report.
pytest_command=("$python" -c 'import signal, sys
signal.signal(signal.SIGINT, signal.default_int_handler)
import pytest
sys.exit(pytest.main(sys.argv[1:]))' -p no:cacheprovider -ra -q)

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

# The installed package is a copy: a later run with edited sources (C++ or Python) rebuilds.
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

device_kind() { [ "$smoke" = 1 ] && echo cpu || echo cuda; }

stage_test() {
  local args=()
  if [ -n "${PYTEST_ARGS:-}" ]; then
    read_words args "$PYTEST_ARGS" || return 2
  elif [ "$smoke" = 1 ]; then
    args=(tests/test_cuda.py tests/test_package.py)
  else
    args=(tests)
  fi
  echo "ROUNDPIPE_DEVICE_KIND=$(device_kind) pytest$(printf ' %q' "${args[@]}")"
  ROUNDPIPE_DEVICE_KIND=$(device_kind) "${pytest_command[@]}" --junitxml="$logs/junit.xml" \
    "${args[@]}"
}

stage_test_cuda() {
  echo "ROUNDPIPE_DEVICE_KIND=$(device_kind) pytest -m requires_cuda tests"
  ROUNDPIPE_DEVICE_KIND=$(device_kind) "${pytest_command[@]}" \
    --junitxml="$logs/junit-cuda.xml" -m requires_cuda tests
}

# The core files' cases on the devices at hand, until the stage's deadline: pytest gets a
# deadline of its own a little earlier, so that it stops with its summary; stopped there, the
# stage counts as passed unless a test that ran failed.
stage_test_core() {
  local files=(tests/test_correctness.py tests/test_local_backward.py tests/test_fused_path.py
    tests/test_step.py tests/test_compat.py tests/test_presets.py)
  local cases=cuda
  [ "$smoke" = 0 ] || cases=3dev
  local limit=${RUN_STAGE_LIMIT:-0} rc=0
  if [ "$limit" != 0 ]; then
    limit=$((limit - 25))
    [ "$limit" -gt 5 ] || limit=5
  fi
  echo "ROUNDPIPE_DEVICE_KIND=$(device_kind) pytest -k $cases ${files[*]}" \
    "($([ "$limit" = 0 ] && echo 'no deadline' || echo "deadline ${limit}s"))"
  ROUNDPIPE_DEVICE_KIND=$(device_kind) timeout -s INT -k 15 "$limit" "${pytest_command[@]}" \
    --junitxml="$logs/junit-core.xml" -k "$cases" "${files[@]}" || rc=$?
  [ "$rc" = 124 ] || return "$rc"
  "$python" - "$logs/junit-core.xml" <<'PY'
import sys
import xml.etree.ElementTree as ET

try:
    suites = ET.parse(sys.argv[1]).getroot()
except (OSError, ET.ParseError) as error:
    sys.exit(f"deadline: stopped; no junit report ({error})")
suite = suites if suites.tag == "testsuite" else suites.find("testsuite")
counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
bad = counts["failures"] + counts["errors"]
print(f"deadline: stopped after {counts['tests']} tests ({bad} failed, {counts['skipped']} "
      "skipped); the rest did not run")
sys.exit(1 if bad else 0)
PY
}

# roundpipe 0.1.1 into PEER_DIR, from .whl/ (fetched first when empty, except in a smoke run,
# where 0.1.1 cannot run: it needs CUDA).
install_peer() {
  [ -d "$peer_dir/roundpipe" ] && return 0
  local wheel=.whl/roundpipe-0.1.1-py3-none-any.whl
  if [ ! -f "$wheel" ] && [ "$smoke" = 0 ]; then
    echo "fetching roundpipe 0.1.1 and its wheels into .whl/ (tools/fetch_gpu_wheels.sh)"
    ROUNDPIPE_PYTHON=$python bash tools/fetch_gpu_wheels.sh || true
  fi
  if [ ! -f "$wheel" ]; then
    echo "no .whl/roundpipe-0.1.1 wheel (tools/fetch_gpu_wheels.sh makes it): no 0.1.1 column"
    return 0
  fi
  "$python" -m pip install -q --no-index --no-deps --no-compile --disable-pip-version-check \
    --target "$peer_dir" .whl/*.whl
  echo "roundpipe 0.1.1 installed in $peer_dir"
}

# 0.1.1 compiles its CPU Adam with torch's cpp_extension (ninja, -march=native) on first use, in
# the run it times; this compiles it into TORCH_EXTENSIONS_DIR beforehand. ninja from the peer's
# wheels when none is on PATH.
peer_path() { command -v ninja >/dev/null && echo "$PATH" || echo "$peer_dir/bin:$PATH"; }
warm_peer() {
  install_peer
  [ -d "$peer_dir/roundpipe" ] || return 0
  echo "compiling roundpipe 0.1.1's Adam into $TORCH_EXTENSIONS_DIR"
  # The builder module alone: importing 0.1.1's package asks every GPU for its memory.
  PATH=$(peer_path) PYTHONPATH="$peer_dir" "$python" - "$peer_dir" <<'PY'
import importlib.util
import sys
import time

start = time.monotonic()
path = f"{sys.argv[1]}/roundpipe/optim/optim_builder.py"
spec = importlib.util.spec_from_file_location("peer_optim_builder", path)
assert spec is not None and spec.loader is not None
builder = importlib.util.module_from_spec(spec)
spec.loader.exec_module(builder)
builder.load_optim_function("adam")
print(f"roundpipe 0.1.1 Adam ready in {time.monotonic() - start:.0f} s")
PY
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
  local args=() extra=()
  read -r -a args <<<"$(train_args)"
  [ "$smoke" = 0 ] || args+=(--seq 32 --rounds 1 --timeout 120)
  [ "$proof" = 0 ] || args+=(--seq "$([ "$smoke" = 1 ] && echo 32,64 || echo 1024,4096)"
    --rounds 1 --iters 2)
  read_words extra "${TRAIN_ARGS:-}" || return 2
  local limit=${RUN_STAGE_LIMIT:-$(stage_limit bench-train)}
  # Its budget ends before the stage's deadline, so that it prints (and records) what it measured.
  PATH=$(peer_path) ROUNDPIPE_BENCH_RESULTS="$OUT/results" "$python" benchmarks/train_gpu.py \
    "${args[@]}" "${extra[@]}" --peer-path "$peer_dir" --log-dir "$logs/train" \
    --budget "$((limit == 0 ? 0 : limit > 40 ? limit - 15 : 25))" --record | tee "$logs/train_table.txt"
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
    ROUNDPIPE_BENCH_RESULTS="$OUT/results" "$python" benchmarks/cpp_bench.py --record "$bench" ||
      rc=$?
  done
  return "$rc"
}

# The host's Adam step: fewer rounds under proof, a small size in a smoke run.
stage_bench_host() {
  local args=(--shapes one)
  [ "$proof" = 0 ] || args+=(--rounds 3)
  [ "$smoke" = 0 ] || args+=(--params 2M --rounds 2)
  ROUNDPIPE_BENCH_RESULTS="$OUT/results" "$python" benchmarks/adam_state_step.py "${args[@]}" \
    --record
}

stage_profile() {
  local args=() extra=()
  read -r -a args <<<"$(train_args)"
  read_words extra "${TRAIN_ARGS:-}" || return 2
  args+=("${extra[@]}")
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

rm -rf "$logs" && mkdir -p "$logs" # a folder given again holds this run's logs alone
: >"$summary"
note "run.sh $(date -u +%Y-%m-%dT%H:%M:%SZ) mode=$([ "$smoke" = 1 ] && echo cpu-smoke || echo gpu)" \
  "stages=${stages[*]} python=$python commit=$(git rev-parse --short HEAD 2>/dev/null || echo ?)"

warm_pid=""
if wanted bench-train; then
  warm_peer >"$logs/peer-warm.log" 2>&1 &
  warm_pid=$!
fi
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
for stage in test test-cuda bench-micro bench-train bench-host test-core profile; do
  wanted "$stage" || continue
  if [ "$build_ok" = 0 ]; then
    note "stage $stage: skipped (build failed)"
    continue
  fi
  if [ "$stage" = bench-train ] && [ -n "$warm_pid" ]; then
    # A minute at most: a compile still running then is waited for by 0.1.1's first run
    # (torch's extension lock), within that run's own time limit.
    timeout 60 tail --pid="$warm_pid" -f /dev/null || true
    sed 's/^/peer warm-up: /' "$logs/peer-warm.log" | tail -n 5 | tee -a "$logs/bench-train.log"
  fi
  run_stage "$stage" || true
done
stamp "done; summary:"
cat "$summary"
echo "everything is in $OUT (summary.txt, logs/, results/)"
failed=$(grep -c -E '^stage .*: FAILED|skipped \(build failed\)' "$summary" || true)
[ "$failed" = 0 ]
