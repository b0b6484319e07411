#include "executor/optimizer_thread.h"

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

}  // namespace roundpipe::executor
