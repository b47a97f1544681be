// Test support: a MEM-PS double for the out-of-memory tests of its
// callers' releases. Include it (with failing_allocations.h) in one file of
// a test binary.
#pragma once

#include <cstdint>

#include "failing_allocations.h"
#include "forwarding_cache.h"

namespace hps::test_support {

// MEM-PS whose releases (WriteBack, Unpin, UnpinUpdated) allocate nothing
// that fail_in counts, so that a failure injected around one lands in its
// caller's own bookkeeping: a release that ran out of memory after it
// released keys would break MemCache's contract (bad_alloc: nothing
// released), which its own tests keep.
class UncountedReleaseCache final : public ForwardingCache {
 public:
  using ForwardingCache::ForwardingCache;

  void WriteBack(const uint64_t* k, uint64_t n, const uint8_t* rows, uint8_t* const* at) override {
    Uncounted([&] { ForwardingCache::WriteBack(k, n, rows, at); });
  }
  void Unpin(const uint64_t* k, uint64_t n, uint8_t* const* at) override {
    Uncounted([&] { ForwardingCache::Unpin(k, n, at); });
  }
  void UnpinUpdated(const uint64_t* k, uint64_t n, const uint8_t* updated, uint8_t* const* at) override {
    Uncounted([&] { ForwardingCache::UnpinUpdated(k, n, updated, at); });
  }

 private:
  template <typename Call>
  static void Uncounted(Call call) {
    const uint64_t armed = fail_in.exchange(0);
    try {
      call();
    } catch (...) {
      fail_in = armed;  // a rethrow allocates nothing
      throw;
    }
    fail_in = armed;
  }
};

}  // namespace hps::test_support
