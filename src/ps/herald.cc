// The Herald scheduler declared in include/hps/herald.h.
#include "hps/herald.h"

#include <algorithm>
#include <array>
#include <bit>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "hps/keys.h"
#include "util/mix64.h"

namespace hps {
namespace {

// Set bits of a holder mask: masks hold a few bits, and std::popcount is a
// library call without -mpopcnt.
template <class Mask>
inline uint32_t Holders(Mask m) {
  uint32_t n = 0;
  for (; m != 0; m &= static_cast<Mask>(m - 1)) ++n;
  return n;
}

// std::popcount without the library call (the build does not assume -mpopcnt).
inline uint64_t Popcount64(uint64_t x) {
  x -= (x >> 1) & 0x5555555555555555ULL;
  x = (x & 0x3333333333333333ULL) + ((x >> 2) & 0x3333333333333333ULL);
  x = (x + (x >> 4)) & 0x0f0f0f0f0f0f0f0fULL;
  return (x * 0x0101010101010101ULL) >> 56;
}

// Compaction's rank of a log position: its block's live records (a bit each)
// and the live records before the block.
struct RankBlock {
  uint64_t bits;
  uint64_t base;
};

// Rewrites each occupied index slot's position p (low 32 bits; ~0 is a free
// slot) to the live records before p.
inline void RankSlots(uint64_t* index, uint64_t n, const RankBlock* blocks) {
  for (uint64_t* v = index; v != index + n; ++v) {
    if (*v == ~uint64_t{0}) continue;
    const auto p = static_cast<uint32_t>(*v);
    const RankBlock& b = blocks[p / 64];
    *v = (*v & ~uint64_t{UINT32_MAX}) | (b.base + Popcount64(b.bits & ((uint64_t{1} << (p % 64)) - 1)));
  }
}

#if defined(__x86_64__)
// The same with the popcnt instruction, where the CPU has it.
__attribute__((target("popcnt"))) void RankSlotsPopcnt(uint64_t* index, uint64_t n, const RankBlock* blocks) {
  for (uint64_t* v = index; v != index + n; ++v) {
    if (*v == ~uint64_t{0}) continue;
    const auto p = static_cast<uint32_t>(*v);
    const RankBlock& b = blocks[p / 64];
    *v = (*v & ~uint64_t{UINT32_MAX}) |
         (b.base + static_cast<uint64_t>(__builtin_popcountll(b.bits & ((uint64_t{1} << (p % 64)) - 1))));
  }
}
#endif

void RankIndex(std::vector<uint64_t>& index, const std::vector<RankBlock>& blocks) {
#if defined(__x86_64__)
  static const bool popcnt = __builtin_cpu_supports("popcnt");
  if (popcnt) return RankSlotsPopcnt(index.data(), index.size(), blocks.data());
#endif
  RankSlots(index.data(), index.size(), blocks.data());
}

// kSpread[m]: byte w is bit w of m (a worker's count, for 8-bit masks).
constexpr auto kSpread = [] {
  std::array<uint64_t, 256> t{};
  for (uint64_t m = 0; m < 256; ++m) {
    for (int w = 0; w < 8; ++w) t[m] |= ((m >> w) & 1) << (8 * w);
  }
  return t;
}();

// Sorts keys ascending and drops repeats, as std::sort and std::unique do:
// a pass places each key in one of about n / 4 buckets by its offset from the
// lowest key (buckets in key order), then each small bucket is sorted. tmp and
// count are scratch.
void SortUnique(std::vector<uint64_t>& keys, std::vector<uint64_t>& tmp, std::vector<uint32_t>& count) {
  const uint64_t n = keys.size();
  if (n < 1024) {
    std::sort(keys.begin(), keys.end());
  } else {
    const auto [lo, hi] = std::minmax_element(keys.begin(), keys.end());
    const uint64_t low = *lo, span = *hi - *lo;
    uint64_t buckets = 1;
    while (buckets < n / 4) buckets *= 2;
    int shift = 0;
    while (shift < 64 && (span >> shift) >= buckets) ++shift;
    count.assign(buckets + 1, 0);
    for (uint64_t k : keys) ++count[((k - low) >> shift) + 1];
    for (uint64_t b = 0; b < buckets; ++b) count[b + 1] += count[b];
    tmp.resize(n);
    for (uint64_t k : keys) tmp[count[(k - low) >> shift]++] = k;  // count[b]: the end of bucket b after
    for (uint64_t b = 0, begin = 0; b < buckets; begin = count[b++]) {
      std::sort(tmp.begin() + static_cast<int64_t>(begin), tmp.begin() + count[b]);
    }
    keys.swap(tmp);
  }
  keys.erase(std::unique(keys.begin(), keys.end()), keys.end());
}

// Tunables of the snapshot's memory (the header's Memory paragraph).
constexpr double kMaxLoad = 0.8;     // the key index grows past this load...
constexpr double kGrownLoad = 0.55;  // ...to this one
constexpr double kLogRoom = 1.25;    // a compacted log has room for 1.25 x (live records + the batch)
constexpr uint64_t kMinSlots = 64;

}  // namespace

struct Herald::Impl {
  virtual ~Impl() = default;
  // Plans a batch whose offsets were checked, and updates the snapshot.
  virtual HeraldPlan Plan(const uint64_t* offsets, uint64_t n_examples, const uint64_t* keys) = 0;
  virtual std::vector<uint64_t> Cached(int32_t worker) const = 0;
  virtual uint64_t Held(int32_t worker) const = 0;
  virtual uint64_t MemoryBytes() const = 0;
  virtual void Clear() = 0;
};

// The snapshot for holder masks of type Mask (W <= its bits).
//
// log_keys/log_masks: a record per (key, batch that last trained it), in
// training order, a run per batch starting at runs[r] (with a capacity; the
// runs order the records by their batch). A record is live while its mask is
// not 0: it lost its holders to a later batch (which appended a new record)
// or to eviction. index: open addressing with linear probing, a slot per live
// record, (high 32 bits of Mix64(key)) << 32 | position; the hash bits place
// the slot (multiply-shift, any table size) and filter the probes, so only a
// match reads the log. Erase shifts the probe run back (no tombstones).
template <class Mask>
struct Herald::Snapshot final : Herald::Impl {
  static constexpr uint64_t kFree = ~uint64_t{0};
  static constexpr uint64_t kNone = ~uint64_t{0};
  static constexpr uint64_t kMaxRecords = UINT32_MAX - 1;  // positions are 32-bit; ~0u marks a free slot

