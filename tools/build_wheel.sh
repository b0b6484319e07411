#!/usr/bin/env bash
# Builds a binary wheel of roundpipe for the torch of one Python environment, into dist/:
#
#   bash tools/build_wheel.sh     # e.g. dist/roundpipe-0.2.0+pt213cpu-cp311-cp311-linux_x86_64.whl
#
# The native core is compiled against that torch (with CUDA when it is a CUDA build), so the wheel
# works with it alone: its local version names torch and CUDA (+pt213cpu, +pt211cu130) and it
# requires exactly that torch (torch==2.13.0+cpu), so pip never installs it beside another one
# (roundpipe also checks at import). Installing it needs no compiler; it fits the same Python
# version and platform (the tags in its name).
#   ROUNDPIPE_PYTHON      the environment's python (default .venv/bin/python, else python3): its
#                         torch, scikit-build-core and ninja build the wheel; the `wheel` tool is
#                         installed into it when missing
#   WHEEL_DIR             where the wheel goes (default dist)
#   TORCH_CUDA_ARCH_LIST  as for tools/setup.sh (default 9.0 for a CUDA build)
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=cuda_env.sh
source tools/cuda_env.sh
python="${ROUNDPIPE_PYTHON:-}"
[ -n "$python" ] || { [ -x .venv/bin/python ] && python=.venv/bin/python || python=python3; }
wheel_dir="${WHEEL_DIR:-dist}"
pip=("$python" -m pip --disable-pip-version-check)

"$python" -c 'import torch' 2>/dev/null || {
  echo "$python has no torch: install the torch to build for first (or run tools/setup.sh)" >&2
  exit 1
}
"$python" -c 'import scikit_build_core' 2>/dev/null || "${pip[@]}" install --quiet \
  "scikit-build-core>=0.10" ninja
"$python" -c 'import wheel' 2>/dev/null || "${pip[@]}" install --quiet wheel

# The local version: pt<major><minor> (p<patch> when not 0), then cu<version> or cpu.
versions=$("$python" - <<'PY'
import torch
from packaging.version import Version

version = Version(torch.__version__)
major, minor, patch = (list(version.release) + [0, 0])[:3]
tag = f"pt{major}{minor}" + (f"p{patch}" if patch else "")
cuda = torch.version.cuda
tag += "cu" + cuda.replace(".", "") if cuda else "cpu"
print(torch.__version__, tag)
PY
)
read -r torch_version local_tag <<<"$versions"
if [ "$local_tag" != "${local_tag%cpu}" ]; then
  echo "building for torch $torch_version (CPU)"
else
  roundpipe_find_cuda "$python" || {
    echo "torch $torch_version is a CUDA build: set CUDA_PATH to the matching CUDA toolkit" >&2
    exit 1
  }
  export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}"
  echo "building for torch $torch_version (TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST)"
fi

# tools/setup.sh's build folder when the environment is one of its (a folder of the checkout),
# so that the build is incremental; else one of the wheel's own.
environment=$(cd "$(dirname "$("$python" -c 'import sys; print(sys.executable)')")/.." && pwd)
if [ "$(dirname "$environment")" = "$PWD" ]; then
  build_dir="build/$(basename "$environment")"
else
  build_dir="build/wheel-$("$python" -c 'import sys; print("py%d%d" % sys.version_info[:2])')-$local_tag"
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"${pip[@]}" wheel --quiet --no-build-isolation --no-deps --config-settings=build-dir="$build_dir" \
  -w "$work/plain" .

# The same wheel with the local version and the exact torch in its metadata, repacked by `wheel`
# (which writes the new RECORD and the file name).
"$python" -m wheel unpack --dest "$work/tree" "$work"/plain/roundpipe-*.whl >/dev/null
version=$("$python" - "$work/tree" "$torch_version" "$local_tag" <<'PY'
import sys
from pathlib import Path

from packaging.requirements import Requirement
from packaging.version import Version

tree, torch_version, local_tag = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
(unpacked,) = tree.iterdir()
(info,) = unpacked.glob("*.dist-info")
lines = (info / "METADATA").read_text(encoding="utf-8").splitlines()
version = next(line.split(": ", 1)[1] for line in lines if line.startswith("Version: "))
pinned = f"{version}+{local_tag}"
for i, line in enumerate(lines):
    if line.startswith("Version: "):
        lines[i] = f"Version: {pinned}"
    elif line.startswith("Requires-Dist: "):
        requirement = Requirement(line.split(": ", 1)[1])
        if requirement.name == "torch" and requirement.marker is None:
            if Version(torch_version) not in requirement.specifier:
                sys.exit(f"roundpipe supports torch{requirement.specifier}; this is {torch_version}")
            lines[i] = f"Requires-Dist: torch=={torch_version}"
(info / "METADATA").write_text("\n".join(lines) + "\n", encoding="utf-8")
info.rename(info.with_name(f"roundpipe-{pinned}.dist-info"))
print(pinned)
PY
)
mkdir -p "$wheel_dir"
"$python" -m wheel pack --dest-dir "$wheel_dir" "$work"/tree/roundpipe-* >/dev/null
ls "$wheel_dir/roundpipe-$version-"*.whl
