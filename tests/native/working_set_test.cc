// The working set under the sanitizers: a batch from pin to release on one
// and two host partitions against HostBatch's steps on the same rows, its
// failures (no pin left, no dirty row lost), and two batches pipelined on two
// threads (the next pinned and loaded while this one trains), for TSan. Host
// partitions run both ways: bound to MEM-PS's rows (their default) and with
// copies in their tables (bind_host_rows off: the path a GPU tier takes).
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <future>
#include <map>
#include <mutex>
#include <new>
#include <stdexcept>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include "hps/device_tier.h"
#include "hps/hash_table.h"
#include "hps/mem_cache.h"
#include "hps/working_set.h"
#include "failing_allocations.h"
#include "forwarding_cache.h"
#include "row_store.h"
#include "uncounted_release_cache.h"

namespace hps {
namespace {

SparseOptimizer AdaGrad(int32_t dim) {
  SparseOptimizer o;
  o.dim = dim;
  o.opt.kind = OptimizerKind::kAdaGrad;
  o.opt.lr = 0.1f;
  o.init.seed = 5;
  return o;
}

using test_support::CallFailingAllocation;
using test_support::FailingAllocationCall;
using test_support::ForEveryAllocation;
using test_support::ForwardingCache;
using test_support::PinBreakingCache;
using test_support::RowStore;
using test_support::UncountedReleaseCache;


std::vector<float> CachedRows(MemCache& cache, const std::vector<uint64_t>& keys) {
  std::vector<float> rows(keys.size() * cache.row_bytes() / sizeof(float));
  cache.Pull(keys.data(), keys.size(), reinterpret_cast<uint8_t*>(rows.data()), /*pin=*/false, nullptr);
  return rows;
}

// The examples' keys of one batch (repeats included) and a gradient each.
struct Step {
  std::vector<uint64_t> keys;
  std::vector<float> grads;
};

Step MakeStep(const std::vector<uint64_t>& keys, int32_t dim, float scale) {
  Step s{keys, std::vector<float>(keys.size() * dim)};
  for (size_t i = 0; i < s.grads.size(); ++i) s.grads[i] = scale * static_cast<float>(i % 7 + 1);
  return s;
}

// The same step through HostBatch: the in-place path's result, the reference.
void HostStep(MemCache& cache, const SparseOptimizer& opt, const Step& s) {
  std::vector<int64_t> inverse(s.keys.size());
  const std::vector<uint64_t> uniq = UniqueKeys(s.keys.data(), s.keys.size(), inverse.data());
  cache.Pull(uniq.data(), uniq.size(), nullptr, true, nullptr);
  HostBatch b(cache, uniq.data(), uniq.size(), opt);
  b.Accumulate(inverse.data(), inverse.size(), s.grads.data());
  b.Apply();
  b.Release();
}

void TierStep(MemCache& cache, DeviceTier& tier, const SparseOptimizer& opt, const Step& s) {
  WorkingSet ws(cache, opt, tier.devices(), s.keys.data(), s.keys.size());
  ws.Load(tier, nullptr);
  // Worker w takes every devices-th example, as the pipeline's mini-batches do.
  const int32_t dim = opt.dim;
  for (int32_t w = 0; w < tier.devices(); ++w) {
    std::vector<uint64_t> keys;
    std::vector<float> grads;
    for (size_t i = static_cast<size_t>(w); i < s.keys.size(); i += static_cast<size_t>(tier.devices())) {
      keys.push_back(s.keys[i]);
      grads.insert(grads.end(), s.grads.begin() + i * dim, s.grads.begin() + (i + 1) * dim);
    }
    std::vector<float> emb(keys.size() * dim);
    ws.Get(w, keys.data(), keys.size(), emb.data());
    ws.Accumulate(w, keys.data(), keys.size(), grads.data());
  }
  EXPECT_GT(ws.Apply(), 0u);
  ws.WriteBack();
  EXPECT_TRUE(ws.released());
  EXPECT_EQ(tier.size(), 0u);
}

std::unique_ptr<DeviceTier> HostTier(int32_t devices, uint64_t capacity, const SparseOptimizer& opt,
                                     bool bind_host_rows) {
  return DeviceTier::New({devices, capacity, opt, /*use_cuda=*/false, /*threads=*/1, nullptr, {}, bind_host_rows});
}

// Loads the working set's keys onto `tier`; worker 0 steps the first two of
// `keys` by g.
void LoadAndStep(WorkingSet& ws, DeviceTier& tier, const std::vector<uint64_t>& keys, const std::vector<float>& g) {
  ws.Load(tier, nullptr);
  ws.Accumulate(0, keys.data(), 2, g.data());
  ws.Apply();
}

// The batch a release test hinders, on a cache nothing hinders: worker 0
// steps the first two keys by g; what the hindered batch's rows should be.
void StepUnhindered(MemCache& cache, const SparseOptimizer& opt, bool bind_host_rows,
                    const std::vector<uint64_t>& keys, const std::vector<float>& g) {
  auto tier = HostTier(2, 16, opt, bind_host_rows);
  WorkingSet unhindered(cache, opt, 2, keys.data(), keys.size());
  LoadAndStep(unhindered, *tier, keys, g);
  unhindered.WriteBack();
}

// What StepUnhindered leaves in the rows of `updated`.
std::vector<float> RowsSteppedUnhindered(const SparseOptimizer& opt, bool bind_host_rows,
                                         const std::vector<uint64_t>& keys, const std::vector<float>& g,
                                         const std::vector<uint64_t>& updated) {
  RowStore store(opt);
  auto cache = store.Cache(16);
  StepUnhindered(*cache, opt, bind_host_rows, keys, g);
  return CachedRows(*cache, updated);
}

// A working set of `keys` on its own cache and host tier, loaded and stepped
// (LoadAndStep).
struct SteppedWorkingSet {
  SteppedWorkingSet(const SparseOptimizer& opt, bool bind_host_rows, const std::vector<uint64_t>& keys,
                    const std::vector<float>& g)
      : store(opt), cache(store.Cache(16)), tier(HostTier(2, 16, opt, bind_host_rows)),
        ws(*cache, opt, 2, keys.data(), keys.size()) {
    LoadAndStep(ws, *tier, keys, g);
  }

  RowStore store;
  std::unique_ptr<MemCache> cache;
  std::unique_ptr<DeviceTier> tier;
  WorkingSet ws;
};

// The batch of a test that fails every allocation of its release in turn:
// worker 0 steps the first two of `keys` (`updated`) by g; `expected`, their
// rows however the release was hindered.
struct ReleaseTestBatch {
  ReleaseTestBatch(const SparseOptimizer& opt, bool bind_host_rows, std::vector<uint64_t> batch_keys)
      : keys(std::move(batch_keys)), expected(RowsSteppedUnhindered(opt, bind_host_rows, keys, g, updated)) {}

