"""The main job: a small run on the default devices (CPU devices when there is no GPU).

Until the pipelined runtime lands this shows what is built: the native core, the device pool it
resolved, and the SIMD level its kernels dispatch on.
"""

from __future__ import annotations

import roundpipe
from roundpipe._native import BUILD_INFO


def main() -> None:
    print(f"roundpipe {roundpipe.__version__} (native core)")
    for key, value in BUILD_INFO.items():
        print(f"  {key:14s} {value}")
    print(f"devices: {roundpipe.device_count()} x {roundpipe.device_kind()}")


if __name__ == "__main__":
    main()
