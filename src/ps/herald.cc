// The Herald scheduler declared in include/hps/herald.h.
#include "hps/herald.h"

#include <algorithm>
#include <bit>
#include <deque>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "hps/keys.h"
#include "util/mix64.h"

namespace hps {

// The snapshot: key -> (mask of the workers holding its latest version, the
// batch that last trained it, whether the PS's copy is stale). Open
// addressing with linear probing over separate arrays, erase by shifting the
// probe run back (no tombstones), as format/key_index.h does; its own table
// because eviction walks every slot and KeyIndex keeps no mask.
struct Herald::Table {
  static constexpr uint64_t kNone = ~uint64_t{0};
  static constexpr uint32_t kDirty = 0x80000000u;  // in meta: the PS's copy is stale; the rest is the tick

  std::vector<uint64_t> keys;
  std::vector<uint64_t> masks;
  std::vector<uint32_t> meta;
  uint64_t mask = 0;  // slots - 1
  uint64_t size = 0;

  Table() { Allocate(64); }

  void Allocate(uint64_t slots) {
    keys.assign(slots, kEmptyKey);
    masks.assign(slots, 0);
    meta.assign(slots, 0);
    mask = slots - 1;
    size = 0;
  }

  uint64_t Find(uint64_t key) const {
    for (uint64_t i = detail::Mix64(key) & mask;; i = (i + 1) & mask) {
      if (keys[i] == key) return i;
      if (keys[i] == kEmptyKey) return kNone;
    }
  }

  // The slot of key, inserted (mask 0, meta 0) if absent.
  uint64_t Upsert(uint64_t key) {
    if ((size + 1) * 4 > (mask + 1) * 3) Grow();
    for (uint64_t i = detail::Mix64(key) & mask;; i = (i + 1) & mask) {
      if (keys[i] == key) return i;
      if (keys[i] == kEmptyKey) {
        keys[i] = key;
        masks[i] = 0;
        meta[i] = 0;
        ++size;
        return i;
      }
    }
  }

  // Room for `more` inserts without growing.
  void Reserve(uint64_t more) {
    while ((size + more) * 4 > (mask + 1) * 3) Grow();
  }

  void Prefetch(uint64_t key) const {
    __builtin_prefetch(&keys[detail::Mix64(key) & mask]);
    __builtin_prefetch(&masks[detail::Mix64(key) & mask]);
    __builtin_prefetch(&meta[detail::Mix64(key) & mask]);
  }

  void Erase(uint64_t key) {
    uint64_t hole = Find(key);
    if (hole == kNone) return;
    for (uint64_t j = (hole + 1) & mask; keys[j] != kEmptyKey; j = (j + 1) & mask) {
      // An entry may fill the hole unless its home lies in (hole, j].
      const uint64_t home = detail::Mix64(keys[j]) & mask;
      const bool stays = hole <= j ? (hole < home && home <= j) : (hole < home || home <= j);
      if (stays) continue;
      keys[hole] = keys[j];
      masks[hole] = masks[j];
      meta[hole] = meta[j];
      hole = j;
    }
    keys[hole] = kEmptyKey;
    masks[hole] = 0;  // an empty slot has no holders: eviction scans masks alone
    --size;
  }