  const std::vector<uint64_t> keys;
  const std::vector<float> g = std::vector<float>(2 * 2, 1.0f);
  const std::vector<uint64_t> updated = {1, 2};
  const std::vector<float> expected;
};

class WorkingSetDevices : public ::testing::TestWithParam<std::tuple<int32_t, bool>> {};

TEST_P(WorkingSetDevices, BatchesMatchHostBatchOnTheSameRows) {
  const SparseOptimizer opt = AdaGrad(4);
  RowStore host_store(opt), tier_store(opt);
  auto host = host_store.Cache(64), cached = tier_store.Cache(64);
  auto tier = HostTier(std::get<0>(GetParam()), 64, opt, std::get<1>(GetParam()));
  EXPECT_EQ(tier->binds_host_rows(), std::get<1>(GetParam()));
  const std::vector<std::vector<uint64_t>> batches = {
      {1, 2, 3, 2, 1, 9}, {2, 3, 4, 5, 3, 3}, {100, 101, 1, 2}, {7, 7, 7, 7}};
  std::vector<uint64_t> all;
  for (size_t b = 0; b < batches.size(); ++b) {
    const Step s = MakeStep(batches[b], opt.dim, 0.01f * static_cast<float>(b + 1));
    HostStep(*host, opt, s);
    TierStep(*cached, *tier, opt, s);
    all.insert(all.end(), batches[b].begin(), batches[b].end());
  }
  std::vector<int64_t> inverse(all.size());
  const std::vector<uint64_t> uniq = UniqueKeys(all.data(), all.size(), inverse.data());
  const std::vector<float> want = CachedRows(*host, uniq), got = CachedRows(*cached, uniq);
  for (size_t i = 0; i < want.size(); ++i) ASSERT_FLOAT_EQ(got[i], want[i]) << "float " << i;
  const MemCacheStats st = cached->stats();
  EXPECT_EQ(st.pinned, 0u);
  EXPECT_EQ(st.dirty, host->stats().dirty);
  EXPECT_GT(st.dirty, 0u);
}

INSTANTIATE_TEST_SUITE_P(HostPartitions, WorkingSetDevices,
                         ::testing::Combine(::testing::Values(1, 2, 4), ::testing::Bool()));

// Bound to MEM-PS's rows the tier holds no copy: Apply steps the rows in
// MEM-PS before the write-back, the transfers are counted as with copies,
// and calls that would put copies in the tables are refused.
TEST(WorkingSet, BoundToHostRowsTheStepLandsInMemPsAtApply) {
  const SparseOptimizer opt = AdaGrad(2);
  RowStore bound_store(opt), copy_store(opt);
  auto bound_cache = bound_store.Cache(16), copy_cache = copy_store.Cache(16);
  auto bound = HostTier(2, 16, opt, true), copies = HostTier(2, 16, opt, false);
  const std::vector<uint64_t> keys = {1, 2, 3, 4, 5};
  const std::vector<float> before = CachedRows(*bound_cache, keys);
  WorkingSet a(*bound_cache, opt, 2, keys.data(), keys.size()), b(*copy_cache, opt, 2, keys.data(), keys.size());
  a.Load(*bound, nullptr);
  b.Load(*copies, nullptr);
  EXPECT_EQ(bound->size(), keys.size());  // the rows it reads, though its tables are empty
  const float row[4] = {0, 0, 0, 0};
  EXPECT_THROW(bound->Insert(keys.data(), 1, row, nullptr), std::logic_error);
  uint8_t* any = nullptr;
  EXPECT_THROW(copies->BindHostRows(keys.data(), 1, nullptr, &any), std::logic_error);
  std::vector<float> g(keys.size() * 2, 1.0f), ea(keys.size() * 2), eb(keys.size() * 2);
  for (WorkingSet* ws : {&a, &b}) {
    ws->Get(1, keys.data(), keys.size(), ws == &a ? ea.data() : eb.data());
    ws->Accumulate(0, keys.data(), keys.size(), g.data());
    EXPECT_EQ(ws->Apply(), keys.size());
  }
  EXPECT_EQ(ea, eb);
  EXPECT_EQ(bound->transfers().rows, copies->transfers().rows);
  const std::vector<float> stepped = CachedRows(*bound_cache, keys);  // before the write-back
  EXPECT_NE(stepped, before);
  std::vector<float> read(keys.size() * opt.row_floats());
  bound->Rows(keys.data(), keys.size(), read.data(), nullptr);
  EXPECT_EQ(read, stepped);
  EXPECT_EQ(CachedRows(*copy_cache, keys), before);  // copies: MEM-PS waits for the write-back
  a.WriteBack();
  b.WriteBack();
  EXPECT_EQ(CachedRows(*bound_cache, keys), CachedRows(*copy_cache, keys));
  EXPECT_EQ(bound_cache->stats().dirty, keys.size());
  EXPECT_EQ(bound_cache->stats().pinned, 0u);
  EXPECT_EQ(bound->size(), 0u);
}

TEST(WorkingSet, GivesTheDistinctKeysAndWhereEachExampleKeyIs) {
  const SparseOptimizer opt = AdaGrad(2);
  RowStore store(opt);
  auto cache = store.Cache(16);
  const std::vector<uint64_t> keys = {5, 6, 5, 7, 6};
  WorkingSet ws(*cache, opt, 2, keys.data(), keys.size());
  EXPECT_EQ(ws.keys(), (std::vector<uint64_t>{5, 6, 7}));
  EXPECT_EQ(ws.inverse(), (std::vector<int64_t>{0, 1, 0, 2, 1}));
  EXPECT_EQ(ws.hits(), 0u);
  EXPECT_EQ(cache->stats().pinned, 3u);
  ws.Abort();
  EXPECT_EQ(cache->stats().pinned, 0u);
  EXPECT_EQ(cache->stats().dirty, 0u);
  WorkingSet again(*cache, opt, 2, keys.data(), keys.size());
  EXPECT_EQ(again.hits(), 3u);
}

TEST(WorkingSet, AReservedKeyIsRefusedWithNothingPinned) {
  const SparseOptimizer opt = AdaGrad(2);
  RowStore store(opt);
  auto cache = store.Cache(16);
  const std::vector<uint64_t> keys = {5, kEmptyKey};
  EXPECT_THROW(WorkingSet(*cache, opt, 1, keys.data(), keys.size()), std::invalid_argument);
  EXPECT_EQ(cache->stats().pinned, 0u);
}

TEST(WorkingSet, AFailedLoadReleasesEveryPinAndEmptiesTheTier) {
  const SparseOptimizer opt = AdaGrad(2);
  RowStore store(opt);
  auto cache = store.Cache(64);
  std::vector<uint64_t> keys(10);
  for (uint64_t i = 0; i < keys.size(); ++i) keys[i] = 100 + i;
  for (bool bind_host_rows : {true, false}) {
    auto tier = HostTier(1, 4, opt, bind_host_rows);  // 4 rows: too small for 10 keys
    WorkingSet ws(*cache, opt, 1, keys.data(), keys.size());
    EXPECT_THROW(ws.Load(*tier, nullptr), TableFullError);
    EXPECT_TRUE(ws.released());
    EXPECT_EQ(cache->stats().pinned, 0u);
    EXPECT_EQ(tier->size(), 0u);
    std::vector<float> emb(2);
    EXPECT_THROW(ws.Get(0, keys.data(), 1, emb.data()), std::logic_error);
  }

  // A tier of the wrong shape is refused the same way.
  auto two = DeviceTier::New({2, 64, opt, false, 1, nullptr, {}});
  WorkingSet other(*cache, opt, 1, keys.data(), keys.size());
  EXPECT_THROW(other.Load(*two, nullptr), std::invalid_argument);
  EXPECT_EQ(cache->stats().pinned, 0u);
}

TEST(WorkingSet, CallsOutOfOrderAreRefused) {
  const SparseOptimizer opt = AdaGrad(2);
  RowStore store(opt);
  auto cache = store.Cache(16);
  auto tier = DeviceTier::New({1, 16, opt, false, 1, nullptr, {}});
  const std::vector<uint64_t> keys = {1, 2};
  WorkingSet ws(*cache, opt, 1, keys.data(), keys.size());
  EXPECT_THROW(ws.Apply(), std::logic_error);  // before load
  ws.Load(*tier, nullptr);
  EXPECT_THROW(ws.Load(*tier, nullptr), std::logic_error);
  EXPECT_THROW(ws.WriteBack(), std::logic_error);  // before apply
  const uint64_t missing = 3;
  std::vector<float> emb(2);
  EXPECT_THROW(ws.Get(0, &missing, 1, emb.data()), std::out_of_range);
  EXPECT_THROW(ws.Get(1, keys.data(), 1, emb.data()), std::invalid_argument);  // worker 1 of 1 device
  // A CPU tier reads and writes host memory only: a GPU's memory is refused before any copy.
  EXPECT_FALSE(tier->accepts_gpu_memory());
  EXPECT_THROW(ws.Get(0, keys.data(), 1, emb.data(), WorkingSet::Memory::kWorkerGpu), std::invalid_argument);
  EXPECT_THROW(ws.Accumulate(0, keys.data(), 1, emb.data(), WorkingSet::Memory::kWorkerGpu),
               std::invalid_argument);
  EXPECT_EQ(ws.Apply(), 0u);  // no gradients: nothing stepped
  ws.WriteBack();
  EXPECT_EQ(cache->stats().pinned, 0u);
  EXPECT_EQ(cache->stats().dirty, 0u);
}

TEST(WorkingSet, OwnersFromAPolicyPlaceTheRowsAndBadOnesAreNamed) {
  const SparseOptimizer opt = AdaGrad(2);
  RowStore store(opt);
  auto cache = store.Cache(16);
  auto tier = DeviceTier::New({2, 16, opt, false, 1, nullptr, {}});
  const std::vector<uint64_t> keys = {1, 2, 3};
  WorkingSet ws(*cache, opt, 2, keys.data(), keys.size());
  const std::vector<int32_t> bad = {0, 2, 1};
  try {
    ws.SetOwners(bad.data());
    FAIL() << "owner 2 of 2 devices accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("owners[1] = 2 (key 2)"), std::string::npos) << e.what();
  }
  const std::vector<int32_t> all_on_one = {1, 1, 1};
  ws.SetOwners(all_on_one.data());
  EXPECT_EQ(ws.most_per_device(), 3u);
  ws.Load(*tier, nullptr);
  std::vector<float> emb(keys.size() * 2);
  ws.Get(0, keys.data(), keys.size(), emb.data());
  const TransferMatrix m = tier->transfers();
  EXPECT_EQ(m.rows[1 * 2 + 0], 3u);  // all three came from device 1 to worker 0
  std::vector<float> g(keys.size() * 2, 1.0f);
  ws.Accumulate(1, keys.data(), keys.size(), g.data());
  EXPECT_EQ(ws.Apply(), 3u);
  ws.WriteBack();
  EXPECT_EQ(cache->stats().dirty, 3u);
  EXPECT_EQ(cache->stats().pinned, 0u);
}

// Both ways: bound to MEM-PS's rows (one unpin, the stepped rows dirty) and
// holding copies (the updated rows written back, then the rest unpinned). A
// key something else unpinned is named, and its step is kept all the same:
// with `evict`, its row leaves MEM-PS before the write-back, and a copy's
// step must reach the store; a step made in MEM-PS's row itself left with
// that row (clean until the release marks it), and is named lost.
TEST(WorkingSet, AKeyUnpinnedByOthersIsNamedAndItsStepKept) {
  const SparseOptimizer opt = AdaGrad(2);
  for (bool bound : {true, false}) {
    for (bool evict : {false, true}) {
      RowStore store(opt);
      auto cache = store.Cache(16);
      auto tier = HostTier(2, 16, opt, bound);
      const std::vector<uint64_t> keys = {1, 2, 3, 4};
      WorkingSet ws(*cache, opt, 2, keys.data(), keys.size());
      ws.Load(*tier, nullptr);
      std::vector<float> g(2 * 2, 1.0f);
      ws.Accumulate(0, keys.data(), 2, g.data());  // keys 1 and 2 get steps
      ws.Apply();
      // The first updated key the write-back writes is refused; the other one's
      // row comes after it, written alone.
      ASSERT_EQ(ws.updated_keys().size(), 2u);
      const uint64_t refused_key = ws.updated_keys()[0], kept_key = ws.updated_keys()[1];
      cache->Unpin(&refused_key, 1);  // an updated key
      cache->Unpin(&keys[3], 1);  // one that was not
      if (evict) {
        for (uint64_t other = 100; other < 164; ++other) cache->Pull(&other, 1, nullptr, /*pin=*/false, nullptr);
        ASSERT_FALSE(cache->Contains(refused_key)) << "bound " << bound;
      }
      try {
        ws.WriteBack();
        FAIL() << "a release of keys no longer pinned passed";
      } catch (const std::runtime_error& e) {
        EXPECT_NE(std::string(e.what()).find("2 of 4 keys"), std::string::npos) << e.what();
        // Bound to MEM-PS's rows, the step was made in the row that the
        // eviction dropped clean before the release could mark it: named lost.
        const std::string said = bound && evict ? "the steps of keys " + std::to_string(refused_key) + " are lost"
                                                : "their steps were kept";
        EXPECT_NE(std::string(e.what()).find(said), std::string::npos) << e.what();
      }
      const MemCacheStats st = cache->stats();
      EXPECT_EQ(st.pinned, 0u);
      if (!evict) {
        EXPECT_EQ(st.dirty, 2u);  // both steps
      }
      EXPECT_EQ(st.failed_releases, 1u);
      EXPECT_TRUE(ws.released());
      EXPECT_EQ(tier->size(), 0u);
      // Both updated rows are their steps (the same batch on an unhindered
      // cache), wherever MEM-PS keeps them now.
      RowStore reference_store(opt);
      auto reference = reference_store.Cache(16);
      StepUnhindered(*reference, opt, bound, keys, g);
      std::vector<uint64_t> updated = {kept_key};
      if (!(bound && evict)) updated.push_back(refused_key);
      EXPECT_EQ(CachedRows(*cache, updated), CachedRows(*reference, updated))
          << "bound " << bound << ", evict " << evict;
    }
  }
}

TEST(WorkingSet, AbortAfterApplyKeepsTheStepsAndBeforeItDropsThem) {
  const SparseOptimizer opt = AdaGrad(2);
  RowStore store(opt);
  auto cache = store.Cache(16);
  auto tier = DeviceTier::New({1, 16, opt, false, 1, nullptr, {}});
  const std::vector<uint64_t> keys = {1, 2};
  const std::vector<float> before = CachedRows(*cache, keys);
  std::vector<float> g(2 * 2, 1.0f);
  {
    WorkingSet ws(*cache, opt, 1, keys.data(), keys.size());
    ws.Load(*tier, nullptr);
    ws.Accumulate(0, keys.data(), 2, g.data());
    ws.Abort();
  }
  EXPECT_EQ(CachedRows(*cache, keys), before);
  EXPECT_EQ(cache->stats().dirty, 0u);
  {
    WorkingSet ws(*cache, opt, 1, keys.data(), keys.size());
    ws.Load(*tier, nullptr);
    ws.Accumulate(0, keys.data(), 2, g.data());
    ws.Apply();
  }  // the destructor writes the applied steps back
  EXPECT_NE(CachedRows(*cache, keys), before);
  EXPECT_EQ(cache->stats().dirty, 2u);
  EXPECT_EQ(cache->stats().pinned, 0u);
}

// The pipeline's overlap: batch B is pinned and loaded on a second tier on
// another thread while batch A trains; B's first Get waits for A's Apply and
// takes A's updated rows. The result equals running them one after another,
// whichever of the two tiers is bound to MEM-PS's rows and which holds copies.
TEST(WorkingSet, APipelinedBatchTakesThePreviousOnesUpdates) {
  const SparseOptimizer opt = AdaGrad(4);
  for (int32_t devices : {1, 2})
  for (int bound : {0, 3}) {  // bit 0: A's tier bound to host rows, bit 1: B's
    RowStore seq_store(opt), pipe_store(opt);
    auto seq = seq_store.Cache(64), piped = pipe_store.Cache(64);
    auto tier_a = HostTier(devices, 64, opt, (bound & 1) != 0);
    auto tier_b = HostTier(devices, 64, opt, (bound & 2) != 0);
    const Step a = MakeStep({1, 2, 3, 4, 1}, opt.dim, 0.5f), b = MakeStep({3, 4, 5, 1}, opt.dim, 0.25f);
    TierStep(*seq, *tier_a, opt, a);
    TierStep(*seq, *tier_a, opt, b);

    WorkingSet wa(*piped, opt, devices, a.keys.data(), a.keys.size());
    wa.Load(*tier_a, nullptr);
    std::unique_ptr<WorkingSet> wb;
    std::thread loader([&] {  // pins and loads B while A trains
      wb = std::make_unique<WorkingSet>(*piped, opt, devices, b.keys.data(), b.keys.size());
      wb->Load(*tier_b, wa.updates());
    });
    wa.Accumulate(0, a.keys.data(), a.keys.size(), a.grads.data());
    wa.Apply();
    loader.join();
    std::thread writer([&] { wa.WriteBack(); });  // A's write-back beside B's training
    std::vector<float> emb(b.keys.size() * opt.dim);
    wb->Get(0, b.keys.data(), b.keys.size(), emb.data());
    wb->Accumulate(0, b.keys.data(), b.keys.size(), b.grads.data());
    wb->Apply();
    writer.join();
    wb->WriteBack();
    const std::vector<uint64_t> keys = {1, 2, 3, 4, 5};
    const std::vector<float> want = CachedRows(*seq, keys), got = CachedRows(*piped, keys);
    for (size_t i = 0; i < want.size(); ++i) {
      ASSERT_FLOAT_EQ(got[i], want[i]) << devices << " devices, bound " << bound << ", float " << i;
    }
    EXPECT_EQ(piped->stats().pinned, 0u);
  }
}

// A copying batch writes its rows into MEM-PS at its write-back, after a
// bound batch behind it may have stepped them there: a pipelined pair of
// tiers of the two kinds is refused at the second load, which releases its pins.
TEST(WorkingSet, APipelinedPairOfTiersOfTwoKindsIsRefused) {
  const SparseOptimizer opt = AdaGrad(2);
  const std::vector<uint64_t> keys = {1, 2};
  for (bool first_bound : {true, false}) {
    RowStore store(opt);
    auto cache = store.Cache(16);
    auto tier_a = HostTier(2, 16, opt, first_bound), tier_b = HostTier(2, 16, opt, !first_bound);
    WorkingSet wa(*cache, opt, 2, keys.data(), keys.size());
    wa.Load(*tier_a, nullptr);
    WorkingSet wb(*cache, opt, 2, keys.data(), keys.size());
    try {
      wb.Load(*tier_b, wa.updates());
      FAIL() << "a pipelined pair of two kinds loaded";
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find("tiers of one kind"), std::string::npos) << e.what();
    }
    EXPECT_TRUE(wb.released());
    EXPECT_EQ(tier_b->size(), 0u);
    std::vector<float> g(2 * 2, 1.0f);
    wa.Accumulate(0, keys.data(), 2, g.data());
    wa.Apply();
    wa.WriteBack();
    EXPECT_EQ(cache->stats().pinned, 0u);
    EXPECT_EQ(cache->stats().dirty, 2u);
  }
}

TEST(WorkingSet, ABatchAfterOneAbortedBeforeApplyTakesNothingAndDoesNotWait) {
  const SparseOptimizer opt = AdaGrad(2);
  RowStore store(opt);
  auto cache = store.Cache(16);
  auto tier_a = DeviceTier::New({1, 16, opt, false, 1, nullptr, {}});
  auto tier_b = DeviceTier::New({1, 16, opt, false, 1, nullptr, {}});
  const std::vector<uint64_t> keys = {1, 2};
  const std::vector<float> before = CachedRows(*cache, keys);
  WorkingSet wa(*cache, opt, 1, keys.data(), keys.size());
  wa.Load(*tier_a, nullptr);
  WorkingSet wb(*cache, opt, 1, keys.data(), keys.size());
  wb.Load(*tier_b, wa.updates());
  std::vector<float> g(2 * 2, 1.0f);
  wa.Accumulate(0, keys.data(), 2, g.data());
  wa.Abort();
  std::vector<float> emb(2 * 2);
  wb.Get(0, keys.data(), 2, emb.data());
  for (int i = 0; i < 2; ++i) {
    for (int d = 0; d < 2; ++d) EXPECT_EQ(emb[i * 2 + d], before[i * opt.row_floats() + d]);
  }
  wb.Abort();
  EXPECT_EQ(cache->stats().pinned, 0u);
}

TEST(WorkingSet, RefusesNoDevicesAndMemPsRowsOfAnotherWidth) {
  const SparseOptimizer opt = AdaGrad(2);
  RowStore store(opt);
  auto cache = store.Cache(16);
  const std::vector<uint64_t> keys = {1, 2};
  EXPECT_THROW(WorkingSet(*cache, opt, 0, keys.data(), keys.size()), std::invalid_argument);
  const SparseOptimizer narrower = AdaGrad(1);  // MEM-PS's rows are wider than its rows
  EXPECT_THROW(WorkingSet(*cache, narrower, 1, keys.data(), keys.size()), std::invalid_argument);
  EXPECT_EQ(cache->stats().pinned, 0u);
}

// SetOwners names a negative owner too, and is refused once loaded.
TEST(WorkingSet, OwnersAreSetBeforeLoadOnlyAndNegativeOnesAreNamed) {
  const SparseOptimizer opt = AdaGrad(2);
  RowStore store(opt);
  auto cache = store.Cache(16);
  auto tier = DeviceTier::New({2, 16, opt, false, 1, nullptr, {}});
  const std::vector<uint64_t> keys = {1, 2};
  WorkingSet ws(*cache, opt, 2, keys.data(), keys.size());
  const std::vector<int32_t> negative = {0, -1};
  try {
    ws.SetOwners(negative.data());
    FAIL() << "owner -1 accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("owners[1] = -1 (key 2)"), std::string::npos) << e.what();
  }
  ws.Load(*tier, nullptr);
  const std::vector<int32_t> good = {1, 0};
  EXPECT_THROW(ws.SetOwners(good.data()), std::logic_error);
  ws.Abort();
  EXPECT_EQ(cache->stats().pinned, 0u);
}

// Positions gives each key's place among keys() (a missing key is named),
// and the positional calls read and step the rows the calls by key do.
TEST(WorkingSet, PositionsAndThePositionalCallsMatchTheCallsByKey) {
  const SparseOptimizer opt = AdaGrad(2);
  for (bool bind_host_rows : {false, true}) {
    RowStore by_key_store(opt), at_store(opt);
    auto by_key_cache = by_key_store.Cache(16), at_cache = at_store.Cache(16);
    auto by_key_tier = HostTier(1, 16, opt, bind_host_rows), at_tier = HostTier(1, 16, opt, bind_host_rows);
    const std::vector<uint64_t> batch = {7, 3, 9, 3, 5};
    WorkingSet by_key(*by_key_cache, opt, 1, batch.data(), batch.size());
    WorkingSet at(*at_cache, opt, 1, batch.data(), batch.size());
    const std::vector<uint64_t> asked = {5, 9, 7, 3, 9};
    std::vector<int64_t> positions(asked.size());
    at.Positions(asked.data(), asked.size(), positions.data());
    EXPECT_EQ(positions, (std::vector<int64_t>{3, 2, 0, 1, 2}));
    const std::vector<uint64_t> missing = {7, 4};
    std::vector<int64_t> unused(missing.size());
    EXPECT_THROW(at.Positions(missing.data(), missing.size(), unused.data()), std::out_of_range);
    by_key.Load(*by_key_tier, nullptr);
    at.Load(*at_tier, nullptr);
    std::vector<float> want(asked.size() * 2), got(asked.size() * 2), grads(asked.size() * 2);
    for (size_t i = 0; i < grads.size(); ++i) grads[i] = 0.1f * static_cast<float>(i + 1);
    by_key.Get(0, asked.data(), asked.size(), want.data());
    at.GetAt(0, positions.data(), positions.size(), got.data());
    EXPECT_EQ(got, want);
    by_key.Accumulate(0, asked.data(), asked.size(), grads.data());
    at.AccumulateAt(0, positions.data(), positions.size(), grads.data());
    EXPECT_EQ(by_key.Apply(), 4u);
    EXPECT_EQ(at.Apply(), 4u);
    by_key.WriteBack();
    at.WriteBack();
    const std::vector<uint64_t> all = {3, 5, 7, 9};
    EXPECT_EQ(CachedRows(*at_cache, all), CachedRows(*by_key_cache, all)) << "bind_host_rows " << bind_host_rows;
  }
}

// With owners from a policy, calls by key find each key on its own owner,
// in whatever order the keys come (tiers holding copies look keys up on the
// owner they are given).
TEST(WorkingSet, CallsByKeyFindEachKeyOnItsOwnerInAnyOrder) {
  const SparseOptimizer opt = AdaGrad(2);
  for (bool bound : {false, true}) {
    RowStore store(opt);
    auto cache = store.Cache(16);
    auto tier = HostTier(2, 16, opt, bound);
    const std::vector<uint64_t> keys = {1, 2, 3};
    const std::vector<float> rows = CachedRows(*cache, keys);
    WorkingSet ws(*cache, opt, 2, keys.data(), keys.size());
    const std::vector<int32_t> owners = {0, 1, 1};
    ws.SetOwners(owners.data());
    ws.Load(*tier, nullptr);
    const std::vector<uint64_t> asked = {3, 1};  // owners 1 and 0
    std::vector<float> emb(asked.size() * 2);
    ws.Get(0, asked.data(), asked.size(), emb.data());
    for (int d = 0; d < 2; ++d) {
      EXPECT_EQ(emb[d], rows[2 * opt.row_floats() + d]) << "bound " << bound;
      EXPECT_EQ(emb[2 + d], rows[0 * opt.row_floats() + d]) << "bound " << bound;
    }
    const TransferMatrix m = tier->transfers();
    EXPECT_EQ(m.rows[1 * 2 + 0], 1u);  // key 3 from device 1
    EXPECT_EQ(m.rows[0 * 2 + 0], 1u);  // key 1 from device 0
    std::vector<float> g(asked.size() * 2, 1.0f);
    ws.Accumulate(1, asked.data(), asked.size(), g.data());
    EXPECT_EQ(ws.Apply(), 2u);
    ws.WriteBack();
    EXPECT_EQ(cache->stats().dirty, 2u);
    EXPECT_EQ(cache->stats().pinned, 0u);
  }
}

// A push of a key the batch does not hold, its owners from the modulo hash:
// on a tier whose rows cross a row mover (a CUDA tier, host partitions with
// executed routes) it was added to the gradient tables, and Apply stepped
// the batch's rows before it named the key, then released the batch. Every
// tier refuses the push now, naming the key, and adds nothing of it: the
// batch goes on, and its Apply steps what the other pushes sent.
TEST(WorkingSet, APushOfAKeyNotInTheBatchIsRefusedOnEveryTierAndAddsNothing) {
  const SparseOptimizer opt = AdaGrad(2);
  Topology t;
  t.devices = {{"h0", DeviceKind::kHost, 0}, {"h1", DeviceKind::kHost, 0}, {"mem", DeviceKind::kCpu, 0}};
  t.links = {{0, 2, 1, 0.5, "memcpy"}, {1, 2, 1, 0.5, "memcpy"}};
  const auto routes = PlanTierRoutes(t, 2, 1 << 20, /*execute=*/true);
  const std::vector<uint64_t> keys = {1, 2, 3};
  const Step s = MakeStep({1, 2, 1}, opt.dim, 0.5f);
  RowStore reference_store(opt);
  auto reference = reference_store.Cache(16);
  HostStep(*reference, opt, s);
  for (const int way : {0, 1, 2}) {
    SCOPED_TRACE(way == 0 ? "bound to host rows" : way == 1 ? "copies, in place" : "through the row mover");
    auto tier = DeviceTier::New({2, 16, opt, /*use_cuda=*/false, /*threads=*/1, way == 2 ? routes : nullptr, {},
                                 /*bind_host_rows=*/way == 0});
    RowStore store(opt);
    auto cache = store.Cache(16);
    WorkingSet ws(*cache, opt, 2, keys.data(), keys.size());
    ws.Load(*tier, nullptr);
    EXPECT_EQ(ws.reads_in_place(), way != 2);
    const std::vector<uint64_t> stray = {2, 999};
    const std::vector<float> g(stray.size() * 2, 1.0f);
    try {
      ws.Accumulate(0, stray.data(), stray.size(), g.data());
      ADD_FAILURE() << "a key not in the batch was pushed";
    } catch (const std::out_of_range& e) {
      EXPECT_STREQ(e.what(), "device tier accumulate: keys[1] = 999 is not among the 3 keys bound");
    }
    ws.Accumulate(1, s.keys.data(), s.keys.size(), s.grads.data());
    EXPECT_EQ(ws.Apply(), 2u);
    ws.WriteBack();
    EXPECT_EQ(CachedRows(*cache, keys), CachedRows(*reference, keys));
    EXPECT_EQ(cache->stats().pinned, 0u);
  }
}

TEST(WorkingSet, ATierThatHoldsRowsIsRefused) {
  const SparseOptimizer opt = AdaGrad(2);
  RowStore store(opt);
  auto cache = store.Cache(16);
  auto tier = DeviceTier::New({1, 16, opt, false, 1, nullptr, {}});
  const std::vector<uint64_t> a_keys = {1, 2}, b_keys = {3};
  WorkingSet a(*cache, opt, 1, a_keys.data(), a_keys.size());
  a.Load(*tier, nullptr);
  WorkingSet b(*cache, opt, 1, b_keys.data(), b_keys.size());
  EXPECT_THROW(b.Load(*tier, nullptr), std::invalid_argument);
  EXPECT_TRUE(b.released());
  EXPECT_EQ(tier->size(), 0u);  // the failed load empties the tier
  a.Abort();
  EXPECT_EQ(cache->stats().pinned, 0u);
}

// A batch released before it was loaded holds no rows of either kind: the
// batch after it may load onto a tier of any kind.
TEST(WorkingSet, ABatchAfterOneNeverLoadedLoadsOntoEitherKindOfTier) {
  const SparseOptimizer opt = AdaGrad(2);
  const std::vector<uint64_t> keys = {1, 2};
  for (bool bound : {true, false}) {
    RowStore store(opt);
    auto cache = store.Cache(16);
    auto tier = HostTier(1, 16, opt, bound);
    WorkingSet a(*cache, opt, 1, keys.data(), keys.size());
    a.Abort();
    WorkingSet b(*cache, opt, 1, keys.data(), keys.size());
    b.Load(*tier, a.updates());
    std::vector<float> g(2 * 2, 1.0f);
    b.Accumulate(0, keys.data(), 2, g.data());
    EXPECT_EQ(b.Apply(), 2u);
    b.WriteBack();
    EXPECT_EQ(cache->stats().pinned, 0u);
  }
}

// Apply steps once: a second call changes nothing and returns 0, and the
// write-back writes the first call's steps and unpins the rows without
// gradients (clean). Abort after a write-back, and the destructor after
// either, do nothing more.
TEST(WorkingSet, LaterAppliesAndReleasesDoNothing) {
  const SparseOptimizer opt = AdaGrad(2);
  for (bool bound : {false, true}) {
    RowStore store(opt), once_store(opt);
    auto cache = store.Cache(16), once = once_store.Cache(16);
    auto tier = HostTier(1, 16, opt, bound), once_tier = HostTier(1, 16, opt, bound);
    const Step s = MakeStep({1, 2, 2}, opt.dim, 0.5f);
    TierStep(*once, *once_tier, opt, s);
    {
      const std::vector<uint64_t> batch = {1, 2, 2, 3};  // 3 gets no gradient
      WorkingSet ws(*cache, opt, 1, batch.data(), batch.size());
      ws.Load(*tier, nullptr);
      ws.Accumulate(0, s.keys.data(), s.keys.size(), s.grads.data());
      EXPECT_EQ(ws.Apply(), 2u);
      EXPECT_EQ(ws.Apply(), 0u);
      EXPECT_EQ(ws.updated_keys().size(), 2u);
      ws.WriteBack();
      ws.WriteBack();
      ws.Abort();
    }
    const std::vector<uint64_t> keys = {1, 2};
    EXPECT_EQ(CachedRows(*cache, keys), CachedRows(*once, keys)) << "bound " << bound;
    const MemCacheStats st = cache->stats();
    EXPECT_EQ(st.pinned, 0u);
    EXPECT_EQ(st.dirty, 2u);
    EXPECT_EQ(st.failed_releases, 0u);
  }
}

// The pipelined batch's positional calls also wait for the previous batch's
// Apply and see its updated rows (host partitions holding copies, the path a
// GPU tier takes, and bound to MEM-PS's rows).
// Batches a and b on one device: stepped in turn on one store (the reference,
// after_a: b's keys' rows after a), and pipelined on another, b's working set
// loaded behind a's.
struct PipelinedPair {
  PipelinedPair(const SparseOptimizer& opt, bool bound)
      : opt(opt), bound(bound), seq_store(opt), pipe_store(opt), seq(seq_store.Cache(32)),
        piped(pipe_store.Cache(32)), seq_tier(HostTier(1, 32, opt, bound)), tier_a(HostTier(1, 32, opt, bound)),
        tier_b(HostTier(1, 32, opt, bound)), a(MakeStep({1, 2, 3}, opt.dim, 0.5f)),
        b(MakeStep({3, 1, 4}, opt.dim, 0.25f)) {
    TierStep(*seq, *seq_tier, opt, a);
    after_a = CachedRows(*seq, b.keys);
    wa = std::make_unique<WorkingSet>(*piped, opt, 1, a.keys.data(), a.keys.size());
    wa->Load(*tier_a, nullptr);
    wb = std::make_unique<WorkingSet>(*piped, opt, 1, b.keys.data(), b.keys.size());
    wb->Load(*tier_b, wa->updates());
  }
  // emb (b's keys' embeddings, as b read them) holds a's updates.
  void ExpectAUpdatesIn(const std::vector<float>& emb) const {
    for (size_t i = 0; i < b.keys.size(); ++i) {
      for (int32_t d = 0; d < opt.dim; ++d) {
        EXPECT_EQ(emb[i * opt.dim + d], after_a[i * opt.row_floats() + d]) << "bound " << bound << ", key " << b.keys[i];
      }
    }
  }

