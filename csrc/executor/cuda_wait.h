// Host notification of a CUDA event without spinning. Compiled only when torch has CUDA.
#pragma once

#include <functional>

#include <c10/core/Event.h>

namespace roundpipe::executor::cuda {

// Calls `notify` on a CUDA runtime thread once `event` (a recorded CUDA event) has completed.
// The wait is queued on a private stream of the event's device on which no other wait is queued
// (one of a small pool), so no compute or copy stream is held up by the host function, and no
// wait by an earlier, slower one. `notify` must not call CUDA.
void notify_when_done(const c10::Event& event, std::function<void()> notify);

}  // namespace roundpipe::executor::cuda
