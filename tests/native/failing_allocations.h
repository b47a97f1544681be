// Test support: allocations that can be made to fail, to reach the
// out-of-memory paths of code that must change nothing or finish when one
// fails. It replaces the global operator new and delete: include it in one
// file of a test binary. Disarmed (fail_in = 0) they are malloc and free.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <new>
#include <stdexcept>
#include <string>

namespace hps::test_support {

// The fail_in-th allocation from now throws std::bad_alloc; 0: none. Armed by
// a test on one thread; atomic because other tests of the binary allocate on
// several (disarmed).
inline std::atomic<uint64_t> fail_in{0};

inline void CountDownToFailure() {
  if (fail_in.load(std::memory_order_relaxed) != 0 && fail_in.fetch_sub(1, std::memory_order_relaxed) == 1) {
    throw std::bad_alloc();
  }
}

// What a call made with its k-th allocation failing did.
struct FailingAllocationCall {
  bool ran_out = false;               // it threw std::bad_alloc
  bool past_its_allocations = false;  // it made fewer than k: no larger k is worth trying
  bool refused = false;               // it threw std::runtime_error, saying `error`
  std::string error;
};

// Calls `call` with its k-th allocation from now failing, and disarms the
// failure before anything else allocates (an error's message is copied after).
template <class Call>
FailingAllocationCall CallFailingAllocation(uint64_t k, Call&& call) {
  FailingAllocationCall result;
  fail_in = k;
  try {
    call();
    result.past_its_allocations = fail_in.exchange(0) != 0;
  } catch (const std::bad_alloc&) {
    result.ran_out = true;
  } catch (const std::runtime_error& e) {
    result.past_its_allocations = fail_in.exchange(0) != 0;
    result.refused = true;
    result.error = e.what();
  }
  fail_in = 0;
  return result;
}

// Calls attempt(k) for k = 1, 2, ..., which fails the k-th allocation of what
// it tries (CallFailingAllocation) and says what that did, until one makes
// fewer than k allocations or a test assertion fails; at least one must have
// run out of memory.
template <class Attempt>
void ForEveryAllocation(Attempt&& attempt) {
  uint64_t failures = 0;
  for (uint64_t k = 1;; ++k) {
    SCOPED_TRACE(testing::Message() << "allocation " << k);
    const FailingAllocationCall first = attempt(k);
    if (first.ran_out) ++failures;
    if (first.past_its_allocations || testing::Test::HasFailure()) break;
  }
  EXPECT_GT(failures, 0u);
}

}  // namespace hps::test_support

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmismatched-new-delete"  // free() of what this operator new gives
#endif
void* operator new(std::size_t n) {
  hps::test_support::CountDownToFailure();
  if (void* p = std::malloc(n == 0 ? 1 : n)) return p;
  throw std::bad_alloc();
}
void operator delete(void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }
// The aligned forms: aligned containers (HugePageAllocator's buffers below a
// huge page, for one) come from them.
void* operator new(std::size_t n, std::align_val_t align) {
  hps::test_support::CountDownToFailure();
  void* p = nullptr;
  if (posix_memalign(&p, std::max(sizeof(void*), static_cast<std::size_t>(align)), n == 0 ? 1 : n) == 0) return p;
  throw std::bad_alloc();
}
void operator delete(void* p, std::align_val_t) noexcept { std::free(p); }
void operator delete(void* p, std::size_t, std::align_val_t) noexcept { std::free(p); }
// The nothrow forms (std::stable_sort's buffer comes from one): replaced too,
// so that what they give is freed by the delete above (a sanitizer's own
// would not be malloc's).
void* operator new(std::size_t n, const std::nothrow_t&) noexcept {
  try {
    return operator new(n);
  } catch (const std::bad_alloc&) {
    return nullptr;
  }
}
void* operator new(std::size_t n, std::align_val_t align, const std::nothrow_t&) noexcept {
  try {
    return operator new(n, align);
  } catch (const std::bad_alloc&) {
    return nullptr;
  }
}
void operator delete(void* p, const std::nothrow_t&) noexcept { std::free(p); }
void operator delete(void* p, std::align_val_t, const std::nothrow_t&) noexcept { std::free(p); }
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif
