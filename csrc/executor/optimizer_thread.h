// The process's one optimizer thread: a FIFO of host jobs (the user's step functions, gradient
// hand-over and weight write-back) that runs beside the pipeline. Started on the first job.
#pragma once

#include "executor/work_queue.h"

namespace roundpipe::executor {

WorkQueue& optimizer_thread();

}  // namespace roundpipe::executor