  const SparseOptimizer& opt;
  const bool bound;
  RowStore seq_store, pipe_store;
  std::unique_ptr<MemCache> seq, piped;
  std::unique_ptr<DeviceTier> seq_tier, tier_a, tier_b;
  const Step a, b;
  std::vector<float> after_a;
  std::unique_ptr<WorkingSet> wa, wb;
};

TEST(WorkingSet, APipelinedBatchsPositionalCallsSeeThePreviousOnesUpdates) {
  const SparseOptimizer opt = AdaGrad(2);
  for (bool bound : {false, true}) {
    PipelinedPair p(opt, bound);
    TierStep(*p.seq, *p.seq_tier, opt, p.b);
    p.wa->Accumulate(0, p.a.keys.data(), p.a.keys.size(), p.a.grads.data());
    p.wa->Apply();
    std::vector<int64_t> positions(p.b.keys.size());
    p.wb->Positions(p.b.keys.data(), p.b.keys.size(), positions.data());
    std::vector<float> emb(p.b.keys.size() * opt.dim);
    p.wb->GetAt(0, positions.data(), positions.size(), emb.data());
    p.ExpectAUpdatesIn(emb);
    p.wb->AccumulateAt(0, positions.data(), positions.size(), p.b.grads.data());
    p.wb->Apply();
    p.wa->WriteBack();
    p.wb->WriteBack();
    const std::vector<uint64_t> keys = {1, 2, 3, 4};
    EXPECT_EQ(CachedRows(*p.piped, keys), CachedRows(*p.seq, keys)) << "bound " << bound;
  }
}

// A policy may give a key another owner in the next batch: the pipelined
// batch still takes the previous one's updated row, wherever it holds the key.
TEST(WorkingSet, APipelinedBatchWithOtherOwnersTakesThePreviousOnesUpdates) {
  const SparseOptimizer opt = AdaGrad(2);
  RowStore seq_store(opt), pipe_store(opt);
  auto seq = seq_store.Cache(32), piped = pipe_store.Cache(32);
  auto seq_tier = HostTier(2, 32, opt, false), tier_a = HostTier(2, 32, opt, false),
       tier_b = HostTier(2, 32, opt, false);
  const Step a = MakeStep({1, 2, 3}, opt.dim, 0.5f), b = MakeStep({3, 1, 4}, opt.dim, 0.25f);
  const std::vector<int32_t> a_owners = {0, 0, 1}, b_owners = {0, 1, 1};  // key 3: 1, then 0; key 1: 0, then 1
  const auto run = [&](MemCache& cache, DeviceTier& tier, const Step& s, const std::vector<int32_t>& owners) {
    WorkingSet ws(cache, opt, 2, s.keys.data(), s.keys.size());
    ws.SetOwners(owners.data());
    ws.Load(tier, nullptr);
    ws.Accumulate(0, s.keys.data(), s.keys.size(), s.grads.data());
    ws.Apply();
    ws.WriteBack();
  };
  run(*seq, *seq_tier, a, a_owners);
  run(*seq, *seq_tier, b, b_owners);

  WorkingSet wa(*piped, opt, 2, a.keys.data(), a.keys.size());
  wa.SetOwners(a_owners.data());
  wa.Load(*tier_a, nullptr);
  WorkingSet wb(*piped, opt, 2, b.keys.data(), b.keys.size());
  wb.SetOwners(b_owners.data());
  wb.Load(*tier_b, wa.updates());
  wa.Accumulate(0, a.keys.data(), a.keys.size(), a.grads.data());
  wa.Apply();
  wb.Accumulate(1, b.keys.data(), b.keys.size(), b.grads.data());
  wb.Apply();
  wa.WriteBack();
  wb.WriteBack();
  const std::vector<uint64_t> keys = {1, 2, 3, 4};
  EXPECT_EQ(CachedRows(*piped, keys), CachedRows(*seq, keys));
}

// A pipelined batch whose first Get comes before the previous batch's Apply
// waits on another thread, and that Apply wakes it: the Get returns only once
// the Apply has begun, with the updated rows, and does not wait forever.
TEST(WorkingSet, APipelinedBatchWaitingOnAnotherThreadWakesAtThePreviousOnesApply) {
  const SparseOptimizer opt = AdaGrad(2);
  for (bool bound : {false, true}) {
    PipelinedPair p(opt, bound);
    std::atomic<bool> applying{false}, returned_early{false};
    std::vector<float> emb(p.b.keys.size() * opt.dim);
    std::promise<void> got;
    std::future<void> got_done = got.get_future();
    std::thread trainer([&] {
      p.wb->Get(0, p.b.keys.data(), p.b.keys.size(), emb.data());
      returned_early = !applying;
      got.set_value();
    });
    std::this_thread::sleep_for(std::chrono::milliseconds(50));  // the trainer waits by now, as a rule
    p.wa->Accumulate(0, p.a.keys.data(), p.a.keys.size(), p.a.grads.data());
    applying = true;
    p.wa->Apply();
    if (got_done.wait_for(std::chrono::seconds(20)) != std::future_status::ready) {
      std::fprintf(stderr, "WorkingSet: a Get waiting for the previous batch's Apply was never woken (bound %d)\n",
                   bound);
      std::abort();  // the waiting thread cannot be joined
    }
    trainer.join();
    EXPECT_FALSE(returned_early) << "bound " << bound << ": Get returned before the previous batch's Apply";
    p.ExpectAUpdatesIn(emb);
    p.wa->WriteBack();
    p.wb->Abort();
    EXPECT_EQ(p.piped->stats().pinned, 0u);
  }
}

// Something else unpins an updated key during the release's own MemCache
// call, past its check that the keys are pinned (PinBreakingCache): that
// call releases the other keys and says so (BrokenPinError), and the batch
// is released: its error names the key, the step is kept, and nothing is
// released twice (the next batch's pins on the same keys stay).
TEST(WorkingSet, AKeyUnpinnedDuringTheReleaseIsNamedAndItsStepKept) {
  const SparseOptimizer opt = AdaGrad(2);
  for (bool bound : {true, false}) {
    RowStore store(opt), reference_store(opt);
    PinBreakingCache cache(store.Cache(16));
    auto reference = reference_store.Cache(16);
    const std::vector<uint64_t> keys = {1, 2, 3, 4};
    std::vector<float> g(2 * 2, 1.0f);  // keys 1 and 2 get steps
    StepUnhindered(*reference, opt, bound, keys, g);

    std::vector<uint64_t> next;  // the next batch's keys: all but the victim, whose only pin the foreign unpin takes
    uint64_t victim = 0;
    {
      auto tier = HostTier(2, 16, opt, bound);
      WorkingSet ws(cache, opt, 2, keys.data(), keys.size());
      LoadAndStep(ws, *tier, keys, g);
      victim = ws.updated_keys()[0];
      for (uint64_t k : keys) {
        if (k != victim) next.push_back(k);
      }
      cache.Pull(next.data(), next.size(), nullptr, /*pin=*/true, nullptr);
      cache.victim = victim;
      try {
        ws.WriteBack();
        FAIL() << "bound " << bound << ": a release that met a key unpinned during it passed";
      } catch (const std::runtime_error& e) {
        const std::string said = e.what();
        EXPECT_NE(said.find("1 of 4 keys were no longer pinned by this batch (keys " + std::to_string(victim) + ")"),
                  std::string::npos)
            << said;
        EXPECT_NE(said.find("their steps were kept"), std::string::npos) << said;
      }
      EXPECT_EQ(cache.victim, kEmptyKey) << "bound " << bound << ": the foreign unpin did not happen";
      EXPECT_TRUE(ws.released()) << "bound " << bound;
    }  // the destructor has nothing left to release
    const MemCacheStats st = cache.stats();
    EXPECT_EQ(st.pinned, next.size()) << "bound " << bound << ": the next batch's pins";
    EXPECT_EQ(st.failed_releases, 1u) << "bound " << bound;
    cache.Unpin(next.data(), next.size(), nullptr);
    const std::vector<uint64_t> updated = {1, 2};
    EXPECT_EQ(CachedRows(cache, updated), CachedRows(*reference, updated)) << "bound " << bound;
  }
}

// MEM-PS whose keeping of a refused release's updates fails (the sink's
// error behind KeepUpdated; MarkUpdated's bad_alloc) as many times as asked;
// everything else is the real cache's.
class KeepFailingCache final : public ForwardingCache {
 public:
  using ForwardingCache::ForwardingCache;
  int failures = 0;

