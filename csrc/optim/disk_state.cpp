#include "optim/disk_state.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

namespace roundpipe::optim {
namespace {

using Clock = std::chrono::steady_clock;

std::int64_t nanoseconds(Clock::time_point time) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(time.time_since_epoch()).count();
}

// Smallest run of elements one compute task takes (on kStateBlock multiples).
constexpr std::int64_t kComputeRun = 1 << 15;

std::int64_t state_element_size(StateDType dtype) {
  switch (dtype) {
    case StateDType::kFloat32:
      return 4;
    case StateDType::kBFloat16:
      return 2;
    default:
      return 1;
  }
}

// Page-aligned memory of its own mapping, so that it goes back to the system when freed
// (from malloc's heap it would stay with the process, and raise malloc's mmap threshold).
class PageBuffer {
 public:
  explicit PageBuffer(std::int64_t bytes) : bytes_(static_cast<std::size_t>(bytes)) {
    void* memory =
        ::mmap(nullptr, bytes_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (memory == MAP_FAILED) throw std::bad_alloc();
    memory_ = static_cast<char*>(memory);
  }
  ~PageBuffer() { ::munmap(memory_, bytes_); }
  PageBuffer(const PageBuffer&) = delete;
  PageBuffer& operator=(const PageBuffer&) = delete;
  char* data() const { return memory_; }

 private:
  std::size_t bytes_;
  char* memory_;
};

// The region kinds of a chunk, in buffer order.
enum Part { kParam, kExpAvg, kExpAvgSq, kExpAvgScale, kExpAvgSqScale, kParts };

// One chunk's buffer and the requests on it in flight.
class Slot {
 public:
  explicit Slot(std::int64_t bytes) : memory_(bytes) {}
  char* data() const { return memory_.data(); }

  void expect(int requests) {
    std::lock_guard lock(mutex_);
    pending_ += requests;
  }
  void finished(std::exception_ptr error) {
    std::lock_guard lock(mutex_);
    if (error && !error_) error_ = error;
    if (--pending_ == 0) done_.notify_all();
  }
  // Waits for the slot's requests; rethrows the first failure (once).
  void wait() {
    std::unique_lock lock(mutex_);
    done_.wait(lock, [&] { return pending_ == 0; });
    if (error_) std::rethrow_exception(std::exchange(error_, nullptr));
  }

 private:
  PageBuffer memory_;
  std::mutex mutex_;
  std::condition_variable done_;
  int pending_ = 0;
  std::exception_ptr error_;
};

// A few threads that run requests in the order they came.
class IoThreads {
 public:
  explicit IoThreads(int count) {
    for (int i = 0; i < count; ++i) threads_.emplace_back([this] { loop(); });
  }
  ~IoThreads() {
    {
      std::lock_guard lock(mutex_);
      stopping_ = true;
    }
    wake_.notify_all();
    for (std::thread& thread : threads_) thread.join();
  }
  void submit(std::function<void()> request) {
    {
      std::lock_guard lock(mutex_);
      queue_.push_back(std::move(request));
    }
    wake_.notify_one();
  }

 private:
  void loop() {
    for (;;) {
      std::function<void()> request;
      {
        std::unique_lock lock(mutex_);
        wake_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
        if (queue_.empty()) return;
        request = std::move(queue_.front());
        queue_.pop_front();
      }
      request();
    }
  }

