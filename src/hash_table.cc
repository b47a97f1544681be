// The CPU launcher of the hash table: host memory, a parallel loop over cores.
//
// Inside a write call each key belongs to one thread (OwnerOf), so a key's row
// is only ever touched by one thread: duplicate keys keep their call order, and
// rows are updated with plain stores rather than atomics (a locked add per float
// would also drain the store buffer and stall the prefetch pipeline). Threads
// still race on empty slots, which the CAS in FindOrClaim settles. Between
// calls, a shared mutex lets reads overlap and gives a write the table alone.
//
// Random slots are far apart in a large table, so every loop is software
// pipelined: the home slot of key i + 2D is prefetched, key i + D is probed and
// its row prefetched, and key i is finished, keeping ~D cache misses in flight.
#include <sys/mman.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <memory>
#include <new>
#include <shared_mutex>
#include <string>
#include <system_error>
#include <vector>

#include "hps/hash_table.h"
#include "parallel.h"
#include "table_kernels.h"

namespace hps {

std::unique_ptr<HashTable> NewCudaHashTable(const HashTableOptions& options);  // cuda

namespace detail {
namespace {

constexpr uint64_t kAhead = 16;       // keys between prefetch, probe and finish
constexpr int64_t kSkipped = -2;      // a key this thread does not own
constexpr uint64_t kCacheLine = 64;

// Anonymous mapping: zero-filled by the kernel (the rows' zero invariant comes
// for free) and eligible for transparent huge pages, which matters when every
// access to a multi-GB table is a random one.
class HostBuffer {
 public:
  explicit HostBuffer(uint64_t bytes) : bytes_(bytes == 0 ? 1 : bytes) {
    void* p = mmap(nullptr, bytes_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) {
      throw std::system_error(errno, std::generic_category(),
                              "hash table: cannot map " + std::to_string(bytes_) + " bytes");
    }
#ifdef MADV_HUGEPAGE
    madvise(p, bytes_, MADV_HUGEPAGE);  // advisory; ignoring a refusal is correct
#endif
    data_ = p;
  }
  ~HostBuffer() { munmap(data_, bytes_); }
  HostBuffer(const HostBuffer&) = delete;
  HostBuffer& operator=(const HostBuffer&) = delete;

  template <class T>
  T* as() const {
    return static_cast<T*>(data_);
  }
  uint64_t bytes() const { return bytes_; }

 private:
  uint64_t bytes_;
  void* data_ = nullptr;
};

inline void PrefetchRead(const void* p) { __builtin_prefetch(p, 0, 3); }
inline void PrefetchWrite(const void* p) { __builtin_prefetch(p, 1, 3); }

void PrefetchRow(const float* row, uint32_t floats, bool for_write) {
  const char* p = reinterpret_cast<const char*>(row);
  const char* end = p + floats * sizeof(float);
  for (; p < end; p += kCacheLine) for_write ? PrefetchWrite(p) : PrefetchRead(p);
}

struct Probed {
  int64_t slot = kSkipped;
  bool claimed = false;
};

// The software pipeline over items [begin, end). owns(i) says whether this
// thread handles item i; key(i) is its key; probe(i) -> Probed finds its slot;
// finish(i, probed) does the row work. finish runs in item order.
template <class Owns, class Key, class Probe, class Finish>
void Pipeline(const TableRef& t, uint64_t begin, uint64_t end, bool row_write, const Owns& owns,
              const Key& key, const Probe& probe, const Finish& finish) {
  Probed ring[kAhead];
  for (uint64_t step = begin; step < end + 2 * kAhead; ++step) {
    if (step < end && owns(step)) PrefetchRead(t.keys + HomeSlot(key(step), t.slots));
    if (step >= begin + 2 * kAhead) {
      const uint64_t i = step - 2 * kAhead;
      const Probed& p = ring[i % kAhead];
      if (p.slot != kSkipped) finish(i, p);
    }
    if (step >= begin + kAhead && step - kAhead < end) {
      const uint64_t i = step - kAhead;
      Probed& p = ring[i % kAhead];
      if (owns(i)) {
        p = probe(i);
        if (p.slot >= 0) PrefetchRow(t.row(static_cast<uint64_t>(p.slot)), t.stride, row_write);
      } else {
        p = Probed{};
      }
    }
  }
}

class CpuHashTable final : public HashTable {
 public:
  CpuHashTable(uint64_t capacity, int32_t row_floats, int32_t threads)
      : keys_(capacity * sizeof(uint64_t)),
        rows_(capacity * static_cast<uint64_t>(row_floats) * sizeof(float)),
        threads_(threads > 0 ? threads : HardwareThreads()) {
    ref_ = TableRef{keys_.as<uint64_t>(), rows_.as<float>(), capacity,
                    static_cast<uint32_t>(row_floats)};
    FillKeysEmpty();
  }