  void KeepUpdated(const uint64_t* k, uint64_t n, const uint8_t* rows) override {
    if (failures > 0) {
      --failures;
      throw std::runtime_error("sink failed (injected)");
    }
    ForwardingCache::KeepUpdated(k, n, rows);
  }
  std::vector<uint64_t> MarkUpdated(const uint64_t* k, uint64_t n, uint8_t* const* at) override {
    if (failures > 0) {
      --failures;
      throw std::bad_alloc();
    }
    return ForwardingCache::MarkUpdated(k, n, at);
  }
};

// A release that has released some keys and then fails to keep a refused
// key's step (KeepUpdated's sink, MarkUpdated's allocation) is retried
// without releasing any key again: meanwhile the next batch pinned the same
// keys, and a second release of them would have taken its pins. The retry
// keeps the step, releases what was left, and names the refused key.
TEST(WorkingSet, ARetryAfterAFailureToKeepARefusedStepReleasesNoKeyTwice) {
  const SparseOptimizer opt = AdaGrad(2);
  for (bool bound : {true, false}) {
    SCOPED_TRACE(bound ? "bound to host rows" : "holding copies");
    RowStore store(opt), reference_store(opt);
    KeepFailingCache cache(store.Cache(16));
    auto reference = reference_store.Cache(16);
    const std::vector<uint64_t> keys = {1, 2, 3, 4};
    std::vector<float> g(2 * 2, 1.0f);  // keys 1 and 2 get steps
    StepUnhindered(*reference, opt, bound, keys, g);

    auto tier = HostTier(2, 16, opt, bound);
    WorkingSet ws(cache, opt, 2, keys.data(), keys.size());
    ws.Load(*tier, nullptr);
    ws.Accumulate(0, keys.data(), 2, g.data());
    ws.Apply();
    const uint64_t refused_key = ws.updated_keys()[0];
    cache.Unpin(&refused_key, 1, nullptr);  // something else takes its pin: the write-back goes one key at a time
    cache.failures = 1;
    try {
      ws.WriteBack();
      FAIL() << "a release whose keeping failed passed";
    } catch (const std::exception& e) {
      EXPECT_NE(std::string(e.what()).find(bound ? "bad_alloc" : "injected"), std::string::npos) << e.what();
    }
    EXPECT_FALSE(ws.released());
    EXPECT_EQ(cache.failures, 0);
    EXPECT_EQ(cache.stats().failed_releases, 1u);

    // The next batch pins every key but the refused one.
    std::vector<uint64_t> next;
    for (uint64_t k : keys) {
      if (k != refused_key) next.push_back(k);
    }
    cache.Pull(next.data(), next.size(), nullptr, /*pin=*/true, nullptr);
    try {
      ws.WriteBack();
      FAIL() << "a release of a key no longer pinned passed";
    } catch (const std::runtime_error& e) {
      const std::string said = e.what();
      EXPECT_NE(said.find("1 of 4 keys were no longer pinned by this batch (keys " + std::to_string(refused_key) + ")"),
                std::string::npos)
          << said;
      EXPECT_NE(said.find("their steps were kept"), std::string::npos) << said;
    }
    EXPECT_TRUE(ws.released());
    EXPECT_EQ(cache.stats().pinned, next.size()) << "the next batch's pins";
    EXPECT_EQ(cache.stats().failed_releases, 2u);
    cache.Unpin(next.data(), next.size(), nullptr);
    const std::vector<uint64_t> updated = {1, 2};
    EXPECT_EQ(CachedRows(cache, updated), CachedRows(*reference, updated));
  }
}

// A release that goes key by key (something else took a key's pin, so the
// bulk call is refused) and runs out of memory midway is retried as its
// batch would retry it: every allocation of the first attempt is failed in
// turn. The retry releases exactly the keys the first left pinned: the next
// batch's pins on the same keys stay (none released twice), none of this
// batch's is left behind, the steps are kept and the refused key is named.
TEST(WorkingSet, AKeyByKeyReleaseThatRunsOutOfMemoryIsFinishedByItsRetry) {
  const SparseOptimizer opt = AdaGrad(2);
  for (bool bound : {true, false}) {
    SCOPED_TRACE(bound ? "bound to host rows" : "holding copies");
    const auto& [keys, g, updated, expected] = ReleaseTestBatch(opt, bound, {1, 2, 3, 4, 5, 6});
    ForEveryAllocation([&](uint64_t k) {
      SteppedWorkingSet stepped(opt, bound, keys, g);
      auto& [store, cache, tier, ws] = stepped;
      const uint64_t refused_key = ws.updated_keys()[0];
      cache->Unpin(&refused_key, 1, nullptr);  // something else takes its pin
      std::vector<uint64_t> next;              // the next batch pins every other key
      for (uint64_t key : keys) {
        if (key != refused_key) next.push_back(key);
      }
      cache->Pull(next.data(), next.size(), nullptr, /*pin=*/true, nullptr);

      const FailingAllocationCall first = CallFailingAllocation(k, [&] { ws.WriteBack(); });
      if (!first.ran_out && !first.refused) ADD_FAILURE() << "a release of a key no longer pinned passed";
      if (first.ran_out) {
        EXPECT_FALSE(ws.released());
        try {
          ws.WriteBack();
          ADD_FAILURE() << "a retried release of a key no longer pinned passed";
        } catch (const std::runtime_error& e) {
          EXPECT_NE(std::string(e.what()).find("(keys " + std::to_string(refused_key) + ")"), std::string::npos)
              << e.what();
        }
      }
      EXPECT_TRUE(ws.released());
      // The next batch's pins, each once: a key released twice has lost its
      // pin (refused), one left pinned stays pinned after.
      EXPECT_NO_THROW(cache->Unpin(next.data(), next.size(), nullptr));
      EXPECT_EQ(cache->stats().pinned, 0u);
      EXPECT_EQ(CachedRows(*cache, updated), expected);
      return first;
    });
  }
}

// A release that runs out of memory is counted in failed_releases, once,
// wherever it ran out: also before any key's release (the room for the
// step's flags or addresses), where the retry does the whole release. Every
// allocation of the first attempt is failed in turn; the retry passes and
// counts nothing more.
TEST(WorkingSet, EveryReleaseThatRunsOutOfMemoryIsCountedOnce) {
  const SparseOptimizer opt = AdaGrad(2);
  for (bool bound : {true, false}) {
    SCOPED_TRACE(bound ? "bound to host rows" : "holding copies");
    const auto& [keys, g, updated, expected] = ReleaseTestBatch(opt, bound, {1, 2, 3, 4});
    ForEveryAllocation([&](uint64_t k) {
      SteppedWorkingSet stepped(opt, bound, keys, g);
      auto& [store, cache, tier, ws] = stepped;

      const FailingAllocationCall first = CallFailingAllocation(k, [&] { ws.WriteBack(); });
      EXPECT_FALSE(first.refused) << first.error;
      EXPECT_EQ(cache->stats().failed_releases, first.ran_out ? 1u : 0u);
      if (first.ran_out) {
        EXPECT_FALSE(ws.released());
        EXPECT_NO_THROW(ws.WriteBack());
        EXPECT_EQ(cache->stats().failed_releases, 1u);
      }
      EXPECT_TRUE(ws.released());
      EXPECT_EQ(cache->stats().pinned, 0u);
      EXPECT_EQ(CachedRows(*cache, updated), expected);
      return first;
    });
  }
}

// Something else unpins a key (one with a step, or one without) during the
// release's bulk call (PinBreakingCache), which releases the others and says so
// (BrokenPinError), and the working set runs out of memory recording what
// the call found: every allocation of the working set's first attempt is
// failed in turn (the cache's own are not: its tests fail those). The call is never made again (it would take the next
// batch's pins), and the retry still names the key: the working set does not
// count the release done before it has recorded what the call found.
TEST(WorkingSet, ARecordOfKeysUnpinnedDuringTheReleaseThatRunsOutOfMemoryIsFinishedByItsRetry) {
  const SparseOptimizer opt = AdaGrad(2);
  for (const auto& [bound, stepped] : {std::pair(true, true), std::pair(true, false), std::pair(false, true),
                                        std::pair(false, false)}) {
    SCOPED_TRACE(bound ? "bound to host rows" : "holding copies");
    SCOPED_TRACE(stepped ? "a key with a step unpinned" : "a key without a step unpinned");
    const auto& [keys, g, updated, expected] = ReleaseTestBatch(opt, bound, {1, 2, 3, 4});
    ForEveryAllocation([&](uint64_t k) {
      RowStore store(opt);
      auto breaking = std::make_unique<PinBreakingCache>(store.Cache(16));
      PinBreakingCache& pin_breaker = *breaking;
      UncountedReleaseCache cache(std::move(breaking));
      auto tier = HostTier(2, 16, opt, bound);
      WorkingSet ws(cache, opt, 2, keys.data(), keys.size());
      LoadAndStep(ws, *tier, keys, g);
      const uint64_t victim = stepped ? ws.updated_keys()[0] : keys.back();  // (holding copies: Unpin's, or WriteBack's)
      std::vector<uint64_t> next;  // the next batch's keys: all but the victim, whose only pin the foreign unpin takes
      for (uint64_t key : keys) {
        if (key != victim) next.push_back(key);
      }
      cache.Pull(next.data(), next.size(), nullptr, /*pin=*/true, nullptr);
      pin_breaker.victim = victim;

      const std::string named = "1 of 4 keys were no longer pinned by this batch (keys " + std::to_string(victim) + ")";
      const FailingAllocationCall first = CallFailingAllocation(k, [&] { ws.WriteBack(); });
      if (!first.ran_out && !first.refused) ADD_FAILURE() << "a release that met a key unpinned during it passed";
      if (first.refused) {
        EXPECT_NE(first.error.find(named), std::string::npos) << first.error;
      }
      if (first.ran_out) {
        EXPECT_FALSE(ws.released());
        try {
          ws.WriteBack();
          ADD_FAILURE() << "a retried release that met a key unpinned during it passed";
        } catch (const std::runtime_error& e) {
          EXPECT_NE(std::string(e.what()).find(named), std::string::npos) << e.what();
          EXPECT_NE(std::string(e.what()).find("their steps were kept"), std::string::npos) << e.what();
        }
      }
      EXPECT_EQ(pin_breaker.victim, kEmptyKey) << "the foreign unpin did not happen";
      EXPECT_TRUE(ws.released());
      EXPECT_EQ(cache.stats().failed_releases, first.ran_out ? 2u : 1u);
      // The next batch's pins, each once: a key released twice has lost its pin.
      EXPECT_EQ(cache.stats().pinned, next.size());
      EXPECT_NO_THROW(cache.Unpin(next.data(), next.size(), nullptr));
      EXPECT_EQ(cache.stats().pinned, 0u);
      EXPECT_EQ(CachedRows(cache, updated), expected);
      return first;
    });
  }
}

// MEM-PS whose Unpin fails (a fault other than a key something else
// unpinned) as many times as asked; everything else is the real cache's.
class UnpinFailingCache final : public ForwardingCache {
 public:
  using ForwardingCache::ForwardingCache;
  int failures = 0;

