// MEM-PS under the sanitizers: every policy through evictions, pins and the
// sink; several threads pulling at once (run under TSan).
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <functional>
#include <map>
#include <mutex>
#include <new>  // std::bad_alloc
#include <random>
#include <stdexcept>
#include <thread>
#include <vector>

#include "cache/cache_policy.h"
#include "hps/keys.h"  // kEmptyKey
#include "hps/mem_cache.h"
#include "failing_allocations.h"

namespace hps {
namespace {

using test_support::fail_in;

// The slots a policy's walk names, in its order (at most `limit`).
std::vector<uint32_t> CandidateOrder(detail::CachePolicy& policy, uint32_t limit = UINT32_MAX) {
  std::vector<uint32_t> order;
  policy.ForEachCandidate(limit, [&](uint32_t slot) {
    order.push_back(slot);
    return true;
  });
  return order;
}

// SSD-PS stand-in: rows are one uint64; an absent key's row is key * 1000.
// before_load (optional) runs at the start of each load; while sink_down,
// the sink throws without storing anything. loads and sunk count the rows
// asked for and stored (a row stored twice counts twice).
struct Backing {
  std::mutex mutex;
  std::map<uint64_t, uint64_t> rows;
  std::function<void()> before_load;
  bool sink_down = false;
  uint64_t loads = 0, sunk = 0;

  RowLoader Loader() {
    return [this](const uint64_t* keys, uint64_t n, uint8_t* out, uint8_t* dirty) {
      if (before_load) before_load();
      std::lock_guard lock(mutex);
      loads += n;
      for (uint64_t i = 0; i < n; ++i) {
        const auto it = rows.find(keys[i]);
        const uint64_t v = it == rows.end() ? keys[i] * 1000 : it->second;
        std::memcpy(out + i * 8, &v, 8);
        dirty[i] = it == rows.end();
      }
    };
  }
  RowSink Sink() {
    return [this](const uint64_t* keys, uint64_t n, const uint8_t* in) {
      std::lock_guard lock(mutex);
      if (sink_down) throw std::runtime_error("sink down");
      sunk += n;
      for (uint64_t i = 0; i < n; ++i) std::memcpy(&rows[keys[i]], in + i * 8, 8);
    };
  }
};

// The distinct keys among `draws` draws from [0, universe): a batch in the tests.
std::vector<uint64_t> DistinctDraws(std::mt19937_64& rng, int draws, uint64_t universe) {
  std::vector<uint64_t> keys;
  for (int j = 0; j < draws; ++j) {
    const uint64_t k = rng() % universe;
    if (std::find(keys.begin(), keys.end(), k) == keys.end()) keys.push_back(k);
  }
  return keys;
}

// Options of a cache of 8-byte rows (the tests' rows: a key or a count).
MemCacheOptions EightByteRows(uint64_t capacity, uint32_t shards, CachePolicyKind policy) {
  MemCacheOptions o;
  o.row_bytes = 8;
  o.capacity = capacity;
  o.shards = shards;
  o.policy = policy;
  // The window's memory unbounded: these tests are of its evictions
  // (MemCacheLookaheadRoom is of its memory).
  o.lookahead_room = MemCache::kUnboundedRoom;
  return o;
}

// A cache of 8-byte rows over `backing` (its loader and sink).
std::unique_ptr<MemCache> BackedCache(Backing& backing, const std::string& policy, uint64_t capacity,
                                      uint32_t shards = 0) {
  const MemCacheOptions o = EightByteRows(capacity, shards, ParseCachePolicy(policy));
  return MemCache::New(o, backing.Loader(), backing.Sink());
}

// Pulls `keys` pinned and checks each row against `model` (absent: the backing's
// key * 1000); returns the rows plus one, recorded in `model`: what a test writes back.
std::vector<uint64_t> PullCheckedPlusOne(MemCache& cache, const std::vector<uint64_t>& keys,
                                         std::map<uint64_t, uint64_t>& model, size_t step) {
  std::vector<uint64_t> rows(keys.size());
  cache.Pull(keys.data(), keys.size(), reinterpret_cast<uint8_t*>(rows.data()), true, nullptr);
  for (size_t i = 0; i < keys.size(); ++i) {
    const auto it = model.find(keys[i]);
    EXPECT_EQ(rows[i], it == model.end() ? keys[i] * 1000 : it->second) << "step " << step << ", key " << keys[i];
    rows[i] += 1;
    model[keys[i]] = rows[i];
  }
  return rows;
}

class MemCachePolicies : public ::testing::TestWithParam<std::string> {};

TEST_P(MemCachePolicies, WriteBacksSurviveEvictionAndFlush) {
  Backing backing;
  auto cache = BackedCache(backing, GetParam(), 64);
  std::map<uint64_t, uint64_t> model;
  std::mt19937_64 rng(7);
  for (int step = 0; step < 500; ++step) {
    const std::vector<uint64_t> keys = DistinctDraws(rng, 20, 500);
    std::vector<uint64_t> rows = PullCheckedPlusOne(*cache, keys, model, step);
    ASSERT_FALSE(HasFailure());
    cache->WriteBack(keys.data(), keys.size(), reinterpret_cast<const uint8_t*>(rows.data()));
  }
  const MemCacheStats st = cache->stats();
  EXPECT_EQ(st.pinned, 0u);
  EXPECT_GT(st.dirty_evictions, 0u);
  cache->FlushDirty();
  for (const auto& [k, v] : model) ASSERT_EQ(backing.rows.at(k), v) << k;
}

// Erase drops clean and dirty rows without the sink (the next Pull loads the
// key anew), keeps pinned ones dirty, and leaves the policy able to reuse
// the freed slots: the model stays right through later evictions.
TEST_P(MemCachePolicies, EraseDropsRowsWithoutTheSinkAndKeepsPinnedOnes) {
  Backing backing;
  auto cache = BackedCache(backing, GetParam(), 64);
  std::map<uint64_t, uint64_t> model;  // what a Pull must return; absent: key * 1000
  std::mt19937_64 rng(11);
  for (int step = 0; step < 300; ++step) {
    std::vector<uint64_t> keys = DistinctDraws(rng, 10, 200);
    for (uint64_t& k : keys) k += 1;  // keys 1..200
    std::vector<uint64_t> rows = PullCheckedPlusOne(*cache, keys, model, step);
    ASSERT_FALSE(HasFailure());
    // Erase a few keys while this batch is pinned: its own keys stay (and
    // are written back), the others leave MEM-PS and, as SSD-PS's Bound
    // would, the backing store.
    std::vector<uint64_t> erase;
    for (int j = 0; j < 5; ++j) erase.push_back(1 + rng() % 200);
    if (step % 50 == 0) erase.push_back(keys[0]);  // pinned: kept
    {
      std::lock_guard lock(backing.mutex);
      for (uint64_t k : erase) {
        if (std::find(keys.begin(), keys.end(), k) != keys.end()) continue;
        backing.rows.erase(k);
        model.erase(k);
      }
    }
    const uint64_t before = cache->stats().size;
    const uint64_t dropped = cache->Erase(erase.data(), erase.size());
    EXPECT_EQ(cache->stats().size, before - dropped);
    for (uint64_t k : erase) {
      const bool pinned = std::find(keys.begin(), keys.end(), k) != keys.end();
      EXPECT_EQ(cache->Contains(k), pinned) << "key " << k << " step " << step;
    }
    cache->WriteBack(keys.data(), keys.size(), reinterpret_cast<const uint8_t*>(rows.data()));
  }
  cache->FlushDirty();
  for (const auto& [k, v] : model) {
    const auto it = backing.rows.find(k);
    const uint64_t stored = it == backing.rows.end() ? k * 1000 : it->second;
    if (cache->Contains(k)) continue;  // clean in MEM-PS, equal to what was flushed
    ASSERT_EQ(stored, v) << k;
  }
  // Every key reads as the model has it.
  for (uint64_t k = 1; k <= 200; ++k) {
    uint64_t row = 0;
    cache->Pull(&k, 1, reinterpret_cast<uint8_t*>(&row), false, nullptr);
    const auto it = model.find(k);
    ASSERT_EQ(row, it == model.end() ? k * 1000 : it->second) << k;
  }
}

INSTANTIATE_TEST_SUITE_P(All, MemCachePolicies, ::testing::Values("lru", "lfu", "lru+lfu", "w-tinylfu", "tinylfu-lfu"));

// One shard of 4 LRU rows holding dirty rows 1..4 (1 the least recent).
std::unique_ptr<MemCache> FourDirtyRows(Backing& backing) {
  const MemCacheOptions o = EightByteRows(4, 1, CachePolicyKind::kLru);
  auto cache = MemCache::New(o, backing.Loader(), backing.Sink());
  for (uint64_t k = 1; k <= 4; ++k) {
    cache->Pull(&k, 1, nullptr, /*pin=*/true, nullptr);
    const uint64_t v = k * 10 + 1;
    cache->WriteBack(&k, 1, reinterpret_cast<const uint8_t*>(&v));
  }
  return cache;
}

// The loader runs with no shard lock: meanwhile other callers pin rows, and
// the slots a Pull counted before loading are gone when it takes them. Its
// first victim (dirty) must not vanish with the CacheFullError, and the rows
// it placed must not stay pinned.
TEST(MemCache, APrefaultedArenaCachesAsAnotherDoes) {
  // Writing every page at construction changes where the first touch is paid,
  // not what the cache holds.
  std::vector<std::vector<uint8_t>> got;
  for (bool prefault : {false, true}) {
    MemCacheOptions o;
    o.row_bytes = 8;
    o.capacity = 1000;
    o.prefault = prefault;
    auto cache = MemCache::New(o, [](const uint64_t* keys, uint64_t n, uint8_t* rows, uint8_t*) {
      for (uint64_t i = 0; i < n; ++i) std::memcpy(rows + 8 * i, &keys[i], 8);
    }, nullptr);
    std::vector<uint64_t> keys(1500);
    for (size_t i = 0; i < keys.size(); ++i) keys[i] = 1 + (i * 7919) % 1200;
    std::vector<uint8_t> out(keys.size() * 8);
    cache->Pull(keys.data(), keys.size(), out.data(), false, nullptr);
    for (size_t i = 0; i < keys.size(); ++i) {
      uint64_t v;
      std::memcpy(&v, out.data() + 8 * i, 8);
      ASSERT_EQ(v, keys[i]) << "prefault " << prefault << " at " << i;
    }
    got.push_back(out);
    EXPECT_EQ(cache->stats().size, 1000u);
  }
  EXPECT_EQ(got[0], got[1]);
}

TEST(MemCache, WriteBackAndReadPinnedByAddressAsByKey) {
  Backing backing;
  MemCacheOptions o;
  o.row_bytes = 8;
  o.capacity = 64;
  auto cache = MemCache::New(o, backing.Loader(), backing.Sink());
  std::vector<uint64_t> keys = {3, 4, 5};
  std::vector<uint8_t> hit(3);
  std::vector<uint8_t*> at(3);
  ASSERT_EQ(cache->Pin(keys.data(), 3, hit.data(), at.data()), 0u);
  std::vector<uint8_t> read(3 * 8);
  cache->ReadPinned(keys.data(), 3, read.data(), at.data());
  uint64_t v;
  std::memcpy(&v, read.data() + 8, 8);
  EXPECT_EQ(v, 4000u);  // the loader's row of key 4
  cache->FlushDirty();   // clean: only WriteBack's marks make them go to the sink again
  EXPECT_EQ(backing.rows.at(3), 3000u);

  // Another key's address is refused, naming the key, and nothing changes.
  std::vector<uint8_t*> swapped = {at[1], at[0]};
  const uint64_t rows[2] = {7, 8};
  try {
    cache->WriteBack(keys.data(), 2, reinterpret_cast<const uint8_t*>(rows), swapped.data());
    ADD_FAILURE() << "a row address of another key must be refused";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("3"), std::string::npos) << e.what();
  }
  EXPECT_THROW(cache->ReadPinned(keys.data(), 2, read.data(), swapped.data()), std::invalid_argument);
  EXPECT_EQ(cache->stats().pinned, 3u);

