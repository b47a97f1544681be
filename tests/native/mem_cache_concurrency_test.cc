// MEM-PS with dirty rows, write-backs, in-place writes, pins, flushes and
// CacheFullError racing across threads; run under TSan and ASan.
//
// Every row holds (key, version). Each key has one writer thread, which pins
// it, checks that it reads exactly the version it last committed, and writes
// the next version back (WriteBack, or in place through Pin's address and
// UnpinUpdated). A model records the latest committed version of each key.
// Readers check that a row is never older than the version committed before
// their read began; the sink checks that no key's stored version goes back.
// The cache is small and pinned from several threads at once, so calls fail
// with CacheFullError after evicting dirty rows: a dirty victim dropped on
// that path reloads an older version from the sink, which the writer sees.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <mutex>
#include <ostream>
#include <random>
#include <shared_mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "hps/mem_cache.h"

namespace hps {
namespace {

struct Row {
  uint64_t key;
  uint64_t version;
};
constexpr uint32_t kRowBytes = sizeof(Row);

Row RowOf(const uint8_t* bytes) {
  Row r;
  std::memcpy(&r, bytes, sizeof(r));
  return r;
}

void PutRow(uint8_t* bytes, Row r) { std::memcpy(bytes, &r, sizeof(r)); }

// SSD-PS stand-in: the last version sunk of each key; a key never sunk is at
// version 0 (its initial row, which can be made again: loaded clean).
class VersionStore {
 public:
  RowLoader Loader() {
    return [this](const uint64_t* keys, uint64_t n, uint8_t* rows, uint8_t* dirty) {
      {
        std::lock_guard lock(mutex_);
        for (uint64_t i = 0; i < n; ++i) {
          const auto it = versions_.find(keys[i]);
          PutRow(rows + i * kRowBytes, {keys[i], it == versions_.end() ? 0 : it->second});
          dirty[i] = 0;
        }
      }
      // A read from SSD-PS takes a while; meanwhile other threads pin rows,
      // which is when a call can find fewer free slots than it counted.
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    };
  }

  RowSink Sink() {
    return [this](const uint64_t* keys, uint64_t n, const uint8_t* rows) {
      std::lock_guard lock(mutex_);
      for (uint64_t i = 0; i < n; ++i) {
        const Row r = RowOf(rows + i * kRowBytes);
        if (r.key != keys[i]) ++wrong_key_;
        uint64_t& stored = versions_[keys[i]];
        if (r.version < stored) ++regressions_;  // an older row stored over a newer one
        stored = r.version;
      }
    };
  }

  uint64_t Version(uint64_t key) const {
    std::lock_guard lock(mutex_);
    const auto it = versions_.find(key);
    return it == versions_.end() ? 0 : it->second;
  }
  uint64_t regressions() const {
    std::lock_guard lock(mutex_);
    return regressions_;
  }
  uint64_t wrong_key() const {
    std::lock_guard lock(mutex_);
    return wrong_key_;
  }

