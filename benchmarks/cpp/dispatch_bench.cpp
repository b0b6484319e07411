// roundpipe_dispatch_bench: what the executors cost the issuing thread per stage x microbatch,
// on virtual CPU devices and (where present) on CUDA devices, one per GPU and 3 logical ones.
//
//   roundpipe_dispatch_bench [--stages 8] [--microbatches 4] [--rounds 50] [--bytes 4096]
//
// One stage x microbatch is the hand-over the pipeline issues for a saved activation: an event
// on the producing device, a copy of the activation to host memory on its activation lane after
// that event, a copy back to the next device's activation lane after the first copy, and the
// next device's current stream made to wait for it. The activation is small (--bytes), so the
// figures are overhead, not bandwidth:
//   issue_us  host time to issue one hand-over (CUDA: no wait for the GPU; virtual CPU devices:
//             the copies run on the engines' workers and the final wait is a host wait)
//   total_us  the same, including the wait for the last hand-over of a round, per hand-over
// Also the raw executor round trip: submit_job of an empty job and its event's wait.
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include <ATen/ops/empty.h>

#include "bench_util.h"
#include "device/registry.h"
#include "executor/copy_engine.h"
#include "executor/jobs.h"
#include "executor/work_queue.h"
#include "memory/host_arena.h"
#ifdef ROUNDPIPE_WITH_CUDA
#include <c10/cuda/CUDAFunctions.h>

#include "device/cuda_devices.h"
#endif

namespace {

using roundpipe::bench::median;
using roundpipe::bench::now_seconds;
using roundpipe::bench::Report;
using roundpipe::bench::Row;
namespace executor = roundpipe::executor;
using roundpipe::device::Registry;

struct Options {
  int stages = 8;
  int microbatches = 4;
  int rounds = 50;
  std::int64_t bytes = 4096;
};

bool parse(int argc, char** argv, Options& options) {
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    if (i + 1 >= argc) {
      std::fprintf(stderr, "%s needs a value\n", arg.c_str());
      return false;
    }
    const long value = std::atol(argv[++i]);
    if (value < 1) {
      std::fprintf(stderr, "%s must be a positive integer, got '%s'\n", arg.c_str(), argv[i]);
      return false;
    }
    if (arg == "--stages") {
      options.stages = static_cast<int>(value);
    } else if (arg == "--microbatches") {
      options.microbatches = static_cast<int>(value);
    } else if (arg == "--rounds") {
      options.rounds = static_cast<int>(value);
    } else if (arg == "--bytes") {
      options.bytes = value;
    } else {
      std::fprintf(stderr,
                   "usage: %s [--stages 8] [--microbatches 4] [--rounds 50] [--bytes 4096]\n",
                   argv[0]);
      return false;
    }
  }
  return true;
}

// submit_job of an empty job: the host cost of submitting, and the round trip to its completion.
Row submit_round_trip(const Options& options) {
  executor::WorkQueue queue;
  std::vector<double> issue, total;
  const int jobs = options.stages * options.microbatches;
  for (int round = 0; round <= options.rounds; ++round) {
    const double start = now_seconds();
    double issued = 0.0;
    for (int j = 0; j < jobs; ++j) {
      const double t0 = now_seconds();
      executor::EventPtr done = executor::submit_job(queue, 0, [](executor::Event&) {});
      issued += now_seconds() - t0;
      done->synchronize();
    }
    if (round == 0) continue;  // warm-up: the worker thread starts on the first job
    issue.push_back(issued / jobs * 1e6);
    total.push_back((now_seconds() - start) / jobs * 1e6);
  }
  return Row{"submit_job + wait (one worker)",
             {{"issue_us", median(issue)}, {"total_us", median(total)}}};
}

// The pipeline's activation hand-over, stage s on device s % count, microbatch by microbatch,
// on the devices the registry is configured with now.
Row hand_over(const std::string& name, const Options& options) {
  Registry& registry = Registry::instance();
  const int count = registry.count();
  const bool cuda = registry.kind() == roundpipe::device::DeviceKind::kCuda;
  auto device_of = [&](int index) {
    return cuda ? c10::Device(c10::DeviceType::CUDA,
                              static_cast<c10::DeviceIndex>(registry.physical_index(index)))
                : c10::Device(c10::DeviceType::CPU);
  };
  std::vector<at::Tensor> produced, received;
  for (int d = 0; d < count; ++d) {
    auto on_device = at::TensorOptions().dtype(at::kByte).device(device_of(d));
    produced.push_back(at::empty({options.bytes}, on_device));
    received.push_back(at::empty({options.bytes}, on_device));
  }
  std::vector<at::Tensor> host;
  for (int m = 0; m < options.microbatches; ++m) {
    host.push_back(roundpipe::memory::allocate_pinned_staging(options.bytes));
  }
  const int per_round = options.stages * options.microbatches;
  std::vector<double> issue, total;
  for (int round = 0; round <= options.rounds; ++round) {
    const double start = now_seconds();
    executor::EventPtr last;
    for (int s = 0; s < options.stages; ++s) {
      const int from = s % count, to = (s + 1) % count;
      for (int m = 0; m < options.microbatches; ++m) {
        executor::EventPtr computed = executor::record_event(from);
        executor::EventPtr down = executor::copy_engine(from).copy(
            host[m], produced[from], executor::Lane::kActivation, computed);
        last = executor::copy_engine(to).copy(received[to], host[m], executor::Lane::kActivation,
                                              down);
        last->block(executor::current_stream(to));
      }
    }
    const double issued = now_seconds() - start;
    last->synchronize();
    for (int d = 0; d < count; ++d) executor::record_event(d)->synchronize();
    if (round == 0) continue;  // warm-up: engines, streams and workers start on first use
    issue.push_back(issued / per_round * 1e6);
    total.push_back((now_seconds() - start) / per_round * 1e6);
  }
  return Row{name, {{"issue_us", median(issue)}, {"total_us", median(total)}}};
}

int run(const Options& options) {
  Registry& registry = Registry::instance();
  Report report("dispatch");
  report.add(submit_round_trip(options));
  for (int devices : {1, 3}) {
    registry.configure("cpu", devices, std::nullopt);
    report.add(hand_over("hand-over, " + std::to_string(devices) + " CPU device(s)", options));
  }
  std::string cuda_note = "CUDA: skipped: no CUDA device (this build has no CUDA)";
#ifdef ROUNDPIPE_WITH_CUDA
  registry.set_cuda_provider(roundpipe::device::cuda_provider());
  if (c10::cuda::device_count() == 0) {
    cuda_note = "CUDA: skipped: no CUDA device";
  } else {
    registry.configure("cuda", std::nullopt, 0);
    report.add(hand_over("hand-over, " + std::to_string(registry.count()) + " GPU(s)", options));
    registry.configure("cuda", std::nullopt, 3);
    report.add(hand_over("hand-over, 3 logical CUDA devices", options));
    cuda_note = "CUDA: " + std::to_string(c10::cuda::device_count()) + " GPU(s)";
  }
#endif
  std::printf("%d stages x %d microbatches, %lld-byte activations, median of %d rounds; %s\n",
              options.stages, options.microbatches, static_cast<long long>(options.bytes),
              options.rounds, cuda_note.c_str());
  report.print();
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Options options;
  if (!parse(argc, argv, options)) return 2;
  try {
    return run(options);
  } catch (const std::exception& error) {
    std::fprintf(stderr, "roundpipe_dispatch_bench failed: %s\n", error.what());
    return 1;
  }
}