  explicit Snapshot(const HeraldOptions& options)
      : opt(options), held(options.workers, 0), cursor(options.workers, 0), score(options.workers, 0) {
    index.assign(kMinSlots, kFree);
  }

  // ---- the key index ----
  static uint32_t Hash(uint64_t key) { return static_cast<uint32_t>(detail::Mix64(key) >> 32); }
  uint64_t Home(uint32_t hash) const { return (uint64_t{hash} * index.size()) >> 32; }
  uint64_t Next(uint64_t i) const { return i + 1 == index.size() ? 0 : i + 1; }

  uint64_t Find(uint64_t key, uint32_t hash) const {
    for (uint64_t i = Home(hash);; i = Next(i)) {
      const uint64_t v = index[i];
      if (v == kFree) return kNone;
      if ((v >> 32) == hash && log_keys[static_cast<uint32_t>(v)] == key) return i;
    }
  }

  void Insert(uint32_t hash, uint64_t pos) {
    uint64_t i = Home(hash);
    while (index[i] != kFree) i = Next(i);
    index[i] = uint64_t{hash} << 32 | pos;
    ++used;
  }

  // Erases the slot of the record at `pos` (key hashing to `hash`).
  void Erase(uint32_t hash, uint64_t pos) {
    uint64_t hole = Home(hash);
    while (static_cast<uint32_t>(index[hole]) != pos) hole = Next(hole);
    for (uint64_t j = Next(hole); index[j] != kFree; j = Next(j)) {
      // An entry may fill the hole unless its home lies in (hole, j].
      const uint64_t home = Home(static_cast<uint32_t>(index[j] >> 32));
      const bool stays = hole <= j ? (hole < home && home <= j) : (hole < home || home <= j);
      if (stays) continue;
      index[hole] = index[j];
      hole = j;
    }
    index[hole] = kFree;
    --used;
  }

