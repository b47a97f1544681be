// Probe and row bodies shared by the CPU launcher (hash_table.cc) and the CUDA
// launcher (hash_table_cuda.cu); the optimizer maths they call live in
// optimizer_kernels.h. Everything here is HPS_HD and free of allocation, so one
// body serves both; the CPU tests therefore test the logic the GPU runs.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>

#include "hps/config.h"
#include "hps/hash_table.h"
#include "hps/optimizer.h"
#include "table/optimizer_kernels.h"  // InitRow, ApplyUpdate
#include "util/mix64.h"

#if defined(__CUDA_ARCH__)
#include <cuda/atomic>
#else
#include <atomic>
#endif

namespace hps::detail {

inline constexpr int64_t kNoSlot = -1;

// A non-owning view of a table's storage, cheap to pass to a kernel.
struct TableRef {
  uint64_t* keys;   // (slots), kEmptyKey where free
  float* rows;      // (slots, stride); zero in free slots
  uint64_t slots;
  uint32_t stride;

  HPS_HD float* row(uint64_t slot) const { return rows + slot * stride; }
};


HPS_HD inline uint64_t MulHigh(uint64_t a, uint64_t b) {
#if defined(__CUDA_ARCH__)
  return __umul64hi(a, b);
#else
  __extension__ using U128 = unsigned __int128;
  return static_cast<uint64_t>((static_cast<U128>(a) * b) >> 64);
#endif
}

// Slots form buckets of one cache line (8 keys). A key's probe starts at the
// first slot of its home bucket and runs linearly from there, so one line holds
// every candidate slot of most probes, hits and misses alike, and that one line
// is what the CPU launcher prefetches. (cuco calls this a probing window.)
inline constexpr uint64_t kBucketSlots = 8;

// Tables hold whole buckets: a capacity rounds up to a multiple of 8 slots.
HPS_HD inline uint64_t RoundToBuckets(uint64_t capacity) {
  return (capacity + kBucketSlots - 1) / kBucketSlots * kBucketSlots;
}

// Maps the high bits of the mixed key onto a bucket without a division, so any
// bucket count works (Lemire's multiply-shift range reduction).
HPS_HD inline uint64_t HomeSlot(uint64_t key, uint64_t slots) {
  return MulHigh(Mix64(key), slots / kBucketSlots) * kBucketSlots;
}

// Which of `parts` CPU threads owns a key: the low half of the mixed key, so
// owners do not follow the home bucket (which the high bits pick).
HPS_HD inline uint32_t OwnerOf(uint64_t key, uint32_t parts) {
  return static_cast<uint32_t>(((Mix64(key) & 0xffffffffULL) * parts) >> 32);
}

HPS_HD inline uint64_t LoadKey(const uint64_t* p) {
#if defined(__CUDA_ARCH__)
  return cuda::atomic_ref<const uint64_t, cuda::thread_scope_device>(*p).load(
      cuda::std::memory_order_relaxed);
#else
  return std::atomic_ref<const uint64_t>(*p).load(std::memory_order_relaxed);
#endif
}

// Returns the key that was in *p; the claim succeeded iff that equals `expected`.
HPS_HD inline uint64_t CasKey(uint64_t* p, uint64_t expected, uint64_t desired) {
#if defined(__CUDA_ARCH__)
  cuda::atomic_ref<uint64_t, cuda::thread_scope_device>(*p).compare_exchange_strong(
      expected, desired, cuda::std::memory_order_relaxed);
#else
  std::atomic_ref<uint64_t>(*p).compare_exchange_strong(expected, desired,
                                                        std::memory_order_relaxed);
#endif
  return expected;
}

HPS_HD inline void AtomicAdd(float* p, float v) {
#if defined(__CUDA_ARCH__)
  cuda::atomic_ref<float, cuda::thread_scope_device>(*p).fetch_add(v,
                                                                   cuda::std::memory_order_relaxed);
#else
  std::atomic_ref<float>(*p).fetch_add(v, std::memory_order_relaxed);
#endif
}

// The slot of `key`, probing from `home`, or kNoSlot. Plain loads: every call
// that finds without claiming (find, assign) has the table to itself, so no
// key can change under it. (A branchless compare of the whole bucket measured
// slower here than this early-exit scan: most hits end in the first slots.)
HPS_HD inline int64_t FindSlot(const TableRef& t, uint64_t key, uint64_t home) {
  uint64_t s = home;
  for (uint64_t step = 0; step < t.slots; ++step) {
    const uint64_t k = t.keys[s];
    if (k == key) return static_cast<int64_t>(s);
    if (k == kEmptyKey) return kNoSlot;
    if (++s == t.slots) s = 0;
  }
  return kNoSlot;
}

HPS_HD inline int64_t FindSlot(const TableRef& t, uint64_t key) {
  return FindSlot(t, key, HomeSlot(key, t.slots));
}

// The slot holding `key`, claiming the first empty one on its probe path if the
// key is absent; kNoSlot when the table is full. *claimed is true iff this call
// took the slot, and so owes it its row. kConcurrent: other threads may claim
// slots at the same time (atomic loads and CAS); otherwise plain ones suffice.
template <bool kConcurrent = true>
HPS_HD inline int64_t FindOrClaim(const TableRef& t, uint64_t key, uint64_t home, bool* claimed) {
  uint64_t s = home;
  *claimed = false;
  for (uint64_t step = 0; step < t.slots; ++step) {
    uint64_t k = kConcurrent ? LoadKey(t.keys + s) : t.keys[s];
    if (k == kEmptyKey) {
      if constexpr (kConcurrent) {
        k = CasKey(t.keys + s, kEmptyKey, key);
      } else {
        t.keys[s] = key;
      }
      if (k == kEmptyKey) {
        *claimed = true;
        return static_cast<int64_t>(s);
      }
    }
    if (k == key) return static_cast<int64_t>(s);
    if (++s == t.slots) s = 0;
  }
  return kNoSlot;
}

HPS_HD inline int64_t FindOrClaim(const TableRef& t, uint64_t key, bool* claimed) {
  return FindOrClaim<true>(t, key, HomeSlot(key, t.slots), claimed);
}

HPS_HD inline void CopyRow(float* dst, const float* src, uint32_t n) {
#if defined(__CUDA_ARCH__)
  for (uint32_t j = 0; j < n; ++j) dst[j] = src[j];
#else
  std::memcpy(dst, src, n * sizeof(float));  // a runtime-width loop costs ~4x the instructions
#endif
}

HPS_HD inline void ZeroRow(float* dst, uint32_t n) {
#if defined(__CUDA_ARCH__)
  for (uint32_t j = 0; j < n; ++j) dst[j] = 0.0f;
#else
  std::memset(dst, 0, n * sizeof(float));
#endif
}

// kAtomic: the CUDA launcher, where threads may share a key. The CPU launcher
// gives each key to one thread, so plain adds are race-free there.
template <bool kAtomic>
HPS_HD inline void AddRow(float* dst, const float* src, uint32_t n) {
  for (uint32_t j = 0; j < n; ++j) {
    if constexpr (kAtomic) {
      AtomicAdd(dst + j, src[j]);
    } else {
      dst[j] += src[j];
    }
  }
}

// find_columns' argument, checked alike by both launchers (host only).
inline void CheckColumns(int32_t columns, int32_t row_floats) {
  if (columns <= 0 || columns > row_floats) {
    throw std::invalid_argument("hash table find_columns: columns = " + std::to_string(columns) +
                                " is not in [1, " + std::to_string(row_floats) + "] (the row's floats)");
  }
}

// keys_at's slots, checked alike by both launchers (host only).
inline void CheckSlots(const int64_t* slots, uint64_t n, uint64_t capacity) {
  for (uint64_t i = 0; i < n; ++i) {
    if (slots[i] < 0 || static_cast<uint64_t>(slots[i]) >= capacity) {
      throw std::out_of_range("hash table keys_at: slots[" + std::to_string(i) + "] = " +
                              std::to_string(slots[i]) + " is outside [0, " + std::to_string(capacity) + ")");
    }
  }
}

// Throws TableFullError for a step (apply_gradients, apply_summed_gradients)
// that needs a slot for more keys the table lacks than it has free: "<what>:
// hash table full: the step needs a slot for each of 7 keys the table lacks,
// and 2 are free (capacity 8, size 6); no row was stepped". A claim fails
// only when no slot of the table is free (the probe goes all the way round),
// so a step whose keys the table lacks number no more than its free slots
// finds a slot for each. Both launchers, host only; the table is as it was.
[[noreturn]] inline void RefuseFullStep(const std::string& what, uint64_t lacking, uint64_t capacity,
                                        uint64_t size) {
  const uint64_t free = capacity - size;
  throw TableFullError(what + ": hash table full: the step needs a slot for each of " + std::to_string(lacking) +
                       (lacking == 1 ? " key" : " keys") + " the table lacks, and " + std::to_string(free) +
                       (free == 1 ? " is" : " are") + " free (capacity " + std::to_string(capacity) + ", size " +
                       std::to_string(size) + "); no row was stepped");
}

}  // namespace hps::detail
