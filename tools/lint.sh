#!/usr/bin/env bash
# One lint command for the whole tree: ruff and mypy (Python, mypy strict on python/roundpipe as
# configured in pyproject.toml) and clang-format (C++). Pass --fix to rewrite what can be.
set -euo pipefail
cd "$(dirname "$0")/.."
bin="${ROUNDPIPE_VENV:-.venv}/bin"
python_paths=(python tests benchmarks examples)
mapfile -t cxx_files < <(git ls-files --cached --others --exclude-standard \
  '*.cpp' '*.h' '*.cu' '*.cuh')

if [ "${1:-}" = "--fix" ]; then
  "$bin/ruff" check --fix "${python_paths[@]}"
  "$bin/ruff" format "${python_paths[@]}"
  [ ${#cxx_files[@]} -eq 0 ] || "$bin/clang-format" -i "${cxx_files[@]}"
  "$bin/mypy" --python-executable "$bin/python"
else
  "$bin/ruff" check "${python_paths[@]}"
  "$bin/ruff" format --check "${python_paths[@]}"
  [ ${#cxx_files[@]} -eq 0 ] || "$bin/clang-format" --dry-run -Werror "${cxx_files[@]}"
  "$bin/mypy" --python-executable "$bin/python"
fi
echo "lint clean"