  uint64_t capacity() const override { return ref_.slots; }
  int32_t row_floats() const override { return static_cast<int32_t>(ref_.stride); }
  uint64_t size() const override { return size_.load(std::memory_order_relaxed); }
  std::string device() const override { return "cpu"; }

  uint64_t insert(const uint64_t* keys, uint64_t n, const float* rows,
                  uint8_t* inserted) override {
    CheckKeys(keys, n);
    std::unique_lock lock(mutex_);
    if (inserted) std::memset(inserted, 0, n);  // keys that find no slot stay 0
    const uint32_t stride = ref_.stride;
    return ForOwnedKeys(keys, n, /*row_write=*/true, [&](uint64_t i, const Probed& p) {
      if (p.claimed) CopyRow(ref_.row(p.slot), rows + i * stride, stride);
      if (inserted) inserted[i] = p.claimed ? 1 : 0;
      return p.claimed;
    });
  }

  uint64_t find(const uint64_t* keys, uint64_t n, float* rows_out, uint8_t* found) const override {
    CheckKeys(keys, n);
    std::shared_lock lock(mutex_);
    const uint32_t stride = ref_.stride;
    return FindEach(keys, n, stride, [&](uint64_t i, int64_t slot) {
      float* out = rows_out + i * stride;
      if (slot >= 0) {
        CopyRow(out, ref_.row(static_cast<uint64_t>(slot)), stride);
      } else {
        ZeroRow(out, stride);
      }
      if (found) found[i] = slot >= 0 ? 1 : 0;
    });
  }

  void accumulate(const uint64_t* keys, uint64_t n, const float* deltas) override {
    CheckKeys(keys, n);
    std::unique_lock lock(mutex_);
    const uint32_t stride = ref_.stride;
    ForOwnedKeys(keys, n, /*row_write=*/true, [&](uint64_t i, const Probed& p) {
      AddRow<false>(ref_.row(p.slot), deltas + i * stride, stride);
      return p.claimed;
    });
  }

  uint64_t assign(const uint64_t* keys, uint64_t n, const float* rows, uint8_t* found) override {
    CheckKeys(keys, n);
    std::unique_lock lock(mutex_);
    const uint32_t stride = ref_.stride;
    return RunOwned(
        keys, n, /*row_write=*/true,
        [&](uint64_t i) { return Probed{FindSlot(ref_, keys[i]), false}; },
        [&](uint64_t i, const Probed& p) {
          if (p.slot >= 0) CopyRow(ref_.row(static_cast<uint64_t>(p.slot)), rows + i * stride, stride);
          if (found) found[i] = p.slot >= 0 ? 1 : 0;
          return p.slot >= 0;
        },
        /*count_full=*/false);
  }

  void lookup_or_init(const uint64_t* keys, uint64_t n, const SparseOptimizer& opt,
                      float* embeddings_out) override {
    CheckOptimizer(opt);
    CheckKeys(keys, n);
    std::unique_lock lock(mutex_);
    const uint32_t dim = static_cast<uint32_t>(opt.dim);
    ForOwnedKeys(keys, n, /*row_write=*/false, [&](uint64_t i, const Probed& p) {
      float* row = ref_.row(p.slot);
      if (p.claimed) InitRow(opt, keys[i], row);
      CopyRow(embeddings_out + i * dim, row, dim);
      return p.claimed;
    });
  }