  // By address: keys 3 and 4 take the rows and are unpinned dirty; 5 stays pinned.
  cache->WriteBack(keys.data(), 2, reinterpret_cast<const uint8_t*>(rows), at.data());
  EXPECT_EQ(cache->stats().pinned, 1u);
  std::vector<uint8_t> out(2 * 8);
  cache->Pull(keys.data(), 2, out.data(), false, nullptr);
  EXPECT_EQ(std::memcmp(out.data(), rows, 16), 0);
  cache->FlushDirty();
  EXPECT_EQ(backing.rows.at(3), 7u);
  EXPECT_EQ(backing.rows.at(4), 8u);
  EXPECT_THROW(cache->WriteBack(keys.data(), 1, reinterpret_cast<const uint8_t*>(rows), at.data()),
               std::invalid_argument);  // no longer pinned
}

// A key may miss several times in one call (a batch's examples repeat keys):
// one load serves every occurrence, each gets its row and the same slot, and
// the row is pinned once per occurrence.
TEST(MemCache, RepeatedMissesAreLoadedOnceAndPinnedPerOccurrence) {
  Backing backing;
  std::vector<std::vector<uint64_t>> loads;
  MemCacheOptions o;
  o.row_bytes = 8;
  o.capacity = 64;
  o.shards = 4;
  auto loader = backing.Loader();
  auto cache = MemCache::New(
      o,
      [&](const uint64_t* keys, uint64_t n, uint8_t* out, uint8_t* dirty) {
        loads.emplace_back(keys, keys + n);
        loader(keys, n, out, dirty);
      },
      backing.Sink());
  const uint64_t cached = 1;
  cache->Pull(&cached, 1, nullptr, /*pin=*/false, nullptr);
  loads.clear();

  const std::vector<uint64_t> keys = {7, 3, 7, 9, 3, 7, 1};
  std::vector<uint64_t> rows(keys.size());
  std::vector<uint8_t> hit(keys.size());
  EXPECT_EQ(cache->Pull(keys.data(), keys.size(), reinterpret_cast<uint8_t*>(rows.data()), /*pin=*/true,
                        hit.data()),
            1u);
  for (size_t i = 0; i < keys.size(); ++i) {
    EXPECT_EQ(rows[i], keys[i] * 1000) << "occurrence " << i;
    EXPECT_EQ(hit[i], keys[i] == cached ? 1 : 0) << "occurrence " << i;
  }
  ASSERT_EQ(loads.size(), 1u);
  std::sort(loads[0].begin(), loads[0].end());
  EXPECT_EQ(loads[0], (std::vector<uint64_t>{3, 7, 9}));  // each missing key once
  EXPECT_EQ(cache->stats().misses, 1u + 6u);            // the first Pull's miss, then one per occurrence

  std::vector<uint8_t*> at(keys.size());
  cache->Pin(keys.data(), keys.size(), nullptr, at.data());  // all hits now, pinned again
  EXPECT_EQ(at[0], at[2]);
  EXPECT_EQ(at[0], at[5]);
  EXPECT_EQ(at[1], at[4]);
  EXPECT_NE(at[0], at[1]);
  cache->Unpin(keys.data(), keys.size());
  EXPECT_EQ(cache->stats().pinned, 4u);  // the first Pull's pins: 7 three times, 3 twice
  const std::vector<uint64_t> most = {7, 3, 9, 1, 7};
  cache->Unpin(most.data(), most.size());
  EXPECT_EQ(cache->stats().pinned, 2u);  // 7 and 3, once each
  const std::vector<uint64_t> rest = {7, 3};
  cache->Unpin(rest.data(), rest.size());
  EXPECT_EQ(cache->stats().pinned, 0u);
  EXPECT_THROW(cache->Unpin(rest.data(), 1), std::invalid_argument);  // no pin left
}

// A release that names a key more often than it is pinned passes the check
// (each occurrence finds a pin) and finds the key unpinned at its last
// occurrence: the same state as a key that a concurrent caller unpinned
// between the check and the change (a broken pin contract), reached without
// threads. That occurrence's update is kept, not dropped, and BrokenPinError
// names it once the others are released.
TEST(MemCache, ReleaseOfAKeyUnpinnedPastTheCheckKeepsItsUpdateAndNamesIt) {
  Backing backing;
  auto cache = BackedCache(backing, "lru", 64, 4);
  const uint64_t key = 5;
  const std::vector<uint64_t> twice = {key, key};
  const auto pin_once_clean = [&] {
    cache->Pull(&key, 1, nullptr, /*pin=*/true, nullptr);
    cache->FlushDirty();  // the loader's row of a new key is dirty: stored now, so that only a release dirties it
    ASSERT_EQ(cache->stats().dirty, 0u);
    ASSERT_EQ(cache->stats().pinned, 1u);
  };
  const auto expect_names_second = [&](const BrokenPinError& e) {
    EXPECT_EQ(e.unpinned(), std::vector<uint64_t>{1});
    EXPECT_TRUE(e.lost().empty());
    EXPECT_NE(std::string(e.what()).find("keys[1] = 5"), std::string::npos) << e.what();
  };

  // WriteBack: the second occurrence's row, the last one written, is the one kept.
  pin_once_clean();
  const uint64_t rows[2] = {7, 8};
  try {
    cache->WriteBack(twice.data(), 2, reinterpret_cast<const uint8_t*>(rows));
    ADD_FAILURE() << "a write-back that found its key unpinned must say so";
  } catch (const BrokenPinError& e) {
    expect_names_second(e);
  }
  EXPECT_EQ(cache->stats().pinned, 0u);
  EXPECT_EQ(cache->stats().dirty, 1u);
  uint64_t row = 0;
  cache->Pull(&key, 1, reinterpret_cast<uint8_t*>(&row), /*pin=*/false, nullptr);
  EXPECT_EQ(row, 8u);
  cache->FlushDirty();
  EXPECT_EQ(backing.rows.at(key), 8u);

  // UnpinUpdated: the step of the occurrence found unpinned is marked.
  pin_once_clean();
  std::vector<uint8_t*> at(2);
  cache->PinnedRows(&key, 1, at.data());
  at[1] = at[0];
  const std::vector<uint8_t> updated = {0, 1};
  try {
    cache->UnpinUpdated(twice.data(), 2, updated.data(), at.data());
    ADD_FAILURE() << "an unpin that found its key unpinned must say so";
  } catch (const BrokenPinError& e) {
    expect_names_second(e);
  }
  EXPECT_EQ(cache->stats().pinned, 0u);
  EXPECT_EQ(cache->stats().dirty, 1u);

  // Unpin: named too; nothing to keep.
  pin_once_clean();
  try {
    cache->Unpin(twice.data(), 2);
    ADD_FAILURE() << "an unpin that found its key unpinned must say so";
  } catch (const BrokenPinError& e) {
    expect_names_second(e);
  }
  EXPECT_EQ(cache->stats().pinned, 0u);
  EXPECT_EQ(cache->stats().dirty, 0u);
}

// A release that runs out of memory changes nothing, or it finishes: one
// that stopped midway, some keys unpinned and others not, would be retried
// by its batch (bad_alloc says nothing was released), and the retry would
// unpin the next batch's pins on the keys released the first time. Every
// allocation of the call is failed in turn, until one attempt passes. The
// rows come clean, two Pulls of half the keys each, so that the release
// marks more rows dirty than any earlier call did (dirty_slots' growth).
// Each release runs twice: its first unpins Add the rows to the policy's
// order (inserted pinned), its second Reattach them.
TEST_P(MemCachePolicies, AReleaseThatRunsOutOfMemoryChangesNothingOrFinishes) {
  constexpr uint64_t kKeys = 512;
  for (const bool write_back : {true, false}) {
    SCOPED_TRACE(write_back ? "WriteBack" : "UnpinUpdated");
    Backing backing;
    std::vector<uint64_t> keys(kKeys);
    for (uint64_t i = 0; i < kKeys; ++i) {
      keys[i] = i + 1;
      backing.rows[keys[i]] = keys[i];  // stored already: loaded clean
    }
    auto cache = BackedCache(backing, GetParam(), 2 * kKeys, 2);
    for (int round = 0; round < 2; ++round) {
      SCOPED_TRACE(round);
      cache->Pull(keys.data(), kKeys / 2, nullptr, /*pin=*/true, nullptr);
      cache->Pull(keys.data() + kKeys / 2, kKeys / 2, nullptr, /*pin=*/true, nullptr);
      cache->FlushDirty();
      ASSERT_EQ(cache->stats().dirty, 0u);
      std::vector<uint64_t> before(kKeys);
      cache->ReadPinned(keys.data(), kKeys, reinterpret_cast<uint8_t*>(before.data()));
      std::vector<uint64_t> rows(kKeys);
      for (uint64_t i = 0; i < kKeys; ++i) rows[i] = before[i] + 1;
      const std::vector<uint8_t> updated(kKeys, 1);
      std::vector<uint8_t*> at(kKeys);
      cache->PinnedRows(keys.data(), kKeys, at.data());
      if (!write_back) std::memcpy(at[0], &rows[0], 8);  // a step in place (the others' rows stay)
      uint64_t failures = 0;
      for (uint64_t k = 1;; ++k) {
        bool failed = false;
        fail_in = k;
        try {
          if (write_back) {
            cache->WriteBack(keys.data(), kKeys, reinterpret_cast<const uint8_t*>(rows.data()), at.data());
          } else {
            cache->UnpinUpdated(keys.data(), kKeys, updated.data(), at.data());
          }
        } catch (const std::bad_alloc&) {
          failed = true;
        }
        fail_in = 0;
        if (!failed) break;
        ++failures;
        SCOPED_TRACE(testing::Message() << "allocation " << k);
        const MemCacheStats st = cache->stats();
        ASSERT_EQ(st.pinned, kKeys) << "a failed release unpinned some keys";
        ASSERT_EQ(st.dirty, 0u) << "a failed release marked rows dirty";
        std::vector<uint64_t> now(kKeys);
        cache->ReadPinned(keys.data(), kKeys, reinterpret_cast<uint8_t*>(now.data()));
        if (!write_back) now[0] = before[0];
        ASSERT_EQ(now, before) << "a failed write-back wrote rows";
      }
      EXPECT_GT(failures, 0u);  // the call's own bookkeeping, at least, was failed
      const MemCacheStats st = cache->stats();
      EXPECT_EQ(st.pinned, 0u);
      EXPECT_EQ(st.dirty, kKeys);
      std::vector<uint64_t> now(kKeys);
      cache->Pull(keys.data(), kKeys, reinterpret_cast<uint8_t*>(now.data()), /*pin=*/false, nullptr);
      if (write_back) {
        EXPECT_EQ(now, rows);
      }
    }
  }
}

// The same with a broken pin: the call names its last key twice and it is
// pinned once, so the change pass finds that occurrence unpinned after it
// has released every other key (as one a concurrent caller unpinned). The
// pass records it, and reports it, without failing midway: an attempt that
// runs out of memory changed nothing (bad_alloc: the caller's retry releases
// no key twice), or it released every other key and threw BrokenPinError
// naming the occurrence, having kept its update unless it says it lost it.
TEST(MemCache, AReleaseThatFindsABrokenPinAndRunsOutOfMemoryChangesNothingOrFinishes) {
  constexpr uint64_t kKeys = 256;
  enum Release { kWriteBack, kUnpinUpdated, kUnpin };
  for (const Release release : {kWriteBack, kUnpinUpdated, kUnpin}) {
    SCOPED_TRACE(release == kWriteBack ? "WriteBack" : release == kUnpinUpdated ? "UnpinUpdated" : "Unpin");
    Backing backing;
    std::vector<uint64_t> keys(kKeys);
    for (uint64_t i = 0; i < kKeys; ++i) {
      keys[i] = i + 1;
      backing.rows[keys[i]] = keys[i];  // stored already: loaded clean
    }
    auto cache = BackedCache(backing, "lru", 2 * kKeys, 4);
    std::vector<uint64_t> twice = keys;
    twice.push_back(keys.back());  // the broken occurrence: index kKeys
    std::vector<uint64_t> rows(kKeys + 1);
    for (uint64_t i = 0; i <= kKeys; ++i) rows[i] = 10000 + i;  // the second occurrence's row differs
    const std::vector<uint8_t> updated(kKeys + 1, 1);
    uint64_t failures = 0;
    for (uint64_t k = 1;; ++k) {
      SCOPED_TRACE(testing::Message() << "allocation " << k);
      cache->Pull(keys.data(), kKeys, nullptr, /*pin=*/true, nullptr);
      ASSERT_EQ(cache->stats().pinned, kKeys);
      ASSERT_EQ(cache->stats().dirty, 0u);
      std::vector<uint8_t*> at(kKeys + 1);
      cache->PinnedRows(twice.data(), kKeys + 1, at.data());
      bool failed = false, broken = false;
      bool none_failed = false;  // k is past the call's allocations
      std::vector<uint64_t> lost;
      fail_in = k;
      try {
        switch (release) {
          case kWriteBack:
            cache->WriteBack(twice.data(), kKeys + 1, reinterpret_cast<const uint8_t*>(rows.data()), at.data());
            break;
          case kUnpinUpdated: cache->UnpinUpdated(twice.data(), kKeys + 1, updated.data(), at.data()); break;
          case kUnpin: cache->Unpin(twice.data(), kKeys + 1, at.data()); break;
        }
      } catch (const std::bad_alloc&) {
        failed = true;
      } catch (const BrokenPinError& e) {
        none_failed = fail_in.exchange(0) != 0;  // before the handler allocates
        broken = true;
        EXPECT_EQ(e.unpinned(), std::vector<uint64_t>{kKeys}) << e.what();
        lost = e.lost();
      }
      fail_in = 0;
      const MemCacheStats st = cache->stats();
      if (failed) {
        ++failures;
        ASSERT_EQ(st.pinned, kKeys) << "a failed release unpinned some keys";
        ASSERT_EQ(st.dirty, 0u) << "a failed release marked rows dirty";
        std::vector<uint64_t> now(kKeys);
        cache->ReadPinned(keys.data(), kKeys, reinterpret_cast<uint8_t*>(now.data()));
        ASSERT_EQ(now, keys) << "a failed write-back wrote rows";
        cache->Unpin(keys.data(), kKeys, at.data());  // as the retry would: every key once
        continue;
      }
      ASSERT_TRUE(broken) << "a release that found a key unpinned passed";
      ASSERT_EQ(st.pinned, 0u) << "a release that named a broken pin left keys pinned";
      if (release == kUnpin) {
        EXPECT_TRUE(lost.empty());
        EXPECT_EQ(st.dirty, 0u);
      } else if (lost.empty()) {  // kept: the last occurrence's row (WriteBack), the step marked (UnpinUpdated)
        EXPECT_EQ(st.dirty, kKeys);
        if (release == kWriteBack) {
          std::vector<uint64_t> now(kKeys);
          cache->Pull(keys.data(), kKeys, reinterpret_cast<uint8_t*>(now.data()), /*pin=*/false, nullptr);
          EXPECT_EQ(now.back(), rows[kKeys]);
          now.back() = rows[kKeys - 1];
          EXPECT_EQ(now, std::vector<uint64_t>(rows.begin(), rows.end() - 1));
        }
      } else {
        EXPECT_EQ(lost, std::vector<uint64_t>{kKeys});
      }
      if (none_failed) {
        EXPECT_TRUE(lost.empty());
        break;
      }
      cache->FlushDirty();
      for (uint64_t i = 0; i < kKeys; ++i) backing.rows[keys[i]] = keys[i];
      cache->Erase(keys.data(), kKeys);  // clean again for the next attempt
    }
    EXPECT_GT(failures, 0u);
  }
}

TEST(MemCache, PullThatLosesItsSlotsToConcurrentPinsKeepsItsDirtyVictims) {
  Backing backing;
  auto cache = FourDirtyRows(backing);
  const std::vector<uint64_t> others = {2, 3, 4};
  bool pinned_others = false;
  backing.before_load = [&] {
    if (pinned_others) return;
    pinned_others = true;
    cache->Pull(others.data(), others.size(), nullptr, /*pin=*/true, nullptr);  // hits: no miss lock
  };
  const std::vector<uint64_t> keys = {10, 11};  // 1 is evicted for 10, then no slot for 11
  EXPECT_THROW(cache->Pull(keys.data(), keys.size(), nullptr, /*pin=*/true, nullptr), CacheFullError);
  MemCacheStats st = cache->stats();
  EXPECT_EQ(st.pinned, 3u) << "only the other caller's pins";
  EXPECT_EQ(st.dirty, 4u);
  EXPECT_TRUE(cache->Contains(1));
  EXPECT_FALSE(cache->Contains(10));
  cache->Unpin(others.data(), others.size());
  cache->FlushDirty();
  for (uint64_t k = 1; k <= 4; ++k) EXPECT_EQ(backing.rows.at(k), k * 10 + 1) << k;
  // The same Pull now succeeds.
  cache->Pull(keys.data(), keys.size(), nullptr, /*pin=*/true, nullptr);
  cache->Unpin(keys.data(), keys.size());
  EXPECT_EQ(cache->stats().pinned, 0u);
}

TEST(MemCache, SinkThatThrowsOnEvictionLosesNoRow) {
  Backing backing;
  auto cache = FourDirtyRows(backing);
  backing.sink_down = true;
  const std::vector<uint64_t> keys = {10, 11};  // evicts dirty rows 1 and 2
  uint64_t got[2] = {};
  EXPECT_THROW(cache->Pull(keys.data(), keys.size(), reinterpret_cast<uint8_t*>(got), /*pin=*/true, nullptr),
               std::runtime_error);
  MemCacheStats st = cache->stats();
  EXPECT_EQ(st.pinned, 0u);
  EXPECT_EQ(st.dirty, 4u);
  EXPECT_EQ(st.size, 4u);
  EXPECT_TRUE(cache->Contains(1));
  EXPECT_TRUE(cache->Contains(2));
  EXPECT_FALSE(cache->Contains(10));
  uint64_t row = 0;
  const uint64_t one = 1;
  cache->Pull(&one, 1, reinterpret_cast<uint8_t*>(&row), /*pin=*/false, nullptr);
  EXPECT_EQ(row, 11u);
  backing.sink_down = false;
  cache->Pull(keys.data(), keys.size(), reinterpret_cast<uint8_t*>(got), /*pin=*/false, nullptr);
  EXPECT_EQ(got[0], 10000u);
  cache->FlushDirty();
  for (uint64_t k = 1; k <= 4; ++k) EXPECT_EQ(backing.rows.at(k), k * 10 + 1) << k;
}

// An unpinned pull that finds every slot of its shard pinned serves its new
// rows uncached; one the loader marked dirty (nowhere else yet) goes to the
// sink before the call returns, a clean one does not. If the sink throws,
// the call throws and the next pull loads the key anew.
TEST(MemCache, UncachedDirtyRowOfAnUnpinnedPullGoesToTheSink) {
  Backing backing;
  backing.rows[4] = 44;  // stored: the loader gives it clean
  auto cache = BackedCache(backing, "lru", 2, 1);
  const std::vector<uint64_t> pinned = {1, 2};
  cache->Pull(pinned.data(), pinned.size(), nullptr, /*pin=*/true, nullptr);
  const std::vector<uint64_t> keys = {3, 4, 3};
  uint64_t got[3] = {};

  backing.sink_down = true;
  EXPECT_THROW(cache->Pull(keys.data(), keys.size(), reinterpret_cast<uint8_t*>(got), /*pin=*/false, nullptr),
               std::runtime_error);
  EXPECT_EQ(backing.rows.count(3), 0u);
  EXPECT_EQ(cache->stats().pinned, 2u);
  EXPECT_EQ(cache->stats().dirty, 2u);

  backing.sink_down = false;
  const uint64_t sunk = backing.sunk;
  EXPECT_EQ(cache->Pull(keys.data(), keys.size(), reinterpret_cast<uint8_t*>(got), /*pin=*/false, nullptr), 0u);
  EXPECT_EQ(got[0], 3000u);
  EXPECT_EQ(got[1], 44u);
  EXPECT_EQ(got[2], 3000u);
  EXPECT_FALSE(cache->Contains(3));
  EXPECT_FALSE(cache->Contains(4));
  EXPECT_EQ(backing.sunk, sunk + 1) << "key 3 once; key 4 is stored already";
  ASSERT_EQ(backing.rows.count(3), 1u) << "the loader's dirty row of key 3 was dropped";
  EXPECT_EQ(backing.rows.at(3), 3000u);
  EXPECT_EQ(backing.rows.at(4), 44u);
  MemCacheStats st = cache->stats();
  EXPECT_EQ(st.evictions, 0u);
  EXPECT_EQ(st.dirty_evictions, 0u);
  EXPECT_EQ(st.dirty, 2u);  // 1 and 2, pinned

  cache->Unpin(pinned.data(), pinned.size());
  cache->FlushDirty();
  uint64_t row = 0;
  const uint64_t three = 3;
  cache->Pull(&three, 1, reinterpret_cast<uint8_t*>(&row), /*pin=*/false, nullptr);
  EXPECT_EQ(row, 3000u);
  EXPECT_EQ(cache->stats().dirty, 0u) << "key 3 comes back stored, clean";
}

TEST(MemCache, FlushWhoseSinkThrowsKeepsTheRowsDirty) {
  Backing backing;
  auto cache = FourDirtyRows(backing);
  backing.sink_down = true;
  EXPECT_THROW(cache->FlushDirty(), std::runtime_error);
  MemCacheStats st = cache->stats();
  EXPECT_EQ(st.dirty, 4u);
  EXPECT_EQ(st.rows_flushed, 0u);
  backing.sink_down = false;
  cache->FlushDirty();
  EXPECT_EQ(cache->stats().dirty, 0u);
  EXPECT_EQ(cache->stats().rows_flushed, 4u);
  for (uint64_t k = 1; k <= 4; ++k) EXPECT_EQ(backing.rows.at(k), k * 10 + 1) << k;
}

TEST(MemCache, AccessWhoseSinkThrowsKeepsTheRowsDirty) {
  Backing backing;
  auto cache = FourDirtyRows(backing);
  backing.sink_down = true;
  const uint64_t key = 10;
  EXPECT_THROW(cache->Access(&key, 1, nullptr), std::runtime_error);
  EXPECT_EQ(cache->stats().dirty, 4u);
  for (uint64_t k = 1; k <= 4; ++k) EXPECT_TRUE(cache->Contains(k)) << k;
  backing.sink_down = false;
  cache->Access(&key, 1, nullptr);
  EXPECT_TRUE(cache->Contains(10));
  EXPECT_EQ(backing.rows.size(), 1u);  // the victim, stored
  cache->FlushDirty();
  for (uint64_t k = 1; k <= 4; ++k) EXPECT_EQ(backing.rows.at(k), k * 10 + 1) << k;
}

TEST(MemCache, PullWhoseLoaderThrowsGivesBackItsPins) {
  Backing backing;
  auto cache = FourDirtyRows(backing);
  backing.before_load = [] { throw std::runtime_error("SSD-PS read failed"); };
  const std::vector<uint64_t> keys = {1, 2, 10, 2};  // hits (one twice) and a miss
  EXPECT_THROW(cache->Pull(keys.data(), keys.size(), nullptr, /*pin=*/true, nullptr), std::runtime_error);
  EXPECT_EQ(cache->stats().pinned, 0u);
  EXPECT_FALSE(cache->Contains(10));
}

// The pipeline retries a prefetch that met CacheFullError until the batches
// in flight free their pins: a failed attempt must count no hit, no miss.
TEST(MemCache, PullThatThrowsCountsNoHitOrMiss) {
  Backing backing;
  auto cache = FourDirtyRows(backing);  // 1..4 cached, pinned again below
  const std::vector<uint64_t> all = {1, 2, 3, 4};
  cache->Pull(all.data(), all.size(), nullptr, /*pin=*/true, nullptr);  // 4 hits
  const MemCacheStats before = cache->stats();
  ASSERT_EQ(before.hits, 4u);
  const std::vector<uint64_t> keys = {1, 2, 10};  // two hits and a miss that finds no slot
  for (int attempt = 0; attempt < 3; ++attempt) {
    EXPECT_THROW(cache->Pull(keys.data(), keys.size(), nullptr, /*pin=*/true, nullptr), CacheFullError);
  }
  backing.before_load = [] { throw std::runtime_error("SSD-PS read failed"); };
  EXPECT_THROW(cache->Pull(keys.data(), keys.size(), nullptr, /*pin=*/false, nullptr), std::runtime_error);
  backing.before_load = nullptr;
  MemCacheStats st = cache->stats();
  EXPECT_EQ(st.hits, before.hits);
  EXPECT_EQ(st.misses, before.misses);
  cache->Unpin(all.data(), all.size());
  cache->Pull(keys.data(), keys.size(), nullptr, /*pin=*/true, nullptr);  // succeeds: counted once
  st = cache->stats();
  EXPECT_EQ(st.hits, before.hits + 2);
  EXPECT_EQ(st.misses, before.misses + 1);
  cache->Unpin(keys.data(), keys.size());
}

// Nor may a failed pinning attempt count its keys' visits in the admission
// sketch: tinylfu-lfu evicts the least frequent row, and a key whose failed
// prefetches counted would pass for a hotter one.
TEST(MemCache, PullThatThrowsRecordsNoVisitInTheSketch) {
  Backing backing;
  const MemCacheOptions o = EightByteRows(2, 1, CachePolicyKind::kTinyLfuLfu);
  auto cache = MemCache::New(o, backing.Loader(), backing.Sink());
  const uint64_t cold = 7, warm = 8, fresh = 9;
  cache->Pull(&cold, 1, nullptr, /*pin=*/false, nullptr);  // one visit
  for (int i = 0; i < 3; ++i) cache->Pull(&warm, 1, nullptr, /*pin=*/false, nullptr);  // three
  ASSERT_TRUE(cache->Contains(cold) && cache->Contains(warm));
  // Failed prefetches of the cold key with a miss whose load fails.
  backing.before_load = [] { throw std::runtime_error("SSD-PS read failed"); };
  const std::vector<uint64_t> keys = {cold, 100};
  for (int attempt = 0; attempt < 4; ++attempt) {
    EXPECT_THROW(cache->Pull(keys.data(), keys.size(), nullptr, /*pin=*/true, nullptr), std::runtime_error);
  }
  backing.before_load = nullptr;
  EXPECT_EQ(cache->stats().pinned, 0u);
  cache->Pull(&fresh, 1, nullptr, /*pin=*/false, nullptr);  // evicts the least frequent
  EXPECT_FALSE(cache->Contains(cold)) << "the cold key's failed prefetches were counted as visits";
  EXPECT_TRUE(cache->Contains(warm));
}

// Pulls `keys` pinned and unpins them; returns how many rows were not the
// backing's (key * 1000): what a concurrency test's thread adds up.
int PullCountingWrongRows(MemCache& cache, const std::vector<uint64_t>& keys) {
  std::vector<uint64_t> rows(keys.size());
  cache.Pull(keys.data(), keys.size(), reinterpret_cast<uint8_t*>(rows.data()), true, nullptr);
  int wrong = 0;
  for (size_t i = 0; i < keys.size(); ++i) wrong += rows[i] != keys[i] * 1000;
  cache.Unpin(keys.data(), keys.size());
  return wrong;
}

TEST(MemCache, ConcurrentPullsSeeConsistentRows) {
  Backing backing;
  const MemCacheOptions o = EightByteRows(256, 4, CachePolicyKind::kWTinyLfu);
  auto cache = MemCache::New(o, backing.Loader(), backing.Sink());
  std::vector<std::thread> threads;
  std::vector<int> bad(4, 0);
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937_64 rng(t);
      for (int step = 0; step < 300; ++step) {
        bad[t] += PullCountingWrongRows(*cache, DistinctDraws(rng, 30, 2000));
        if (step % 50 == 0) (void)cache->stats();
      }
    });
  }
  for (auto& th : threads) th.join();
  for (int t = 0; t < 4; ++t) EXPECT_EQ(bad[t], 0);
  EXPECT_EQ(cache->stats().pinned, 0u);
}

