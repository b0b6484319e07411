// The process's one optimizer thread: a FIFO of host jobs (the user's step functions, gradient
// hand-over and weight write-back) that runs beside the pipeline. Started on the first job.
#pragma once

#include "executor/work_queue.h"

namespace roundpipe::executor {

WorkQueue& optimizer_thread();

// The weight writer: copies new weights into the parameter arena layer by layer, first in first
// out, beside the pipeline (uploads of a layer wait for its copy's event).
WorkQueue& writeback_thread();

}  // namespace roundpipe::executor
