// Adam's step with the master weights and moments in files (roundpipe.optim.offload): each
// tensor's state is streamed through a few page-aligned buffers, chunk by chunk, read ahead on a
// small pool of I/O threads, updated by the kernels of adam.h (so the numbers are the in-memory
// step's bits) and written behind, while the gradients and the low-precision weights stay in
// memory. Plain pread/pwrite, so any filesystem works; a file opened with O_DIRECT gets only
// aligned requests. Torch-free.
#pragma once

#include <cstdint>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#include "common/cpu_features.h"
#include "common/thread_pool.h"
#include "optim/adam.h"

namespace roundpipe::optim {

// The alignment of every region, request and buffer: a page, which direct I/O accepts on the
// filesystems and devices in use (their logical blocks are 512 or 4096 bytes).
inline constexpr std::int64_t kDiskAlign = 4096;
// Chunks start on multiples of this many elements, where every region's bytes (fp32, bf16,
// 8-bit codes and their block scales) start on a kDiskAlign boundary.
inline constexpr std::int64_t kDiskGrain = kStateBlock * kDiskAlign / sizeof(float);

// Bytes a region of `count` elements of `element_size` bytes takes in a file: a whole number of
// kDiskAlign blocks, so that the last chunk's request is aligned too.
inline constexpr std::int64_t disk_bytes(std::int64_t count, std::int64_t element_size) {
  return (count * element_size + kDiskAlign - 1) / kDiskAlign * kDiskAlign;
}

// An open file of the state, and its path for errors.
struct DiskFile {
  int fd;
  std::string path;
};

// Where a region lies: index into the step's files, byte offset (a multiple of kDiskAlign).
struct FileRegion {
  int file = -1;
  std::int64_t offset = 0;
};

// One tensor of the step: its state in files, its gradient and low-precision weights in memory.
struct StreamedTensor {
  std::int64_t numel;
  FileRegion param;             // fp32 master weights
  FileRegion exp_avg;           // in the step's state_dtype
  FileRegion exp_avg_sq;        // likewise
  FileRegion exp_avg_scale;     // kInt8 only: state_blocks(numel) fp32 scales
  FileRegion exp_avg_sq_scale;  // likewise
  const void* grad;
  DType grad_dtype;
  void* lowp_param;  // optional: receives the new weights as lowp_dtype; may be `grad` itself
  DType lowp_dtype;
  AdamCoefficients coefficients;
};

struct StreamOptions {
  StateDType state_dtype = StateDType::kFloat32;
  std::int64_t chunk_elements = 1 << 20;  // rounded up to kDiskGrain
  int buffers = 4;                        // chunks held in memory at once (at least 3)
  int io_threads = 4;                     // requests in flight
  int compute_threads = 1;
  SimdLevel level = SimdLevel::kScalar;
};

// A failed read or write: the errno and the file, for the caller's OSError.
class DiskError : public std::runtime_error {
 public:
  DiskError(int error_number, std::string path, const std::string& what)
      : std::runtime_error(what), error_number_(error_number), path_(std::move(path)) {}
  int error_number() const { return error_number_; }
  const std::string& path() const { return path_; }

 private:
  int error_number_;
  std::string path_;
};

// One read or write request: steady-clock nanoseconds (CLOCK_MONOTONIC, the host clock of
// roundpipe's traces) of its start and end.
struct IoSpan {
  bool write;
  std::int64_t start_ns;
  std::int64_t end_ns;
  std::int64_t bytes;
};

// Totals of one streamed step and its requests, for the caller's trace and benchmarks.
struct StreamStats {
  std::int64_t bytes_read = 0;
  std::int64_t bytes_written = 0;
  double read_seconds = 0;   // summed over the I/O threads
  double write_seconds = 0;  // likewise
  std::vector<IoSpan> spans;
};

// One Adam step over `tensors` with their state in `files`: per chunk, read, update, write back.
// Returns once every write has landed; throws DiskError (after the requests in flight finished)
// if one failed, leaving the chunks before it stepped and the rest as they were.
StreamStats adam_step_streamed(ThreadPool& pool, std::span<const DiskFile> files,
                               std::span<const StreamedTensor> tensors,
                               const StreamOptions& options);

}  // namespace roundpipe::optim