// A caller may reuse its hit buffer: a miss must read 0 whatever it held.
TEST(MemCache, PullClearsTheHitFlagsOfMisses) {
  Backing backing;
  auto cache = BackedCache(backing, "lru", 8, 1);
  const uint64_t cached = 1;
  cache->Pull(&cached, 1, nullptr, /*pin=*/false, nullptr);
  const std::vector<uint64_t> keys = {1, 2, 3};
  std::vector<uint8_t> hit(keys.size(), 1);
  EXPECT_EQ(cache->Pull(keys.data(), keys.size(), nullptr, /*pin=*/false, hit.data()), 1u);
  EXPECT_EQ(hit, (std::vector<uint8_t>{1, 0, 0}));
}

// The budget check is "more than the shard holds": pins that fill a shard
// exactly fit, one more does not (and fails before the loader is asked).
TEST(MemCache, PinsThatExactlyFillAShardFit) {
  Backing backing;
  auto cache = BackedCache(backing, "lru", 4, 1);
  const std::vector<uint64_t> keys = {1, 2, 3, 4};
  EXPECT_NO_THROW(cache->Pull(keys.data(), keys.size(), nullptr, /*pin=*/true, nullptr));
  EXPECT_EQ(cache->stats().pinned, 4u);
  const uint64_t more = 5;
  EXPECT_THROW(cache->Pull(&more, 1, nullptr, /*pin=*/true, nullptr), CacheFullError);
  cache->Unpin(keys.data(), keys.size());
}

// A pinning Pull that cannot fit fails before it loads or evicts: the
// pipeline retries it until pins free up, and each attempt that read SSD-PS
// or pushed rows out would cost I/O for nothing.
TEST(MemCache, PullWhosePinsCannotFitFailsBeforeLoading) {
  Backing backing;
  auto cache = FourDirtyRows(backing);
  const std::vector<uint64_t> held = {1, 2, 3};
  cache->Pull(held.data(), held.size(), nullptr, /*pin=*/true, nullptr);
  const MemCacheStats before = cache->stats();
  const uint64_t loads = backing.loads;
  const std::vector<uint64_t> keys = {10, 11};  // one unpinned slot (4's) for two new rows
  try {
    cache->Pull(keys.data(), keys.size(), nullptr, /*pin=*/true, nullptr);
    ADD_FAILURE() << "two new pinned rows cannot fit in one unpinned slot";
  } catch (const CacheFullError& e) {
    EXPECT_NE(std::string(e.what()).find("has 3 pinned and this call needs 2 more"), std::string::npos) << e.what();
  }
  EXPECT_EQ(backing.loads, loads) << "the loader was asked for rows of a call bound to fail";
  const MemCacheStats st = cache->stats();
  EXPECT_EQ(st.rows_loaded, before.rows_loaded);
  EXPECT_EQ(st.evictions, before.evictions);
  EXPECT_EQ(st.pinned, 3u);
  EXPECT_TRUE(cache->Contains(4));
  cache->Unpin(held.data(), held.size());
}

// rows_loaded is the loader's traffic: one row per distinct missing key.
TEST(MemCache, RowsLoadedCountsEachDistinctMissingKeyOnce) {
  Backing backing;
  auto cache = BackedCache(backing, "lru", 8, 1);
  const std::vector<uint64_t> first = {5, 6, 5, 7};
  cache->Pull(first.data(), first.size(), nullptr, /*pin=*/false, nullptr);
  EXPECT_EQ(cache->stats().rows_loaded, 3u);
  const std::vector<uint64_t> second = {5, 8};
  cache->Pull(second.data(), second.size(), nullptr, /*pin=*/false, nullptr);
  EXPECT_EQ(cache->stats().rows_loaded, 4u);
  EXPECT_EQ(cache->stats().rows_loaded, backing.loads);
}

// A failed call changes nothing the caller can see but its own counts of
// hits and misses: the evictions it undid are not evictions.
TEST(MemCache, FailedPullUndoesItsEvictionCounts) {
  Backing backing;
  auto cache = FourDirtyRows(backing);
  backing.sink_down = true;
  const std::vector<uint64_t> keys = {10, 11};  // evicts dirty rows 1 and 2, then the sink throws
  EXPECT_THROW(cache->Pull(keys.data(), keys.size(), nullptr, /*pin=*/true, nullptr), std::runtime_error);
  MemCacheStats st = cache->stats();
  EXPECT_EQ(st.evictions, 0u);
  EXPECT_EQ(st.dirty_evictions, 0u);
  backing.sink_down = false;
  cache->Pull(keys.data(), keys.size(), nullptr, /*pin=*/false, nullptr);
  st = cache->stats();
  EXPECT_EQ(st.evictions, 2u);
  EXPECT_EQ(st.dirty_evictions, 2u);
}

// Each dirty victim reaches SSD-PS once: a replay that evicts several
// stores each as it goes, not again with the next.
TEST(MemCache, EachDirtyVictimGoesToTheSinkOnce) {
  Backing backing;
  auto cache = FourDirtyRows(backing);
  const std::vector<uint64_t> keys = {10, 11, 12};
  cache->Access(keys.data(), keys.size(), nullptr);
  EXPECT_EQ(cache->stats().dirty_evictions, 3u);
  EXPECT_EQ(backing.sunk, 3u);
}

// A replayed miss that takes a dirty victim's slot enters clean: once the
// victim is stored, nothing of it stays dirty, and a flush sends only the
// rows still dirty (not the replayed key's zero row).
TEST(MemCache, AccessThatEvictsADirtyRowLeavesNoDirtyMarkBehind) {
  Backing backing;
  auto cache = FourDirtyRows(backing);
  const uint64_t key = 10;  // evicts 1
  cache->Access(&key, 1, nullptr);
  EXPECT_EQ(cache->stats().dirty, 3u);
  backing.sunk = 0;
  cache->FlushDirty();
  EXPECT_EQ(cache->stats().dirty, 0u);
  EXPECT_EQ(backing.sunk, 3u);
  EXPECT_EQ(backing.rows.count(key), 0u) << "the replayed row went to the sink";
  for (uint64_t k = 1; k <= 4; ++k) EXPECT_EQ(backing.rows.at(k), k * 10 + 1) << k;
}

// Access enters a miss with a zero row, whatever its slot held before.
TEST(MemCache, AccessEntersMissesWithZeroRows) {
  Backing backing;
  auto cache = BackedCache(backing, "lru", 1, 1);
  const uint64_t one = 1, two = 2;
  uint64_t row = 0;
  cache->Pull(&one, 1, reinterpret_cast<uint8_t*>(&row), /*pin=*/false, nullptr);
  ASSERT_EQ(row, 1000u);
  cache->Access(&two, 1, nullptr);  // 1's slot
  ASSERT_TRUE(cache->Contains(two));
  cache->Pull(&two, 1, reinterpret_cast<uint8_t*>(&row), /*pin=*/false, nullptr);
  EXPECT_EQ(row, 0u) << "the replayed key was served its victim's row";
}

// FlushDirty hands the sink batches of kSinkBatchRows or more as it goes;
// rows_flushed counts every batch, not only the last.
TEST(MemCache, FlushCountsTheRowsOfEveryBatch) {
  Backing backing;
  constexpr uint64_t kRows = 20000;  // above the flush's batch of 16384 rows, in one shard
  auto cache = BackedCache(backing, "lru", kRows, 1);
  std::vector<uint64_t> keys(kRows);
  for (uint64_t k = 0; k < kRows; ++k) keys[k] = k + 1;
  cache->Pull(keys.data(), keys.size(), nullptr, /*pin=*/false, nullptr);  // all new: dirty
  ASSERT_EQ(cache->stats().dirty, kRows);
  cache->FlushDirty();
  EXPECT_EQ(cache->stats().dirty, 0u);
  EXPECT_EQ(cache->stats().rows_flushed, kRows);
  EXPECT_EQ(backing.sunk, kRows);
}

// UnpinUpdated marks dirty only the rows the caller says it wrote: an
// unwritten row goes back to SSD-PS for nothing otherwise.
TEST(MemCache, UnpinUpdatedMarksOnlyTheUpdatedRows) {
  Backing backing;
  backing.rows = {{1, 11}, {2, 22}};  // stored: loaded clean
  auto cache = BackedCache(backing, "lru", 8, 1);
  const std::vector<uint64_t> keys = {1, 2};
  std::vector<uint8_t*> at(2);
  cache->Pin(keys.data(), keys.size(), nullptr, at.data());
  ASSERT_EQ(cache->stats().dirty, 0u);
  const uint64_t v = 12;
  std::memcpy(at[0], &v, 8);
  const std::vector<uint8_t> updated = {1, 0};
  cache->UnpinUpdated(keys.data(), keys.size(), updated.data(), at.data());
  EXPECT_EQ(cache->stats().dirty, 1u);
  cache->FlushDirty();
  EXPECT_EQ(backing.sunk, 1u);
  EXPECT_EQ(backing.rows.at(1), 12u);
}

// A pinned row that SSD-PS erased (a prefetch made beside the erase holds it)
// stays pinned where it is, but with what the loader gives for its key now: the
// erased row is never served nor written back.
TEST(MemCache, ErasedPinnedRowTakesTheLoadersRowNow) {
  Backing backing;
  backing.rows = {{5, 55}, {6, 66}};
  auto cache = BackedCache(backing, "lru", 8, 1);
  const std::vector<uint64_t> keys = {5, 6};
  std::vector<uint8_t*> at(2);
  cache->Pin(keys.data(), keys.size(), nullptr, at.data());
  ASSERT_EQ(cache->stats().dirty, 0u);
  backing.rows.erase(5);  // as SsdStore::Bound would
  backing.rows[6] = 67;   // (another row now: the loader's is taken, clean as it says)
  EXPECT_EQ(cache->Erase(keys.data(), keys.size()), 0u);
  uint64_t five = 0, six = 0;
  std::memcpy(&five, at[0], 8);
  std::memcpy(&six, at[1], 8);
  EXPECT_EQ(five, 5000u) << "the erased row stayed";  // this loader's row for a key it does not hold
  EXPECT_EQ(six, 67u);
  EXPECT_EQ(cache->stats().dirty, 1u);  // key 5: this loader calls the rows it does not hold dirty
  cache->Unpin(keys.data(), keys.size(), at.data());
  cache->FlushDirty();
  EXPECT_EQ(backing.rows.at(5), 5000u);
  EXPECT_EQ(backing.rows.at(6), 67u);
  EXPECT_EQ(backing.sunk, 1u);
}

// A pinned dirty row whose key the loader now holds (another writer stored
// it) takes that row clean: flushing it would overwrite what SSD-PS has.
TEST(MemCache, ErasedPinnedDirtyRowTakesTheLoadersRowClean) {
  Backing backing;  // key 5 absent: loaded dirty
  auto cache = BackedCache(backing, "lru", 8, 1);
  const uint64_t key = 5;
  uint8_t* at = nullptr;
  cache->Pin(&key, 1, nullptr, &at);
  ASSERT_EQ(cache->stats().dirty, 1u);
  backing.rows[5] = 55;
  EXPECT_EQ(cache->Erase(&key, 1), 0u);
  uint64_t row = 0;
  std::memcpy(&row, at, 8);
  EXPECT_EQ(row, 55u);
  EXPECT_EQ(cache->stats().dirty, 0u) << "the reloaded row is clean, as the loader says";
  cache->Unpin(&key, 1, &at);
  cache->FlushDirty();
  EXPECT_EQ(backing.sunk, 0u);
}

// Without a loader, a pinned row that is erased keeps its row, dirty: SSD-PS
// no longer has it, so the row's only copy is here and goes to the sink.
TEST(MemCache, ErasedPinnedRowWithoutALoaderStaysDirty) {
  Backing backing;
  const MemCacheOptions o = EightByteRows(4, 1, CachePolicyKind::kLru);
  auto cache = MemCache::New(o, nullptr, backing.Sink());
  const uint64_t key = 7;
  cache->Access(&key, 1, nullptr);  // enters clean, a zero row
  cache->Pull(&key, 1, nullptr, /*pin=*/true, nullptr);  // a hit: no loader needed
  EXPECT_EQ(cache->Erase(&key, 1), 0u);
  EXPECT_TRUE(cache->Contains(key));
  EXPECT_EQ(cache->stats().dirty, 1u);
  cache->Unpin(&key, 1);
  cache->FlushDirty();
  EXPECT_EQ(backing.sunk, 1u);
  EXPECT_EQ(backing.rows.at(key), 0u);
}

// Erasing an unpinned dirty row drops it from the dirty count with the row:
// stats().dirty counts only rows cached.
TEST(MemCache, ErasedDirtyRowLeavesTheDirtyCount) {
  Backing backing;  // absent keys load dirty
  auto cache = BackedCache(backing, "lru", 8, 1);
  const std::vector<uint64_t> keys = {1, 2};
  cache->Pull(keys.data(), keys.size(), nullptr, /*pin=*/false, nullptr);
  ASSERT_EQ(cache->stats().dirty, 2u);
  EXPECT_EQ(cache->Erase(keys.data(), 1), 1u);
  EXPECT_EQ(cache->stats().dirty, 1u);
  EXPECT_EQ(cache->stats().size, 1u);
  cache->FlushDirty();
  EXPECT_EQ(backing.sunk, 1u);
  EXPECT_EQ(cache->stats().dirty, 0u);
}

