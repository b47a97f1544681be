// MEM-PS under the sanitizers: every policy through evictions, pins and the
// sink; several threads pulling at once (run under TSan).
#include <gtest/gtest.h>

#include <cstring>
#include <map>
#include <mutex>
#include <random>
#include <thread>
#include <vector>

#include "hps/mem_cache.h"

namespace hps {
namespace {

// SSD-PS stand-in: rows are one uint64; an absent key's row is key * 1000.
struct Backing {
  std::mutex mutex;
  std::map<uint64_t, uint64_t> rows;

  RowLoader Loader() {
    return [this](const uint64_t* keys, uint64_t n, uint8_t* out, uint8_t* dirty) {
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
