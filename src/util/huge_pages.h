// An allocator for std::vector whose large buffers sit on transparent huge
// pages: for arrays probed at random (an index, a log read by position), a
// 4 KiB page per access misses the TLB about as often as the cache, and the
// page walk costs as much as the miss. THP is "madvise" on most kernels, so
// the buffer asks for it; a kernel that refuses leaves 4 KiB pages, which is
// correct, only slower.
//
// Buffers of at least kHugePageBytes are anonymous mappings whose start is
// aligned to a huge page (mmap alone aligns only to 4 KiB): the mapping's
// whole 2 MiB spans become huge pages and its tail, if any, small ones, so
// no memory is spent on rounding. Smaller buffers come from operator new, and
// so do all under AddressSanitizer, whose redzones a mapping would not have.
#pragma once

#include <sys/mman.h>

#include <cstddef>
#include <cstdint>
#include <new>

#if defined(__SANITIZE_ADDRESS__)
#define HPS_HUGE_PAGES_MAPPED 0
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define HPS_HUGE_PAGES_MAPPED 0
#endif
#endif
#ifndef HPS_HUGE_PAGES_MAPPED
#define HPS_HUGE_PAGES_MAPPED 1
#endif

namespace hps::detail {

inline constexpr uint64_t kHugePageBytes = uint64_t{2} << 20;
inline constexpr uint64_t kSmallPageBytes = 4096;

// A mapping of `bytes` (rounded up to a small page) starting at a huge page.
inline void* MapHugeAligned(uint64_t bytes) {
  const uint64_t size = (bytes + kSmallPageBytes - 1) / kSmallPageBytes * kSmallPageBytes;
  const uint64_t span = size + kHugePageBytes - kSmallPageBytes;  // room to slide to a huge page
  void* p = mmap(nullptr, span, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) throw std::bad_alloc();
  const auto start = reinterpret_cast<uintptr_t>(p);
  const uintptr_t aligned = (start + kHugePageBytes - 1) & ~(uintptr_t{kHugePageBytes} - 1);
  if (aligned > start) munmap(p, aligned - start);
  const uintptr_t end = aligned + size;
  if (start + span > end) munmap(reinterpret_cast<void*>(end), start + span - end);
#ifdef MADV_HUGEPAGE
  madvise(reinterpret_cast<void*>(aligned), size, MADV_HUGEPAGE);  // advisory: a refusal is correct
#endif
  return reinterpret_cast<void*>(aligned);
}

inline void UnmapHugeAligned(void* p, uint64_t bytes) {
  munmap(p, (bytes + kSmallPageBytes - 1) / kSmallPageBytes * kSmallPageBytes);
}

template <class T>
struct HugePageAllocator {
  using value_type = T;

  HugePageAllocator() = default;
  template <class U>
  explicit HugePageAllocator(const HugePageAllocator<U>&) {}

  // Whether a buffer of `bytes` is a mapping on huge pages (else operator new's).
  static constexpr bool Mapped(uint64_t bytes) { return HPS_HUGE_PAGES_MAPPED && bytes >= kHugePageBytes; }

  T* allocate(size_t n) {
    if (n > SIZE_MAX / sizeof(T)) throw std::bad_array_new_length();
    const uint64_t bytes = n * sizeof(T);
    if (!Mapped(bytes)) return static_cast<T*>(::operator new(bytes, std::align_val_t{alignof(T)}));
    return static_cast<T*>(MapHugeAligned(bytes));
  }
  void deallocate(T* p, size_t n) {
    const uint64_t bytes = n * sizeof(T);
    if (!Mapped(bytes)) {
      ::operator delete(p, std::align_val_t{alignof(T)});
    } else {
      UnmapHugeAligned(p, bytes);
    }
  }

  template <class U>
  bool operator==(const HugePageAllocator<U>&) const {
    return true;
  }
};

}  // namespace hps::detail