// An address that is not the start of a row (a caller's pointer
// arithmetic gone wrong) is refused like another key's row.
TEST(MemCache, AddressInsideARowIsRefused) {
  Backing backing;
  auto cache = BackedCache(backing, "lru", 8, 1);
  const uint64_t key = 3;
  uint8_t* at = nullptr;
  cache->Pin(&key, 1, nullptr, &at);
  uint8_t* inside = at + 1;
  const uint64_t row = 7;
  EXPECT_THROW(cache->WriteBack(&key, 1, reinterpret_cast<const uint8_t*>(&row), &inside), std::invalid_argument);
  uint64_t out = 0;
  EXPECT_THROW(cache->ReadPinned(&key, 1, reinterpret_cast<uint8_t*>(&out), &inside), std::invalid_argument);
  EXPECT_EQ(cache->stats().pinned, 1u);
  cache->Unpin(&key, 1, &at);
}

// A write-back may land while a flush's sink runs (it takes no miss lock);
// if that sink then throws, the row is dirty once, not twice.
TEST(MemCache, FlushWhoseSinkThrowsAfterAWriteBackCountsTheRowDirtyOnce) {
  Backing backing;
  MemCache* self = nullptr;
  const uint64_t five = 5, written = 77;
  bool write_back_then_throw = true;
  RowSink store = backing.Sink();
  const MemCacheOptions o = EightByteRows(4, 1, CachePolicyKind::kLru);
  auto cache = MemCache::New(o, backing.Loader(), [&](const uint64_t* keys, uint64_t n, const uint8_t* rows) {
    if (write_back_then_throw) {
      write_back_then_throw = false;
      self->WriteBack(&five, 1, reinterpret_cast<const uint8_t*>(&written));
      throw std::runtime_error("sink down");
    }
    store(keys, n, rows);
  });
  self = cache.get();
  cache->Pull(&five, 1, nullptr, /*pin=*/true, nullptr);  // absent: loaded dirty
  ASSERT_EQ(cache->stats().dirty, 1u);
  EXPECT_THROW(cache->FlushDirty(), std::runtime_error);
  EXPECT_EQ(cache->stats().dirty, 1u);
  EXPECT_EQ(cache->stats().pinned, 0u);
  cache->FlushDirty();
  EXPECT_EQ(cache->stats().dirty, 0u);
  EXPECT_EQ(backing.rows.at(five), written);
}

// lru_fraction is in (0, 1]: at 1 the LRU takes every slot.
TEST(MemCache, LruLfuTakesAnLruShareUpToTheWholeCache) {
  Backing backing;
  MemCacheOptions o = EightByteRows(8, 1, CachePolicyKind::kLruLfu);
  for (double bad : {0.0, -0.5, 1.01}) {
    o.lru_fraction = bad;
    EXPECT_THROW(MemCache::New(o, backing.Loader(), backing.Sink()), std::invalid_argument) << bad;
  }
  o.lru_fraction = 1.0;
  auto cache = MemCache::New(o, backing.Loader(), backing.Sink());
  std::vector<uint64_t> keys(20);
  for (uint64_t k = 0; k < keys.size(); ++k) keys[k] = k + 1;
  std::vector<uint64_t> rows(keys.size());
  cache->Pull(keys.data(), keys.size(), reinterpret_cast<uint8_t*>(rows.data()), /*pin=*/false, nullptr);
  for (size_t i = 0; i < keys.size(); ++i) EXPECT_EQ(rows[i], keys[i] * 1000);
  EXPECT_EQ(cache->stats().size, 8u);
}

// lfu counts visits while a row is cached: a row's count starts at its
// entry, whoever held its slot before, and carries across its pins.
TEST(MemCache, LfuStartsANewRowsCountAfreshInAReusedSlot) {
  Backing backing;
  auto cache = BackedCache(backing, "lfu", 2, 1);
  const uint64_t hot = 1, warm = 2, fresh = 3, next = 4;
  for (int i = 0; i < 10; ++i) cache->Pull(&hot, 1, nullptr, /*pin=*/false, nullptr);
  for (int i = 0; i < 3; ++i) cache->Pull(&warm, 1, nullptr, /*pin=*/false, nullptr);
  ASSERT_EQ(cache->Erase(&hot, 1), 1u);  // frees the slot with the count of 10
  cache->Pull(&fresh, 1, nullptr, /*pin=*/true, nullptr);  // takes it, pinned
  cache->Unpin(&fresh, 1);  // enters the order with one visit
  cache->Pull(&next, 1, nullptr, /*pin=*/false, nullptr);  // evicts the least visited
  EXPECT_FALSE(cache->Contains(fresh)) << "the new row inherited the erased row's count";
  EXPECT_TRUE(cache->Contains(warm));
}

TEST(MemCache, LfuKeepsARowsCountAcrossItsPins) {
  Backing backing;
  auto cache = BackedCache(backing, "lfu", 2, 1);
  const uint64_t pinned = 1, other = 2, next = 3;
  for (int i = 0; i < 4; ++i) {  // a miss, then three hits: four visits
    cache->Pull(&pinned, 1, nullptr, /*pin=*/true, nullptr);
    cache->Unpin(&pinned, 1);
  }
  for (int i = 0; i < 2; ++i) cache->Pull(&other, 1, nullptr, /*pin=*/false, nullptr);
  cache->Pull(&next, 1, nullptr, /*pin=*/false, nullptr);  // evicts the least visited
  EXPECT_TRUE(cache->Contains(pinned)) << "a re-pinned row's count started over";
  EXPECT_FALSE(cache->Contains(other));
}

// A pinning Pull that succeeds counts its keys' visits in the admission
// sketch (once each, after it succeeded): tinylfu-lfu keeps the row a
// training batch pins often over one read once.
TEST(MemCache, PinnedPullsCountTheirVisitsInTheSketch) {
  Backing backing;
  auto cache = BackedCache(backing, "tinylfu-lfu", 2, 1);
  const uint64_t cold = 7, warm = 8, fresh = 9;
  cache->Pull(&cold, 1, nullptr, /*pin=*/false, nullptr);
  for (int i = 0; i < 3; ++i) {
    cache->Pull(&warm, 1, nullptr, /*pin=*/true, nullptr);
    cache->Unpin(&warm, 1);
  }
  cache->Pull(&fresh, 1, nullptr, /*pin=*/false, nullptr);  // evicts the least frequent
  EXPECT_TRUE(cache->Contains(warm)) << "pinned visits were not counted";
  EXPECT_FALSE(cache->Contains(cold));
}

// ---- lookahead eviction (SetLookahead)

std::unique_ptr<MemCache> TraceCache(const std::string& policy, uint64_t capacity, uint32_t shards = 1) {
  const MemCacheOptions o = EightByteRows(capacity, shards, ParseCachePolicy(policy));
  return MemCache::New(o, nullptr, nullptr);
}

std::vector<uint64_t> ZipfLikeTrace(uint64_t n, uint64_t universe, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<uint64_t> trace(n);
  for (uint64_t& k : trace) {
    const uint64_t a = rng() % universe, b = rng() % universe;
    k = std::min(a, b) * std::min(a, b) % universe + 1;  // skewed towards small keys
  }
  return trace;
}

std::vector<uint8_t> AccessAll(MemCache& cache, const std::vector<uint64_t>& keys) {
  std::vector<uint8_t> hit(keys.size());
  cache.Access(keys.data(), keys.size(), hit.data());
  return hit;
}

class Lookahead : public ::testing::TestWithParam<std::string> {};

// The row the policy would evict next is in the window: it stays, another goes.
TEST_P(Lookahead, KeyInTheWindowSurvivesTheEvictionItWouldHaveLost) {
  const std::vector<uint64_t> fill = ZipfLikeTrace(200, 40, 3);
  auto plain = TraceCache(GetParam(), 8);
  auto seen = TraceCache(GetParam(), 8);
  AccessAll(*plain, fill);
  AccessAll(*seen, fill);
  uint64_t fresh = 1000;
  // A key the plain cache evicts for a new one.
  uint64_t victim = 0;
  std::vector<uint64_t> cached;
  for (uint64_t k = 1; k <= 40; ++k) {
    if (plain->Contains(k)) cached.push_back(k);
  }
  ASSERT_EQ(cached.size(), 8u);
  AccessAll(*plain, {fresh});
  for (uint64_t k : cached) {
    if (!plain->Contains(k)) victim = k;
  }
  ASSERT_NE(victim, 0u) << "the plain cache evicted none of its rows";
  seen->SetLookahead(&victim, 1);
  EXPECT_EQ(seen->stats().lookahead_keys, 1u);
  AccessAll(*seen, {fresh});
  EXPECT_TRUE(seen->Contains(victim)) << GetParam() << " evicted " << victim << ", a key in the window";
  EXPECT_TRUE(seen->Contains(fresh));
  EXPECT_EQ(seen->stats().size, 8u);
  EXPECT_EQ(seen->stats().lookahead_spared, 1u);
  EXPECT_EQ(seen->stats().lookahead_forced, 0u);
}

// No window or a cleared one: a replay is the one without lookahead, access
// for access. A window that holds no cached key, or an empty one: Pulls are
// as without one (Access, below, also counts its own keys as the window's head).
TEST_P(Lookahead, EmptyOrDisjointWindowChangesNothing) {
  const std::vector<uint64_t> trace = ZipfLikeTrace(20000, 3000, 11);
  auto plain = TraceCache(GetParam(), 300, 2);
  auto cleared = TraceCache(GetParam(), 300, 2);
  Backing backing;
  auto pulled = BackedCache(backing, GetParam(), 300, 2);
  auto disjoint = BackedCache(backing, GetParam(), 300, 2);
  const std::vector<uint64_t> never = {1u << 30, (1u << 30) + 1, (1u << 30) + 2};
  for (size_t start = 0; start < trace.size(); start += 500) {
    const std::vector<uint64_t> batch(trace.begin() + start, trace.begin() + start + 500);
    cleared->SetLookahead(batch.data(), batch.size());
    cleared->ClearLookahead();
    disjoint->SetLookahead(never.data(), start % 1000 == 0 ? never.size() : 0);
    ASSERT_EQ(AccessAll(*cleared, batch), AccessAll(*plain, batch)) << "batch at " << start;
    std::vector<uint8_t> want(batch.size()), got(batch.size());
    pulled->Pull(batch.data(), batch.size(), nullptr, /*pin=*/false, want.data());
    disjoint->Pull(batch.data(), batch.size(), nullptr, /*pin=*/false, got.data());
    ASSERT_EQ(got, want) << "batch at " << start;
  }
  EXPECT_EQ(cleared->stats().lookahead_keys, 0u);
  EXPECT_EQ(disjoint->stats().lookahead_spared + disjoint->stats().lookahead_forced, 0u);
  EXPECT_EQ(disjoint->stats().hits, pulled->stats().hits);
}

// With a window set, Access spares the rows its own later keys need: the
// rest of a replayed batch is the window's head.
TEST(MemCacheLookahead, AccessCountsItsOwnKeysAsTheWindowsHead) {
  auto plain = TraceCache("lru", 2);
  auto seen = TraceCache("lru", 2);
  const std::vector<uint64_t> batch = {1, 2, 3, 1};
  EXPECT_EQ(AccessAll(*plain, batch), (std::vector<uint8_t>{0, 0, 0, 0}));  // 3 evicts 1
  const uint64_t later = 99;
  seen->SetLookahead(&later, 1);
  EXPECT_EQ(AccessAll(*seen, batch), (std::vector<uint8_t>{0, 0, 0, 1}));  // 3 evicts 2
  // Past its last use in the call, a key is no longer in the window.
  auto past = TraceCache("lru", 2);
  past->SetLookahead(&later, 1);
  EXPECT_EQ(AccessAll(*past, {2, 1, 1, 3, 2}), (std::vector<uint8_t>{0, 0, 1, 0, 1}));  // 3 evicts 1
}

// The call's own keys come before the window's: a row the window needs
// first is needed after every key still to come in the call.
TEST(MemCacheLookahead, AccessRanksTheWindowAfterItsOwnKeys) {
  auto cache = TraceCache("lru", 2);
  AccessAll(*cache, {1, 2});
  const uint64_t one = 1;
  cache->SetLookahead(&one, 1);
  // 3's miss finds 1 and 2 both needed: 2 later in this call, 1 after it.
  EXPECT_EQ(AccessAll(*cache, {3, 2}), (std::vector<uint8_t>{0, 1}));
  EXPECT_FALSE(cache->Contains(1));
  EXPECT_EQ(cache->stats().lookahead_forced, 1u);
}

// An empty window (n = 0: no batch comes) is still a window: Access counts
// its own keys as its head, unlike after ClearLookahead.
TEST(MemCacheLookahead, EmptyWindowStillCountsAccessOwnKeys) {
  auto cache = TraceCache("lru", 2);
  cache->SetLookahead(nullptr, 0);
  EXPECT_EQ(AccessAll(*cache, {1, 2, 3, 1}), (std::vector<uint8_t>{0, 0, 0, 1}));  // 3 evicts 2
  cache->ClearLookahead();  // order: 3, 1
  EXPECT_EQ(AccessAll(*cache, {4, 3}), (std::vector<uint8_t>{0, 0}));  // 4 evicts 3, the least recent
}

// A window of the coming batches: hits at least as many as without (on this
// trace, not a theorem), and correct rows through dirty evictions.
TEST_P(Lookahead, WriteBacksSurviveLookaheadEvictions) {
  Backing backing;
  auto cache = BackedCache(backing, GetParam(), 64, 2);
  std::map<uint64_t, uint64_t> model;
  std::mt19937_64 rng(7);
  std::vector<std::vector<uint64_t>> batches(502);
  for (auto& keys : batches) {
    for (int j = 0; j < 20; ++j) {
      const uint64_t k = rng() % 500;
      if (std::find(keys.begin(), keys.end(), k) == keys.end()) keys.push_back(k);
    }
  }
  for (size_t step = 0; step + 2 < batches.size(); ++step) {
    std::vector<uint64_t> window = batches[step + 1];
    window.insert(window.end(), batches[step + 2].begin(), batches[step + 2].end());
    cache->SetLookahead(window.data(), window.size());
    const std::vector<uint64_t>& keys = batches[step];
    std::vector<uint64_t> rows = PullCheckedPlusOne(*cache, keys, model, step);
    ASSERT_FALSE(HasFailure());
    cache->WriteBack(keys.data(), keys.size(), reinterpret_cast<const uint8_t*>(rows.data()));
  }
  const MemCacheStats st = cache->stats();
  EXPECT_EQ(st.pinned, 0u);
  EXPECT_GT(st.dirty_evictions, 0u);
  EXPECT_GT(st.lookahead_spared, 0u);
  cache->FlushDirty();
  for (const auto& [k, v] : model) ASSERT_EQ(backing.rows.at(k), v) << k;
}

// One Pull's evictions under one window, no row entering the order between
// them: the coldest rows (A, visited once, then D, once, newer) are all in the
// window, and every policy's order meets one of B (visited twice) after
// enough of them. Each eviction takes a row of B. A walk that passes the
// window's rows of a run whole (lfu's and tinylfu-lfu's rows of one count,
// lru+lfu's LFU rows of one count, w-tinylfu's probation) marks it, and the
// later walks of the window skip it (lru's meet them no more: Defer sent them
// to its front): a window row is looked up at most twice (once more as its
// run is completed), not once an eviction.
TEST_P(Lookahead, EvictionsUnderOneWindowLookUpItsRowsOnce) {
  Backing backing;
  auto cache = BackedCache(backing, GetParam(), 64, 1);
  const auto pull = [&](const std::vector<uint64_t>& keys) {  // unpinned: each occurrence a visit
    std::vector<uint64_t> rows(keys.size());
    cache->Pull(keys.data(), keys.size(), reinterpret_cast<uint8_t*>(rows.data()), false, nullptr);
  };
  std::vector<uint64_t> a, b, d, fresh;
  for (uint64_t k = 1; k <= 16; ++k) {
    a.push_back(k);
    b.push_back(100 + k);
    fresh.push_back(300 + k);
  }
  for (uint64_t k = 1; k <= 32; ++k) d.push_back(200 + k);
  pull(a);
  pull(b);
  pull(b);
  pull(d);
  ASSERT_EQ(cache->stats().size, 64u);
  std::vector<uint64_t> window = a;
  window.insert(window.end(), d.begin(), d.end());
  cache->SetLookahead(window.data(), window.size());
  pull(fresh);  // 16 evictions in one call
  const MemCacheStats st = cache->stats();
  ASSERT_EQ(st.evictions, 16u);
  for (uint64_t k : window) EXPECT_TRUE(cache->Contains(k)) << k;
  for (uint64_t k : b) EXPECT_FALSE(cache->Contains(k)) << k;
  EXPECT_LE(st.lookahead_visited, 2 * (window.size() + st.evictions))
      << "each window row looked up at most twice, and a row of B and a first candidate an eviction";
  if (GetParam() == "lru") {
    EXPECT_EQ(st.lookahead_skipped, 0u);
  } else {
    EXPECT_GE(st.lookahead_skipped, 14 * a.size()) << "the later walks skipped the runs passed";
  }
}