 private:
  mutable std::mutex mutex_;
  std::unordered_map<uint64_t, uint64_t> versions_;
  uint64_t regressions_ = 0, wrong_key_ = 0;
};

struct Config {
  std::string policy;
  uint32_t shards;
  uint64_t capacity;
};

void PrintTo(const Config& c, std::ostream* os) {
  *os << c.policy << ", " << c.shards << " shards, " << c.capacity << " rows";
}

class MemCacheConcurrency : public ::testing::TestWithParam<Config> {};

constexpr int kWriters = 3;
constexpr int kReaders = 2;
constexpr uint64_t kKeys = 3 * 32;  // key % kWriters: its writer; (key / kWriters) % 2 == 0: readers read it too
constexpr int kWriterSteps = 1000;
constexpr size_t kWriterBatch = 10;
constexpr size_t kReaderBatch = 8;

bool Shared(uint64_t key) { return (key / kWriters) % 2 == 0; }

TEST_P(MemCacheConcurrency, VersionsNeverGoBack) {
  const Config config = GetParam();
  VersionStore store;
  MemCacheOptions o;
  o.row_bytes = kRowBytes;
  o.capacity = config.capacity;
  o.shards = config.shards;
  o.policy = ParseCachePolicy(config.policy);
  auto cache = MemCache::New(o, store.Loader(), store.Sink());

  std::vector<std::atomic<uint64_t>> committed(kKeys);  // the model: latest version written back
  for (auto& v : committed) v = 0;
  // Rows written in place (through Pin's addresses) take it shared; FlushDirty,
  // which copies dirty rows whether pinned or not, takes it alone: the
  // parameter server's rows lock between HostBatch steps and checkpoints.
  std::shared_mutex rows_lock;
  std::atomic<int> writers_left{kWriters};
  std::atomic<uint64_t> fulls{0}, bad_reads{0}, leaked_pins{0};
  std::mutex failures_mutex;
  std::vector<std::string> failures;  // the first few, for the message
  auto fail = [&](const std::string& what) {
    ++bad_reads;
    std::lock_guard lock(failures_mutex);
    if (failures.size() < 5) failures.push_back(what);
  };

  auto writer = [&](int t) {
    std::mt19937_64 rng(100 + t);
    std::vector<uint64_t> own;
    for (uint64_t k = static_cast<uint64_t>(t); k < kKeys; k += kWriters) own.push_back(k);
    // Past kWriterSteps while no call has met a full cache yet (up to 10 x):
    // whether one does depends on how the threads interleave (as few as 2 of
    // some 600 in a run on one loaded core), and the check below needs one.
    for (int step = 0; step < kWriterSteps || (fulls == 0 && step < 10 * kWriterSteps); ++step) {
      std::shuffle(own.begin(), own.end(), rng);
      std::vector<uint64_t> keys(own.begin(), own.begin() + kWriterBatch);
      const uint64_t n = keys.size();
      std::vector<uint8_t> rows(n * kRowBytes);
      std::vector<uint8_t*> addresses(n);
      const int mode = step % 3;  // 0: WriteBack; 1: in place + UnpinUpdated; 2: read and Unpin
      try {
        if (mode == 1) {
          cache->Pin(keys.data(), n, nullptr, addresses.data());
          cache->ReadPinned(keys.data(), n, rows.data());
        } else {
          cache->Pull(keys.data(), n, rows.data(), /*pin=*/true, nullptr);
        }
      } catch (const CacheFullError&) {
        ++fulls;
        // The failed call must hold no pin: nobody else pins these keys.
        for (uint64_t k : keys) {
          if (Shared(k)) continue;  // readers may hold a pin of their own
          try {
            uint8_t row[kRowBytes];
            cache->ReadPinned(&k, 1, row);
            ++leaked_pins;
          } catch (const std::invalid_argument&) {
          }
        }
        continue;
      }
      for (uint64_t i = 0; i < n; ++i) {
        const Row r = RowOf(rows.data() + i * kRowBytes);
        const uint64_t want = committed[keys[i]].load();
        if (r.key != keys[i] || r.version != want) {
          fail("writer " + std::to_string(t) + " step " + std::to_string(step) + ": key " +
               std::to_string(keys[i]) + " read (" + std::to_string(r.key) + ", v" + std::to_string(r.version) +
               "), committed v" + std::to_string(want));
        }
      }
      if (mode == 0) {
        for (uint64_t i = 0; i < n; ++i) PutRow(rows.data() + i * kRowBytes, {keys[i], committed[keys[i]] + 1});
        cache->WriteBack(keys.data(), n, rows.data());
        for (uint64_t k : keys) ++committed[k];
      } else if (mode == 1) {
        // Only rows no reader reads are written in place (a reader's copy
        // would race the write, which the caller must order); the rest unpin.
        std::vector<uint8_t> updated(n, 0);
        {
          std::shared_lock lock(rows_lock);
          for (uint64_t i = 0; i < n; ++i) {
            if (Shared(keys[i])) continue;
            PutRow(addresses[i], {keys[i], committed[keys[i]] + 1});
            updated[i] = 1;
          }
        }
        cache->UnpinUpdated(keys.data(), n, updated.data(), addresses.data());
        for (uint64_t i = 0; i < n; ++i) committed[keys[i]] += updated[i];
      } else {
        cache->Unpin(keys.data(), n);
      }
    }
    --writers_left;
  };

  auto reader = [&](int t) {
    std::mt19937_64 rng(200 + t);
    for (int step = 0; writers_left > 0; ++step) {
      std::vector<uint64_t> keys;
      while (keys.size() < kReaderBatch) {
        const uint64_t k = rng() % kKeys;
        if (Shared(k) && std::find(keys.begin(), keys.end(), k) == keys.end()) keys.push_back(k);
      }
      const uint64_t n = keys.size();
      std::vector<uint64_t> before(n);
      for (uint64_t i = 0; i < n; ++i) before[i] = committed[keys[i]];
      std::vector<uint8_t> rows(n * kRowBytes);
      const bool pin = step % 2 == 1;
      try {
        cache->Pull(keys.data(), n, pin ? nullptr : rows.data(), pin, nullptr);
      } catch (const CacheFullError&) {
        ++fulls;
        continue;
      }
      if (pin) {
        cache->ReadPinned(keys.data(), n, rows.data());
        cache->Unpin(keys.data(), n);
      }
      for (uint64_t i = 0; i < n; ++i) {
        const Row r = RowOf(rows.data() + i * kRowBytes);
        const uint64_t after = committed[keys[i]];
        // Its writer may be writing the next version back as we read.
        if (r.key != keys[i] || r.version < before[i] || r.version > after + 1) {
          fail("reader " + std::to_string(t) + ": key " + std::to_string(keys[i]) + " read (" +
               std::to_string(r.key) + ", v" + std::to_string(r.version) + "), committed v" +
               std::to_string(before[i]) + " before the read and v" + std::to_string(after) + " after");
        }
      }
    }
  };

  auto flusher = [&] {
    while (writers_left > 0) {
      {
        std::unique_lock lock(rows_lock);
        cache->FlushDirty();
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
  };

  std::vector<std::thread> threads;
  for (int t = 0; t < kWriters; ++t) threads.emplace_back(writer, t);
  for (int t = 0; t < kReaders; ++t) threads.emplace_back(reader, t);
  threads.emplace_back(flusher);
  for (auto& th : threads) th.join();

  for (const std::string& f : failures) ADD_FAILURE() << f;
  EXPECT_EQ(bad_reads.load(), 0u);
  EXPECT_EQ(leaked_pins.load(), 0u) << "a call that threw CacheFullError kept pins";
  EXPECT_EQ(store.regressions(), 0u);
  EXPECT_EQ(store.wrong_key(), 0u);
  const MemCacheStats st = cache->stats();
  EXPECT_EQ(st.pinned, 0u);
  // The races this test is about did happen.
  EXPECT_GT(fulls.load(), 0u);
  EXPECT_GT(st.dirty_evictions, 0u);

  // Every key's latest version is in the cache or the sink: read through the
  // cache, then from the sink alone after a flush.
  for (uint64_t k = 0; k < kKeys; ++k) {
    uint8_t row[kRowBytes];
    cache->Pull(&k, 1, row, /*pin=*/false, nullptr);
    const Row r = RowOf(row);
    ASSERT_EQ(r.key, k);
    ASSERT_EQ(r.version, committed[k].load()) << "key " << k;
  }
  cache->FlushDirty();
  for (uint64_t k = 0; k < kKeys; ++k) ASSERT_EQ(store.Version(k), committed[k].load()) << "key " << k;
}

// Caches smaller than the pins of every thread at once (3 x 10 + 2 x 8 rows):
// calls fail with CacheFullError, some after evicting (with the old Fetch,
// each of these configurations lost dirty rows in most runs of 1000 steps).
INSTANTIATE_TEST_SUITE_P(Configs, MemCacheConcurrency,
                         ::testing::Values(Config{"lru", 1, 32}, Config{"tinylfu-lfu", 1, 32},
                                           Config{"w-tinylfu", 4, 48}),
                         [](const ::testing::TestParamInfo<Config>& param) {
                           std::string name = param.param.policy + "_" + std::to_string(param.param.shards) + "shards";
                           std::replace(name.begin(), name.end(), '-', '_');
                           return name;
                         });

// A rogue thread unpins a key that the writer holds pinned (a broken pin
// contract) at a random moment of the writer's WriteBack of a large batch.
// Whatever the timing, the writer's row of that key is never lost silently:
// the rogue came first and the write-back is refused whole
// (std::invalid_argument), or the row is in MEM-PS, named by BrokenPinError
// if the rogue came between the check that every key is pinned and the write.
TEST(MemCacheBrokenPin, ARogueUnpinDuringAWriteBackNeverLosesTheRowSilently) {
  constexpr uint64_t kBatch = uint64_t{1} << 16;  // a call of milliseconds: the rogue lands inside it on a loaded machine too
  MemCacheOptions o;
  o.row_bytes = 8;
  o.capacity = 2 * kBatch;  // never evicts: each row stays where the writer's pin put it
  o.shards = 64;
  o.policy = CachePolicyKind::kLru;
  auto cache = MemCache::New(
      o, [](const uint64_t*, uint64_t n, uint8_t* rows, uint8_t* dirty) {
        std::memset(rows, 0, n * 8);
        std::memset(dirty, 0, n);
      },
      [](const uint64_t*, uint64_t, const uint8_t*) {});
  std::vector<uint64_t> keys(kBatch);
  for (uint64_t i = 0; i < kBatch; ++i) keys[i] = i + 1;
  const uint64_t contested_at = kBatch / 2;
  const uint64_t contested = keys[contested_at];
  std::vector<uint64_t> others = keys;
  others.erase(others.begin() + static_cast<std::ptrdiff_t>(contested_at));

  // The writer publishes round r with the rogue's delay; the rogue answers
  // with how its Unpin ended: 1 returned, 2 refused (invalid_argument), 3 BrokenPinError.
  std::atomic<int64_t> round{-1}, answered{-1};
  std::atomic<int64_t> delay_ns{0};
  std::atomic<int> rogue_outcome{0};
  std::thread rogue([&] {
    for (int64_t r = 0;; ++r) {
      while (round.load() < r) std::this_thread::yield();
      if (delay_ns.load() < 0) return;  // the writer is done
      const auto until = std::chrono::steady_clock::now() + std::chrono::nanoseconds(delay_ns.load());
      while (std::chrono::steady_clock::now() < until) {
      }
      int outcome = 1;
      try {
        cache->Unpin(&contested, 1);
      } catch (const std::invalid_argument&) {
        outcome = 2;
      } catch (const BrokenPinError&) {
        outcome = 3;
      }
      rogue_outcome = outcome;
      answered = r;
    }
  });

  std::mt19937_64 rng(7);
  double call_ns = 1e5;  // a running mean of the write-back's time
  uint64_t inside = 0, refused = 0, silent = 0, rounds = 0;
  std::vector<std::string> failures;
  const auto start = std::chrono::steady_clock::now();
  // Until the rogue has landed inside the call a few times (a few hundred
  // rounds at most with either fix or defect; a time bound for slow builds).
  for (int64_t r = 0; inside + silent < 5 && std::chrono::steady_clock::now() - start < std::chrono::seconds(20);
       ++r, ++rounds) {
    cache->Pin(keys.data(), kBatch, nullptr, std::vector<uint8_t*>(kBatch).data());
    const uint64_t value = static_cast<uint64_t>(r) + 1;
    const std::vector<uint64_t> rows(kBatch, value);
    delay_ns = static_cast<int64_t>(std::uniform_real_distribution<double>(0, 1.5 * call_ns)(rng));
    round = r;
    int outcome = 1;
    const auto t0 = std::chrono::steady_clock::now();
    try {
      cache->WriteBack(keys.data(), kBatch, reinterpret_cast<const uint8_t*>(rows.data()));
    } catch (const std::invalid_argument&) {
      outcome = 2;
    } catch (const BrokenPinError& e) {
      outcome = 3;
      if (e.unpinned() != std::vector<uint64_t>{contested_at} || !e.lost().empty()) {
        failures.push_back(std::string("round ") + std::to_string(r) + ": " + e.what());
      }
    }
    call_ns = 0.9 * call_ns + 0.1 * static_cast<double>((std::chrono::steady_clock::now() - t0).count());
    while (answered.load() < r) std::this_thread::yield();
    if (outcome == 2) {  // refused whole: the writer still holds the other pins
      ++refused;
      cache->Unpin(others.data(), others.size());
    }
    uint64_t row = 0;
    cache->Pull(&contested, 1, reinterpret_cast<uint8_t*>(&row), /*pin=*/false, nullptr);
    if (outcome == 3) ++inside;
    // One pin, two releases: both returning means one of them skipped the key silently.
    if (outcome == 1 && rogue_outcome == 1) {
      ++silent;
      failures.push_back("round " + std::to_string(r) + ": the write-back and the rogue unpin both returned, row " +
                         std::to_string(row) + ", written " + std::to_string(value));
    } else if (outcome != 2 && row != value) {
      failures.push_back("round " + std::to_string(r) + ": row " + std::to_string(row) + ", written " +
                         std::to_string(value));
    }
    if (cache->stats().pinned != 0) failures.push_back("round " + std::to_string(r) + ": pins left");
  }
  delay_ns = -1;
  round = round.load() + 1;
  rogue.join();
  for (size_t f = 0; f < failures.size() && f < 5; ++f) ADD_FAILURE() << failures[f];
  EXPECT_EQ(silent, 0u) << "of " << rounds << " rounds";
  EXPECT_TRUE(failures.empty()) << failures.size() << " failures in " << rounds << " rounds";
  // Whether the race this test is about happened depends on the scheduler (under
  // ThreadSanitizer it once did not in 180 rounds): a run where it never did shows
  // nothing, and says so as a skip rather than a failure. The deterministic
  // MemCache.ReleaseOfAKeyUnpinnedPastTheCheckKeepsItsUpdateAndNamesIt covers the path.
  if (inside + silent == 0) {
    GTEST_SKIP() << "the rogue unpin never landed inside a write-back: " << rounds << " rounds, " << refused
                 << " refused whole";
  }
}

}  // namespace
}  // namespace hps