  void Unpin(const uint64_t* k, uint64_t n, uint8_t* const* at) override {
    if (failures > 0) {
      --failures;
      throw std::runtime_error("unpin failed (injected)");
    }
    ForwardingCache::Unpin(k, n, at);
  }
};

// A write-back whose unpinning of the rows without steps fails has written
// the updated rows already (and unpinned them): it is counted, and a retry
// unpins the rest without writing those rows again (they are no longer
// pinned, so a second write would be refused and their keys named).
TEST(WorkingSet, AWriteBackThatFailsToUnpinTheRestIsRetriedWithoutWritingTwice) {
  const SparseOptimizer opt = AdaGrad(2);
  RowStore store(opt), reference_store(opt);
  UnpinFailingCache cache(store.Cache(16));
  auto reference = reference_store.Cache(16);
  const std::vector<uint64_t> keys = {1, 2, 3};
  const Step s = MakeStep({1, 2}, opt.dim, 0.5f);  // 3 gets no gradient
  auto tier = HostTier(1, 16, opt, /*bind_host_rows=*/false), reference_tier = HostTier(1, 16, opt, false);
  WorkingSet unhindered(*reference, opt, 1, keys.data(), keys.size());
  unhindered.Load(*reference_tier, nullptr);
  unhindered.Accumulate(0, s.keys.data(), s.keys.size(), s.grads.data());
  unhindered.Apply();
  unhindered.WriteBack();

  WorkingSet ws(cache, opt, 1, keys.data(), keys.size());
  ws.Load(*tier, nullptr);
  ws.Accumulate(0, s.keys.data(), s.keys.size(), s.grads.data());
  EXPECT_EQ(ws.Apply(), 2u);
  cache.failures = 1;
  EXPECT_THROW(ws.WriteBack(), std::runtime_error);
  EXPECT_FALSE(ws.released());
  EXPECT_EQ(cache.stats().failed_releases, 1u);
  EXPECT_EQ(cache.stats().pinned, 1u);  // key 3's pin; the updated rows went back
  ws.WriteBack();
  EXPECT_TRUE(ws.released());
  const MemCacheStats st = cache.stats();
  EXPECT_EQ(st.pinned, 0u);
  EXPECT_EQ(st.dirty, 2u);
  EXPECT_EQ(st.failed_releases, 1u);
  EXPECT_EQ(CachedRows(cache, keys), CachedRows(*reference, keys));
}

// A tier whose ApplyBound fails after the real one stepped the rows (as an
// allocation failure midway would); everything else is the real tier's.
class ApplyFailingTier final : public DeviceTier {
 public:
  explicit ApplyFailingTier(std::unique_ptr<DeviceTier> tier) : tier_(std::move(tier)) {}