// Every row in the window, more of them than a walk looks at: each eviction
// of the call is forced (Beyond's). A walk that skipped runs and found no row
// outside the window is made again, unskipped; the walks after it skip
// nothing until one finds such a row, so each eviction walks kLookaheadScan
// rows once, not the runs left unmarked past the first walk's limit and then
// kLookaheadScan again.
TEST_P(Lookahead, ForcedEvictionsWalkOnceAnEviction) {
  constexpr uint64_t kRows = MemCache::kLookaheadScan + 200;
  Backing backing;
  auto cache = BackedCache(backing, GetParam(), kRows, 1);
  for (uint64_t visits = 0; visits < 4; ++visits) {  // key k visited k % 4 + 1 times: runs of each count
    std::vector<uint64_t> keys;
    for (uint64_t k = 0; k < kRows; ++k) {
      if (k % 4 >= visits) keys.push_back(k);
    }
    std::vector<uint64_t> rows(keys.size());
    cache->Pull(keys.data(), keys.size(), reinterpret_cast<uint8_t*>(rows.data()), false, nullptr);
  }
  std::vector<uint64_t> window(kRows + 8), fresh(8);
  for (uint64_t k = 0; k < window.size(); ++k) window[k] = k;
  for (uint64_t i = 0; i < fresh.size(); ++i) fresh[i] = kRows + i;
  cache->SetLookahead(window.data(), window.size());
  std::vector<uint64_t> rows(fresh.size());
  cache->Pull(fresh.data(), fresh.size(), reinterpret_cast<uint8_t*>(rows.data()), false, nullptr);
  const MemCacheStats st = cache->stats();
  ASSERT_EQ(st.evictions, fresh.size());
  EXPECT_EQ(st.lookahead_forced, fresh.size());
  EXPECT_LE(st.lookahead_visited, st.evictions * MemCache::kLookaheadScan);
}

INSTANTIATE_TEST_SUITE_P(All, Lookahead, ::testing::Values("lru", "lfu", "lru+lfu", "w-tinylfu", "tinylfu-lfu"));

// Every row in the window: the one needed latest goes (Belady inside it).
TEST(MemCacheLookahead, EveryRowInTheWindowEvictsTheOneNeededLatest) {
  auto cache = TraceCache("lru", 3);
  AccessAll(*cache, {1, 2, 3});
  const std::vector<uint64_t> window = {3, 1, 3, 2, 1};  // 2 is needed last
  cache->SetLookahead(window.data(), window.size());
  EXPECT_EQ(cache->stats().lookahead_keys, 3u);
  AccessAll(*cache, {4});
  EXPECT_FALSE(cache->Contains(2));
  EXPECT_TRUE(cache->Contains(1) && cache->Contains(3) && cache->Contains(4));
  EXPECT_EQ(cache->stats().lookahead_forced, 1u);
}

// Keys 1..n.
std::vector<uint64_t> KeysFrom1(uint64_t n) {
  std::vector<uint64_t> keys(n);
  for (uint64_t k = 0; k < n; ++k) keys[k] = k + 1;
  return keys;
}

// A TraceCache of one shard just big enough for keys, which it accessed in
// order (keys.front() the least recent).
std::unique_ptr<MemCache> TraceCacheOf(const std::string& policy, const std::vector<uint64_t>& keys) {
  auto cache = TraceCache(policy, keys.size());
  AccessAll(*cache, keys);
  return cache;
}

// Forced evictions look past the first kLookaheadScan candidates, at the
// whole shard: a row outside the window there goes first.
TEST(MemCacheLookahead, RowOutsideTheWindowBeyondTheScanGoesFirst) {
  const uint32_t scan = MemCache::kLookaheadScan;
  const std::vector<uint64_t> keys = KeysFrom1(scan + 10);
  auto cache = TraceCacheOf("lru", keys);  // 1 the least recent, scan + 10 the most
  const std::vector<uint64_t> window(keys.begin(), keys.end() - 1);  // all but the most recent
  cache->SetLookahead(window.data(), window.size());
  AccessAll(*cache, {100000});
  EXPECT_FALSE(cache->Contains(keys.back())) << "the one row outside the window, past the scan";
  for (uint64_t k : window) ASSERT_TRUE(cache->Contains(k)) << k;
  EXPECT_EQ(cache->stats().lookahead_spared, 1u);
  EXPECT_EQ(cache->stats().lookahead_forced, 0u);
}

// Every row in the window: the one needed latest goes, also when it lies past
// the first kLookaheadScan candidates (Belady inside the window, whole shard).
TEST(MemCacheLookahead, LatestNeededBeyondTheScanGoes) {
  const uint32_t scan = MemCache::kLookaheadScan;
  const std::vector<uint64_t> keys = KeysFrom1(scan + 10);
  auto cache = TraceCacheOf("lru", keys);
  std::vector<uint64_t> window = keys;
  std::rotate(window.begin() + scan + 4, window.begin() + scan + 5, window.end());  // scan + 5 needed last
  cache->SetLookahead(window.data(), window.size());
  AccessAll(*cache, {100000});
  EXPECT_FALSE(cache->Contains(scan + 5)) << "the latest needed, candidate scan + 5";
  EXPECT_TRUE(cache->Contains(scan)) << "the latest needed of the first kLookaheadScan candidates stays";
  EXPECT_EQ(cache->stats().lookahead_forced, 1u);
}

// Rows that enter the order after a forced eviction looked at the whole
// shard count in the next ones: a row outside the window, then the row
// needed latest, both loaded after the window was set.
TEST(MemCacheLookahead, RowsLoadedUnderTheWindowCountInForcedEvictions) {
  const uint32_t scan = MemCache::kLookaheadScan;
  const uint64_t n = scan + 10, later = 200000, outside = 100000;
  const std::vector<uint64_t> keys = KeysFrom1(n);
  auto cache = TraceCacheOf("lru", keys);
  std::vector<uint64_t> window = keys;
  window.push_back(later);  // needed after every cached row
  cache->SetLookahead(window.data(), window.size());
  AccessAll(*cache, {outside});  // forced: n, needed latest of the rows cached, goes
  EXPECT_FALSE(cache->Contains(n));
  AccessAll(*cache, {later});  // outside, loaded since, is the one row not in the window
  EXPECT_FALSE(cache->Contains(outside));
  EXPECT_TRUE(cache->Contains(later));
  AccessAll(*cache, {300000});  // forced: later, loaded since, is needed latest
  EXPECT_FALSE(cache->Contains(later));
  for (uint64_t k = 1; k < n; ++k) ASSERT_TRUE(cache->Contains(k)) << k;
  const MemCacheStats st = cache->stats();
  EXPECT_EQ(st.lookahead_spared, 1u);
  EXPECT_EQ(st.lookahead_forced, 2u);
}

// Likewise a row pinned by a forced eviction's Pull and unpinned after it.
TEST(MemCacheLookahead, RowUnpinnedUnderTheWindowCountsInForcedEvictions) {
  const uint32_t scan = MemCache::kLookaheadScan;
  const uint64_t n = scan + 10, later = 200000;
  Backing backing;
  auto cache = BackedCache(backing, "lru", n, 1);
  std::vector<uint64_t> keys(n);
  for (uint64_t k = 0; k < n; ++k) keys[k] = k + 1;
  AccessAll(*cache, keys);
  std::vector<uint64_t> window = keys;
  window.push_back(later);
  cache->SetLookahead(window.data(), window.size());
  cache->Pull(&later, 1, nullptr, /*pin=*/true, nullptr);  // forced: n goes
  EXPECT_FALSE(cache->Contains(n));
  cache->Unpin(&later, 1);
  AccessAll(*cache, {300000});  // forced: later, unpinned since, is needed latest
  EXPECT_FALSE(cache->Contains(later));
  for (uint64_t k = 1; k < n; ++k) ASSERT_TRUE(cache->Contains(k)) << k;
  EXPECT_EQ(cache->stats().lookahead_forced, 2u);
}

// An Access call's own keys stay past the scan too: needed in the call, they
// come before any row the window names.
TEST(MemCacheLookahead, AccessOwnKeysBeyondTheScanStay) {
  const uint32_t scan = MemCache::kLookaheadScan;
  const uint64_t n = scan + 10;
  const std::vector<uint64_t> keys = KeysFrom1(n);
  auto cache = TraceCacheOf("lru", keys);
  std::vector<uint64_t> window(keys.begin(), keys.end() - 2);  // n - 1 and n outside the window
  window.push_back(n - 1);  // n - 1 in it, needed latest
  cache->SetLookahead(window.data(), window.size());
  // 100000 misses: n is needed later in the call, n - 1 is not: n - 1 goes.
  EXPECT_EQ(AccessAll(*cache, {100000, n}), (std::vector<uint8_t>{0, 1}));
  EXPECT_FALSE(cache->Contains(n - 1));
  EXPECT_EQ(cache->stats().lookahead_forced, 1u);
}

TEST(MemCacheLookahead, PinnedRowsStayOutOfReach) {
  Backing backing;
  auto cache = BackedCache(backing, "lru", 2, 1);
  const uint64_t one = 1, two = 2, three = 3;
  cache->Pull(&one, 1, nullptr, /*pin=*/true, nullptr);
  cache->Pull(&two, 1, nullptr, /*pin=*/false, nullptr);
  cache->SetLookahead(&two, 1);
  cache->Pull(&three, 1, nullptr, /*pin=*/false, nullptr);  // 2, in the window, is the only candidate
  EXPECT_TRUE(cache->Contains(one));
  EXPECT_FALSE(cache->Contains(two));
  EXPECT_EQ(cache->stats().pinned, 1u);
  const std::vector<uint64_t> both = {2, 4};
  EXPECT_THROW(cache->Pull(both.data(), 2, nullptr, /*pin=*/true, nullptr), CacheFullError);
  cache->Unpin(&one, 1);
}

TEST(MemCacheLookahead, ReservedKeyIsRefusedAndTheWindowStays) {
  auto cache = TraceCache("lru", 4);
  const std::vector<uint64_t> good = {1, 2};
  cache->SetLookahead(good.data(), good.size());
  const std::vector<uint64_t> bad = {3, kEmptyKey};
  EXPECT_THROW(cache->SetLookahead(bad.data(), bad.size()), std::invalid_argument);
  EXPECT_EQ(cache->stats().lookahead_keys, 2u);
}

// A row passed over goes behind the others: once the window is gone, the
// next eviction takes the row that was next in line, not the one spared.
TEST(MemCacheLookahead, SparedRowGoesBehindTheOthers) {
  auto cache = TraceCache("lru", 3);
  AccessAll(*cache, {1, 2, 3});
  const uint64_t one = 1;
  cache->SetLookahead(&one, 1);
  AccessAll(*cache, {4});  // 1 spared, 2 goes: order 3, 1, 4
  ASSERT_TRUE(cache->Contains(1));
  ASSERT_FALSE(cache->Contains(2));
  cache->ClearLookahead();
  AccessAll(*cache, {5});
  EXPECT_FALSE(cache->Contains(3));
  EXPECT_TRUE(cache->Contains(1)) << "the spared row stayed first in line";
}

// tinylfu-lfu's walks skip the rows of one estimate that a walk under the
// same window passed over whole (CachePolicy::WalkCandidates): a new window
// walks them again. 1 and 2 (visited once) are in the first window, passed
// over for 3 (visited 3 times); in the second window, 2 is the first row
// outside it.
TEST(MemCacheLookahead, RowsPassedOverUnderAnOldWindowAreWalkedAgain) {
  Backing backing;
  auto cache = BackedCache(backing, "tinylfu-lfu", 4, 1);
  const auto pull = [&](std::vector<uint64_t> keys) {  // unpinned: each occurrence a visit
    std::vector<uint64_t> rows(keys.size());
    cache->Pull(keys.data(), keys.size(), reinterpret_cast<uint8_t*>(rows.data()), false, nullptr);
  };
  pull({3, 3, 3});
  pull({4, 4, 4});
  pull({1});
  pull({2});
  const std::vector<uint64_t> first = {1, 2}, second = {1, 4};
  cache->SetLookahead(first.data(), first.size());
  pull({5, 5});  // estimate 2: it enters a run of its own
  ASSERT_FALSE(cache->Contains(3));
  ASSERT_TRUE(cache->Contains(1) && cache->Contains(2));
  cache->SetLookahead(second.data(), second.size());
  pull({6, 6});
  EXPECT_FALSE(cache->Contains(2)) << "the least visited row outside the window";
  EXPECT_TRUE(cache->Contains(1) && cache->Contains(4) && cache->Contains(5) && cache->Contains(6));
  EXPECT_EQ(cache->stats().lookahead_spared, 2u);
}

// Two threads pull 30 distinct keys of [0, pulled) a step for 300 steps,
// checking each row; a third replays (Access) 30 a step, which `replayed`
// maps to keys no Pull asks for (replayed keys enter with zero rows). Then
// `done` is set and `prefetch` joined. EXPECTs every pulled row right.
template <class Replayed>
void PullAndReplayAlongside(MemCache& cache, uint64_t pulled, Replayed replayed, std::atomic<bool>& done,
                            std::thread& prefetch) {
  std::vector<std::thread> threads;
  std::vector<int> bad(2, 0);
  for (int t = 0; t < 3; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937_64 rng(t);
      for (int step = 0; step < 300; ++step) {
        std::vector<uint64_t> keys = DistinctDraws(rng, 30, pulled);
        if (t == 2) {
          replayed(keys);
          cache.Access(keys.data(), keys.size(), nullptr);
          continue;
        }
        bad[t] += PullCountingWrongRows(cache, keys);
      }
    });
  }
  for (auto& th : threads) th.join();
  done = true;
  prefetch.join();
  for (int t = 0; t < 2; ++t) EXPECT_EQ(bad[t], 0) << "puller " << t;
}

// PullAndReplayAlongside's `replayed` for keys in [pulled, all): each drawn
// key moved there, repeats dropped.
auto ReplayedIn(uint64_t pulled, uint64_t all) {
  return [pulled, all](std::vector<uint64_t>& keys) {
    for (uint64_t& k : keys) k = pulled + k % (all - pulled);
    std::sort(keys.begin(), keys.end());
    keys.erase(std::unique(keys.begin(), keys.end()), keys.end());
  };
}

// Under TSan: a prefetch thread replaces the window while others pull, pin,
// unpin and replay; rows stay right and no pin is lost.
TEST(MemCacheLookahead, WindowSwapsRaceNothing) {
  Backing backing;
  auto cache = BackedCache(backing, "tinylfu-lfu", 256, 4);
  std::vector<uint64_t> even(1000);
  for (uint64_t k = 0; k < even.size(); ++k) even[k] = 2 * k;
  cache->SetLookahead(even.data(), even.size());  // set before any eviction: some meet it
  std::atomic<bool> done{false};
  std::thread prefetch([&] {
    std::mt19937_64 rng(99);
    while (!done.load()) {
      std::vector<uint64_t> window(500 + rng() % 500);
      for (uint64_t& k : window) k = rng() % 4000;
      cache->SetLookahead(window.data(), window.size());
      (void)cache->stats();
    }
  });
  PullAndReplayAlongside(*cache, 2000, [](std::vector<uint64_t>& keys) {
    for (uint64_t& k : keys) k += 2000;
  }, done, prefetch);
  const MemCacheStats st = cache->stats();
  EXPECT_EQ(st.pinned, 0u);
  EXPECT_GT(st.lookahead_spared + st.lookahead_forced, 0u);
}

// Under TSan and ASan: every eviction of a shard past kLookaheadScan rows is
// forced (each window names every key), so the whole-shard lists are built,
// appended to by concurrent unpins and inserts, and dropped by window swaps.
TEST(MemCacheLookahead, ForcedEvictionsBeyondTheScanRaceNothing) {
  const uint64_t capacity = MemCache::kLookaheadScan + 300, pulled = capacity + 600, all = pulled + 600;
  Backing backing;
  auto cache = BackedCache(backing, "lru", capacity, 1);
  std::vector<uint64_t> every(all);
  for (uint64_t k = 0; k < all; ++k) every[k] = k;
  cache->SetLookahead(every.data(), every.size());
  std::atomic<bool> done{false};
  std::thread prefetch([&] {
    std::mt19937_64 rng(5);
    std::vector<uint64_t> window = every;
    while (!done.load()) {
      std::shuffle(window.begin(), window.end(), rng);
      cache->SetLookahead(window.data(), window.size());
    }
  });
  PullAndReplayAlongside(*cache, pulled, ReplayedIn(pulled, all), done, prefetch);
  const MemCacheStats st = cache->stats();
  EXPECT_EQ(st.pinned, 0u);
  EXPECT_GT(st.lookahead_forced, 0u);
}

// ---- sliding lookahead windows (PushLookahead, PopLookahead, SlideLookahead)

// Random batches of a trace: `count` of them, of up to `most` keys drawn
// skewed from [1, universe]; or (whole) each the universe shuffled, less a
// few keys, so that windows cover almost every cached row (forced evictions
// past the scan, both outside the window and Belady's).
std::vector<std::vector<uint64_t>> RandomBatches(std::mt19937_64& rng, size_t count, uint64_t most,
                                                 uint64_t universe, bool whole) {
  std::vector<std::vector<uint64_t>> batches(count);
  for (auto& batch : batches) {
    if (whole) {
      batch = KeysFrom1(universe);
      std::shuffle(batch.begin(), batch.end(), rng);
      batch.resize(universe - rng() % 8);
    } else {
      batch = ZipfLikeTrace(1 + rng() % most, universe, rng());
    }
  }
  return batches;
}

// The distinct keys of batch, at most `most` of them: what a test pins.
std::vector<uint64_t> FirstDistinct(const std::vector<uint64_t>& batch, size_t most) {
  std::vector<uint64_t> keys;
  for (const uint64_t k : batch) {
    if (keys.size() == most) break;
    if (std::find(keys.begin(), keys.end(), k) == keys.end()) keys.push_back(k);
  }
  return keys;
}

class SlidingLookahead : public ::testing::TestWithParam<std::tuple<std::string, uint32_t>> {};

// The twin test below runs on one thread: ThreadSanitizer finds nothing in it
// and runs it some 10x slower, so under TSan it takes three rounds (one past
// the scan) and ASan+UBSan and the plain build take all nine.
#if defined(__SANITIZE_THREAD__)
constexpr int kSlidingRounds = 3;
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
constexpr int kSlidingRounds = 3;
#else
constexpr int kSlidingRounds = 9;
#endif
#else
constexpr int kSlidingRounds = 9;
#endif