  void Grow() {
    std::vector<uint64_t> old_keys = std::move(keys), old_masks = std::move(masks);
    std::vector<uint32_t> old_meta = std::move(meta);
    Allocate(2 * old_keys.size());
    for (uint64_t j = 0; j < old_keys.size(); ++j) {
      if (old_keys[j] == kEmptyKey) continue;
      uint64_t i = detail::Mix64(old_keys[j]) & mask;
      while (keys[i] != kEmptyKey) i = (i + 1) & mask;
      keys[i] = old_keys[j];
      masks[i] = old_masks[j];
      meta[i] = old_meta[j];
      ++size;
    }
  }
};

Herald::Herald(const HeraldOptions& options) : options_(options), table_(std::make_unique<Table>()) {
  if (options.workers < 1 || options.workers > 64) {
    throw std::invalid_argument("Herald: workers = " + std::to_string(options.workers) +
                                " is outside [1, 64] (a key's holders are a 64-bit mask)");
  }
  held_.assign(options.workers, 0);
  recency_.resize(options.workers);
  queued_.assign(options.workers, 0);
}

Herald::~Herald() = default;

HeraldPlan Herald::Schedule(const uint64_t* keys, uint64_t n_examples, int32_t fields) {
  if (fields < 0) throw std::invalid_argument("Herald::Schedule: fields = " + std::to_string(fields) + " is negative");
  std::vector<uint64_t> offsets(n_examples + 1);
  for (uint64_t i = 0; i <= n_examples; ++i) offsets[i] = i * static_cast<uint64_t>(fields);
  return Schedule(offsets.data(), n_examples, keys);
}

HeraldPlan Herald::Schedule(const uint64_t* offsets, uint64_t n_examples, const uint64_t* keys) {
  const int32_t W = options_.workers;
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
  const uint64_t total = offsets[n_examples];
  std::vector<int64_t> inverse(total);
  const std::vector<uint64_t> uniq = UniqueKeys(keys, total, inverse.data());  // throws like CheckKeys
  const uint64_t U = uniq.size();
  Table& t = *table_;

  HeraldPlan plan;
  plan.distinct = U;
  std::vector<uint64_t> latest(U), need(U, 0);
  std::vector<uint8_t> dirty(U);
  // Every batch key gets its slot now (a new one: mask 0, clean), grown once
  // up front so that the slots stay put until the snapshot update below; the
  // table is far larger than the caches, so the probes are prefetched.
  t.Reserve(U);
  std::vector<uint64_t> slot(U);
  constexpr uint64_t kAhead = 8;
  for (uint64_t u = 0; u < std::min(U, kAhead); ++u) t.Prefetch(uniq[u]);
  for (uint64_t u = 0; u < U; ++u) {
    if (u + kAhead < U) t.Prefetch(uniq[u + kAhead]);
    const uint64_t s = slot[u] = t.Upsert(uniq[u]);
    latest[u] = t.masks[s];
    dirty[u] = (t.meta[s] & Table::kDirty) != 0;
  }

  // ---- partition: shares of n / W, the first n % W workers one more ----
  std::vector<uint64_t> room(W);
  for (int32_t w = 0; w < W; ++w) room[w] = n_examples / W + (static_cast<uint64_t>(w) < n_examples % W ? 1 : 0);
  plan.assignment.resize(n_examples);
  if (options_.location_aware) {
    std::vector<uint64_t> placed = latest;  // the snapshot, plus the keys of examples placed so far
    std::vector<uint32_t> score(W);
    // Examples with the most cached keys choose first (their best score on the
    // snapshot, ties in batch order): they have the most to lose to a full worker.
    std::vector<std::pair<uint32_t, uint64_t>> order(n_examples);  // (-best, i) as (kMax - best, i)
    for (uint64_t i = 0; i < n_examples; ++i) {
      std::fill(score.begin(), score.end(), 0);
      for (uint64_t j = offsets[i]; j < offsets[i + 1]; ++j) {
        for (uint64_t m = latest[inverse[j]]; m != 0; m &= m - 1) ++score[std::countr_zero(m)];
      }
      order[i] = {UINT32_MAX - *std::max_element(score.begin(), score.end()), i};
    }
    std::sort(order.begin(), order.end());
    for (const auto& [unused, i] : order) {
      std::fill(score.begin(), score.end(), 0);
      for (uint64_t j = offsets[i]; j < offsets[i + 1]; ++j) {
        for (uint64_t m = placed[inverse[j]]; m != 0; m &= m - 1) ++score[std::countr_zero(m)];
      }
      int32_t best = -1;
      for (int32_t w = 0; w < W; ++w) {
        if (room[w] != 0 && (best < 0 || score[w] > score[best])) best = w;
      }
      plan.assignment[i] = best;
      --room[best];
      for (uint64_t j = offsets[i]; j < offsets[i + 1]; ++j) placed[inverse[j]] |= uint64_t{1} << best;
    }
  } else {
    int32_t w = 0;
    for (uint64_t i = 0; i < n_examples; ++i) {
      while (room[w] == 0) ++w;
      plan.assignment[i] = w;
      --room[w];
    }
  }
  for (uint64_t i = 0; i < n_examples; ++i) {
    const uint64_t bit = uint64_t{1} << plan.assignment[i];
    for (uint64_t j = offsets[i]; j < offsets[i + 1]; ++j) need[inverse[j]] |= bit;
  }

  // ---- fetches, comm plans and counts ----
  auto source_of = [&](uint64_t u) -> int32_t {
    return latest[u] != 0 && dirty[u] ? std::countr_zero(latest[u]) : -1;
  };
  plan.fetch_offsets.assign(W + 1, 0);
  plan.comm_offsets.assign(W + 1, 0);
  for (uint64_t u = 0; u < U; ++u) {
    const uint64_t lacking = need[u] & ~latest[u];
    for (uint64_t m = lacking; m != 0; m &= m - 1) ++plan.fetch_offsets[std::countr_zero(m) + 1];
    const int32_t from = source_of(u);
    if (lacking != 0 && from >= 0) ++plan.comm_offsets[from + 1];
    plan.pulls += std::popcount(lacking);
    if (from >= 0) plan.peer_pulls += std::popcount(lacking);
    if (options_.on_demand ? (lacking != 0 && from >= 0) : true) ++plan.pushes;
    plan.shared += std::popcount(need[u]) - 1;  // every batch key is needed by someone
  }
  for (int32_t w = 0; w < W; ++w) {
    plan.fetch_offsets[w + 1] += plan.fetch_offsets[w];
    plan.comm_offsets[w + 1] += plan.comm_offsets[w];
  }
  plan.fetch_keys.resize(plan.fetch_offsets[W]);
  plan.fetch_from.resize(plan.fetch_offsets[W]);
  plan.comm_keys.resize(plan.comm_offsets[W]);
  {
    std::vector<uint64_t> fetch_at(plan.fetch_offsets.begin(), plan.fetch_offsets.end() - 1);
    std::vector<uint64_t> comm_at(plan.comm_offsets.begin(), plan.comm_offsets.end() - 1);
    for (uint64_t u = 0; u < U; ++u) {
      const uint64_t lacking = need[u] & ~latest[u];
      if (lacking == 0) continue;
      const int32_t from = source_of(u);
      for (uint64_t m = lacking; m != 0; m &= m - 1) {
        const uint64_t at = fetch_at[std::countr_zero(m)]++;
        plan.fetch_keys[at] = uniq[u];
        plan.fetch_from[at] = from;
      }
      if (from >= 0) plan.comm_keys[comm_at[from]++] = uniq[u];
    }
  }

  // ---- the snapshot: the trainers hold the latest version, other copies go ----
  const uint32_t tick = static_cast<uint32_t>(batches_ & 0x7fffffffu);
  for (uint64_t u = 0; u < U; ++u) {
    if (u + kAhead < U) {  // the slots were touched long ago: fetch them again ahead of use
      __builtin_prefetch(&t.masks[slot[u + kAhead]], 1);
      __builtin_prefetch(&t.meta[slot[u + kAhead]], 1);
    }
    const uint64_t s = slot[u];
    const uint64_t old = t.masks[s];
    for (uint64_t m = need[u] & ~old; m != 0; m &= m - 1) ++held_[std::countr_zero(m)];
    for (uint64_t m = old & ~need[u]; m != 0; m &= m - 1) --held_[std::countr_zero(m)];
    t.masks[s] = need[u];
    t.meta[s] = tick | (options_.on_demand ? Table::kDirty : 0);
  }
  ++batches_;

  // ---- recency: each worker's keys of this batch join its queue as one group ----
  if (options_.capacity > 0) {
    for (int32_t w = 0; w < W; ++w) recency_[w].push_back({tick, {}});
    for (uint64_t u = 0; u < U; ++u) {
      for (uint64_t m = need[u]; m != 0; m &= m - 1) recency_[std::countr_zero(m)].back().keys.push_back(uniq[u]);
    }
    for (int32_t w = 0; w < W; ++w) {
      queued_[w] += recency_[w].back().keys.size();
      if (recency_[w].back().keys.empty()) recency_[w].pop_back();
    }
  }

  // ---- eviction: a cache above capacity drops its least recently used keys ----
  if (options_.capacity > 0) {
    std::vector<uint64_t> emptied;
    for (int32_t w = 0; w < W; ++w) {
      if (held_[w] > options_.capacity) Evict(w, held_[w] - options_.capacity, plan.evicted, emptied);
      // Stale entries (keys trained again later, or dropped) are skipped when
      // reached; drop them all once they outnumber the live ones.
      if (queued_[w] > 2 * held_[w] + 1024) CompactRecency(w);
    }
    for (uint64_t key : emptied) {
      const uint64_t s = t.Find(key);
      if (t.meta[s] & Table::kDirty) {
        ++plan.pushes;
        ++plan.evict_pushes;
      }
      t.Erase(key);
    }
    std::sort(plan.evicted.begin(), plan.evicted.end());
    plan.evicted.erase(std::unique(plan.evicted.begin(), plan.evicted.end()), plan.evicted.end());
  }
  return plan;
}

bool Herald::Holds(int32_t worker, uint32_t tick, uint64_t key) const {
  const Table& t = *table_;
  const uint64_t s = t.Find(key);
  return s != Table::kNone && ((t.masks[s] >> worker) & 1) && (t.meta[s] & ~Table::kDirty) == tick;
}

// Worker w drops its `drop` least recently used keys. Its queue holds a group
// per batch it trained in, oldest first; a group's live entries (keys w still
// holds from that batch) are older than every later group's. Whole groups go
// in any order (the evicted list is sorted after); only the group the count
// ends in needs its lowest keys picked.
void Herald::Evict(int32_t w, uint64_t drop, std::vector<uint64_t>& evicted, std::vector<uint64_t>& emptied) {
  Table& t = *table_;
  auto& queue = recency_[w];
  const uint64_t bit = uint64_t{1} << w;
  held_[w] -= drop;
  while (drop > 0) {
    RecencyGroup& g = queue.front();  // held_ counts live entries: the queue cannot run dry first
    const uint64_t before = g.keys.size();
    LiveOnly(w, g);
    queued_[w] -= before - g.keys.size();
    const uint64_t take = std::min<uint64_t>(drop, g.keys.size());
    const auto end = g.keys.begin() + static_cast<int64_t>(take);
    if (take < g.keys.size()) std::nth_element(g.keys.begin(), end, g.keys.end());
    for (auto it = g.keys.begin(); it != end; ++it) {
      const uint64_t s = t.Find(*it);
      t.masks[s] &= ~bit;
      evicted.push_back(*it);
      if (t.masks[s] == 0) emptied.push_back(*it);
    }
    g.keys.erase(g.keys.begin(), end);
    drop -= take;
    queued_[w] -= take;
    if (g.keys.empty()) queue.pop_front();
  }
}

// Keeps the entries of g that worker w still holds from g's batch.
void Herald::LiveOnly(int32_t w, RecencyGroup& g) const {
  constexpr size_t kAhead = 8;  // the table is far larger than the caches: fetch the probes early
  const size_t n = g.keys.size();
  for (size_t i = 0; i < std::min(n, kAhead); ++i) table_->Prefetch(g.keys[i]);
  size_t kept = 0;
  for (size_t i = 0; i < n; ++i) {
    if (i + kAhead < n) table_->Prefetch(g.keys[i + kAhead]);
    if (Holds(w, g.tick, g.keys[i])) g.keys[kept++] = g.keys[i];
  }
  g.keys.resize(kept);
  // A group keeps its old keys' room otherwise: cold keys trickling through a
  // cache leave many groups of a few live keys each.
  if (g.keys.capacity() > 2 * kept + 8) g.keys.shrink_to_fit();
}

void Herald::CompactRecency(int32_t w) {
  auto& queue = recency_[w];
  std::deque<RecencyGroup> live;
  uint64_t queued = 0;
  for (RecencyGroup& g : queue) {
    LiveOnly(w, g);
    if (g.keys.empty()) continue;
    queued += g.keys.size();
    live.push_back(std::move(g));
  }
  queue = std::move(live);
  queued_[w] = queued;
}

std::vector<uint64_t> Herald::Cached(int32_t worker) const {
  if (worker < 0 || worker >= options_.workers) {
    throw std::out_of_range("Herald::Cached: worker " + std::to_string(worker) + " is outside [0, " +
                            std::to_string(options_.workers) + ")");
  }
  std::vector<uint64_t> out;
  const Table& t = *table_;
  for (uint64_t s = 0; s <= t.mask; ++s) {
    if (t.keys[s] != kEmptyKey && ((t.masks[s] >> worker) & 1)) out.push_back(t.keys[s]);
  }
  std::sort(out.begin(), out.end());
  return out;
}

uint64_t Herald::cached(int32_t worker) const {
  if (worker < 0 || worker >= options_.workers) {
    throw std::out_of_range("Herald::cached: worker " + std::to_string(worker) + " is outside [0, " +
                            std::to_string(options_.workers) + ")");
  }
  return held_[worker];
}

uint64_t Herald::memory_bytes() const {
  const Table& t = *table_;
  uint64_t bytes = (t.mask + 1) * (2 * sizeof(uint64_t) + sizeof(uint32_t));
  for (const auto& queue : recency_) {
    for (const RecencyGroup& g : queue) bytes += sizeof(RecencyGroup) + g.keys.capacity() * sizeof(uint64_t);
  }
  return bytes;
}

void Herald::Clear() {
  table_->Allocate(64);
  std::fill(held_.begin(), held_.end(), 0);
  for (auto& queue : recency_) queue.clear();
  std::fill(queued_.begin(), queued_.end(), 0);
}

}  // namespace hps