  int32_t devices() const override { return tier_->devices(); }
  int32_t row_floats() const override { return tier_->row_floats(); }
  int32_t dim() const override { return tier_->dim(); }
  std::string kind() const override { return tier_->kind(); }
  bool accepts_gpu_memory() const override { return tier_->accepts_gpu_memory(); }
  uint64_t size() const override { return tier_->size(); }
  float* StagingRows(uint64_t floats) override { return tier_->StagingRows(floats); }
  void Insert(const uint64_t* k, uint64_t n, const float* rows, const int32_t* o) override {
    tier_->Insert(k, n, rows, o);
  }
  uint64_t Assign(const uint64_t* k, uint64_t n, const float* rows, const int32_t* o) override {
    return tier_->Assign(k, n, rows, o);
  }
  void Get(int32_t w, const uint64_t* k, uint64_t n, float* e, const int32_t* o) override { tier_->Get(w, k, n, e, o); }
  void Accumulate(int32_t w, const uint64_t* k, uint64_t n, const float* g, const int32_t* o) override {
    tier_->Accumulate(w, k, n, g, o);
  }
  std::vector<uint64_t> Apply() override { return tier_->Apply(); }
  void Rows(const uint64_t* k, uint64_t n, float* rows, const int32_t* o) const override { tier_->Rows(k, n, rows, o); }
  uint64_t ReadBack(uint64_t* k, float* rows, uint64_t max_rows) const override {
    return tier_->ReadBack(k, rows, max_rows);
  }
  void Clear() override { tier_->Clear(); }
  void SetGradientCapacity(int32_t device, uint64_t capacity) override { tier_->SetGradientCapacity(device, capacity); }
  void Bind(const uint64_t* k, uint64_t n, const int32_t* o) override { tier_->Bind(k, n, o); }
  bool reads_in_place() const override { return tier_->reads_in_place(); }
  void GetAt(int32_t w, const int64_t* p, uint64_t n, float* e, RowLayout l) override { tier_->GetAt(w, p, n, e, l); }
  void AccumulateAt(int32_t w, const int64_t* p, uint64_t n, const float* g, RowLayout l) override {
    tier_->AccumulateAt(w, p, n, g, l);
  }
  std::vector<uint64_t> ApplyBound(std::vector<int64_t>* positions) override {
    tier_->ApplyBound(positions);
    throw std::runtime_error("apply failed after its steps (injected)");
  }
  void RowsAt(const int64_t* p, uint64_t n, float* rows) const override { tier_->RowsAt(p, n, rows); }
  void CopyRowsAt(const int64_t* from, const int64_t* to, uint64_t n) override { tier_->CopyRowsAt(from, to, n); }
  bool binds_host_rows() const override { return tier_->binds_host_rows(); }
  void BindHostRows(const uint64_t* k, uint64_t n, const int32_t* o, uint8_t* const* rows) override {
    tier_->BindHostRows(k, n, o, rows);
  }
  void Trained(const uint64_t* k, uint64_t n, const int32_t* o, uint8_t* trained) const override {
    tier_->Trained(k, n, o, trained);
  }
  void SetTrained(const uint64_t* k, uint64_t n, const int32_t* o, bool trained) override {
    tier_->SetTrained(k, n, o, trained);
  }
  void TakeTrained(std::vector<uint64_t>* k, std::vector<int32_t>* o) override { tier_->TakeTrained(k, o); }
  void RowsTrained(const uint64_t* k, uint64_t n, const int32_t* o, float* rows, uint8_t* trained) const override {
    tier_->RowsTrained(k, n, o, rows, trained);
  }
  void Upsert(const uint64_t* k, uint64_t n, const float* rows, const int32_t* o, const uint8_t* trained) override {
    tier_->Upsert(k, n, rows, o, trained);
  }
  TransferMatrix transfers() const override { return tier_->transfers(); }
  LinkCounters link_counters() const override { return tier_->link_counters(); }
  void ResetTransfers() override { tier_->ResetTransfers(); }