// A cache whose window slides batch by batch evicts exactly as one given
// the same batches concatenated (SetLookahead) before each batch, under the
// same accesses, pins and unpins: the same rows cached and the same counts
// after every batch, also in windows past kLookaheadScan rows a shard.
TEST_P(SlidingLookahead, SlidingEvictsAsSettingTheConcatenation) {
  const auto& [policy, shards] = GetParam();
  uint64_t forced = 0, spared = 0;
  for (int round = 0; round < kSlidingRounds; ++round) {
    SCOPED_TRACE("round " + std::to_string(round));
    std::mt19937_64 rng(1000 * shards + round);
    const bool past_scan = round % 3 == 2;
    const uint64_t capacity = past_scan ? shards * (MemCache::kLookaheadScan + 300) : 20 + rng() % 300;
    const uint64_t universe = past_scan ? capacity + 600 : capacity * (2 + rng() % 4);
    const size_t k = 1 + rng() % (past_scan ? 3 : 6);
    const size_t count = past_scan ? 7 : 40;
    const auto batches = RandomBatches(rng, count, 1 + capacity / 2, universe, past_scan);
    Backing slid_backing, set_backing;
    auto slid = BackedCache(slid_backing, policy, capacity, shards);
    auto set = BackedCache(set_backing, policy, capacity, shards);
    std::vector<uint64_t> pinned;  // the previous batch's pins, released after this batch's (the pipeline's overlap)
    for (size_t i = 0; i < count; ++i) {
      // The window: batches i+1..i+k.
      std::vector<uint64_t> window;
      for (size_t j = i + 1; j <= i + k && j < count; ++j) window.insert(window.end(), batches[j].begin(), batches[j].end());
      set->SetLookahead(window.data(), window.size());
      if (i == 0) {
        for (size_t j = 1; j <= k && j < count; ++j) {
          if (j == 1 && round % 2 == 1) {
            slid->SetLookahead(batches[j].data(), batches[j].size());  // a window of one batch, pushed onto
          } else {
            slid->PushLookahead(batches[j].data(), batches[j].size());
          }
        }
      } else if (i + k < count) {
        slid->SlideLookahead(batches[i + k].data(), batches[i + k].size());
      } else {  // no batch enters at the end of the data
        if (rng() % 2 == 0) {
          slid->PopLookahead();
        } else {
          slid->SlideLookahead(nullptr, 0);  // an empty batch in, the first out
        }
      }
      const std::vector<uint64_t>& batch = batches[i];
      std::vector<uint64_t> pins = FirstDistinct(batch, past_scan ? 50 : capacity / (4 * shards));
      const int op = static_cast<int>(rng() % 3);
      for (MemCache* cache : {slid.get(), set.get()}) {
        if (op == 0 || past_scan) {
          AccessAll(*cache, batch);
        } else {
          cache->Pull(batch.data(), batch.size() / 2, nullptr, /*pin=*/false, nullptr);
        }
        if (op != 2) cache->Pin(pins.data(), pins.size(), nullptr, nullptr);
        if (!pinned.empty()) cache->Unpin(pinned.data(), pinned.size());
      }
      pinned = op != 2 ? pins : std::vector<uint64_t>{};
      const MemCacheStats a = slid->stats(), b = set->stats();
      ASSERT_EQ(a.hits, b.hits) << "batch " << i;
      ASSERT_EQ(a.evictions, b.evictions) << "batch " << i;
      ASSERT_EQ(a.lookahead_spared, b.lookahead_spared) << "batch " << i;
      ASSERT_EQ(a.lookahead_forced, b.lookahead_forced) << "batch " << i;
      ASSERT_EQ(a.lookahead_keys, b.lookahead_keys) << "batch " << i;
      for (uint64_t key = 1; key <= universe; ++key) {
        ASSERT_EQ(slid->Contains(key), set->Contains(key)) << "batch " << i << " key " << key;
      }
    }
    if (past_scan) {
      forced += slid->stats().lookahead_forced;
      spared += slid->stats().lookahead_spared;
    }
  }
  EXPECT_GT(forced, 0u) << "no window past the scan forced an eviction";
  EXPECT_GT(spared, 0u);
}

INSTANTIATE_TEST_SUITE_P(All, SlidingLookahead,
                         ::testing::Combine(::testing::Values("lru", "tinylfu-lfu"), ::testing::Values(1u, 4u)));

// A key leaves the window with the last batch that has it, and a key in a
// later batch moves to it: after the pops, only the key needed soonest stays.
TEST(MemCacheLookahead, PoppedBatchesTakeTheirKeysAlong) {
  auto cache = TraceCache("lru", 3);
  AccessAll(*cache, {1, 2, 3});  // 1 the least recent
  const std::vector<uint64_t> first = {1, 2}, second = {2};
  cache->PushLookahead(first.data(), first.size());
  cache->PushLookahead(second.data(), second.size());
  EXPECT_EQ(cache->stats().lookahead_keys, 2u);
  cache->PopLookahead();  // 1 leaves, 2 stays (the second batch)
  EXPECT_EQ(cache->stats().lookahead_keys, 1u);
  AccessAll(*cache, {4});  // 1 goes: outside the window now
  EXPECT_FALSE(cache->Contains(1));
  EXPECT_TRUE(cache->Contains(2));
  EXPECT_EQ(cache->stats().lookahead_slides, 1u) << "the pop; pushes only grow the window";
}

TEST(MemCacheLookahead, PopOfAnEmptyWindowIsRefused) {
  auto cache = TraceCache("lru", 4);
  EXPECT_THROW(cache->PopLookahead(), std::invalid_argument);
  EXPECT_THROW(cache->SlideLookahead(nullptr, 0), std::invalid_argument);
  const std::vector<uint64_t> keys = {1, 2};
  cache->SetLookahead(keys.data(), keys.size());
  cache->PopLookahead();  // the set window is one batch
  EXPECT_EQ(cache->stats().lookahead_keys, 0u);
  EXPECT_THROW(cache->PopLookahead(), std::invalid_argument);
  cache->PushLookahead(keys.data(), keys.size());
  cache->ClearLookahead();
  EXPECT_THROW(cache->PopLookahead(), std::invalid_argument);
  EXPECT_EQ(cache->stats().lookahead_slides, 1u) << "refused calls count no slide";
}

TEST(MemCacheLookahead, ReservedKeyInASlideIsRefusedAndTheWindowStays) {
  auto cache = TraceCache("lru", 4);
  const std::vector<uint64_t> first = {1, 2}, second = {3};
  cache->PushLookahead(first.data(), first.size());
  cache->PushLookahead(second.data(), second.size());
  const std::vector<uint64_t> bad = {4, kEmptyKey};
  EXPECT_THROW(cache->PushLookahead(bad.data(), bad.size()), std::invalid_argument);
  EXPECT_THROW(cache->SlideLookahead(bad.data(), bad.size()), std::invalid_argument);
  EXPECT_EQ(cache->stats().lookahead_keys, 3u);
  cache->PopLookahead();
  EXPECT_EQ(cache->stats().lookahead_keys, 1u) << "the batches are the two pushed";
  cache->PopLookahead();
  EXPECT_THROW(cache->PopLookahead(), std::invalid_argument);
}

// Under TSan and ASan: as above, with a window that slides batch by batch
// (tables grown outside the shard locks, keys moved and dropped under them),
// some batches naming every key, so that evictions past the scan are forced
// and the whole-shard lists are built and dropped by slides.
TEST(MemCacheLookahead, WindowSlidesRaceNothing) {
  const uint64_t capacity = MemCache::kLookaheadScan + 300, pulled = capacity + 600, all = pulled + 600;
  Backing backing;
  auto cache = BackedCache(backing, "tinylfu-lfu", capacity, 1);
  std::mt19937_64 rng(7);
  auto batch = [&] {
    std::vector<uint64_t> keys(rng() % 3 == 0 ? all : 200 + rng() % 3000);
    for (uint64_t k = 0; k < keys.size(); ++k) keys[k] = keys.size() == all ? k : rng() % all;
    std::shuffle(keys.begin(), keys.end(), rng);
    return keys;
  };
  for (int j = 0; j < 4; ++j) {
    const std::vector<uint64_t> keys = batch();
    cache->PushLookahead(keys.data(), keys.size());
  }
  std::atomic<bool> done{false};
  std::thread prefetch([&] {
    while (!done.load()) {
      const std::vector<uint64_t> keys = batch();
      cache->SlideLookahead(keys.data(), keys.size());
      (void)cache->stats();
    }
  });
  PullAndReplayAlongside(*cache, pulled, ReplayedIn(pulled, all), done, prefetch);
  const MemCacheStats st = cache->stats();
  EXPECT_EQ(st.pinned, 0u);
  EXPECT_GT(st.lookahead_slides, 4u);
}

// ---- the deferred order (src/cache/cache_policy.cc, DeferredOrder)

// Until the cache first fills, lru only stamps visits; the order it builds
// at the first eviction is the one eager visits give: least recent first,
// pins out of it until their unpin, which counts as a visit.
TEST(MemCacheDeferredOrder, LruBuiltAtTheFirstEvictionEvictsInRecencyOrder) {
  auto cache = TraceCache("lru", 6);
  AccessAll(*cache, {1, 2, 3, 4, 5, 6});
  const std::vector<uint64_t> pinned{2, 4};
  std::vector<uint8_t> hit(2);
  ASSERT_EQ(cache->Pin(pinned.data(), 2, hit.data(), nullptr), 2u);
  AccessAll(*cache, {1});  // 1 after 6
  const std::vector<uint64_t> unpin{4, 2};
  for (uint64_t k : unpin) cache->Unpin(&k, 1);  // then 4, then 2
  const uint64_t five = 5;
  ASSERT_EQ(cache->Pin(&five, 1, hit.data(), nullptr), 1u);
  // Order, least recent first: 3, [5 pinned], 6, 1, 4, 2.
  const auto evicts = [&](uint64_t fresh, uint64_t expected) {
    AccessAll(*cache, {fresh});
    EXPECT_FALSE(cache->Contains(expected)) << "key " << fresh << " should have evicted " << expected;
    EXPECT_EQ(cache->stats().size, 6u);
  };
  evicts(7, 3);
  evicts(8, 6);
  EXPECT_TRUE(cache->Contains(5)) << "a pinned row was evicted";
  cache->Unpin(&five, 1);  // now: 1, 4, 2, 7, 8, 5
  evicts(9, 1);
  evicts(10, 4);
  evicts(11, 2);
  evicts(12, 7);
  evicts(13, 8);
  evicts(14, 5);
  EXPECT_EQ(cache->stats().pinned, 0u);
}

// Every pinned row survives the build and the evictions after it, for every
// policy (those that build late and those that order eagerly), and rows
// erased before the build do not come back into the order.
TEST_P(MemCachePolicies, PinsAndErasesBeforeTheFirstEvictionHoldAfterIt) {
  auto cache = TraceCache(GetParam(), 64);
  std::vector<uint64_t> fill(64);
  for (uint64_t k = 0; k < 64; ++k) fill[k] = k + 1;
  AccessAll(*cache, fill);
  std::vector<uint64_t> pinned;
  for (uint64_t k = 1; k <= 64; k += 4) pinned.push_back(k);
  std::vector<uint8_t> hit(pinned.size());
  ASSERT_EQ(cache->Pin(pinned.data(), pinned.size(), hit.data(), nullptr), pinned.size());
  const std::vector<uint64_t> erased{2, 3};
  ASSERT_EQ(cache->Erase(erased.data(), erased.size()), 2u);
  std::vector<uint64_t> others(5000);  // 997 keys, none of the rows above
  for (uint64_t i = 0; i < others.size(); ++i) others[i] = 1000 + i * 7919 % 997;
  AccessAll(*cache, others);  // fills the two free slots, then evicts
  EXPECT_GT(cache->stats().evictions, 900u);
  for (uint64_t k : pinned) EXPECT_TRUE(cache->Contains(k)) << GetParam() << " evicted pinned key " << k;
  EXPECT_EQ(cache->stats().size, 64u);
  EXPECT_EQ(cache->stats().pinned, pinned.size());
  for (uint64_t k : pinned) cache->Unpin(&k, 1);
  EXPECT_EQ(cache->stats().pinned, 0u);
  // Back in the order: erasing takes them out of it (a row missing from it
  // would corrupt the lists, which the sanitizers and the refill would see).
  ASSERT_EQ(cache->Erase(pinned.data(), pinned.size()), pinned.size());
  std::vector<uint64_t> fresh(200);
  for (uint64_t k = 0; k < fresh.size(); ++k) fresh[k] = 100000 + k;
  AccessAll(*cache, fresh);
  EXPECT_EQ(cache->stats().size, 64u);
  for (uint64_t k : pinned) EXPECT_FALSE(cache->Contains(k));
}


// ---- trace replay (Access)

// Access returns and counts its hits and misses like Pull does.
TEST(MemCacheAccess, CountsHitsAndMisses) {
  auto cache = TraceCache("lru", 2);
  const std::vector<uint64_t> keys = {1, 2, 1, 3, 1};  // hits: the second and third 1
  std::vector<uint8_t> hit(keys.size());
  EXPECT_EQ(cache->Access(keys.data(), keys.size(), hit.data()), 2u);
  EXPECT_EQ(hit, (std::vector<uint8_t>{0, 0, 1, 0, 1}));
  const MemCacheStats st = cache->stats();
  EXPECT_EQ(st.hits, 2u);
  EXPECT_EQ(st.misses, 3u);
  EXPECT_EQ(st.evictions, 1u);
}

// Access records each visit in the admission sketch: tinylfu-lfu keeps
// the frequent row over the recent one.
TEST(MemCacheAccess, VisitsCountInTheSketch) {
  auto cache = TraceCache("tinylfu-lfu", 2);
  AccessAll(*cache, {8, 8, 8, 7});
  AccessAll(*cache, {9});  // evicts the least frequent, 7, not the least recent, 8
  EXPECT_TRUE(cache->Contains(8));
  EXPECT_FALSE(cache->Contains(7));
}

// A replayed hit on a pinned row counts, but leaves the row out of the
// policy's order: it stays cached, whatever the replay evicts after.
TEST_P(MemCachePolicies, AccessHitOnAPinnedRowLeavesItPinned) {
  auto cache = TraceCache(GetParam(), 4);
  AccessAll(*cache, {1, 2, 3, 4});
  const uint64_t one = 1;
  std::vector<uint8_t> hit(1);
  ASSERT_EQ(cache->Pin(&one, 1, hit.data(), nullptr), 1u);
  for (int i = 0; i < 3; ++i) AccessAll(*cache, {1});
  std::vector<uint64_t> others(100);
  for (uint64_t k = 0; k < others.size(); ++k) others[k] = 100 + k;
  AccessAll(*cache, others);
  EXPECT_TRUE(cache->Contains(one)) << GetParam() << " evicted a pinned row";
  EXPECT_EQ(cache->stats().pinned, 1u);
  EXPECT_EQ(cache->stats().size, 4u);
  cache->Unpin(&one, 1);
}

// The reserved key (kEmptyKey) is never cached: Contains says so, and Erase
// refuses it like every other call that takes keys, changing nothing. (The
// index marks its empty buckets with that key: looked up, it finds one.)
TEST(MemCache, ReservedKeyIsNeverCachedNorErased) {
  Backing backing;
  auto cache = BackedCache(backing, "lru", 4096, 1);
  std::vector<uint64_t> keys(4096);  // enough to reach every part of the index
  for (uint64_t k = 0; k < keys.size(); ++k) keys[k] = k + 1;
  cache->Pull(keys.data(), keys.size(), nullptr, /*pin=*/false, nullptr);
  const std::vector<uint64_t> some = {1, 2, 3};
  cache->Erase(some.data(), some.size());  // leaves holes in the index
  EXPECT_FALSE(cache->Contains(kEmptyKey));
  const uint64_t before = cache->stats().size;
  const std::vector<uint64_t> erase = {4, kEmptyKey};
  EXPECT_THROW(cache->Erase(erase.data(), erase.size()), std::invalid_argument);
  EXPECT_EQ(cache->stats().size, before);
  EXPECT_TRUE(cache->Contains(4));
  // Every row is still its key's, once the erased keys are back (the first
  // pass copies misses from the loader; the second reads every row cached).
  for (int pass = 0; pass < 2; ++pass) {
    std::vector<uint64_t> rows(keys.size());
    cache->Pull(keys.data(), keys.size(), reinterpret_cast<uint8_t*>(rows.data()), /*pin=*/false, nullptr);
    for (size_t i = 0; i < keys.size(); ++i) ASSERT_EQ(rows[i], keys[i] * 1000) << "pass " << pass << ", key " << keys[i];
  }
  EXPECT_EQ(cache->stats().size, keys.size());
  // New keys evict; none may take a slot that still holds a cached row.
  std::vector<uint64_t> fresh(64);
  for (uint64_t k = 0; k < fresh.size(); ++k) fresh[k] = 100000 + k;
  cache->Pull(fresh.data(), fresh.size(), nullptr, /*pin=*/false, nullptr);
  std::vector<uint64_t> rows(keys.size());
  cache->Pull(keys.data(), keys.size(), reinterpret_cast<uint8_t*>(rows.data()), /*pin=*/false, nullptr);
  for (size_t i = 0; i < keys.size(); ++i) ASSERT_EQ(rows[i], keys[i] * 1000) << "key " << keys[i];
}

// ---- the replacement policies themselves (src/cache/cache_policy.h)

// Drives one policy as a shard does (Record before every visit) through
// random adds, visits, pins, unpins, walks, defers and evictions. After each
// step: a walk names every ordered row once, no pinned or free one, and at
// most `limit`; Evict takes the walk's first. For lru, lfu and tinylfu-lfu
// the walk is also checked against a reference order, (rank, last visit)
// least first: lru's rank is nothing, lfu's the visits since the row was
// added, tinylfu-lfu's the key's count at the row's last visit (or when the
// order was built, for rows visited before). The tinylfu-lfu sketch is large
// for the few keys, so its estimates are the exact counts. lru+lfu's
// reference: the LFU's rows by (visits since added, when they left the
// LRU), then the LRU's (its half of the slots) least recent first.
class PolicyWalk : public ::testing::TestWithParam<std::string> {};

