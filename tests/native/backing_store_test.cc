// The backing store under the sanitizers: the write buffer and SSD-PS against
// a map, behind a real MEM-PS; and loads racing sinks and flushes (TSan).
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <map>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "hps/backing_store.h"
#include "hps/mem_cache.h"
#include "hps/ssd_store.h"
#include "temp_dir.h"

namespace hps {
namespace {

namespace fs = std::filesystem;

// SGD rows of dim 2: two floats, 8 bytes.
SparseOptimizer Sgd() {
  SparseOptimizer o;
  o.dim = 2;
  o.opt.kind = OptimizerKind::kSgd;
  o.opt.lr = 0.1f;
  o.init.seed = 9;
  return o;
}

class BackingStoreTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = test_support::FreshTestDir("hps-backing-test");
    SsdStoreOptions o;
    o.path = dir_;
    o.row_bytes = 8;
    o.file_records = 64;
    ssd_ = SsdStore::Open(o);
  }
  void TearDown() override {
    ssd_.reset();
    fs::remove_all(dir_);
  }

  std::string dir_;
  std::unique_ptr<SsdStore> ssd_;
};

std::vector<float> Initial(const SparseOptimizer& o, uint64_t key) {
  std::vector<float> row(2);
  o.initial_rows(&key, 1, row.data());
  return row;
}

TEST_F(BackingStoreTest, MemCacheThroughItMatchesAMap) {
  const SparseOptimizer opt = Sgd();
  BackingStore backing(ssd_.get(), opt, /*write_buffer_rows=*/40);
  MemCacheOptions mo;
  mo.row_bytes = 8;
  mo.capacity = 64;
  auto cache = MemCache::New(mo, backing.loader(), backing.sink());
  std::map<uint64_t, std::vector<float>> model;  // the latest row of every key written
  std::mt19937_64 rng(5);
  for (int step = 0; step < 400; ++step) {
    std::vector<uint64_t> keys;
    for (int j = 0; j < 16; ++j) {
      const uint64_t k = 1 + rng() % 400;
      if (std::find(keys.begin(), keys.end(), k) == keys.end()) keys.push_back(k);
    }
    std::vector<float> rows(keys.size() * 2);
    cache->Pull(keys.data(), keys.size(), reinterpret_cast<uint8_t*>(rows.data()), /*pin=*/true, nullptr);
    for (size_t i = 0; i < keys.size(); ++i) {
      const auto it = model.find(keys[i]);
      const std::vector<float> want = it == model.end() ? Initial(opt, keys[i]) : it->second;
      ASSERT_EQ(rows[2 * i], want[0]) << "key " << keys[i] << " at step " << step;
      ASSERT_EQ(rows[2 * i + 1], want[1]) << "key " << keys[i] << " at step " << step;
      rows[2 * i] = static_cast<float>(step);
      rows[2 * i + 1] = static_cast<float>(keys[i]);
      model[keys[i]] = {rows[2 * i], rows[2 * i + 1]};
    }
    cache->WriteBack(keys.data(), keys.size(), reinterpret_cast<const uint8_t*>(rows.data()));
  }
  const BackingStoreCounts c = backing.counts();
  EXPECT_GT(c.puts, 3u);
  EXPECT_GT(c.pending_hits, 0u);
  EXPECT_GT(c.ssd_hits, 0u);
  EXPECT_EQ(c.pending_hits + c.ssd_hits + c.initialized, c.rows_loaded);
  // Everything to SSD-PS: each key's latest row is there.
  cache->FlushDirty();
  backing.Flush();
  EXPECT_EQ(backing.counts().pending_rows, 0u);
  for (const auto& [key, row] : model) {
    std::vector<float> got(2);
    uint8_t found = 0;
    ssd_->Get(&key, 1, reinterpret_cast<uint8_t*>(got.data()), &found);
    ASSERT_TRUE(found) << key;
    EXPECT_EQ(got, row) << key;
  }
}

// The buffer goes to SSD-PS when it holds write_buffer_rows rows, not one
// later; a loaded row is never reported dirty, whatever the caller's flags held.
TEST_F(BackingStoreTest, PutsAFullBufferAndClearsTheDirtyFlags) {
  const SparseOptimizer opt = Sgd();
  BackingStore backing(ssd_.get(), opt, /*write_buffer_rows=*/2);
  const std::vector<uint64_t> keys = {1, 2};
  const std::vector<float> rows = {1.0f, 2.0f, 3.0f, 4.0f};
  backing.Sink(keys.data(), 1, reinterpret_cast<const uint8_t*>(rows.data()));
  EXPECT_EQ(backing.counts().puts, 0u);
  EXPECT_EQ(backing.counts().pending_rows, 1u);
  backing.Sink(keys.data() + 1, 1, reinterpret_cast<const uint8_t*>(rows.data() + 2));
  EXPECT_EQ(backing.counts().puts, 1u);
  EXPECT_EQ(backing.counts().rows_put, 2u);
  EXPECT_EQ(backing.counts().pending_rows, 0u);

  const std::vector<uint64_t> load = {2, 3};  // on SSD-PS, and found nowhere
  std::vector<float> got(4, 0.0f);
  std::vector<uint8_t> dirty(2, 1);
  backing.Load(load.data(), 2, reinterpret_cast<uint8_t*>(got.data()), dirty.data());
  EXPECT_EQ(dirty, (std::vector<uint8_t>{0, 0}));
  EXPECT_EQ(std::vector<float>(got.begin(), got.begin() + 2), (std::vector<float>{3.0f, 4.0f}));
  EXPECT_EQ(std::vector<float>(got.begin() + 2, got.end()), Initial(opt, 3));
}