  // Room for `more` inserts below kMaxLoad.
  void Reserve(uint64_t more) {
    if (static_cast<double>(used + more) <= kMaxLoad * static_cast<double>(index.size())) return;
    const auto slots = std::max<uint64_t>(kMinSlots, static_cast<uint64_t>(static_cast<double>(used + more) / kGrownLoad));
    std::vector<uint64_t> old(slots, kFree);
    old.swap(index);
    used = 0;
    for (uint64_t v : old) {
      if (v != kFree) Insert(static_cast<uint32_t>(v >> 32), static_cast<uint32_t>(v));
    }
  }

  // ---- the log ----
  // Drops the dead records in place, then moves the live ones to a log with
  // room for `more` records beyond them (kLogRoom x) where that room differs,
  // rewriting the positions the index, runs and cursors hold: a record's new
  // position is the number of live ones before it (a bit a record and a count
  // a block of 64).
  void Compact(uint64_t more) {
    const uint64_t n = log_keys.size();
    const uint64_t live = n - dead;
    std::vector<RankBlock> blocks(n / 64 + 1);
    uint64_t at = 0;
    for (uint64_t b = 0; b < blocks.size(); ++b) {
      blocks[b].base = at;
      uint64_t bits = 0;
      for (uint64_t p = 64 * b, end = std::min(n, p + 64); p < end; ++p) {
        const Mask m = log_masks[p];
        log_keys[at] = log_keys[p];  // at <= p: in place
        log_masks[at] = m;
        bits |= uint64_t{m != 0} << (p % 64);
        at += m != 0;
      }
      blocks[b].bits = bits;
    }
    auto moved = [&](uint64_t p) {
      const RankBlock& b = blocks[p / 64];
      return b.base + Popcount64(b.bits & ((uint64_t{1} << (p % 64)) - 1));
    };
    log_keys.resize(live);
    log_masks.resize(live);
    const uint64_t room =
        std::min(kMaxRecords, static_cast<uint64_t>(kLogRoom * static_cast<double>(live + more)) + 64);
    if (log_keys.capacity() != room) {
      std::vector<uint64_t> keys;
      std::vector<Mask> masks;
      keys.reserve(room);
      masks.reserve(room);
      keys.assign(log_keys.begin(), log_keys.end());
      masks.assign(log_masks.begin(), log_masks.end());
      log_keys = std::move(keys);
      log_masks = std::move(masks);
    }
    RankIndex(index, blocks);
    std::vector<uint64_t> kept;
    for (uint64_t r = 0; r < runs.size(); ++r) {
      const uint64_t begin = moved(runs[r]);
      if (begin == live) break;  // this run and the later ones are empty
      if (!kept.empty() && kept.back() == begin) kept.pop_back();  // the run before was empty
      kept.push_back(begin);
    }
    runs = std::move(kept);
    for (uint64_t& c : cursor) c = moved(c);
    dead = 0;
  }