TEST_P(PolicyWalk, WalksNameTheOrderedRowsInOrderAndEvictTakesTheFirst) {
  const CachePolicyKind kind = ParseCachePolicy(GetParam());
  constexpr uint32_t kSlots = 48;
  // tinylfu-lfu's sketch grows with the capacity: room for exact counts.
  const uint32_t capacity = kind == CachePolicyKind::kTinyLfuLfu ? 1024 : kSlots;
  auto policy = detail::NewCachePolicy(kind, capacity, 0.5);
  const bool modelled = kind != CachePolicyKind::kWTinyLfu;
  const bool two_parts = kind == CachePolicyKind::kLruLfu;
  const uint32_t lru_share = kSlots / 2;
  enum State { kFree, kOrdered, kPinned };
  std::vector<State> state(kSlots, kFree);
  std::vector<uint64_t> key_of(kSlots, 0), rank(kSlots, 0), last(kSlots, 0);
  std::vector<uint8_t> in_lru(kSlots, 0);  // lru+lfu: in its LRU part
  std::map<uint64_t, uint64_t> recorded;  // key -> Record calls
  uint64_t clock = 0;
  bool built = kind == CachePolicyKind::kLfu;  // lru and tinylfu-lfu order at the first walk or eviction
  std::mt19937_64 rng(17);
  const auto record = [&](uint64_t key) {
    policy->Record(key);
    ++recorded[key];
  };
  const auto visit_rank = [&](uint32_t slot, bool added) -> uint64_t {
    switch (kind) {
      case CachePolicyKind::kLfu:
      case CachePolicyKind::kLruLfu: return added ? 1 : rank[slot] + 1;
      case CachePolicyKind::kTinyLfuLfu: return std::min<uint64_t>(recorded[key_of[slot]], 255);
      default: return 0;
    }
  };
  const auto slots_in = [&](State s) {
    std::vector<uint32_t> out;
    for (uint32_t slot = 0; slot < kSlots; ++slot) {
      if (state[slot] == s) out.push_back(slot);
    }
    return out;
  };
  // A visit of an ordered row: its rank and recency; lru+lfu's enter its
  // LRU, whose least recent beyond its share go to the LFU.
  const auto visited = [&](uint32_t slot, bool added) {
    rank[slot] = visit_rank(slot, added);
    last[slot] = ++clock;
    if (!two_parts) return;
    in_lru[slot] = 1;
    for (;;) {
      std::vector<uint32_t> lru;
      for (uint32_t s = 0; s < kSlots; ++s) {
        if (state[s] == kOrdered && in_lru[s]) lru.push_back(s);
      }
      if (lru.size() <= lru_share) return;
      const uint32_t oldest = *std::min_element(lru.begin(), lru.end(), [&](uint32_t a, uint32_t b) { return last[a] < last[b]; });
      in_lru[oldest] = 0;
      last[oldest] = ++clock;
    }
  };
  const auto build = [&] {
    if (built) return;
    built = true;
    if (kind == CachePolicyKind::kTinyLfuLfu) {
      for (uint32_t slot : slots_in(kOrdered)) rank[slot] = std::min<uint64_t>(recorded[key_of[slot]], 255);
    }
  };
  const auto expected_order = [&] {
    std::vector<uint32_t> order = slots_in(kOrdered);
    std::sort(order.begin(), order.end(), [&](uint32_t a, uint32_t b) {
      if (in_lru[a] != in_lru[b]) return in_lru[a] < in_lru[b];
      if (!in_lru[a] && rank[a] != rank[b]) return rank[a] < rank[b];
      return last[a] < last[b];
    });
    return order;
  };
  const auto walk = [&](uint32_t limit) {
    std::vector<uint32_t> named = CandidateOrder(*policy, limit);
    build();
    return named;
  };
  const auto pick = [&](const std::vector<uint32_t>& from) { return from[rng() % from.size()]; };
  uint64_t next_key = 1;
  for (int step = 0; step < 4000; ++step) {
    const int op = static_cast<int>(rng() % 100);
    const std::vector<uint32_t> free = slots_in(kFree), ordered = slots_in(kOrdered), pinned = slots_in(kPinned);
    if (op < 25 && !free.empty()) {  // a miss takes a free slot; keys come back now and then
      const uint32_t slot = pick(free);
      const uint64_t key = rng() % 4 == 0 && next_key > 1 ? 1 + rng() % next_key : next_key++;
      bool cached = false;
      for (uint32_t s = 0; s < kSlots; ++s) cached |= state[s] != kFree && key_of[s] == key;
      if (cached) continue;
      record(key);
      key_of[slot] = key;
      policy->Add(slot, key);
      state[slot] = kOrdered;
      visited(slot, true);
    } else if (op < 45 && !ordered.empty()) {  // a hit
      const uint32_t slot = pick(ordered);
      record(key_of[slot]);
      policy->Touch(slot);
      in_lru[slot] = 0;  // Touch is a Detach and a Reattach
      visited(slot, false);
    } else if (op < 55 && !ordered.empty()) {  // a pin
      const uint32_t slot = pick(ordered);
      record(key_of[slot]);
      policy->Detach(slot);
      state[slot] = kPinned;
      in_lru[slot] = 0;
    } else if (op < 65 && !pinned.empty()) {  // its unpin, a visit
      const uint32_t slot = pick(pinned);
      policy->Reattach(slot);
      state[slot] = kOrdered;
      visited(slot, false);
    } else if (op < 72) {  // a key no row holds
      record(100000 + rng() % 50);
    } else if (op < 85) {
      const std::vector<uint32_t> first = walk(1);
      const uint32_t victim = policy->Evict();
      if (ordered.empty()) {
        ASSERT_EQ(victim, detail::kNoSlot) << "step " << step;
        ASSERT_TRUE(first.empty());
        continue;
      }
      ASSERT_EQ(first.size(), 1u) << "step " << step;
      ASSERT_EQ(victim, first[0]) << "step " << step << ": Evict took another row than the walk's first";
      if (modelled) {
        ASSERT_EQ(victim, expected_order()[0]) << "step " << step;
      }
      state[victim] = kFree;
      in_lru[victim] = 0;
    } else {
      const uint32_t limit = std::vector<uint32_t>{0, 1, 2, 5, UINT32_MAX}[rng() % 5];
      const std::vector<uint32_t> named = walk(limit);
      ASSERT_EQ(named.size(), std::min<uint64_t>(limit, ordered.size())) << "step " << step << ", limit " << limit;
      std::vector<uint32_t> sorted = named;
      std::sort(sorted.begin(), sorted.end());
      ASSERT_TRUE(std::adjacent_find(sorted.begin(), sorted.end()) == sorted.end()) << "step " << step;
      for (uint32_t slot : named) ASSERT_EQ(state[slot], kOrdered) << "step " << step << ", slot " << slot;
      if (modelled) {
        const std::vector<uint32_t> want = expected_order();
        ASSERT_EQ(named, std::vector<uint32_t>(want.begin(), want.begin() + named.size())) << "step " << step;
      }
      // Pass some over, as a lookahead eviction does: a new last visit, the same rank.
      for (uint32_t slot : named) {
        if (rng() % 2 == 0) continue;
        policy->Defer(slot);
        last[slot] = ++clock;
      }
    }
  }
}

// A lookahead eviction's walk (WalkCandidates, as MemCache's Victim makes
// it: the walk again, unskipped, when no row outside the window came; no
// Defer of the rows of whole runs) against the walk it stands for
// (ForEachCandidate, every row visited and every passed row deferred), on
// twin policies told the same: each eviction takes the same row, and the two
// orders stay the same. Windows are drawn so that whole runs of rows in them
// are common (most keys in, a few counts or estimates), and each lasts some
// evictions (an epoch), so that every policy with runs skips some (lru has
// none: see WalkCandidates).
TEST_P(PolicyWalk, WalksSkippingPassedRunsEvictAsWalksVisitingEveryRow) {
  const CachePolicyKind kind = ParseCachePolicy(GetParam());
  constexpr uint32_t kSlots = 48;
  const uint32_t capacity = kind == CachePolicyKind::kTinyLfuLfu ? 1024 : kSlots;
  auto skipping = detail::NewCachePolicy(kind, capacity, 0.5);
  auto visiting = detail::NewCachePolicy(kind, capacity, 0.5);
  const auto both = [&](auto change) {
    change(*skipping);
    change(*visiting);
  };
  enum State { kFree, kOrdered, kPinned };
  std::vector<State> state(kSlots, kFree);
  std::vector<uint64_t> key_of(kSlots, 0);
  std::mt19937_64 rng(29);
  uint64_t epoch = 1, share = 90, skipped = 0;  // share: the percent of keys in the window
  const auto in_window = [&](uint64_t key) { return (key * 0x9E3779B97F4A7C15ULL + epoch) % 100 < share; };
  const auto slots_in = [&](State st) {
    std::vector<uint32_t> out;
    for (uint32_t slot = 0; slot < kSlots; ++slot) {
      if (state[slot] == st) out.push_back(slot);
    }
    return out;
  };
  const auto pick = [&](const std::vector<uint32_t>& from) { return from[rng() % from.size()]; };
  // An eviction under the window, each policy walked its way; the slot freed, or kNoSlot.
  const auto evict = [&](int step) -> uint32_t {
    const uint32_t limit = std::vector<uint32_t>{1, 3, 8, 20, UINT32_MAX}[rng() % 5];
    std::vector<uint32_t> passed, visited;
    uint32_t spare = detail::kNoSlot, spare_visiting = detail::kNoSlot;
    const std::function<bool(uint32_t)> skip_visit = [&](uint32_t slot) {
      passed.push_back(slot);
      if (in_window(key_of[slot])) return true;
      spare = slot;
      return false;
    };
    detail::CachePolicy::Walk walk = skipping->WalkCandidates(limit, epoch, skip_visit);
    skipped += walk.skipped;
    if (spare == detail::kNoSlot && walk.skipped > 0) {
      passed.clear();
      walk = skipping->WalkCandidates(limit, 0, skip_visit);
      EXPECT_EQ(walk.skipped, 0u) << "step " << step << ": epoch 0 skips nothing";
    }
    visiting->ForEachCandidate(limit, [&](uint32_t slot) {
      visited.push_back(slot);
      if (in_window(key_of[slot])) return true;
      spare_visiting = slot;
      return false;
    });
    EXPECT_EQ(spare, spare_visiting) << "step " << step;
    EXPECT_EQ(passed.size() + walk.skipped, visited.size()) << "step " << step << ": rows seen";
    if (spare == detail::kNoSlot) {
      EXPECT_EQ(passed, visited) << "step " << step;
    }
    EXPECT_LE(walk.whole, passed.size()) << "step " << step;
    if (visited.empty()) return detail::kNoSlot;
    // The row taken: the spare, else any the walk saw (MemCache's latest needed, or Beyond's).
    const uint32_t victim = spare_visiting != detail::kNoSlot ? spare_visiting : visited[rng() % visited.size()];
    for (size_t i = walk.whole; i < passed.size(); ++i) {
      if (passed[i] != victim) skipping->Defer(passed[i]);
    }
    for (const uint32_t slot : visited) {
      if (slot != victim) visiting->Defer(slot);
    }
    both([&](detail::CachePolicy& p) { p.Detach(victim); });
    state[victim] = kFree;
    return victim;
  };
  uint64_t next_key = 1;
  for (int step = 0; step < 20000; ++step) {
    const int op = static_cast<int>(rng() % 100);
    const std::vector<uint32_t> ordered = slots_in(kOrdered), pinned = slots_in(kPinned);
    if (op < 50) {  // a miss, its key visited 1 to 3 times before: a free slot, or a victim's
      std::vector<uint32_t> free = slots_in(kFree);
      if (free.empty()) free.assign(1, evict(step));
      if (free[0] == detail::kNoSlot) continue;  // every row pinned
      const uint32_t slot = pick(free);
      const uint64_t key = next_key++;
      for (uint64_t r = rng() % 3; r-- > 0;) both([&](detail::CachePolicy& p) { p.Record(key); });
      both([&](detail::CachePolicy& p) { p.Record(key); });
      key_of[slot] = key;
      both([&](detail::CachePolicy& p) { p.Add(slot, key); });
      state[slot] = kOrdered;
    } else if (op < 62 && !ordered.empty()) {  // a hit
      const uint32_t slot = pick(ordered);
      both([&](detail::CachePolicy& p) { p.Record(key_of[slot]); });
      both([&](detail::CachePolicy& p) { p.Touch(slot); });
    } else if (op < 70 && !ordered.empty()) {  // a pin
      const uint32_t slot = pick(ordered);
      both([&](detail::CachePolicy& p) { p.Record(key_of[slot]); });
      both([&](detail::CachePolicy& p) { p.Detach(slot); });
      state[slot] = kPinned;
    } else if (op < 78 && !pinned.empty()) {  // its unpin
      const uint32_t slot = pick(pinned);
      both([&](detail::CachePolicy& p) { p.Reattach(slot); });
      state[slot] = kOrdered;
    } else if (op < 81) {  // the window moves on
      ++epoch;
      share = std::vector<uint64_t>{0, 50, 90, 95, 100}[rng() % 5];
    } else {
      evict(step);
    }
    ASSERT_EQ(CandidateOrder(*skipping), CandidateOrder(*visiting)) << "step " << step;
    ASSERT_FALSE(HasFailure()) << "step " << step;
  }
  if (kind == CachePolicyKind::kLru) {
    EXPECT_EQ(skipped, 0u) << "a policy without runs visits every row";
  } else {
    EXPECT_GT(skipped, 1000u) << "the walks skipped runs they had passed";
  }
}

INSTANTIATE_TEST_SUITE_P(All, PolicyWalk, ::testing::Values("lru", "lfu", "lru+lfu", "w-tinylfu", "tinylfu-lfu"));

// tinylfu-lfu's counts are halved every 200 x capacity accesses (its
// "slowly aged" sketch): then every row is ordered by its halved estimate,
// so a key that became more frequent since outranks an old hot one, and rows
// of one estimate keep their recency order.
TEST(PolicyAging, TinyLfuLfuReordersItsRowsByTheHalvedCounts) {
  auto policy = detail::NewCachePolicy(CachePolicyKind::kTinyLfuLfu, 4, 0.5);
  const uint64_t hot = 1, rising = 2, a = 3, b = 4, other = 5;
  uint64_t accesses = 0;
  const auto record = [&](uint64_t key, int times) {
    for (int i = 0; i < times; ++i, ++accesses) policy->Record(key);
  };
  record(hot, 100);
  policy->Add(0, hot);
  record(a, 1);
  policy->Add(2, a);
  record(b, 1);
  policy->Add(3, b);
  record(rising, 10);
  policy->Add(1, rising);
  const auto walk = [&] { return CandidateOrder(*policy); };
  ASSERT_EQ(walk(), (std::vector<uint32_t>{2, 3, 1, 0}));  // a 1, b 1, rising 10, hot 100
  record(other, static_cast<int>(200 * 4 - accesses));  // the period's last access halves: hot 50, rising 5
  record(rising, 50);
  policy->Touch(1);  // rising 55 + 0 (its Record comes first)
  EXPECT_EQ(walk(), (std::vector<uint32_t>{2, 3, 0, 1})) << "a 0, b 0, hot 50, rising 55";
}

// w-tinylfu: a window of 1% of the slots in front of the main space. A row
// leaving the window enters the main space only if the sketch counts its key
// more often than the main space's victim's: a one-off key does not push out
// a row seen as often (TinyLFU's admission), here the least recent row.
TEST(MemCache, WTinyLfuAdmitsFromItsOnePercentWindowOnlyTheMoreFrequent) {
  auto cache = TraceCache("w-tinylfu", 100);  // a window of 1 row
  std::vector<uint64_t> fill(100);
  for (uint64_t k = 0; k < fill.size(); ++k) fill[k] = k + 1;
  AccessAll(*cache, fill);  // 100 in the window, 1..99 in the main space
  AccessAll(*cache, {101});  // 100 leaves the window, as frequent as 1: not admitted
  EXPECT_FALSE(cache->Contains(100));
  EXPECT_TRUE(cache->Contains(1));
  AccessAll(*cache, {101, 102});  // 101, seen twice, is admitted over 1
  EXPECT_TRUE(cache->Contains(101));
  EXPECT_FALSE(cache->Contains(1));
  for (uint64_t k = 2; k <= 99; ++k) EXPECT_TRUE(cache->Contains(k)) << k;
}

// w-tinylfu's walk: the duel's loser, then the window's rows, the
// probation's and the protected's, each least recent first. A row hit in
// the probation moves to the protected segment (80% of the main space), whose
// least recent row goes back to the probation's front when it overflows; a
// row passed over goes to the front of its own segment; the window's oldest
// row is admitted over the main space's victim only when more frequent.
TEST(PolicySegments, WTinyLfuWalksItsWindowThenProbationThenProtected) {
  auto policy = detail::NewCachePolicy(CachePolicyKind::kWTinyLfu, 10, 0.5);  // window 1, protected 7
  const auto key = [](uint32_t slot) { return uint64_t{slot} + 1; };
  const auto walk = [&] { return CandidateOrder(*policy); };
  for (uint32_t slot = 0; slot < 10; ++slot) {
    policy->Record(key(slot));
    policy->Add(slot, key(slot));
  }
  // Window: 9; probation, least recent first: 0 .. 8. 9 loses its duel with 0 (a tie).
  EXPECT_EQ(walk(), (std::vector<uint32_t>{9, 0, 1, 2, 3, 4, 5, 6, 7, 8}));
  for (uint32_t slot = 0; slot < 8; ++slot) {
    policy->Record(key(slot));
    policy->Touch(slot);  // probation -> protected; the 8th pushes 0 back to the probation
  }
  EXPECT_EQ(walk(), (std::vector<uint32_t>{9, 8, 0, 1, 2, 3, 4, 5, 6, 7}));
  policy->Defer(8);  // to the probation's front, behind 0
  EXPECT_EQ(walk(), (std::vector<uint32_t>{9, 0, 8, 1, 2, 3, 4, 5, 6, 7}));
  for (int i = 0; i < 2; ++i) policy->Record(key(9));  // 9 is seen 3 times, 0 twice: 9 wins
  EXPECT_EQ(walk(), (std::vector<uint32_t>{0, 9, 8, 1, 2, 3, 4, 5, 6, 7}));
  EXPECT_EQ(policy->Evict(), 0u);
  EXPECT_EQ(walk(), (std::vector<uint32_t>{8, 9, 1, 2, 3, 4, 5, 6, 7})) << "9 went to the probation's front";
}


