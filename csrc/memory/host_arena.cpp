#include "memory/host_arena.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <c10/util/Exception.h>

#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <iterator>
#include <map>
#include <mutex>
#include <stdexcept>
#include <string>
#include <utility>
#if defined(__GLIBC__)
#include <malloc.h>
#endif

#include "device/registry.h"
#ifdef ROUNDPIPE_WITH_CUDA
#include "memory/cuda_host.h"
#endif

namespace roundpipe::memory {
namespace {

constexpr std::int64_t kAlignment = 64;

std::int64_t round_up(std::int64_t bytes) {
  return (bytes + kAlignment - 1) / kAlignment * kAlignment;
}

// Below this a pageable arena comes from malloc: a mapping of its own would round it up to whole
// pages and cost a system call per stage buffer of a small model.
constexpr std::int64_t kOwnMappingBytes = std::int64_t{1} << 20;

// The pageable arenas that are mappings of their own (start -> length): zero_host_memory() may
// drop their pages. Pinned (registered) memory is never listed: its pages must stay.
class Mappings {
 public:
  // Never destroyed: arenas may die during static destruction (at interpreter exit).
  static Mappings& instance() {
    static auto* mappings = new Mappings();
    return *mappings;
  }

  void add(void* start, std::size_t length) {
    const std::lock_guard<std::mutex> lock(mutex_);
    spans_[reinterpret_cast<std::uintptr_t>(start)] = length;
  }

  void remove(void* start) {
    const std::lock_guard<std::mutex> lock(mutex_);
    spans_.erase(reinterpret_cast<std::uintptr_t>(start));
  }

  // Whether [begin, end) lies inside one listed mapping.
  bool covers(std::uintptr_t begin, std::uintptr_t end) const {
    const std::lock_guard<std::mutex> lock(mutex_);
    auto after = spans_.upper_bound(begin);
    if (after == spans_.begin()) return false;
    const auto& [start, length] = *std::prev(after);
    return end <= start + length;
  }