  std::mutex mutex_;
  std::condition_variable wake_;
  std::deque<std::function<void()>> queue_;
  bool stopping_ = false;
  std::vector<std::thread> threads_;
};

// Reads or writes `length` bytes at `offset`, retrying short transfers and interruptions. A read
// past the end of the file (a region never written) reads zeros.
void transfer(bool write, const DiskFile& file, char* buffer, std::int64_t length,
              std::int64_t offset) {
  while (length > 0) {
    const ssize_t done = write ? ::pwrite(file.fd, buffer, length, offset)
                               : ::pread(file.fd, buffer, length, offset);
    if (done < 0) {
      if (errno == EINTR) continue;
      const int error = errno;
      throw DiskError(error, file.path,
                      std::string(write ? "writing " : "reading ") + std::to_string(length) +
                          " bytes at offset " + std::to_string(offset) + " of " + file.path +
                          " failed: " + std::strerror(error));
    }
    if (done == 0) {
      if (write) {
        throw DiskError(ENOSPC, file.path,
                        "writing " + std::to_string(length) + " bytes at offset " +
                            std::to_string(offset) + " of " + file.path +
                            " wrote nothing: " + std::strerror(ENOSPC));
      }
      std::memset(buffer, 0, length);
      return;
    }
    buffer += done;
    length -= done;
    offset += done;
  }
}

struct Chunk {
  std::size_t tensor;
  std::int64_t first;
  std::int64_t last;
};

}  // namespace

StreamStats adam_step_streamed(ThreadPool& pool, std::span<const DiskFile> files,
                               std::span<const StreamedTensor> tensors,
                               const StreamOptions& options) {
  const std::int64_t grain =
      std::max<std::int64_t>(1, (options.chunk_elements + kDiskGrain - 1) / kDiskGrain);
  const std::int64_t chunk_elements = grain * kDiskGrain;
  std::vector<Chunk> chunks;
  for (std::size_t k = 0; k < tensors.size(); ++k) {
    for (std::int64_t first = 0; first < tensors[k].numel; first += chunk_elements) {
      chunks.push_back({k, first, std::min(tensors[k].numel, first + chunk_elements)});
    }
  }
  StreamStats stats;
  if (chunks.empty()) return stats;

  const bool int8 = options.state_dtype == StateDType::kInt8;
  const std::int64_t state_size = state_element_size(options.state_dtype);
  // Byte offset and capacity of each part in a slot.
  const std::int64_t capacity[kParts] = {
      disk_bytes(chunk_elements, sizeof(float)), disk_bytes(chunk_elements, state_size),
      disk_bytes(chunk_elements, state_size),
      int8 ? disk_bytes(state_blocks(chunk_elements), sizeof(float)) : 0,
      int8 ? disk_bytes(state_blocks(chunk_elements), sizeof(float)) : 0};
  std::int64_t base[kParts + 1] = {0};
  for (int part = 0; part < kParts; ++part) base[part + 1] = base[part] + capacity[part];

  const int buffers = std::max(options.buffers, 3);
  const auto slot_count = static_cast<std::size_t>(
      std::min<std::int64_t>(buffers, static_cast<std::int64_t>(chunks.size())));
  std::vector<std::unique_ptr<Slot>> slots;
  for (std::size_t s = 0; s < slot_count; ++s)
    slots.push_back(std::make_unique<Slot>(base[kParts]));

  std::mutex stats_mutex;
  // The requests of chunk `index` in its slot: one per region, each on an I/O thread.
  IoThreads io(std::max(options.io_threads, 1));
  const auto issue = [&](std::size_t index, bool write) {
    const Chunk& chunk = chunks[index];
    const StreamedTensor& t = tensors[chunk.tensor];
    Slot& slot = *slots[index % slot_count];
    const std::int64_t count = chunk.last - chunk.first;
    const FileRegion* regions[kParts] = {&t.param, &t.exp_avg, &t.exp_avg_sq, &t.exp_avg_scale,
                                         &t.exp_avg_sq_scale};
    const std::int64_t sizes[kParts] = {sizeof(float), state_size, state_size, sizeof(float),
                                        sizeof(float)};
    const int parts = int8 ? kParts : kExpAvgScale;
    slot.expect(parts);
    for (int part = 0; part < parts; ++part) {
      // Scales count one per block; chunks start on block boundaries.
      const bool scale = part >= kExpAvgScale;
      const std::int64_t first = scale ? chunk.first / kStateBlock : chunk.first;
      const std::int64_t n = scale ? state_blocks(chunk.last) - first : count;
      const FileRegion region = *regions[part];
      char* buffer = slot.data() + base[part];
      const std::int64_t length = disk_bytes(n, sizes[part]);
      const std::int64_t offset = region.offset + first * sizes[part];
      io.submit([&, &file = files[region.file], buffer, length, offset, write] {
        std::exception_ptr error;
        const auto start = Clock::now();
        try {
          transfer(write, file, buffer, length, offset);
        } catch (...) {
          error = std::current_exception();
        }
        const auto end = Clock::now();
        {
          std::lock_guard lock(stats_mutex);
          (write ? stats.bytes_written : stats.bytes_read) += length;
          (write ? stats.write_seconds : stats.read_seconds) +=
              std::chrono::duration<double>(end - start).count();
          stats.spans.push_back({write, nanoseconds(start), nanoseconds(end), length});
        }
        slot.finished(error);
      });
    }
  };
  std::unique_ptr<PageBuffer> lowp_staging;
  // Updates chunk `index` in its slot with the kernels, the gradients and low-precision weights
  // read and written in memory. The buffers stand at the chunk's place in a whole tensor, so the
  // kernels see the element indices (and the random bits of compact moments) of the in-memory
  // step.
  const auto compute = [&](std::size_t index) {
    const Chunk& chunk = chunks[index];
    const StreamedTensor& t = tensors[chunk.tensor];
    char* data = slots[index % slot_count]->data();
    AdamBuffers b{};
    b.param = reinterpret_cast<float*>(data + base[kParam]) - chunk.first;
    b.grad = t.grad;
    b.grad_dtype = t.grad_dtype;
    b.exp_avg = data + base[kExpAvg] - chunk.first * state_size;
    b.exp_avg_sq = data + base[kExpAvgSq] - chunk.first * state_size;
    b.max_exp_avg_sq = nullptr;
    // New weights that replace the gradients they come from (the same memory) are staged and
    // copied over the chunk's gradients once the kernels have read them all.
    const bool in_place = t.lowp_param != nullptr && t.lowp_param == t.grad;
    if (in_place && !lowp_staging) {
      lowp_staging = std::make_unique<PageBuffer>(chunk_elements * sizeof(std::uint16_t));
    }
    auto* const staged =
        in_place ? reinterpret_cast<std::uint16_t*>(lowp_staging->data()) : nullptr;
    b.lowp_param = in_place ? staged - chunk.first : t.lowp_param;
    b.lowp_dtype = t.lowp_dtype;
    b.numel = t.numel;
    b.state_dtype = options.state_dtype;
    if (int8) {
      const std::int64_t first_block = chunk.first / kStateBlock;
      b.exp_avg_scale = reinterpret_cast<float*>(data + base[kExpAvgScale]) - first_block;
      b.exp_avg_sq_scale = reinterpret_cast<float*>(data + base[kExpAvgSqScale]) - first_block;
    }
    const std::int64_t count = chunk.last - chunk.first;
    const std::int64_t threads = std::max(options.compute_threads, 1);
    const std::int64_t tasks =
        std::clamp<std::int64_t>((count + kComputeRun - 1) / kComputeRun, 1, threads);
    const std::int64_t per =
        ((count + tasks - 1) / tasks + kStateBlock - 1) / kStateBlock * kStateBlock;
    pool.run(tasks, options.compute_threads, [&](std::int64_t task) {
      const std::int64_t begin = chunk.first + task * per;
      const std::int64_t end = std::min(chunk.last, begin + per);
      if (begin < end) adam_update(options.level, t.coefficients, b, begin, end);
    });
    if (in_place) {
      std::memcpy(static_cast<std::uint16_t*>(t.lowp_param) + chunk.first, staged,
                  static_cast<std::size_t>(count) * sizeof(std::uint16_t));
    }
  };

  // Reads run slot_count - 2 chunks ahead, so that the chunk being updated overlaps both them
  // and the previous chunk's write; a slot is read again once its last write has landed.
  std::exception_ptr failure;
  std::size_t issued = 0;
  const std::size_t ahead = std::max<std::size_t>(slot_count, 2) - 2;
  try {
    for (std::size_t i = 0; i < chunks.size(); ++i) {
      for (; issued < chunks.size() && issued <= i + ahead; ++issued) {
        if (issued >= slot_count) slots[issued % slot_count]->wait();
        issue(issued, false);
      }
      slots[i % slot_count]->wait();
      compute(i);
      issue(i, true);
    }
  } catch (...) {
    failure = std::current_exception();
  }
  for (auto& slot : slots) {
    try {
      slot->wait();
    } catch (...) {
      if (!failure) failure = std::current_exception();
    }
  }
  if (failure) std::rethrow_exception(failure);
  return stats;
}

}  // namespace roundpipe::optim