TEST_F(BackingStoreTest, RefusesRowsOfAnotherSize) {
  SparseOptimizer wide = Sgd();
  wide.dim = 4;
  EXPECT_THROW(BackingStore(ssd_.get(), wide, 8), std::invalid_argument);
  EXPECT_THROW(BackingStore(ssd_.get(), Sgd(), 0), std::invalid_argument);
  EXPECT_THROW(BackingStore(nullptr, Sgd(), 8), std::invalid_argument);
}

// A row holds (key, version). A load racing sinks and flushes must return
// each key's row at least as new as the version whose Sink returned before
// the load began (a row between the buffer and SSD-PS must be found in one
// of them), never a version not sunk yet, another key's or a torn row; after
// a flush SSD-PS holds each key's latest version.
TEST_F(BackingStoreTest, LoadsRaceSinksAndFlushes) {
  BackingStore backing(ssd_.get(), Sgd(), /*write_buffer_rows=*/32);
  constexpr uint64_t kKeys = 100;
  constexpr int kCalls = 300;
  std::vector<std::atomic<int>> committed(kKeys + 1);  // key's latest version whose Sink returned; 0: none
  for (auto& c : committed) c = 0;
  std::atomic<int> issued{0};  // the newest version any Sink has begun
  std::atomic<bool> stop{false};
  std::thread writer([&] {
    std::mt19937_64 rng(1);
    for (int version = 1; version <= kCalls; ++version) {
      std::vector<uint64_t> keys;
      while (keys.size() < 8) {
        const uint64_t k = 1 + rng() % kKeys;
        if (std::find(keys.begin(), keys.end(), k) == keys.end()) keys.push_back(k);
      }
      std::vector<float> rows(keys.size() * 2);
      for (size_t i = 0; i < keys.size(); ++i) {
        rows[2 * i] = static_cast<float>(keys[i]);
        rows[2 * i + 1] = static_cast<float>(version);
      }
      issued = version;
      backing.Sink(keys.data(), keys.size(), reinterpret_cast<const uint8_t*>(rows.data()));
      for (uint64_t k : keys) committed[k] = version;
      if (version % 50 == 0) backing.Flush();
    }
    stop = true;
  });
  std::atomic<uint64_t> checked{0};
  std::thread reader([&] {
    std::mt19937_64 rng(2);
    const SparseOptimizer opt = Sgd();
    while (!stop) {
      std::vector<uint64_t> keys;
      while (keys.size() < 10) {
        const uint64_t k = 1 + rng() % kKeys;
        if (std::find(keys.begin(), keys.end(), k) == keys.end()) keys.push_back(k);
      }
      std::vector<int> before(keys.size());
      for (size_t i = 0; i < keys.size(); ++i) before[i] = committed[keys[i]];
      std::vector<float> rows(keys.size() * 2);
      backing.Load(keys.data(), keys.size(), reinterpret_cast<uint8_t*>(rows.data()), nullptr);
      const int newest = issued;
      for (size_t i = 0; i < keys.size(); ++i) {
        const uint64_t k = keys[i];
        const std::vector<float> initial = Initial(opt, k);
        if (before[i] == 0 && rows[2 * i] == initial[0] && rows[2 * i + 1] == initial[1]) continue;
        ASSERT_EQ(rows[2 * i], static_cast<float>(k)) << "key " << k << " (committed v" << before[i] << ")";
        const float version = rows[2 * i + 1];
        ASSERT_GE(version, static_cast<float>(before[i])) << "key " << k << ": a stale row";
        ASSERT_LE(version, static_cast<float>(newest)) << "key " << k << ": a version not sunk yet";
        ASSERT_EQ(version, std::floor(version)) << "key " << k;
        ++checked;
      }
    }
  });
  writer.join();
  reader.join();
  EXPECT_GT(checked.load(), 0u);
  backing.Flush();
  const BackingStoreCounts c = backing.counts();
  EXPECT_EQ(c.pending_rows, 0u);
  EXPECT_EQ(c.rows_put, ssd_->stats().rows_written);
  for (uint64_t k = 1; k <= kKeys; ++k) {
    if (committed[k] == 0) continue;
    float row[2];
    uint8_t found = 0;
    ssd_->Get(&k, 1, reinterpret_cast<uint8_t*>(row), &found);
    ASSERT_TRUE(found) << "key " << k;
    EXPECT_EQ(row[0], static_cast<float>(k));
    EXPECT_EQ(row[1], static_cast<float>(committed[k].load())) << "key " << k;
  }
}

}  // namespace
}  // namespace hps