  void apply_gradients(const uint64_t* keys, uint64_t n, const float* grads,
                       const SparseOptimizer& opt) override {
    CheckOptimizer(opt);
    CheckKeys(keys, n);
    if (n == 0) return;
    // Sum the gradients of each distinct key first: the update is not linear in
    // the gradient, so duplicates must meet before the optimizer sees them.
    CpuHashTable sums(std::max<uint64_t>(2 * n, 64), opt.dim, threads_);
    sums.accumulate(keys, n, grads);
    std::unique_lock lock(mutex_);
    const TableRef& s = sums.ref_;
    const int parts = PartsFor(s.slots, threads_);
    std::vector<uint64_t> claimed(static_cast<size_t>(parts), 0);
    std::vector<uint64_t> full(static_cast<size_t>(parts), 0);
    RunParts(parts, [&](int part) {
      const uint64_t begin = PartBegin(s.slots, part, parts);
      const uint64_t end = PartBegin(s.slots, part + 1, parts);
      Pipeline(
          ref_, begin, end, /*row_write=*/true,
          [&](uint64_t i) { return s.keys[i] != kEmptyKey; }, [&](uint64_t i) { return s.keys[i]; },
          [&](uint64_t i) {
            Probed p;
            p.slot = FindOrClaim(ref_, s.keys[i], &p.claimed);
            return p;
          },
          [&](uint64_t i, const Probed& p) {
            if (p.slot < 0) {
              ++full[part];
              return;
            }
            float* row = ref_.row(static_cast<uint64_t>(p.slot));
            if (p.claimed) {
              InitRow(opt, s.keys[i], row);
              ++claimed[part];
            }
            ApplyUpdate(opt, row, s.row(i));
          });
    });
    Settle(claimed, full);
  }

  uint64_t export_rows(uint64_t* keys_out, float* rows_out, uint64_t max_rows) const override {
    std::shared_lock lock(mutex_);
    const int parts = PartsFor(ref_.slots, threads_);
    std::vector<uint64_t> counts(static_cast<size_t>(parts) + 1, 0);
    RunParts(parts, [&](int part) {
      uint64_t c = 0;
      for (uint64_t s = PartBegin(ref_.slots, part, parts); s < PartBegin(ref_.slots, part + 1, parts); ++s) {
        c += LoadKey(ref_.keys + s) != kEmptyKey;
      }
      counts[static_cast<size_t>(part) + 1] = c;
    });
    for (int part = 0; part < parts; ++part) counts[part + 1] += counts[part];
    const uint32_t stride = ref_.stride;
    RunParts(parts, [&](int part) {
      uint64_t out = counts[static_cast<size_t>(part)];
      for (uint64_t s = PartBegin(ref_.slots, part, parts);
           s < PartBegin(ref_.slots, part + 1, parts) && out < max_rows; ++s) {
        const uint64_t k = LoadKey(ref_.keys + s);
        if (k == kEmptyKey) continue;
        keys_out[out] = k;
        CopyRow(rows_out + out * stride, ref_.row(s), stride);
        ++out;
      }
    });
    return std::min(counts[static_cast<size_t>(parts)], max_rows);
  }

  void clear() override {
    std::unique_lock lock(mutex_);
    const uint64_t bytes = rows_.bytes();
    const int parts = PartsFor(bytes / 4096, threads_);
    RunParts(parts, [&](int part) {
      const uint64_t b = PartBegin(bytes, part, parts);
      std::memset(rows_.as<char>() + b, 0, PartBegin(bytes, part + 1, parts) - b);
    });
    FillKeysEmpty();
    size_.store(0, std::memory_order_relaxed);
  }

 private:
  void FillKeysEmpty() {
    const int parts = PartsFor(ref_.slots / 512, threads_);
    RunParts(parts, [&](int part) {
      const uint64_t b = PartBegin(ref_.slots, part, parts);
      std::memset(ref_.keys + b, 0xff, (PartBegin(ref_.slots, part + 1, parts) - b) * sizeof(uint64_t));
    });
  }

  void CheckOptimizer(const SparseOptimizer& opt) const {
    opt.validate();
    if (opt.row_floats() != row_floats()) {
      throw std::invalid_argument("optimizer " + ToString(opt.opt.kind) + " with dim " +
                                  std::to_string(opt.dim) + " needs rows of " +
                                  std::to_string(opt.row_floats()) +
                                  " floats, but the table's rows have " +
                                  std::to_string(row_floats()));
    }
  }

  // Read-only: contiguous chunks, any thread may read any key.
  template <class Finish>
  uint64_t FindEach(const uint64_t* keys, uint64_t n, uint32_t /*stride*/, const Finish& finish) const {
    const int parts = PartsFor(n, threads_);
    std::vector<uint64_t> hits(static_cast<size_t>(parts), 0);
    RunParts(parts, [&](int part) {
      uint64_t h = 0;
      Pipeline(
          ref_, PartBegin(n, part, parts), PartBegin(n, part + 1, parts), /*row_write=*/false,
          [](uint64_t) { return true; }, [&](uint64_t i) { return keys[i]; },
          [&](uint64_t i) { return Probed{FindSlot(ref_, keys[i]), false}; },
          [&](uint64_t i, const Probed& p) {
            finish(i, p.slot);
            h += p.slot >= 0;
          });
      hits[static_cast<size_t>(part)] = h;
    });
    uint64_t total = 0;
    for (uint64_t h : hits) total += h;
    return total;
  }