  // Worker w drops its `drop` least recently used keys: its records from its
  // cursor on, a run at a time; the run the count ends in gives its lowest keys.
  void Evict(int32_t w, uint64_t drop, std::vector<uint64_t>& evicted) {
    const auto bit = static_cast<Mask>(uint64_t{1} << w);
    held[w] -= drop;
    uint64_t p = cursor[w];
    uint64_t r = static_cast<uint64_t>(std::upper_bound(runs.begin(), runs.end(), p) - runs.begin()) - 1;
    auto lose = [&](uint64_t q) {
      log_masks[q] &= static_cast<Mask>(~bit);
      evicted.push_back(log_keys[q]);
      if (log_masks[q] == 0) {
        emptied.push_back(q);
        emptied_from.push_back(w);
      }
    };
    while (drop > 0) {  // held counts live records: the log cannot run dry first
      const uint64_t end = r + 1 < runs.size() ? runs[r + 1] : log_keys.size();
      mine.clear();
      for (uint64_t q = p; q < end; ++q) {
        if (log_masks[q] & bit) mine.push_back(q);
      }
      if (mine.size() <= drop) {
        for (uint64_t q : mine) lose(q);
        drop -= mine.size();
        p = end;
        ++r;
        continue;
      }
      const auto cut = mine.begin() + static_cast<int64_t>(drop);
      std::nth_element(mine.begin(), cut, mine.end(), [&](uint64_t a, uint64_t b) { return log_keys[a] < log_keys[b]; });
      for (auto it = mine.begin(); it != cut; ++it) lose(*it);
      p = *std::min_element(cut, mine.end());
      drop = 0;
    }
    cursor[w] = p;
  }

  // score[w] = the batch keys j in [begin, end) whose masks[inverse[j]] has
  // bit w. Each byte of a key's mask adds kSpread[byte] to its accumulator, a
  // byte a worker (no branch on how many bits are set), and the bytes are
  // spilled before they can overflow.
  void Tally(uint64_t begin, uint64_t end, const Mask* masks) {
    constexpr int kBytes = sizeof(Mask);
    const auto W = static_cast<int32_t>(score.size());
    for (bool first = true; first || begin < end; first = false) {
      std::array<uint64_t, kBytes> acc{};
      for (const uint64_t stop = std::min(end, begin + 255); begin < stop; ++begin) {
        const Mask m = masks[inverse[begin]];
        for (int b = 0; b < kBytes; ++b) acc[b] += kSpread[static_cast<uint8_t>(m >> (8 * b))];
      }
      for (int32_t w = 0; w < W; ++w) {
        score[w] = (first ? 0 : score[w]) + static_cast<uint32_t>((acc[w / 8] >> (8 * (w % 8))) & 0xff);
      }
    }
  }

  // ---- the batch's distinct keys ----
  // UniqueKeys' pass (uniq in order of first appearance, inverse), which also
  // keeps each distinct key's Hash, on a table kept across batches: open
  // addressing with linear probing from Home-like slots of the Hash, at load at
  // most 1/2, never shrunk, so after the first batches it neither grows nor is
  // cleared by a memset; the pass empties the slots it filled, last key first
  // (each key's probe run then still holds the keys placed before it).
  // REQUIRES: the keys were checked (CheckKeys).
  void Distinct(const uint64_t* keys, uint64_t n) {
    uint64_t capacity = std::max<uint64_t>(seen_keys.size(), 1024);
    while (capacity < n / 2) capacity *= 2;  // UniqueKeys' first size: a batch repeats its keys
    if (capacity != seen_keys.size()) {
      seen_keys.assign(capacity, kEmptyKey);
      seen_at.resize(capacity);
    }
    inverse.resize(n);
    // Sized for every key distinct, cut to the distinct ones at the end.
    uniq.resize(n);
    hashes.resize(n);
    uint64_t count = 0;
    uint64_t mask = capacity - 1;
    auto home = [&](uint32_t hash) { return (uint64_t{hash} * (mask + 1)) >> 32; };
    auto slot_of = [&](uint64_t key, uint32_t hash) {
      uint64_t i = home(hash);
      while (seen_keys[i] != key && seen_keys[i] != kEmptyKey) i = (i + 1) & mask;
      return i;
    };
    // The table is larger than L2 and was cold since the last batch: each key's
    // home slot is fetched kAhead keys ahead of its probe (ahead[] keeps their Hash).
    constexpr uint64_t kAhead = 16;
    std::array<uint32_t, kAhead> ahead;
    for (uint64_t k = 0; k < std::min(n, kAhead); ++k) {
      ahead[k] = Hash(keys[k]);
      __builtin_prefetch(&seen_keys[home(ahead[k])]);
    }
    try {
      for (uint64_t k = 0; k < n; ++k) {
        const uint64_t key = keys[k];
        const uint32_t hash = ahead[k % kAhead];
        if (k + kAhead < n) {
          const uint64_t next = home(ahead[k % kAhead] = Hash(keys[k + kAhead]));
          __builtin_prefetch(&seen_keys[next]);
          __builtin_prefetch(&seen_at[next]);
        }
        const uint64_t i = slot_of(key, hash);
        if (seen_keys[i] == key) {
          inverse[k] = seen_at[i];
          continue;
        }
        const auto at = static_cast<uint32_t>(count++);
        seen_keys[i] = key;
        seen_at[i] = at;
        uniq[at] = key;
        hashes[at] = hash;
        inverse[k] = at;
        if (2 * count > capacity) {  // load above 1/2: double and re-place the distinct keys
          capacity *= 2;
          mask = capacity - 1;
          seen_keys.assign(capacity, kEmptyKey);
          seen_at.resize(capacity);
          for (uint32_t u = 0; u < count; ++u) {
            const uint64_t j = slot_of(uniq[u], hashes[u]);
            seen_keys[j] = uniq[u];
            seen_at[j] = u;
          }
        }
      }
    } catch (...) {  // out of memory growing: drop the table rather than leave it holding keys
      seen_keys = {};
      seen_at = {};
      throw;
    }
    uniq.resize(count);
    hashes.resize(count);
    for (uint64_t u = count; u-- > 0;) seen_keys[slot_of(uniq[u], hashes[u])] = kEmptyKey;
  }

