// MEM-PS under the sanitizers: every policy through evictions, pins and the
// sink; several threads pulling at once (run under TSan).
#include <gtest/gtest.h>

#include <cstring>
#include <functional>
#include <map>
#include <mutex>
#include <random>
#include <stdexcept>
#include <thread>
#include <vector>

#include "hps/mem_cache.h"

namespace hps {
namespace {

// SSD-PS stand-in: rows are one uint64; an absent key's row is key * 1000.
// before_load (optional) runs at the start of each load; while sink_down,
// the sink throws without storing anything.
struct Backing {
  std::mutex mutex;
  std::map<uint64_t, uint64_t> rows;
  std::function<void()> before_load;
  bool sink_down = false;

  RowLoader Loader() {
    return [this](const uint64_t* keys, uint64_t n, uint8_t* out, uint8_t* dirty) {
      if (before_load) before_load();
      std::lock_guard lock(mutex);
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
      for (uint64_t i = 0; i < n; ++i) std::memcpy(&rows[keys[i]], in + i * 8, 8);
    };
  }
};

class MemCachePolicies : public ::testing::TestWithParam<std::string> {};

TEST_P(MemCachePolicies, WriteBacksSurviveEvictionAndFlush) {
  Backing backing;
  MemCacheOptions o;
  o.row_bytes = 8;
  o.capacity = 64;
  o.policy = ParseCachePolicy(GetParam());
  auto cache = MemCache::New(o, backing.Loader(), backing.Sink());
  std::map<uint64_t, uint64_t> model;
  std::mt19937_64 rng(7);
  for (int step = 0; step < 500; ++step) {
    std::vector<uint64_t> keys;
    for (int j = 0; j < 20; ++j) {
      const uint64_t k = rng() % 500;
      if (std::find(keys.begin(), keys.end(), k) == keys.end()) keys.push_back(k);
    }
    std::vector<uint64_t> rows(keys.size());
    cache->Pull(keys.data(), keys.size(), reinterpret_cast<uint8_t*>(rows.data()), true, nullptr);
    for (size_t i = 0; i < keys.size(); ++i) {
      const auto it = model.find(keys[i]);
      ASSERT_EQ(rows[i], it == model.end() ? keys[i] * 1000 : it->second) << "step " << step;
      model[keys[i]] = rows[i] + 1;
      rows[i] += 1;
    }
    cache->WriteBack(keys.data(), keys.size(), reinterpret_cast<const uint8_t*>(rows.data()));
  }
  const MemCacheStats st = cache->stats();
  EXPECT_EQ(st.pinned, 0u);
  EXPECT_GT(st.dirty_evictions, 0u);
  cache->FlushDirty();
  for (const auto& [k, v] : model) ASSERT_EQ(backing.rows.at(k), v) << k;
}

INSTANTIATE_TEST_SUITE_P(All, MemCachePolicies, ::testing::Values("lru", "lfu", "lru+lfu", "w-tinylfu", "tinylfu-lfu"));

// One shard of 4 LRU rows holding dirty rows 1..4 (1 the least recent).
std::unique_ptr<MemCache> FourDirtyRows(Backing& backing) {
  MemCacheOptions o;
  o.row_bytes = 8;
  o.capacity = 4;
  o.shards = 1;
  o.policy = CachePolicyKind::kLru;
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
  MemCacheOptions o;
  o.row_bytes = 8;
  o.capacity = 2;
  o.shards = 1;
  o.policy = CachePolicyKind::kTinyLfuLfu;
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

TEST(MemCache, ConcurrentPullsSeeConsistentRows) {
  Backing backing;
  MemCacheOptions o;
  o.row_bytes = 8;
  o.capacity = 256;
  o.shards = 4;
  o.policy = CachePolicyKind::kWTinyLfu;
  auto cache = MemCache::New(o, backing.Loader(), backing.Sink());
  std::vector<std::thread> threads;
  std::vector<int> bad(4, 0);
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937_64 rng(t);
      for (int step = 0; step < 300; ++step) {
        std::vector<uint64_t> keys;
        for (int j = 0; j < 30; ++j) {
          const uint64_t k = rng() % 2000;
          if (std::find(keys.begin(), keys.end(), k) == keys.end()) keys.push_back(k);
        }
        std::vector<uint64_t> rows(keys.size());
        cache->Pull(keys.data(), keys.size(), reinterpret_cast<uint8_t*>(rows.data()), true, nullptr);
        for (size_t i = 0; i < keys.size(); ++i) bad[t] += rows[i] != keys[i] * 1000;
        cache->Unpin(keys.data(), keys.size());
        if (step % 50 == 0) (void)cache->stats();
      }
    });
  }
  for (auto& th : threads) th.join();
  for (int t = 0; t < 4; ++t) EXPECT_EQ(bad[t], 0);
  EXPECT_EQ(cache->stats().pinned, 0u);
}

}  // namespace
}  // namespace hps
