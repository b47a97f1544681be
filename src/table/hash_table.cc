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
// pipelined over D = kAhead items: the home bucket of item i + 2D (and the line
// after it) is prefetched, item i + D is probed and its row prefetched, and item
// i is finished, keeping ~2D cache misses in flight.
#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <memory>
#include <shared_mutex>
#include <stdexcept>
#include <string>
#include <system_error>
#include <vector>

#include "hps/hash_table.h"
#include "format/key_index.h"
#include "util/mix64.h"
#include "util/parallel.h"
#include "table/nonfinite.h"
#include "table/table_kernels.h"

namespace hps {

std::unique_ptr<HashTable> NewCudaHashTable(const HashTableOptions& options);  // cuda

namespace detail {
namespace {

constexpr uint64_t kAhead = 16;       // keys between prefetch, probe and finish
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

// One item of a thread's sequence on its way through the pipeline.
struct Probe {
  uint64_t item = 0;  // index into the call's arrays
  uint64_t key = 0;
  uint64_t home = 0;
  int64_t slot = kNoSlot;
  bool claimed = false;
};

// The software pipeline over `count` items. next_item() yields the item indices
// in order, key_of(item) their keys; items whose key is kEmptyKey (free slots
// of a table being scanned) are passed over. probe(Probe&) sets slot and
// claimed; finish(const Probe&) does the row work, in item order.
template <class NextItem, class KeyOf, class ProbeFn, class Finish>
void Pipeline(const TableRef& t, uint64_t count, bool row_write, NextItem next_item,
              const KeyOf& key_of, const ProbeFn& probe, const Finish& finish) {
  constexpr uint64_t kRing = 2 * kAhead;
  Probe ring[kRing];
  for (uint64_t step = 0; step < count + 2 * kAhead; ++step) {
    if (step >= 2 * kAhead) {
      const Probe& p = ring[(step - 2 * kAhead) % kRing];
      if (p.key != kEmptyKey) finish(p);
    }
    if (step >= kAhead && step - kAhead < count) {
      Probe& p = ring[(step - kAhead) % kRing];
      if (p.key != kEmptyKey) {
        probe(p);
        if (p.slot >= 0) PrefetchRow(t.row(static_cast<uint64_t>(p.slot)), t.stride, row_write);
      }
    }
    if (step < count) {
      Probe& p = ring[step % kRing];
      p.item = next_item();
      p.key = key_of(p.item);
      if (p.key != kEmptyKey) {
        p.home = HomeSlot(p.key, t.slots);
        PrefetchRead(t.keys + p.home);
        PrefetchRead(t.keys + (p.home + kBucketSlots) % t.slots);
      }
    }
  }
}

inline uint64_t Sum(const std::vector<uint64_t>& v) {
  uint64_t total = 0;
  for (uint64_t x : v) total += x;
  return total;
}

class CpuHashTable final : public HashTable {
 public:
  CpuHashTable(uint64_t capacity, int32_t row_floats, int32_t threads)
      : keys_(RoundToBuckets(capacity) * sizeof(uint64_t)),
        rows_(RoundToBuckets(capacity) * static_cast<uint64_t>(row_floats) * sizeof(float)),
        threads_(threads > 0 ? threads : HardwareThreads()) {
    ref_ = TableRef{keys_.as<uint64_t>(), rows_.as<float>(), RoundToBuckets(capacity),
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
    return ClaimEach(keys, n, [&](const Probe& p) {
      if (p.claimed) CopyRow(ref_.row(p.slot), rows + p.item * stride, stride);
      if (inserted) inserted[p.item] = p.claimed ? 1 : 0;
      return p.claimed;
    });
  }

  uint64_t find(const uint64_t* keys, uint64_t n, float* rows_out, uint8_t* found) const override {
    return find_columns(keys, n, row_floats(), rows_out, found);
  }

  uint64_t find_columns(const uint64_t* keys, uint64_t n, int32_t columns, float* rows_out,
                        uint8_t* found) const override {
    CheckKeys(keys, n);
    detail::CheckColumns(columns, row_floats());
    const uint32_t stride = static_cast<uint32_t>(columns);
    return FindEach(keys, n, [&](const Probe& p) {
      float* out = rows_out + p.item * stride;
      if (p.slot >= 0) {
        CopyRow(out, ref_.row(static_cast<uint64_t>(p.slot)), stride);
      } else {
        ZeroRow(out, stride);
      }
      if (found) found[p.item] = p.slot >= 0 ? 1 : 0;
    });
  }

  uint64_t row_addresses(const uint64_t* keys, uint64_t n, float** rows_out, int64_t* slots_out) override {
    CheckKeys(keys, n);
    return FindEach(keys, n, [&](const Probe& p) {
      rows_out[p.item] = p.slot >= 0 ? ref_.row(static_cast<uint64_t>(p.slot)) : nullptr;
      if (slots_out) slots_out[p.item] = p.slot;
    });
  }

  uint64_t slots(const uint64_t* keys, uint64_t n, int64_t* slots_out) const override {
    CheckKeys(keys, n);
    return FindEach(keys, n, [&](const Probe& p) { slots_out[p.item] = p.slot; });
  }

  void keys_at(const int64_t* slots, uint64_t n, uint64_t* keys_out) const override {
    CheckSlots(slots, n, ref_.slots);
    std::shared_lock lock(mutex_);
    for (uint64_t i = 0; i < n; ++i) keys_out[i] = ref_.keys[static_cast<uint64_t>(slots[i])];
  }

  void accumulate(const uint64_t* keys, uint64_t n, const float* deltas) override {
    CheckKeys(keys, n);
    std::unique_lock lock(mutex_);
    const uint32_t stride = ref_.stride;
    ClaimEach(keys, n, [&](const Probe& p) {
      AddRow<false>(ref_.row(p.slot), deltas + p.item * stride, stride);
      return p.claimed;
    });
  }

  uint64_t assign(const uint64_t* keys, uint64_t n, const float* rows, uint8_t* found) override {
    CheckKeys(keys, n);
    std::unique_lock lock(mutex_);
    const uint32_t stride = ref_.stride;
    std::vector<uint64_t> assigned;
    ForOwnedItems(keys, n, /*row_write=*/true,
        [this](Probe& p) { p.slot = FindSlot(ref_, p.key, p.home); },
        [&](const Probe& p, uint64_t& counted) {
          if (p.slot >= 0) {
            CopyRow(ref_.row(static_cast<uint64_t>(p.slot)), rows + p.item * stride, stride);
            ++counted;
          }
          if (found) found[p.item] = p.slot >= 0 ? 1 : 0;
        },
        &assigned, nullptr, nullptr);
    return Sum(assigned);
  }

  void lookup_or_init(const uint64_t* keys, uint64_t n, const SparseOptimizer& opt,
                      float* embeddings_out) override {
    CheckOptimizer(opt);
    CheckKeys(keys, n);
    std::unique_lock lock(mutex_);
    const uint32_t dim = static_cast<uint32_t>(opt.dim);
    ClaimEach(keys, n, [&](const Probe& p) {
      float* row = ref_.row(p.slot);
      if (p.claimed) InitRow(opt, p.key, row);
      CopyRow(embeddings_out + p.item * dim, row, dim);
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
    ApplySums(sums, opt, "apply_gradients");
  }

  void apply_summed_gradients(const HashTable& sums, const SparseOptimizer& opt) override {
    CheckOptimizer(opt);
    const CpuHashTable& cpu = CheckSums(sums, opt, "apply_summed_gradients");
    std::shared_lock sums_lock(cpu.mutex_);
    ApplySums(cpu, opt, "apply_summed_gradients");
  }

  void refuse_nonfinite(const std::string& what) const override {
    std::shared_lock lock(mutex_);
    RefuseNonFiniteRows(what);
  }

  void refuse_failing_steps(const HashTable& sums, const SparseOptimizer& opt,
                            const std::string& what) const override {
    CheckOptimizer(opt);
    const CpuHashTable& cpu = CheckSums(sums, opt, "refuse_failing_steps");
    std::shared_lock sums_lock(cpu.mutex_);
    cpu.RefuseNonFiniteRows(what);
    std::shared_lock lock(mutex_);
    RefuseFailingSteps(cpu, opt, what);
  }

  uint64_t export_rows(uint64_t* keys_out, float* rows_out, uint64_t max_rows) const override {
    std::shared_lock lock(mutex_);
    const int parts = PartsFor(ref_.slots, threads_);
    std::vector<uint64_t> counts(static_cast<size_t>(parts) + 1, 0);
    RunParts(parts, [&](int part) {
      uint64_t c = 0;
      for (uint64_t s = PartBegin(ref_.slots, part, parts); s < PartBegin(ref_.slots, part + 1, parts); ++s) {
        c += ref_.keys[s] != kEmptyKey;
      }
      counts[static_cast<size_t>(part) + 1] = c;
    });
    for (int part = 0; part < parts; ++part) counts[part + 1] += counts[part];
    const uint32_t stride = ref_.stride;
    RunParts(parts, [&](int part) {
      uint64_t out = counts[static_cast<size_t>(part)];
      for (uint64_t s = PartBegin(ref_.slots, part, parts);
           s < PartBegin(ref_.slots, part + 1, parts) && out < max_rows; ++s) {
        const uint64_t k = ref_.keys[s];
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
    const uint64_t used = size_.load(std::memory_order_relaxed);
    if (used == 0) return;  // nothing erases a key, so every slot is empty (a tier bound to host rows)
    const uint64_t row_bytes = uint64_t{ref_.stride} * sizeof(float);
    if (used * row_bytes * 4 < ref_.slots * sizeof(uint64_t) + rows_.bytes()) {
      // A mostly empty table (the device tier's, between batches): scanning the
      // keys and zeroing the occupied rows moves far fewer bytes than a memset
      // of every row.
      const int parts = PartsFor(ref_.slots / 4096, threads_);
      RunParts(parts, [&](int part) {
        const uint64_t end = PartBegin(ref_.slots, part + 1, parts);
        for (uint64_t slot = PartBegin(ref_.slots, part, parts); slot < end; ++slot) {
          if (ref_.keys[slot] == kEmptyKey) continue;
          ref_.keys[slot] = kEmptyKey;
          std::memset(ref_.row(slot), 0, row_bytes);
        }
      });
      size_.store(0, std::memory_order_relaxed);
      return;
    }
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
  // REQUIRES: mutex_ held, shared or not.
  void RefuseNonFiniteRows(const std::string& what) const {
    if (HasNonFiniteRows()) RefuseNonFinite(what, ref_.keys, ref_.rows, ref_.slots, ref_.stride);
  }

  // REQUIRES: mutex_ held, shared or not. Whether an occupied slot's row holds
  // a NaN or an infinity.
  bool HasNonFiniteRows() const {
    // The occupied slots' rows, found by their keys as ApplySums finds them: a
    // gradient table has as many slots as its tier's rows, mostly free.
    const uint32_t stride = ref_.stride;
    const int parts = PartsFor(ref_.slots, threads_);
    std::vector<uint8_t> bad(static_cast<size_t>(parts), 0);
    RunParts(parts, [&](int part) {
      bool any = false;
      const uint64_t end = PartBegin(ref_.slots, part + 1, parts);
      for (uint64_t s = PartBegin(ref_.slots, part, parts); s < end; ++s) {
        if (ref_.keys[s] != kEmptyKey) any |= AnyNonFinite(ref_.row(s), stride);
      }
      bad[static_cast<size_t>(part)] = any;
    });
    for (uint8_t b : bad) {
      if (b) return true;
    }
    return false;
  }

  // REQUIRES: mutex_ and sums' held, shared or not. Each key's step run dry
  // (its row, or its initial row where this table lacks it), found as
  // ApplySums finds them, without claiming a slot; and the keys this table
  // lacks counted, against its free slots.
  void RefuseFailingSteps(const CpuHashTable& sums, const SparseOptimizer& opt, const std::string& what) const {
    const TableRef& s = sums.ref_;
    const int parts = PartsFor(s.slots, threads_);
    std::vector<uint8_t> bad(static_cast<size_t>(parts), 0);
    std::vector<uint64_t> lacking(static_cast<size_t>(parts), 0);
    RunParts(parts, [&](int part) {
      uint64_t slot = PartBegin(s.slots, part, parts);
      bool any = false;
      uint64_t absent = 0;
      Pipeline(
          ref_, PartBegin(s.slots, part + 1, parts) - slot, /*row_write=*/false,
          [&slot] { return slot++; }, [&s](uint64_t i) { return s.keys[i]; },
          [this](Probe& p) { p.slot = FindSlot(ref_, p.key, p.home); },
          [&](const Probe& p) {
            const float* grad = s.row(p.item);
            absent += p.slot < 0;
            any |= p.slot >= 0 ? !StepStaysFinite(opt, RowValues{ref_.row(static_cast<uint64_t>(p.slot))}, grad)
                               : !StepStaysFinite(opt, InitialRowValue{&opt, p.key}, grad);
          });
      bad[static_cast<size_t>(part)] = any;
      lacking[static_cast<size_t>(part)] = absent;
    });
    for (uint8_t b : bad) {
      if (b) detail::RefuseNonFiniteSteps(what, ref_, s, opt);
    }
    if (Sum(lacking) > ref_.slots - size()) RefuseFullStep(what, Sum(lacking), ref_.slots, size());
  }

  // apply_summed_gradients' and refuse_failing_steps' sums: a CPU table with
  // rows of opt.dim floats, else std::invalid_argument.
  const CpuHashTable& CheckSums(const HashTable& sums, const SparseOptimizer& opt, const char* what) const {
    // Its own lock would be taken shared for the sums, then again for the rows.
    if (&sums == this) throw std::invalid_argument(std::string(what) + ": sums must be another table");
    const auto* cpu = dynamic_cast<const CpuHashTable*>(&sums);
    if (cpu == nullptr || sums.row_floats() != opt.dim) {
      throw std::invalid_argument(std::string(what) + ": sums must be a CPU table with rows of dim = " +
                                  std::to_string(opt.dim) + " floats, got " + sums.device() + " with " +
                                  std::to_string(sums.row_floats()));
    }
    return *cpu;
  }

  // REQUIRES: sums holds each key once (a table does), its lock held (or it is
  // the call's own). A sum that is not finite, a step that leaves a row not
  // finite, or a key that finds no free slot refuses the whole call once the
  // others have stepped: every row stepped is put back (a journal of them),
  // every key claimed freed, and the call refused as if it had been checked
  // first, so that a retry (after making room) steps each key once. A sum
  // that is not finite leaves a value of its row so under every optimizer
  // (each of its floats reaches a value the step sets), so the sums are read
  // for it only where a step failed, or where the table had no room for a key
  // and no step read its sum. (Claiming every key the table lacks before any
  // steps would cost a second probe of each key a call that succeeds; the
  // journal, kept anyway, costs nothing more.)
  void ApplySums(const CpuHashTable& sums, const SparseOptimizer& opt, const char* what) {
    std::unique_lock lock(mutex_);
    const TableRef& s = sums.ref_;
    const uint32_t stride = ref_.stride;
    // Each distinct key is one slot of `sums`, so threads splitting its slots
    // never share a key.
    const int parts = PartsFor(s.slots, threads_);
    std::vector<uint64_t> claimed(static_cast<size_t>(parts), 0);
    std::vector<uint64_t> full(static_cast<size_t>(parts), 0);
    std::vector<uint64_t> bad(static_cast<size_t>(parts), 0);
    std::vector<Journal> journals(static_cast<size_t>(parts));
    RunParts(parts, [&](int part) {
      uint64_t slot = PartBegin(s.slots, part, parts);
      uint64_t cl = 0, f = 0, b = 0;
      Journal& journal = journals[static_cast<size_t>(part)];
      journal.Reserve(sums.size() / static_cast<uint64_t>(parts) + 64, stride);
      Pipeline(
          ref_, PartBegin(s.slots, part + 1, parts) - slot, /*row_write=*/true,
          [&slot] { return slot++; }, [&s](uint64_t i) { return s.keys[i]; },
          [&](Probe& p) { p.slot = ClaimSlot(p, parts); },
          [&](const Probe& p) {
            if (p.slot < 0) {
              ++f;
              return;
            }
            float* row = ref_.row(static_cast<uint64_t>(p.slot));
            journal.Keep(p.slot, p.claimed, row, stride);
            if (p.claimed) {
              InitRow(opt, p.key, row);
              ++cl;
            }
            b += !ApplyUpdateFinite(opt, row, s.row(p.item));
          });
      claimed[static_cast<size_t>(part)] = cl;
      full[static_cast<size_t>(part)] = f;
      bad[static_cast<size_t>(part)] = b;
    });
    const bool failed = Sum(bad) != 0;
    if (failed || Sum(full) != 0) {
      for (const Journal& journal : journals) journal.PutBack(ref_);
      if (failed || sums.HasNonFiniteRows()) {
        sums.RefuseNonFiniteRows(what);  // the cause named, if it was a sum
        detail::RefuseNonFiniteSteps(what, ref_, s, opt);
      }
      // Every key the table lacks was claimed or found no slot.
      RefuseFullStep(what, Sum(claimed) + Sum(full), ref_.slots, size());
    }
    size_.fetch_add(Sum(claimed), std::memory_order_relaxed);
  }

  // The rows a call stepped, as they were: each stepped slot, in order, and
  // the row it held, or (~slot) a slot the call claimed, free before it.
  struct Journal {
    std::vector<int64_t> slots;
    std::vector<float> rows;

    void Reserve(uint64_t n, uint32_t stride) {
      slots.reserve(n);
      rows.reserve(n * stride);
    }
    void Keep(int64_t slot, bool claimed, const float* row, uint32_t stride) {
      slots.push_back(claimed ? ~slot : slot);
      if (claimed) return;
      const size_t at = rows.size();
      rows.resize(at + stride);
      std::memcpy(rows.data() + at, row, stride * sizeof(float));
    }
    // REQUIRES: the table's lock held exclusively. A claimed slot is free
    // again (its key empty, its row zero, as free slots are): a claim never
    // moves another key, so the keys are as they were before the call.
    void PutBack(const TableRef& t) const {
      const float* from = rows.data();
      for (int64_t slot : slots) {
        if (slot < 0) {
          t.keys[static_cast<uint64_t>(~slot)] = kEmptyKey;
          ZeroRow(t.row(static_cast<uint64_t>(~slot)), t.stride);
          continue;
        }
        std::memcpy(t.row(static_cast<uint64_t>(slot)), from, t.stride * sizeof(float));
        from += t.stride;
      }
    }
  };

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

  // With one thread in the call nothing else can claim a slot (writers hold
  // the table exclusively), so the claim needs no CAS.
  int64_t ClaimSlot(Probe& p, int parts) {
    return parts == 1 ? FindOrClaim<false>(ref_, p.key, p.home, &p.claimed)
                      : FindOrClaim<true>(ref_, p.key, p.home, &p.claimed);
  }

  // Finds each key's slot (-1 when absent) on the launcher's threads, the
  // table shared, and hands each probe to visit; returns how many were found.
  template <class Visit>
  uint64_t FindEach(const uint64_t* keys, uint64_t n, const Visit& visit) const {
    std::shared_lock lock(mutex_);
    const int parts = PartsFor(n, threads_);
    std::vector<uint64_t> hits(static_cast<size_t>(parts), 0);
    RunParts(parts, [&](int part) {
      uint64_t item = PartBegin(n, part, parts);
      uint64_t h = 0;
      Pipeline(
          ref_, PartBegin(n, part + 1, parts) - item, /*row_write=*/false,
          [&item] { return item++; }, [keys](uint64_t i) { return keys[i]; },
          [this](Probe& p) { p.slot = FindSlot(ref_, p.key, p.home); },
          [&](const Probe& p) {
            visit(p);
            h += p.slot >= 0;
          });
      hits[static_cast<size_t>(part)] = h;
    });
    return Sum(hits);
  }

  // Finds or claims each key's slot, then finish(probe) -> whether it counts.
  // Keys that found no free slot make the call raise TableFullError.
  template <class Finish>
  uint64_t ClaimEach(const uint64_t* keys, uint64_t n, const Finish& finish) {
    std::vector<uint64_t> counted, claimed, full;
    int parts = 1;
    ForOwnedItems(keys, n, /*row_write=*/true,
        [&](Probe& p) { p.slot = ClaimSlot(p, parts); },
        [&](const Probe& p, uint64_t& c) {
          if (p.slot >= 0) c += finish(p);
        },
        &counted, &claimed, &full, &parts);
    Settle(Sum(claimed), Sum(full));
    return Sum(counted);
  }

  // Runs the pipeline on each thread over the keys it owns, in call order, so
  // that one key's rows are only ever touched by one thread. finish(probe,
  // counted) may bump the thread's count. Per-thread counts of what was
  // counted, claimed, and found full go to the vectors given.
  template <class ProbeFn, class Finish>
  void ForOwnedItems(const uint64_t* keys, uint64_t n, bool row_write, const ProbeFn& probe,
                     const Finish& finish, std::vector<uint64_t>* counted,
                     std::vector<uint64_t>* claimed, std::vector<uint64_t>* full,
                     int* parts_out = nullptr) {
    const int parts = PartsFor(n, threads_);
    if (parts_out) *parts_out = parts;
    for (auto* v : {counted, claimed, full}) {
      if (v) v->assign(static_cast<size_t>(parts), 0);
    }
    // owned[chunk][owner]: the items of one chunk of the call that one owner
    // handles, in call order. Bucketing in parallel first lets each owner's
    // pipeline run over its own items only, at full depth.
    std::vector<std::vector<std::vector<uint64_t>>> owned(static_cast<size_t>(parts));
    if (parts > 1) {
      RunParts(parts, [&](int chunk) {
        auto& lists = owned[static_cast<size_t>(chunk)];
        lists.resize(static_cast<size_t>(parts));
        const uint64_t begin = PartBegin(n, chunk, parts);
        const uint64_t end = PartBegin(n, chunk + 1, parts);
        for (auto& l : lists) l.reserve((end - begin) / static_cast<uint64_t>(parts) * 9 / 8 + 16);
        for (uint64_t i = begin; i < end; ++i) {
          lists[OwnerOf(keys[i], static_cast<uint32_t>(parts))].push_back(i);
        }
      });
    }
    RunParts(parts, [&](int me) {
      uint64_t count = n;
      // Walks owned[0][me], owned[1][me], ... as one sequence.
      size_t chunk = 0, at = 0;
      auto next_item = [&]() -> uint64_t {
        if (parts == 1) return at++;
        while (at == owned[chunk][static_cast<size_t>(me)].size()) {
          ++chunk;
          at = 0;
        }
        return owned[chunk][static_cast<size_t>(me)][at++];
      };
      if (parts > 1) {
        count = 0;
        for (const auto& lists : owned) count += lists[static_cast<size_t>(me)].size();
      }
      uint64_t c = 0, cl = 0, f = 0;
      Pipeline(ref_, count, row_write, next_item, [keys](uint64_t i) { return keys[i]; }, probe,
               [&](const Probe& p) {
                 if (p.slot < 0) ++f;
                 cl += p.claimed;
                 finish(p, c);
               });
      const size_t m = static_cast<size_t>(me);
      if (counted) (*counted)[m] = c;
      if (claimed) (*claimed)[m] = cl;
      if (full) (*full)[m] = f;
    });
  }

  // Adds this call's claims to the size, then reports keys that found no slot.
  void Settle(uint64_t claimed, uint64_t full) {
    size_.fetch_add(claimed, std::memory_order_relaxed);
    if (full > 0) {
      throw TableFullError("hash table full: " + std::to_string(full) +
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
  // A slot takes a key and a row. Past this many slots their bytes overflow 64
  // bits, and the table would map a wrapped (small) size and write past it.
  const uint64_t slot_bytes = sizeof(uint64_t) + static_cast<uint64_t>(options.row_floats) * sizeof(float);
  if (options.capacity > UINT64_MAX / slot_bytes - detail::kBucketSlots) {
    throw std::invalid_argument("hash table: capacity " + std::to_string(options.capacity) + " slots of " +
                                std::to_string(slot_bytes) + " bytes overflows 64 bits of bytes");
  }
  if (options.cuda_device >= 0) return NewCudaHashTable(options);
  return std::make_unique<detail::CpuHashTable>(options.capacity, options.row_floats,
                                                options.threads);
}

}  // namespace hps
