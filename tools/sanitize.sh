#!/usr/bin/env bash
# Builds the torch-free core's C++ unit tests under sanitizers and runs them; any report fails.
#   build/sanitize-asan-ubsan: -fsanitize=address,undefined
#   build/sanitize-tsan:       -fsanitize=thread
# Needs cmake and a C++20 compiler (ninja if present). Takes a minute or two on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
generator=()
command -v ninja >/dev/null && generator=(-G Ninja)

run_variant() {
  local name="$1" sanitizers="$2"
  local dir="build/sanitize-$name"
  echo "=== $name (-fsanitize=$sanitizers)"
  cmake -S . -B "$dir" "${generator[@]}" -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DROUNDPIPE_CORE_ONLY=ON -DROUNDPIPE_BUILD_TESTS=ON -DROUNDPIPE_SANITIZE="$sanitizers" >/dev/null
  cmake --build "$dir" --parallel
  "$dir/roundpipe_core_tests"
}

export ASAN_OPTIONS="halt_on_error=1:detect_leaks=1:abort_on_error=0"
export UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1"
export TSAN_OPTIONS="halt_on_error=1:second_deadlock_stack=1"
run_variant asan-ubsan address,undefined
run_variant tsan thread
echo "sanitizers clean"
