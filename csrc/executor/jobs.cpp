#include "executor/jobs.h"

#include <memory>
#include <utility>

namespace roundpipe::executor {

EventPtr submit_job(WorkQueue& queue, int lane, std::function<void(Event& done)> job) {
  auto done = std::make_shared<Event>();
  auto pending = std::make_shared<std::function<void(Event&)>>(std::move(job));
  queue.submit(lane, [done, pending] {
    std::exception_ptr error;
    try {
      (*pending)(*done);
    } catch (...) {
      error = std::current_exception();
    }
    *pending = nullptr;
    done->complete(error);
  });
  return done;
}

}  // namespace roundpipe::executor
