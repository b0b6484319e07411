#include "executor/optimizer_thread.h"

#include <c10/util/Exception.h>

#include "executor/copy_engine.h"
#include "executor/jobs.h"

namespace roundpipe::executor {

WorkQueue& optimizer_thread() {
  // Leaked on purpose, like the copy engines: never joined during static destruction.
  static auto* queue = new WorkQueue();
  return *queue;
}

WorkQueue& writeback_thread() {
  static auto* queue = new WorkQueue();
  return *queue;
}

EventPtr write_back(std::vector<at::Tensor> dsts, std::vector<at::Tensor> srcs) {
  TORCH_CHECK(dsts.size() == srcs.size(), "writeback_async: ", dsts.size(), " destinations for ",
              srcs.size(), " sources");
  return submit_job(writeback_thread(), 0,
                    [dsts = std::move(dsts), srcs = std::move(srcs)](Event&) {
                      for (std::size_t i = 0; i < dsts.size(); ++i) dsts[i].copy_(srcs[i]);
                    });
}

void drain_all_workers(const WaitCheck& check) {
  drain_copy_engines(check);
  writeback_thread().drain(check);
  optimizer_thread().drain(check);
}

}  // namespace roundpipe::executor