  HeraldPlan Plan(const uint64_t* offsets, uint64_t n_examples, const uint64_t* keys) override {
    const int32_t W = opt.workers;
    const uint64_t total = offsets[n_examples];
    CheckKeys(keys, total);
    // Indices are uint32 with UINT32_MAX kept free, as in UniqueKeys.
    if (total >= UINT32_MAX) throw std::invalid_argument("Herald::Schedule: more than 2^32 - 2 keys");
    Distinct(keys, total);
    const uint64_t U = uniq.size();
    if (log_keys.size() - dead + U > kMaxRecords) {
      throw std::length_error("Herald::Schedule: the snapshot would pass 2^32 - 2 keys");
    }

    HeraldPlan plan;
    plan.distinct = U;
    // Every batch key's slot now; the index is far larger than the caches, so
    // its slots and then the records they point to are fetched ahead of use.
    Reserve(U);  // the inserts below must not move the slots found here
    slot.resize(U);
    latest.resize(U);
    need.assign(U, 0);
    constexpr uint64_t kAhead = 16, kPeek = 8;
    for (uint64_t u = 0; u < std::min(U, kAhead); ++u) __builtin_prefetch(&index[Home(hashes[u])]);
    for (uint64_t u = 0; u < U; ++u) {
      if (u + kAhead < U) __builtin_prefetch(&index[Home(hashes[u + kAhead])]);
      if (u + kPeek < U) {
        const uint64_t v = index[Home(hashes[u + kPeek])];
        if (v != kFree && (v >> 32) == hashes[u + kPeek]) {
          __builtin_prefetch(&log_keys[static_cast<uint32_t>(v)]);
          __builtin_prefetch(&log_masks[static_cast<uint32_t>(v)]);
        }
      }
      const uint64_t s = slot[u] = Find(uniq[u], hashes[u]);
      latest[u] = s == kNone ? Mask{0} : log_masks[static_cast<uint32_t>(index[s])];
    }

    // ---- partition: shares of n / W, the first n % W workers one more ----
    share.resize(W);
    for (int32_t w = 0; w < W; ++w) share[w] = n_examples / W + (static_cast<uint64_t>(w) < n_examples % W ? 1 : 0);
    plan.assignment.resize(n_examples);
    if (opt.location_aware) {
      placed = latest;  // the snapshot, plus the keys of examples placed so far
      // Examples with the most cached keys choose first (their best score on the
      // snapshot, ties in batch order): they have the most to lose to a full worker.
      order.resize(n_examples);  // (-best, i) as (kMax - best, i)
      for (uint64_t i = 0; i < n_examples; ++i) {
        Tally(offsets[i], offsets[i + 1], latest.data());
        const uint32_t best = *std::max_element(score.begin(), score.end());
        order[i] = {UINT32_MAX - best, i};
      }
      std::sort(order.begin(), order.end());
      for (const auto& [unused, i] : order) {
        Tally(offsets[i], offsets[i + 1], placed.data());
        int32_t best = -1;
        for (int32_t w = 0; w < W; ++w) {
          if (share[w] != 0 && (best < 0 || score[w] > score[best])) best = w;
        }
        plan.assignment[i] = best;
        --share[best];
        const auto bit = static_cast<Mask>(uint64_t{1} << best);
        for (uint64_t j = offsets[i]; j < offsets[i + 1]; ++j) placed[inverse[j]] |= bit;
      }
    } else {
      int32_t w = 0;
      for (uint64_t i = 0; i < n_examples; ++i) {
        while (share[w] == 0) ++w;
        plan.assignment[i] = w;
        --share[w];
      }
    }
    for (uint64_t i = 0; i < n_examples; ++i) {
      const auto bit = static_cast<Mask>(uint64_t{1} << plan.assignment[i]);
      for (uint64_t j = offsets[i]; j < offsets[i + 1]; ++j) need[inverse[j]] |= bit;
    }

    // ---- fetches, comm plans and counts ----
    // The source of a fetch: on demand every held row is dirty (a worker
    // trained it), so its lowest holder; write-through the PS holds them all.
    auto source_of = [&](uint64_t u) -> int32_t {
      return latest[u] != 0 && opt.on_demand ? std::countr_zero(latest[u]) : -1;
    };
    plan.fetch_offsets.assign(W + 1, 0);
    plan.comm_offsets.assign(W + 1, 0);
    for (uint64_t u = 0; u < U; ++u) {
      const auto lacking = static_cast<Mask>(need[u] & ~latest[u]);
      uint32_t pulls = 0;
      for (Mask m = lacking; m != 0; m &= static_cast<Mask>(m - 1)) {
        ++plan.fetch_offsets[std::countr_zero(m) + 1];
        ++pulls;
      }
      const int32_t from = source_of(u);
      if (lacking != 0 && from >= 0) ++plan.comm_offsets[from + 1];
      plan.pulls += pulls;
      if (from >= 0) plan.peer_pulls += pulls;
      if (opt.on_demand ? (lacking != 0 && from >= 0) : true) ++plan.pushes;
      plan.shared += Holders(need[u]) - 1;  // every batch key is needed by someone
    }
    for (int32_t w = 0; w < W; ++w) {
      plan.fetch_offsets[w + 1] += plan.fetch_offsets[w];
      plan.comm_offsets[w + 1] += plan.comm_offsets[w];
    }
    plan.fetch_keys.resize(plan.fetch_offsets[W]);
    plan.fetch_from.resize(plan.fetch_offsets[W]);
    plan.comm_keys.resize(plan.comm_offsets[W]);
    fetch_at.assign(plan.fetch_offsets.begin(), plan.fetch_offsets.end() - 1);
    comm_at.assign(plan.comm_offsets.begin(), plan.comm_offsets.end() - 1);
    for (uint64_t u = 0; u < U; ++u) {
      const auto lacking = static_cast<Mask>(need[u] & ~latest[u]);
      if (lacking == 0) continue;
      const int32_t from = source_of(u);
      for (Mask m = lacking; m != 0; m &= static_cast<Mask>(m - 1)) {
        const uint64_t at = fetch_at[std::countr_zero(m)]++;
        plan.fetch_keys[at] = uniq[u];
        plan.fetch_from[at] = from;
      }
      if (from >= 0) plan.comm_keys[comm_at[from]++] = uniq[u];
    }

    // ---- the snapshot: the trainers hold the latest version, other copies go ----
    // Each batch key gets a new record at the log's end, a run for the batch;
    // its old record (if any) dies.
    if (log_keys.size() + U > std::min<uint64_t>(log_keys.capacity(), kMaxRecords)) Compact(U);
    if (opt.capacity > 0 && U > 0) runs.push_back(log_keys.size());
    for (uint64_t u = 0; u < U; ++u) {
      if (u + kAhead < U) {  // the slots were read long ago: fetch them again ahead of use
        const uint64_t s = slot[u + kAhead];
        __builtin_prefetch(&index[s != kNone ? s : Home(hashes[u + kAhead])], 1);
      }
      if (u + kPeek < U && slot[u + kPeek] != kNone) {
        __builtin_prefetch(&log_masks[static_cast<uint32_t>(index[slot[u + kPeek]])], 1);
      }
      const Mask old = latest[u];
      for (Mask m = static_cast<Mask>(need[u] & ~old); m != 0; m &= static_cast<Mask>(m - 1)) ++held[std::countr_zero(m)];
      for (Mask m = static_cast<Mask>(old & ~need[u]); m != 0; m &= static_cast<Mask>(m - 1)) --held[std::countr_zero(m)];
      const uint64_t pos = log_keys.size();
      log_keys.push_back(uniq[u]);
      log_masks.push_back(need[u]);
      if (slot[u] == kNone) {
        Insert(hashes[u], pos);
      } else {
        log_masks[static_cast<uint32_t>(index[slot[u]])] = 0;
        ++dead;
        index[slot[u]] = uint64_t{hashes[u]} << 32 | pos;
      }
    }

    // ---- eviction: a cache above capacity drops its least recently used keys ----
    if (opt.capacity > 0) {
      emptied.clear();
      emptied_from.clear();
      for (int32_t w = 0; w < W; ++w) {
        if (held[w] > opt.capacity) Evict(w, held[w] - opt.capacity, plan.evicted);
      }
      for (uint64_t e = 0; e < emptied.size(); ++e) {  // the last holder dropped it: a dirty row goes to the PS
        if (e + kAhead < emptied.size()) __builtin_prefetch(&index[Home(Hash(log_keys[emptied[e + kAhead]]))], 1);
        const uint64_t q = emptied[e];
        plan.lost_keys.push_back(log_keys[q]);
        plan.lost_from.push_back(emptied_from[e]);
        if (opt.on_demand) {
          ++plan.pushes;
          ++plan.evict_pushes;
        }
        Erase(Hash(log_keys[q]), q);
        ++dead;
      }
      SortUnique(plan.evicted, sort_tmp, sort_count);
    }
    return plan;
  }

