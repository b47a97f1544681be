// The Herald scheduler declared in include/hps/herald.h.
#include "hps/herald.h"

#include <algorithm>
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

  // ---- eviction: a cache above capacity drops its least recently used keys ----
  if (options_.capacity > 0) {
    std::vector<int32_t> over, slot_of(W, -1);
    uint64_t over_mask = 0;
    for (int32_t w = 0; w < W; ++w) {
      if (held_[w] > options_.capacity) {
        slot_of[w] = static_cast<int32_t>(over.size());
        over.push_back(w);
        over_mask |= uint64_t{1} << w;
      }
    }
    if (!over.empty()) {
      std::vector<std::vector<std::pair<uint32_t, uint64_t>>> held_by(over.size());  // (tick, key)
      for (size_t o = 0; o < over.size(); ++o) held_by[o].reserve(held_[over[o]]);
      for (uint64_t s = 0; s <= t.mask; ++s) {
        // empty slots have mask 0 (Allocate, Erase's shift leaves none behind with bits)
        for (uint64_t m = t.masks[s] & over_mask; m != 0; m &= m - 1) {
          held_by[slot_of[std::countr_zero(m)]].emplace_back(t.meta[s] & ~Table::kDirty, t.keys[s]);
        }
      }
      std::vector<uint64_t> emptied;
      for (size_t o = 0; o < over.size(); ++o) {
        auto& v = held_by[o];
        const uint64_t drop = held_[over[o]] - options_.capacity;
        std::nth_element(v.begin(), v.begin() + static_cast<int64_t>(drop), v.end());
        for (uint64_t d = 0; d < drop; ++d) {
          const uint64_t s = t.Find(v[d].second);
          t.masks[s] &= ~(uint64_t{1} << over[o]);
          plan.evicted.push_back(v[d].second);
          if (t.masks[s] == 0) emptied.push_back(v[d].second);
        }
        held_[over[o]] = options_.capacity;
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
  }
  return plan;
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
  return (t.mask + 1) * (2 * sizeof(uint64_t) + sizeof(uint32_t));
}

void Herald::Clear() {
  table_->Allocate(64);
  std::fill(held_.begin(), held_.end(), 0);
}

}  // namespace hps