  // Finds or claims each key's slot, then finish(i, probed) -> whether it counts.
  template <class Finish>
  uint64_t ForOwnedKeys(const uint64_t* keys, uint64_t n, bool row_write, const Finish& finish) {
    return RunOwned(
        keys, n, row_write,
        [&](uint64_t i) {
          Probed p;
          p.slot = FindOrClaim(ref_, keys[i], &p.claimed);
          return p;
        },
        finish, /*count_full=*/true);
  }

  // Each thread handles the keys it owns, in call order. A key whose claim found
  // no slot is counted, and the call then raises TableFullError.
  template <class Probe, class Finish>
  uint64_t RunOwned(const uint64_t* keys, uint64_t n, bool row_write, const Probe& probe,
                    const Finish& finish, bool count_full) {
    const int parts = PartsFor(n, threads_);
    std::vector<uint64_t> counted(static_cast<size_t>(parts), 0);
    std::vector<uint64_t> claimed(static_cast<size_t>(parts), 0);
    std::vector<uint64_t> full(static_cast<size_t>(parts), 0);
    RunParts(parts, [&](int part) {
      const uint32_t me = static_cast<uint32_t>(part);
      const uint32_t of = static_cast<uint32_t>(parts);
      uint64_t c = 0, cl = 0, f = 0;
      Pipeline(
          ref_, 0, n, row_write, [&](uint64_t i) { return parts == 1 || OwnerOf(keys[i], of) == me; },
          [&](uint64_t i) { return keys[i]; }, probe,
          [&](uint64_t i, const Probed& p) {
            if (p.slot < 0) {
              f += count_full;
              if (!count_full) finish(i, p);
              return;
            }
            c += finish(i, p);
            cl += p.claimed;
          });
      counted[me] = c;
      claimed[me] = cl;
      full[me] = f;
    });
    Settle(claimed, full);
    uint64_t total = 0;
    for (uint64_t c : counted) total += c;
    return total;
  }

  // Adds this call's claims to the size, then reports keys that found no slot.
  void Settle(const std::vector<uint64_t>& claimed, const std::vector<uint64_t>& full) {
    uint64_t added = 0, missed = 0;
    for (uint64_t c : claimed) added += c;
    for (uint64_t f : full) missed += f;
    size_.fetch_add(added, std::memory_order_relaxed);
    if (missed > 0) {
      throw TableFullError("hash table full: " + std::to_string(missed) +
                           " key(s) found no free slot (capacity " + std::to_string(ref_.slots) +
                           ", size " + std::to_string(size()) +
                           "); the keys that found one were stored");
    }
  }

  HostBuffer keys_;
  HostBuffer rows_;
  TableRef ref_{};
  int threads_;
  std::atomic<uint64_t> size_{0};
  mutable std::shared_mutex mutex_;  // shared: find, export; exclusive: the rest
};

}  // namespace
}  // namespace detail

void CheckKeys(const uint64_t* keys, uint64_t n) {
  for (uint64_t i = 0; i < n; ++i) {
    if (keys[i] == kEmptyKey) {
      throw std::invalid_argument("keys[" + std::to_string(i) +
                                  "] is 0xffffffffffffffff (-1 as int64), the reserved empty-slot "
                                  "key; hash or remap it before use");
    }
  }
}

std::unique_ptr<HashTable> NewHashTable(const HashTableOptions& options) {
  if (options.capacity == 0) throw std::invalid_argument("hash table: capacity must be > 0");
  if (options.row_floats <= 0) {
    throw std::invalid_argument("hash table: row_floats must be > 0, got " +
                                std::to_string(options.row_floats));
  }
  if (options.threads < 0) {
    throw std::invalid_argument("hash table: threads must be >= 0 (0 = all cores), got " +
                                std::to_string(options.threads));
  }
  if (options.cuda_device >= 0) return NewCudaHashTable(options);
  return std::make_unique<detail::CpuHashTable>(options.capacity, options.row_floats,
                                                options.threads);
}

}  // namespace hps
