#!/usr/bin/env bash
# Downloads into .whl/ (git-ignored) roundpipe==0.1.1, the pure-Python peer that
# benchmarks/train_gpu.py compares with, and the wheels it needs besides torch (and nvidia-*,
# triton, transformers: the environment has its own). benchmarks/gpu/run.sh installs them into a
# folder of their own (build/peer: the peer has our import name), and runs this script itself when
# .whl/ is empty. For a GPU machine without network, run it on one with network, naming that
# machine's Python, and copy .whl/ into its checkout.
#   ROUNDPIPE_PYTHON     python whose pip downloads (default .venv/bin/python, else python3); the
#                        wheels fit it unless PEER_PYTHON_VERSION is set
#   PEER_PYTHON_VERSION  download for another Python instead (e.g. 3.12), on manylinux x86-64
#   PEER_SPEC            the peer's requirement (default roundpipe==0.1.1)
set -euo pipefail
cd "$(dirname "$0")/.."
python="${ROUNDPIPE_PYTHON:-}"
[ -n "$python" ] || { [ -x .venv/bin/python ] && python=.venv/bin/python || python=python3; }
spec="${PEER_SPEC:-roundpipe==0.1.1}"
dest=.whl
target=()
if [ -n "${PEER_PYTHON_VERSION:-}" ]; then
  target=(--python-version "$PEER_PYTHON_VERSION" --implementation cp)
  for platform in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 \
    manylinux2014_x86_64 manylinux1_x86_64; do
    target+=("--platform=$platform")
  done
fi
download() {
  "$python" -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
    "${target[@]}" -d "$dest" "$@"
}
rm -rf "$dest" && mkdir -p "$dest"
download "$spec"
peer_wheel=$(ls "$dest"/*.whl)
# The peer's runtime requirements (no extras), less the ones the environment has its own copy of.
metadata='import sys, zipfile
wheel = zipfile.ZipFile(sys.argv[1])
print(wheel.read(next(n for n in wheel.namelist() if n.endswith(".dist-info/METADATA"))).decode())'
mapfile -t needs < <("$python" -c "$metadata" "$peer_wheel" |
  sed -n 's/^Requires-Dist: *//p' | grep -v 'extra *==' | sed 's/[ ;].*//' |
  grep -viE '^(torch|nvidia-.*|triton|transformers)([<>=!~].*)?$')
echo "peer $(basename "$peer_wheel") needs: ${needs[*]}"
[ ${#needs[@]} -eq 0 ] || download "${needs[@]}"
ls -1 "$dest"
du -sh "$dest"