// ---- The window's memory (MemCache::SetLookahead, "Memory") ----

// A trace cache of one LRU shard whose window may hold `room` bytes.
std::unique_ptr<MemCache> RoomyCache(uint64_t capacity, uint64_t room) {
  MemCacheOptions o = EightByteRows(capacity, 1, CachePolicyKind::kLru);
  o.lookahead_room = room;
  return MemCache::New(o, nullptr, nullptr);
}

// The sizes of the window's structures: a table's slot (12 bytes, 20 once
// it slides), an entry of a sliding window (in chunks of 64, each chunk
// behind an 8-byte pointer), a batch's count of keys.
constexpr uint64_t kSetSlot = 12, kSlidingSlot = 20, kEntry = 24, kChunk = 64, kPointer = 8, kCount = 8;

// The eviction scratch of a shard: 4 bytes a candidate a walk may pass over.
uint64_t ScratchOf(uint64_t capacity) { return 4 * std::min<uint64_t>(MemCache::kLookaheadScan, capacity); }

// Beyond's lists: room for 2 x capacity + 1 entries of 4 and 8 bytes, and its
// walk's scratch, 8 bytes an entry it may hold.
uint64_t BeyondOf(uint64_t capacity) {
  return (2 * capacity + 1) * 12 + 8 * std::min<uint64_t>(MemCache::kLookaheadScan, 2 * capacity + 1);
}

std::vector<uint64_t> KeysFrom(uint64_t first, uint64_t n) {
  std::vector<uint64_t> keys(n);
  for (uint64_t k = 0; k < n; ++k) keys[k] = first + k;
  return keys;
}

TEST(MemCacheLookaheadRoom, SetWindowCountsItsTableAndScratch) {
  auto cache = RoomyCache(64, MemCache::kUnboundedRoom);
  EXPECT_EQ(cache->stats().lookahead_bytes, 0u);
  EXPECT_EQ(cache->stats().lookahead_room, MemCache::kUnboundedRoom);
  std::vector<uint64_t> keys = KeysFrom1(10);
  keys.insert(keys.end(), {1, 2});  // 12 keys, 10 distinct
  cache->SetLookahead(keys.data(), keys.size());
  // A table of 32 slots (a power of two, at least twice its 12 keys), the one batch's count, the scratch.
  EXPECT_EQ(cache->stats().lookahead_bytes, 32 * kSetSlot + kCount + ScratchOf(64));
  cache->ClearLookahead();
  EXPECT_EQ(cache->stats().lookahead_bytes, 0u);
}

// Pushes, slides and pops change the count by what their tables, entries
// and counts take and free.
TEST(MemCacheLookaheadRoom, SlidingWindowCountsItsEntriesAsTheyComeAndGo) {
  auto cache = RoomyCache(64, MemCache::kUnboundedRoom);
  const std::vector<uint64_t> b1 = KeysFrom(1, 300), b2 = KeysFrom(301, 300), b3 = KeysFrom(601, 300);
  const uint64_t scratch = ScratchOf(64), chunk = kChunk * kEntry;
  cache->PushLookahead(b1.data(), b1.size());
  // 1024 slots for 300 keys; 300 entries in 5 chunks (room for 8 pointers: doubled as they came); one count a
  // batch, in the shard and the cache.
  EXPECT_EQ(cache->stats().lookahead_bytes, 1024 * kSlidingSlot + 5 * chunk + 8 * kPointer + 2 * kCount + scratch);
  cache->PushLookahead(b2.data(), b2.size());
  // 2048 slots; 600 entries in 10 chunks, room for 16 pointers; room for 2 counts each.
  EXPECT_EQ(cache->stats().lookahead_bytes, 2048 * kSlidingSlot + 10 * chunk + 16 * kPointer + 4 * kCount + scratch);
  cache->SlideLookahead(b3.data(), b3.size());
  // 900 entries in 15 chunks, then b1's 300 go and free the 4 chunks they alone used; room for 4 counts each.
  EXPECT_EQ(cache->stats().lookahead_bytes, 2048 * kSlidingSlot + 11 * chunk + 16 * kPointer + 8 * kCount + scratch);
  EXPECT_EQ(cache->stats().lookahead_keys, 600u);
  cache->PopLookahead();  // b2's 300 go (from entry 44 of the first chunk): 5 chunks more
  EXPECT_EQ(cache->stats().lookahead_bytes, 2048 * kSlidingSlot + 6 * chunk + 16 * kPointer + 8 * kCount + scratch);
  EXPECT_EQ(cache->stats().lookahead_keys, 300u);
  // A set window gets its entries at the next push: listed as its batch, then the push's.
  cache->SetLookahead(b1.data(), b1.size());
  EXPECT_EQ(cache->stats().lookahead_bytes, 1024 * kSetSlot + kCount + scratch);
  cache->PushLookahead(b2.data(), b2.size());
  EXPECT_EQ(cache->stats().lookahead_bytes, 2048 * kSlidingSlot + 10 * chunk + 16 * kPointer + 4 * kCount + scratch);
  cache->ClearLookahead();
  EXPECT_EQ(cache->stats().lookahead_bytes, 0u);
}

// A change whose window would pass the room is refused, naming both, and
// the window stays: its keys, its bytes and its evictions.
TEST(MemCacheLookaheadRoom, WindowPastItsRoomIsRefusedAndStays) {
  const uint64_t one = 16 * kSetSlot + kCount + ScratchOf(4);  // a set window of one key: the least table
  auto cache = RoomyCache(4, one);
  const std::vector<uint64_t> first = {1};
  cache->SetLookahead(first.data(), first.size());
  EXPECT_EQ(cache->stats().lookahead_bytes, one);
  const std::vector<uint64_t> nine = KeysFrom1(9);  // 32 slots
  const uint64_t need = 32 * kSetSlot + kCount + ScratchOf(4);
  try {
    cache->SetLookahead(nine.data(), nine.size());
    FAIL() << "a window past its room was set";
  } catch (const CacheFullError& e) {
    EXPECT_NE(std::string(e.what()).find(std::to_string(need) + " bytes"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("room of " + std::to_string(one) + " bytes"), std::string::npos) << e.what();
  }
  const std::vector<uint64_t> second = {2};
  EXPECT_THROW(cache->PushLookahead(second.data(), second.size()), CacheFullError);  // its entries, chained
  EXPECT_THROW(cache->SlideLookahead(second.data(), second.size()), CacheFullError);
  EXPECT_EQ(cache->stats().lookahead_bytes, one);
  EXPECT_EQ(cache->stats().lookahead_keys, 1u);
  EXPECT_EQ(cache->stats().lookahead_slides, 0u);
  AccessAll(*cache, {1, 2, 3, 4, 5});  // 5 evicts the least recent row outside the window: 2, not 1
  EXPECT_TRUE(cache->Contains(1));
  EXPECT_FALSE(cache->Contains(2));
  EXPECT_EQ(cache->stats().lookahead_spared, 1u);
  // A pop right after a set lists the set window's entries first (see PushLookahead): room too.
  EXPECT_THROW(cache->PopLookahead(), CacheFullError);
  EXPECT_EQ(cache->stats().lookahead_keys, 1u);
  cache->ClearLookahead();
  EXPECT_EQ(cache->stats().lookahead_bytes, 0u);
}

// No room (the default): no window, not even an empty one; eviction as without.
TEST(MemCacheLookaheadRoom, NoRoomNoWindow) {
  MemCacheOptions o = EightByteRows(4, 1, CachePolicyKind::kLru);
  o.lookahead_room = MemCacheOptions{}.lookahead_room;
  auto cache = MemCache::New(o, nullptr, nullptr);
  EXPECT_EQ(cache->stats().lookahead_room, 0u);
  const std::vector<uint64_t> first = {1};
  EXPECT_THROW(cache->SetLookahead(first.data(), first.size()), CacheFullError);
  EXPECT_THROW(cache->SetLookahead(nullptr, 0), CacheFullError);
  EXPECT_THROW(cache->PushLookahead(first.data(), first.size()), CacheFullError);
  EXPECT_EQ(cache->stats().lookahead_bytes, 0u);
  AccessAll(*cache, {1, 2, 3, 4, 5});
  EXPECT_FALSE(cache->Contains(1)) << "plain LRU";
  EXPECT_EQ(cache->stats().lookahead_spared + cache->stats().lookahead_forced, 0u);
}

// Beyond takes the room the window leaves: all of it listed when there is
// room, the scan's choice when there is none, and given back when a change
// of the window needs it.
TEST(MemCacheLookaheadRoom, BeyondTakesTheRoomLeftOrNone) {
  const uint32_t scan = MemCache::kLookaheadScan;
  const uint64_t capacity = scan + 10;
  const std::vector<uint64_t> keys = KeysFrom1(capacity);
  const std::vector<uint64_t> window = KeysFrom1(scan);  // the first candidates: 8192 slots
  const uint64_t small = 8192 * kSetSlot + kCount + ScratchOf(capacity);
  const std::vector<uint64_t> wider = KeysFrom1(scan + 1);  // 16384 slots
  const uint64_t large = 16384 * kSetSlot + kCount + ScratchOf(capacity);
  // The wider window fits the larger room below, but only once Beyond has given its room back.
  ASSERT_GT(small + BeyondOf(capacity), large);
  for (const uint64_t room : {small, small + BeyondOf(capacity)}) {
    SCOPED_TRACE(room);
    MemCacheOptions o = EightByteRows(capacity, 1, CachePolicyKind::kLru);
    o.lookahead_room = room;
    auto cache = MemCache::New(o, nullptr, nullptr);
    AccessAll(*cache, keys);  // 1 the least recent
    cache->SetLookahead(window.data(), window.size());
    AccessAll(*cache, {100000});  // the first kLookaheadScan candidates are all in the window: forced
    const MemCacheStats st = cache->stats();
    EXPECT_LE(st.lookahead_bytes, room);
    if (room == small) {
      EXPECT_EQ(st.lookahead_no_room, 1u);
      EXPECT_EQ(st.lookahead_bytes, small);
      EXPECT_FALSE(cache->Contains(scan)) << "the scan's choice: the latest needed of those it saw";
      EXPECT_TRUE(cache->Contains(scan + 1));
      EXPECT_EQ(st.lookahead_forced, 1u);
    } else {
      EXPECT_EQ(st.lookahead_no_room, 0u);
      EXPECT_EQ(st.lookahead_bytes, small + BeyondOf(capacity));
      EXPECT_FALSE(cache->Contains(scan + 1)) << "Beyond's: the first row outside the window";
      EXPECT_TRUE(cache->Contains(scan));
      EXPECT_EQ(st.lookahead_spared, 1u);
      cache->SetLookahead(wider.data(), wider.size());  // only Beyond's room lets it in: Beyond goes
      EXPECT_EQ(cache->stats().lookahead_bytes, large);
      EXPECT_EQ(cache->stats().lookahead_keys, scan + 1);
    }
    cache->ClearLookahead();
    EXPECT_EQ(cache->stats().lookahead_bytes, 0u);
  }
}


// Window changes that need Beyond's room, racing forced evictions that list
// shards into it: the count stays within the room, and comes back to 0.
TEST(MemCacheLookaheadRoom, ChangesRacingBeyondStayInTheRoom) {
  const uint32_t scan = MemCache::kLookaheadScan;
  const uint64_t capacity = scan + 10;
  const std::vector<uint64_t> keys = KeysFrom1(capacity);
  const std::vector<uint64_t> window = KeysFrom1(scan), wider = KeysFrom1(scan + 1);
  const uint64_t room = 8192 * kSetSlot + kCount + ScratchOf(capacity) + BeyondOf(capacity);
  MemCacheOptions o = EightByteRows(capacity, 1, CachePolicyKind::kLru);
  o.lookahead_room = room;
  auto cache = MemCache::New(o, nullptr, nullptr);
  cache->SetLookahead(window.data(), window.size());
  std::atomic<bool> done{false};
  std::atomic<uint64_t> over{0};
  std::thread changes([&] {
    for (int i = 0; !done.load(); ++i) {
      const std::vector<uint64_t>& next = i % 2 ? wider : window;
      cache->SetLookahead(next.data(), next.size());
      if (cache->stats().lookahead_bytes > room) ++over;
    }
  });
  for (uint64_t round = 0; round < 6; ++round) {
    AccessAll(*cache, keys);  // 1 the least recent: the first candidates are in either window
    AccessAll(*cache, {1000000 + round});
    if (cache->stats().lookahead_bytes > room) ++over;
  }
  done = true;
  changes.join();
  const MemCacheStats st = cache->stats();
  EXPECT_EQ(over.load(), 0u);
  EXPECT_LE(st.lookahead_bytes, room);
  cache->ClearLookahead();
  EXPECT_EQ(cache->stats().lookahead_bytes, 0u) << "every byte counted in was counted out";
  if (st.lookahead_forced + st.lookahead_spared == 0) GTEST_SKIP() << "no eviction met the window";
}

// LookaheadWindowRoom is a bound: a window of at most K batches of B keys each,
// set anew, pushed, slid and popped the pipeline's way, with forced evictions
// listing shards (Beyond), never needs more than it plus LookaheadBaseRoom.
// The batches' keys are all distinct (the tables' and entries' worst case) or
// repeat; one shard (every key in it) or the default count.
TEST(MemCacheLookaheadRoom, WindowRoomHoldsAnyWindowOfThatSize) {
  struct Case {
    uint64_t capacity;
    uint32_t shards;
    uint32_t batches;
    uint64_t batch_keys;
    uint64_t universe;  // keys drawn from [1, universe]: small, they repeat
  };
  // Fewer rows than the window's keys: every eviction meets the window.
  for (const Case& c : {Case{2000, 1, 4, 700, uint64_t{1} << 40}, Case{20000, 0, 8, 3000, uint64_t{1} << 40},
                        Case{1000, 0, 8, 500, 2000}, Case{3000, 0, 1, 4100, uint64_t{1} << 40},
                        Case{9000, 0, 16, 700, uint64_t{1} << 40}}) {
    SCOPED_TRACE(::testing::Message() << c.capacity << " rows, " << c.shards << " shards, " << c.batches
                                      << " batches of " << c.batch_keys << " keys");
    const uint64_t room = MemCache::LookaheadWindowRoom(c.batch_keys, c.batches, c.capacity, c.shards) +
                          MemCache::LookaheadBaseRoom(c.capacity, c.shards);
    MemCacheOptions o = EightByteRows(c.capacity, c.shards, CachePolicyKind::kLru);
    o.lookahead_room = room;
    auto cache = MemCache::New(o, nullptr, nullptr);
    std::mt19937_64 rng(c.capacity + c.batches);
    auto batch = [&] {
      std::vector<uint64_t> keys(c.batch_keys - rng() % 3);  // at most batch_keys, some fewer
      for (uint64_t& k : keys) k = 1 + rng() % c.universe;
      return keys;
    };
    std::vector<std::vector<uint64_t>> window;
    uint64_t most = 0;
    for (uint32_t step = 0; step < 2 * c.batches + 12; ++step) {
      if (step % 11 == 10) {  // set anew, batch by batch, as a prefetch whose window is not the last one shifted
        cache->SetLookahead(window.front().data(), window.front().size());
        for (size_t b = 1; b < window.size(); ++b) cache->PushLookahead(window[b].data(), window[b].size());
      } else if (window.size() < c.batches) {
        window.push_back(batch());
        if (window.size() == 1) {
          cache->SetLookahead(window[0].data(), window[0].size());
        } else {
          cache->PushLookahead(window.back().data(), window.back().size());
        }
      } else {
        window.erase(window.begin());
        window.push_back(batch());
        cache->SlideLookahead(window.back().data(), window.back().size());
      }
      AccessAll(*cache, window.back());  // the cache fills with rows of the window: evictions meet it
      most = std::max(most, cache->stats().lookahead_bytes);
    }
    for (; !window.empty(); window.erase(window.begin())) {  // the end of the data
      cache->PopLookahead();
      most = std::max(most, cache->stats().lookahead_bytes);
    }
    const MemCacheStats st = cache->stats();
    EXPECT_LE(most, room);
    EXPECT_GT(st.lookahead_slides, 0u);
    EXPECT_GT(st.lookahead_forced + st.lookahead_spared, 0u) << "the window met evictions";
  }
}

// The bound grows with the window's keys and batches, about 104 bytes a key of K + 1
// batches (docs/training.md), and is 0 for no window.
TEST(MemCacheLookaheadRoom, WindowRoomCountsTheWindowsKeys) {
  EXPECT_EQ(MemCache::LookaheadWindowRoom(1000, 0, 100000), 0u);
  EXPECT_EQ(MemCache::LookaheadWindowRoom(1000, 4, 0), 0u);
  const uint64_t four = MemCache::LookaheadWindowRoom(100000, 4, 1 << 20);
  EXPECT_LT(MemCache::LookaheadWindowRoom(50000, 4, 1 << 20), four);
  EXPECT_LT(MemCache::LookaheadWindowRoom(100000, 2, 1 << 20), four);
  EXPECT_GE(four, 5 * 100000 * (4 * 20 + 24));
  EXPECT_LE(four, 5 * 100000 * (4 * 20 + 24) * 11 / 10);
}

}  // namespace
}  // namespace hps
