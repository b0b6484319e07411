// How many threads the host optimizer kernels use when the caller does not say. Torch-free.
//
// Not torch's intra-op setting: torchrun sets OMP_NUM_THREADS=1 when it starts several processes
// per machine, which would make every rank's optimizer step single-threaded. Instead: the CPUs in
// this process's affinity mask, shared out among the ranks on this machine (LOCAL_WORLD_SIZE, which
// torchrun sets), at least one. ROUNDPIPE_OPTIMIZER_THREADS, then set_optimizer_threads, override
// it.
#pragma once

namespace roundpipe {

// The threads the optimizer uses now: set_optimizer_threads's value if one is set, else
// ROUNDPIPE_OPTIMIZER_THREADS if set (a positive integer; std::invalid_argument otherwise), else
// affinity_threads().
int optimizer_threads();

// CPUs in the affinity mask / LOCAL_WORLD_SIZE (1 when unset or invalid), at least 1.
int affinity_threads();

// Fixes the number of threads (>= 1), or with 0 returns to the default above.
void set_optimizer_threads(int threads);

}  // namespace roundpipe