 private:
  mutable std::mutex mutex_;
  std::map<std::uintptr_t, std::size_t> spans_;
};

std::size_t page_size() {
  static const auto size = static_cast<std::size_t>(sysconf(_SC_PAGESIZE));
  return size;
}

void* allocate_aligned(std::int64_t bytes) {
  void* data = std::aligned_alloc(kAlignment, static_cast<std::size_t>(round_up(bytes)));
  TORCH_CHECK(data != nullptr, "roundpipe: out of host memory allocating ", bytes, " bytes");
  return data;
}

// A fresh anonymous mapping of `length` bytes: page-aligned, zero until written.
void* map_pages(std::size_t length) {
  void* data = mmap(nullptr, length, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  TORCH_CHECK(data != MAP_FAILED, "roundpipe: out of host memory mapping ", length, " bytes");
  return data;
}

at::Tensor wrap(void* data, std::int64_t bytes, std::function<void(void*)> deleter) {
  return at::from_blob(data, {bytes}, std::move(deleter), at::TensorOptions().dtype(at::kByte));
}

// Pageable memory of `bytes` (> 0) bytes; `zero` when it must read as zero. A mapping of its own
// from kOwnMappingBytes on (zero already), malloc memory below.
at::Tensor allocate_pageable(std::int64_t bytes, bool zero) {
  const auto length = static_cast<std::size_t>(round_up(bytes));
  if (bytes >= kOwnMappingBytes) {
    void* data = map_pages(length);
    Mappings::instance().add(data, length);
    return wrap(data, bytes, [length](void* start) {
      Mappings::instance().remove(start);
      munmap(start, length);
    });
  }
  void* data = allocate_aligned(bytes);
  if (zero) std::memset(data, 0, length);
  return wrap(data, bytes, &std::free);
}

#ifdef ROUNDPIPE_WITH_CUDA
// Page-locked in place: a mapping of whole pages of its own. The driver locks whole pages and
// refuses a second registration of a page already locked (cudaErrorHostMemoryAlreadyRegistered),
// so two small arenas must never share one, as malloc memory would. Never listed in Mappings:
// locked pages must stay.
at::Tensor allocate_registered(std::int64_t bytes) {
  const std::size_t page = page_size();
  const std::size_t length = (static_cast<std::size_t>(bytes) + page - 1) / page * page;
  void* data = map_pages(length);
  try {
    cuda::register_pinned(data, length);
  } catch (...) {
    munmap(data, length);
    throw;
  }
  return wrap(data, bytes, [length](void* start) {
    cuda::unregister(start);
    munmap(start, length);
  });
}
#endif

bool cuda_in_use() { return device::Registry::instance().kind() == device::DeviceKind::kCuda; }

// A host allocation of `bytes` (> 0) bytes per `mode`; zero-filled when `zero` is set.
at::Tensor allocate(std::int64_t bytes, PinMode mode, bool zero) {
  if (mode != PinMode::kOff && cuda_in_use()) {
#ifdef ROUNDPIPE_WITH_CUDA
    const auto size = static_cast<std::size_t>(bytes);
    if (mode == PinMode::kAlloc) {
      at::Tensor pinned = wrap(cuda::allocate_pinned(size), bytes, &cuda::free_pinned);
      if (zero) std::memset(pinned.data_ptr(), 0, size);
      return pinned;
    }
    return allocate_registered(bytes);  // fresh pages: zero already
#endif
  }
  return allocate_pageable(bytes, zero);
}

}  // namespace

PinMode parse_pin_mode(std::string_view name) {
  if (name == "alloc") return PinMode::kAlloc;
  if (name == "register") return PinMode::kRegister;
  if (name == "off") return PinMode::kOff;
  throw std::invalid_argument("pin_model must be 'alloc', 'register' or 'off', got '" +
                              std::string(name) + "'");
}

at::Tensor allocate_host_arena(std::int64_t bytes, PinMode mode, bool zero) {
  TORCH_CHECK(bytes >= 0, "allocate_host_arena: bytes must be >= 0, got ", bytes);
  if (bytes == 0) return at::empty({0}, at::TensorOptions().dtype(at::kByte));
  return allocate(bytes, mode, zero);
}

at::Tensor allocate_pinned_staging(std::int64_t bytes) {
  TORCH_CHECK(bytes >= 0, "allocate_pinned_staging: bytes must be >= 0, got ", bytes);
  if (bytes == 0) return at::empty({0}, at::TensorOptions().dtype(at::kByte));
  return allocate(bytes, PinMode::kAlloc, false);
}

void zero_host_memory(const at::Tensor& tensor) {
  TORCH_CHECK(tensor.device().is_cpu() && tensor.is_contiguous(),
              "zero_host_memory: tensor must be a contiguous CPU tensor");
  const auto bytes = static_cast<std::size_t>(tensor.nbytes());
  if (bytes == 0) return;
  auto* data = static_cast<std::uint8_t*>(tensor.data_ptr());
  const auto begin = reinterpret_cast<std::uintptr_t>(data);
  const std::uintptr_t end = begin + bytes;
  const std::size_t page = page_size();
  const std::uintptr_t first = (begin + page - 1) / page * page;
  const std::uintptr_t last = end / page * page;
  if (last <= first || !Mappings::instance().covers(begin, end)) {
    std::memset(data, 0, bytes);
    return;
  }
  // Private anonymous pages dropped with MADV_DONTNEED read as zero when touched again.
  std::memset(data, 0, first - begin);
  if (madvise(reinterpret_cast<void*>(first), last - first, MADV_DONTNEED) != 0)
    std::memset(reinterpret_cast<void*>(first), 0, last - first);
  std::memset(reinterpret_cast<void*>(last), 0, end - last);
}

bool trim_host_heap() {
#if defined(__GLIBC__)
  malloc_trim(0);
  return true;
#else
  return false;
#endif
}

bool is_page_locked(const at::Tensor& tensor) {
#ifdef ROUNDPIPE_WITH_CUDA
  return cuda::is_page_locked(tensor.data_ptr());
#else
  static_cast<void>(tensor);
  return false;
#endif
}

}  // namespace roundpipe::memory
