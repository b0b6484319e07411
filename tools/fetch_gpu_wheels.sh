#!/usr/bin/env bash
# Downloads into .whl/ (git-ignored) the wheels the GPU device machine lacks: roundpipe==0.1.1 (the
# peer of benchmarks/train_gpu.py) and its dependencies, for Python 3.12 on manylinux x86-64. The
# machine has no network; carry .whl with the call and benchmarks/gpu/run.sh installs them into a
# folder of their own (same import name as ours). torch and the nvidia-* packages are skipped: the
# machine has its own.
#   ROUNDPIPE_PYTHON  python whose pip downloads (default .venv/bin/python, else python3)
#   PEER_SPEC         the peer's requirement (default roundpipe==0.1.1)
set -euo pipefail
cd "$(dirname "$0")/.."
python="${ROUNDPIPE_PYTHON:-}"
[ -n "$python" ] || { [ -x .venv/bin/python ] && python=.venv/bin/python || python=python3; }
spec="${PEER_SPEC:-roundpipe==0.1.1}"
dest=.whl
platforms=(manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64
  manylinux1_x86_64)
download() {
  "$python" -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
    --python-version 3.12 --implementation cp "${platforms[@]/#/--platform=}" -d "$dest" "$@"
}
rm -rf "$dest" && mkdir -p "$dest"
download "$spec"
peer_wheel=$(ls "$dest"/*.whl)
# The peer's runtime requirements (no extras), less the ones the machine has its own copy of.
mapfile -t needs < <(unzip -p "$peer_wheel" '*.dist-info/METADATA' |
  sed -n 's/^Requires-Dist: *//p' | grep -v 'extra *==' | sed 's/[ ;].*//' |
  grep -viE '^(torch|nvidia-.*|triton|transformers)([<>=!~].*)?$')
echo "peer $(basename "$peer_wheel") needs: ${needs[*]}"
[ ${#needs[@]} -eq 0 ] || download "${needs[@]}"
ls -1 "$dest"
du -sh "$dest"