  std::vector<uint64_t> Cached(int32_t worker) const override {
    const auto bit = static_cast<Mask>(uint64_t{1} << worker);
    std::vector<uint64_t> out;
    for (uint64_t p = 0; p < log_keys.size(); ++p) {
      if (log_masks[p] & bit) out.push_back(log_keys[p]);
    }
    std::sort(out.begin(), out.end());
    return out;
  }

  uint64_t Held(int32_t worker) const override { return held[worker]; }

  uint64_t MemoryBytes() const override {
    return index.capacity() * sizeof(uint64_t) + log_keys.capacity() * sizeof(uint64_t) +
           log_masks.capacity() * sizeof(Mask) + runs.capacity() * sizeof(uint64_t);
  }

  void Clear() override {
    index.assign(kMinSlots, kFree);
    index.shrink_to_fit();
    used = 0;
    log_keys = {};
    log_masks = {};
    runs = {};
    dead = 0;
    std::fill(held.begin(), held.end(), 0);
    std::fill(cursor.begin(), cursor.end(), 0);
  }

  HeraldOptions opt;
  std::vector<uint64_t> index;
  uint64_t used = 0;  // occupied index slots: the live records
  std::vector<uint64_t> log_keys;
  std::vector<Mask> log_masks;
  uint64_t dead = 0;          // records whose mask is 0
  std::vector<uint64_t> runs;  // with a capacity: where each batch's records begin, oldest first
  std::vector<uint64_t> held;    // (W,) keys each cache holds
  std::vector<uint64_t> cursor;  // (W,) no record before it has the worker's bit
  // Per-batch scratch, kept for the next batch (not in MemoryBytes).
  std::vector<int64_t> inverse;
  std::vector<uint32_t> hashes, score;
  std::vector<uint64_t> uniq, slot, share, fetch_at, comm_at, emptied, mine;
  std::vector<int32_t> emptied_from;  // the worker whose eviction emptied emptied[e]
  std::vector<uint64_t> seen_keys;  // Distinct's table: kEmptyKey between batches
  std::vector<uint32_t> seen_at;    // the index among uniq of seen_keys' key
  std::vector<uint64_t> sort_tmp;   // SortUnique's
  std::vector<uint32_t> sort_count;
  std::vector<Mask> latest, need, placed;
  std::vector<std::pair<uint32_t, uint64_t>> order;
};

Herald::Herald(const HeraldOptions& options) : options_(options) {
  const int32_t W = options.workers;
  if (W < 1 || W > 64) {
    throw std::invalid_argument("Herald: workers = " + std::to_string(W) +
                                " is outside [1, 64] (a key's holders are a 64-bit mask)");
  }
  if (W <= 8) {
    impl_ = std::make_unique<Snapshot<uint8_t>>(options);
  } else if (W <= 16) {
    impl_ = std::make_unique<Snapshot<uint16_t>>(options);
  } else if (W <= 32) {
    impl_ = std::make_unique<Snapshot<uint32_t>>(options);
  } else {
    impl_ = std::make_unique<Snapshot<uint64_t>>(options);
  }
}

Herald::~Herald() = default;

HeraldPlan Herald::Schedule(const uint64_t* keys, uint64_t n_examples, int32_t fields) {
  if (fields < 0) throw std::invalid_argument("Herald::Schedule: fields = " + std::to_string(fields) + " is negative");
  std::vector<uint64_t> offsets(n_examples + 1);
  for (uint64_t i = 0; i <= n_examples; ++i) offsets[i] = i * static_cast<uint64_t>(fields);
  return Schedule(offsets.data(), n_examples, keys);
}

HeraldPlan Herald::Schedule(const uint64_t* offsets, uint64_t n_examples, const uint64_t* keys) {
  if (offsets[0] != 0) {
    throw std::invalid_argument("Herald::Schedule: offsets[0] = " + std::to_string(offsets[0]) + ", must be 0");
  }
  for (uint64_t i = 0; i < n_examples; ++i) {
    if (offsets[i + 1] < offsets[i]) {
      throw std::invalid_argument("Herald::Schedule: offsets[" + std::to_string(i + 1) + "] = " +
                                  std::to_string(offsets[i + 1]) + " is below offsets[" + std::to_string(i) +
                                  "] = " + std::to_string(offsets[i]));
    }
  }
  HeraldPlan plan = impl_->Plan(offsets, n_examples, keys);
  ++batches_;
  return plan;
}

std::vector<uint64_t> Herald::Cached(int32_t worker) const {
  if (worker < 0 || worker >= options_.workers) {
    throw std::out_of_range("Herald::Cached: worker " + std::to_string(worker) + " is outside [0, " +
                            std::to_string(options_.workers) + ")");
  }
  return impl_->Cached(worker);
}

uint64_t Herald::cached(int32_t worker) const {
  if (worker < 0 || worker >= options_.workers) {
    throw std::out_of_range("Herald::cached: worker " + std::to_string(worker) + " is outside [0, " +
                            std::to_string(options_.workers) + ")");
  }
  return impl_->Held(worker);
}

uint64_t Herald::memory_bytes() const { return impl_->MemoryBytes(); }

void Herald::Clear() { impl_->Clear(); }

}  // namespace hps
