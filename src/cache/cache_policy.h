// Replacement policies of MEM-PS over the slots of one cache shard
// (include/hps/mem_cache.h describes them). A policy orders the unpinned,
// cached slots; the cache tells it what happens and asks it for a victim.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "hps/mem_cache.h"

namespace hps::detail {

inline constexpr uint32_t kNoSlot = UINT32_MAX;

class CachePolicy {
 public:
  virtual ~CachePolicy() = default;
  // A hint: key will be Recorded soon.
  virtual void Prefetch(uint64_t /*key*/) const {}
  // A hint: slot, which holds key, will be detached, reattached or touched
  // soon. The cache's pin and unpin passes go over a batch's rows at random
  // slots, and without it each visit waited on the policy's per-slot state.
  virtual void PrefetchVisit(uint32_t /*slot*/, uint64_t /*key*/) const {}
  // Every access to key, hit or miss, before anything else happens to it.
  virtual void Record(uint64_t /*key*/) {}
  // A row enters the eviction order for the first time. Add and Reattach
  // never allocate or throw: MEM-PS calls them midway through a release
  // (and through undoing a failed call), which must not stop there.
  virtual void Add(uint32_t slot, uint64_t key) = 0;
  // An ordered (unpinned) row is visited.
  virtual void Touch(uint32_t slot) = 0;
  // The row is pinned: out of the order until Reattach.
  virtual void Detach(uint32_t slot) = 0;
  // The row is unpinned again; counts as a visit.
  virtual void Reattach(uint32_t slot) = 0;
  // Takes a row out of the order and returns its slot to reuse, or kNoSlot
  // when no row is ordered (all pinned).
  virtual uint32_t Evict() = 0;
  // Lookahead eviction (MemCache::SetLookahead): the ordered slots in the
  // order Evict would take them, Evict's victim first, changing no row's place
  // (a policy that defers its order builds it first):
  // visit(slot) for each until it returns false or `limit` were visited.
  // The order after the first is each policy's own notion of "next coldest"
  // (see the classes); a caller that takes another slot than the first does
  // so with Detach, and gives the policy no visit.
  virtual void ForEachCandidate(uint32_t limit, const std::function<bool(uint32_t)>& visit) = 0;
  // The row, one ForEachCandidate named, was passed over because the
  // lookahead window needs it: it goes behind the rows of its rank (as recent
  // as a visit would make it, the rows it passes keeping their order) without
  // counting a visit, so that the next eviction's walk does not meet it
  // first again. Never allocates.
  virtual void Defer(uint32_t slot) = 0;
  // ForEachCandidate for a lookahead eviction's walk, whose visitor returns
  // true for each row it passes over, and gives each row the same answer
  // while `epoch` stays the same (0: no such promise). A policy whose order
  // comes in runs (lists that Defer only rotates: lfu's and lru+lfu's rows of
  // one count and lru+lfu's LRU, w-tinylfu's segments, tinylfu-lfu's rows of
  // one estimate) may skip, unvisited, a run whose rows a walk of the same
  // epoch all passed over, if no row has entered it since and the limit left
  // holds all its rows: each would be passed again. (In
  // bench/parameter_server_bench.py --lookahead at K = 16, 29M of tinylfu-lfu's
  // walks' 30M visits were of such runs, walked again eviction after
  // eviction; lfu, lru+lfu and w-tinylfu walked theirs the same way, 189 to
  // 647 rows an eviction at K = 32 on a trace of that shape, until they
  // skipped them too.)
  struct Walk {
    uint32_t skipped = 0;  // rows skipped so: counted against the limit, never visited
    // The first `whole` rows visited are whole runs passed over, which Defer
    // only rotates: Deferring them, in the order visited (all but one that
    // the caller then Detaches), would leave the order as it is, so the
    // caller need not.
    uint32_t whole = 0;
  };
  virtual Walk WalkCandidates(uint32_t limit, uint64_t /*epoch*/, const std::function<bool(uint32_t)>& visit) {
    ForEachCandidate(limit, visit);
    return {};
  }
};

// A policy for `capacity` slots.
std::unique_ptr<CachePolicy> NewCachePolicy(CachePolicyKind kind, uint32_t capacity, double lru_fraction);

}  // namespace hps::detail
