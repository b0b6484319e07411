// The one way work reaches a host worker thread: submit_job() queues a job and returns the Event
// that completes when it has run, carrying its error.
#pragma once

#include <functional>

#include "executor/event.h"
#include "executor/work_queue.h"

namespace roundpipe::executor {

// Runs job(done) on `queue`'s `lane`; the returned event `done` completes after it returns, with
// the exception it threw (if any). The job may record a device part on `done` before it returns.
// The job and everything it captured (tensors may own Python objects) are destroyed before `done`
// completes, so a caller that waits may move on even into interpreter shutdown.
EventPtr submit_job(WorkQueue& queue, int lane, std::function<void(Event& done)> job);

}  // namespace roundpipe::executor