 private:
  std::unique_ptr<DeviceTier> tier_;
};

// Bound to MEM-PS's rows, an Apply that fails may have stepped rows where
// they lie: the batch is released with every row dirty, so no step is lost
// when MEM-PS evicts them.
TEST(WorkingSet, AFailedApplyBoundToHostRowsReleasesEveryRowDirty) {
  const SparseOptimizer opt = AdaGrad(2);
  RowStore store(opt);
  auto cache = store.Cache(16);
  ApplyFailingTier tier(HostTier(1, 16, opt, /*bind_host_rows=*/true));
  const std::vector<uint64_t> keys = {1, 2, 3};
  const std::vector<float> before = CachedRows(*cache, keys);
  const Step s = MakeStep({1, 2}, opt.dim, 0.5f);  // 3 gets no gradient
  WorkingSet ws(*cache, opt, 1, keys.data(), keys.size());
  ws.Load(tier, nullptr);
  ws.Accumulate(0, s.keys.data(), s.keys.size(), s.grads.data());
  EXPECT_THROW(ws.Apply(), std::runtime_error);
  EXPECT_TRUE(ws.released());
  EXPECT_EQ(tier.size(), 0u);
  const MemCacheStats st = cache->stats();
  EXPECT_EQ(st.pinned, 0u);
  EXPECT_EQ(st.dirty, 3u);
  EXPECT_NE(CachedRows(*cache, {1}), std::vector<float>(before.begin(), before.begin() + opt.row_floats()));
  cache->FlushDirty();
  EXPECT_EQ(store.stored.size(), 3u);
}

}  // namespace
}  // namespace hps
