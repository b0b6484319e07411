// The process's host worker threads beside the copy engines: the optimizer thread (a FIFO of the
// user's step functions and the gradient hand-over) and the weight writer. Each starts on its first
// job.
#pragma once

#include <ATen/core/Tensor.h>

#include <vector>

#include "executor/event.h"
#include "executor/work_queue.h"

namespace roundpipe::executor {

WorkQueue& optimizer_thread();

// The weight writer: copies new weights into the parameter arena layer by layer, first in first
// out, beside the pipeline (uploads of a layer wait for its copy's event).
WorkQueue& writeback_thread();

// dsts[i].copy_(srcs[i]) (casting) on the weight writer; the event completes after the last one.
EventPtr write_back(std::vector<at::Tensor> dsts, std::vector<at::Tensor> srcs);

// Returns once every native worker (copy engines, weight writer, optimizer thread) ran the jobs
// submitted before the call. With `check`, every wait is in slices with `check` called between
// them; it may throw to abandon the drain (a copy job waiting on a hung GPU would hold it forever).
void drain_all_workers(const WaitCheck& check = {});

}  // namespace roundpipe::executor
