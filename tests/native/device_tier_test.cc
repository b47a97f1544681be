// The device tier under the sanitizers: a batch through two host partitions,
// against the same optimizer applied to one table, and the transfer matrix.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <set>
#include <span>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "hps/device_tier.h"
#include "hps/hash_table.h"
#include "hps/mem_cache.h"
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
  o.init.seed = 3;
  return o;
}

TEST(DeviceTier, BatchMatchesOneTable) {
  const SparseOptimizer opt = AdaGrad(4);
  const int32_t width = opt.row_floats();
  auto tier = DeviceTier::New({2, 64, opt, /*use_cuda=*/false, /*threads=*/1, nullptr, {}});
  EXPECT_EQ(tier->kind(), "cpu");
  std::vector<uint64_t> keys = {1, 2, 3, 4, 5, 6, 7, 8};
  std::vector<float> rows(keys.size() * width);
  opt.initial_rows(keys.data(), keys.size(), rows.data());
  tier->Insert(keys.data(), keys.size(), rows.data(), nullptr);
  EXPECT_EQ(tier->size(), keys.size());

  // Worker 0 pulls everything; workers 0 and 1 both push key 3.
  std::vector<float> emb(keys.size() * 4);
  tier->Get(0, keys.data(), keys.size(), emb.data(), nullptr);
  for (size_t i = 0; i < keys.size(); ++i) {
    for (int d = 0; d < 4; ++d) EXPECT_EQ(emb[i * 4 + d], rows[i * width + d]);
  }
  std::vector<uint64_t> a = {3, 5}, b = {3, 8};
  std::vector<float> g(2 * 4, 1.0f);
  tier->Accumulate(0, a.data(), 2, g.data(), nullptr);
  tier->Accumulate(1, b.data(), 2, g.data(), nullptr);
  std::vector<uint64_t> updated = tier->Apply();
  std::sort(updated.begin(), updated.end());
  EXPECT_EQ(updated, (std::vector<uint64_t>{3, 5, 8}));

  // The same steps on one table: key 3 got 2 (summed), 5 and 8 got 1.
  auto table = NewHashTable({64, width, 1, -1});
  std::vector<uint64_t> all = {3, 3, 5, 8};
  std::vector<float> g4(4 * 4, 1.0f);
  table->apply_gradients(all.data(), all.size(), g4.data(), opt);
  std::vector<float> want(3 * width), got(3 * width);
  table->find(updated.data(), 3, want.data(), nullptr);
  tier->Rows(updated.data(), 3, got.data(), nullptr);
  EXPECT_EQ(got, want);

  // Rows sent between devices: Get counts owner -> worker, Accumulate worker -> owner.
  const TransferMatrix m = tier->transfers();
  uint64_t total = 0;
  for (uint64_t r : m.rows) total += r;
  EXPECT_EQ(total, keys.size() + 4);
  uint64_t missing = 99;
  EXPECT_THROW(tier->Get(0, &missing, 1, emb.data(), nullptr), std::out_of_range);
  int32_t bad_owner = 2;
  EXPECT_THROW(tier->Insert(&missing, 1, rows.data(), &bad_owner), std::invalid_argument);
  tier->Clear();
  EXPECT_EQ(tier->size(), 0u);
}

// Three host partitions where 0 and 2 share no link and their host path is
// slow: the router relays them via 1, and the executed routes (the host
// executor staging on device 1) give what the tier's own copies give, while
// the link counters put a relayed row on both of its hops.
TEST(DeviceTier, ExecutedRoutesDeliverWhatDirectCopiesDoAndCountEachHop) {
  Topology t;
  t.devices = {{"h0", DeviceKind::kHost, 0}, {"h1", DeviceKind::kHost, 0}, {"h2", DeviceKind::kHost, 0},
               {"mem", DeviceKind::kCpu, 0}};
  t.links = {{0, 1, 100, 0.5, "fast"}, {1, 2, 100, 0.5, "fast"}, {0, 3, 1, 0.5, "memcpy"},
             {1, 3, 1, 0.5, "memcpy"}, {2, 3, 1, 0.5, "memcpy"}};
  const auto routes = PlanTierRoutes(t, 3, 1 << 20, /*execute=*/true);
  ASSERT_EQ(routes->plan.routes[0 * 3 + 2].kind, RouteKind::kRelay);
  ASSERT_EQ(routes->plan.routes[2 * 3 + 0].via, 1);
  ASSERT_EQ(routes->plan.routes[0 * 3 + 1].kind, RouteKind::kDirect);

  const SparseOptimizer opt = AdaGrad(4);
  const int32_t width = opt.row_floats();
  std::vector<uint64_t> keys;
  for (uint64_t k = 1; k <= 30; ++k) keys.push_back(k * 7919);
  std::vector<float> rows(keys.size() * width);
  opt.initial_rows(keys.data(), keys.size(), rows.data());
  std::vector<float> g(keys.size() * 4);
  for (size_t i = 0; i < g.size(); ++i) g[i] = 0.01f * static_cast<float>(i % 17) - 0.05f;
  std::vector<std::vector<float>> emb(2), full(2);
  std::unique_ptr<DeviceTier> tiers[2];
  for (int routed = 0; routed < 2; ++routed) {
    auto& tier = tiers[routed];
    tier = DeviceTier::New({3, 64, opt, /*use_cuda=*/false, /*threads=*/1, routed ? routes : nullptr, {}});
    tier->Insert(keys.data(), keys.size(), rows.data(), nullptr);
    emb[routed].resize(keys.size() * 4);
    tier->Get(0, keys.data(), keys.size(), emb[routed].data(), nullptr);
    tier->Accumulate(2, keys.data(), keys.size(), g.data(), nullptr);
    tier->Accumulate(0, keys.data(), 10, g.data(), nullptr);
    tier->Apply();
    full[routed].resize(keys.size() * width);
    tier->Rows(keys.data(), keys.size(), full[routed].data(), nullptr);
  }
  EXPECT_EQ(emb[0], emb[1]);
  EXPECT_EQ(full[0], full[1]);
  EXPECT_EQ(tiers[0]->transfers().bytes, tiers[1]->transfers().bytes);
  EXPECT_EQ(tiers[0]->link_counters().links, 0);

  const TransferMatrix m = tiers[1]->transfers();
  const LinkCounters c = tiers[1]->link_counters();
  ASSERT_EQ(c.links, 5);
  const auto at = [&](int phase, int link, int way) { return c.bytes[(phase * 5 + link) * 2 + way]; };
  const uint64_t b20 = m.bytes[2 * 3 + 0], b02 = m.bytes[0 * 3 + 2], b10 = m.bytes[1 * 3 + 0],
                 b21 = m.bytes[2 * 3 + 1], b01 = m.bytes[0 * 3 + 1];
  ASSERT_GT(b20, 0u);
  ASSERT_GT(b02, 0u);
  // 2 -> 0 relays h2 -> h1 (link 1, b->a) then h1 -> h0 (link 0, b->a); 0 -> 2 the reverse.
  EXPECT_EQ(at(0, 1, 1), b20 + b21);
  EXPECT_EQ(at(1, 0, 1), b20);
  EXPECT_EQ(at(0, 0, 1), b10);
  EXPECT_EQ(at(0, 0, 0), b02 + b01);
  EXPECT_EQ(at(1, 1, 0), b02);
  for (int link = 2; link < 5; ++link) EXPECT_EQ(at(0, link, 0) + at(0, link, 1), 0u) << "memcpy link " << link;
  EXPECT_EQ(c.relayed_bytes, b20 + b02);
  EXPECT_EQ(c.relayed_rows, m.rows[2 * 3 + 0] + m.rows[0 * 3 + 2]);
  tiers[1]->ResetTransfers();
  EXPECT_EQ(tiers[1]->link_counters().relayed_rows, 0u);

  // Routes for another number of devices, or fewer endpoints than devices, are refused.
  EXPECT_THROW(DeviceTier::New({2, 64, opt, false, 1, routes, {}}), std::invalid_argument);
  EXPECT_THROW(PlanTierRoutes(t, 4, 1 << 20, true), std::invalid_argument);
}

// The pipeline's two tiers share one run's routes and train on different
// threads: the routes are read-only, each tier's counters its own.
TEST(DeviceTier, TiersOnTwoThreadsShareTheirRoutes) {
  Topology t;
  t.devices = {{"h0", DeviceKind::kHost, 0}, {"h1", DeviceKind::kHost, 0}, {"h2", DeviceKind::kHost, 0},
               {"mem", DeviceKind::kCpu, 0}};
  t.links = {{0, 1, 100, 0.5, "fast"}, {1, 2, 100, 0.5, "fast"}, {0, 3, 1, 0.5, "memcpy"},
             {1, 3, 1, 0.5, "memcpy"}, {2, 3, 1, 0.5, "memcpy"}};
  const auto routes = PlanTierRoutes(t, 3, 1 << 20, /*execute=*/true);
  const SparseOptimizer opt = AdaGrad(4);
  std::vector<uint64_t> keys;
  for (uint64_t k = 1; k <= 200; ++k) keys.push_back(k * 104729);
  std::vector<float> rows(keys.size() * opt.row_floats());
  opt.initial_rows(keys.data(), keys.size(), rows.data());
  std::vector<float> g(keys.size() * 4, 0.25f);
  std::vector<float> got[2];
  LinkCounters counted[2];
  std::vector<std::thread> threads;
  for (int i = 0; i < 2; ++i) {
    threads.emplace_back([&, i] {
      auto tier = DeviceTier::New({3, 512, opt, /*use_cuda=*/false, /*threads=*/1, routes, {}});
      tier->Insert(keys.data(), keys.size(), rows.data(), nullptr);
      for (int32_t worker = 0; worker < 3; ++worker) {
        tier->Accumulate(worker, keys.data(), keys.size(), g.data(), nullptr);
      }
      tier->Apply();
      got[i].resize(keys.size() * 4);
      tier->Get(2, keys.data(), keys.size(), got[i].data(), nullptr);
      counted[i] = tier->link_counters();
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(got[0], got[1]);
  EXPECT_EQ(counted[0].bytes, counted[1].bytes);
  EXPECT_GT(counted[0].relayed_rows, 0u);
}

// One device reads and writes the caller's arrays in place (no partition copy).
TEST(DeviceTier, OneDeviceMatchesTheSameStepsOnTwo) {
  const SparseOptimizer opt = AdaGrad(4);
  const int32_t width = opt.row_floats();
  std::vector<uint64_t> keys = {11, 12, 13, 14, 15};
  std::vector<float> rows(keys.size() * width);
  opt.initial_rows(keys.data(), keys.size(), rows.data());
  std::vector<std::vector<float>> got_rows, got_emb;
  for (int32_t devices : {1, 2}) {
    auto tier = DeviceTier::New({devices, 64, opt, /*use_cuda=*/false, /*threads=*/1, nullptr, {}});
    tier->Insert(keys.data(), keys.size(), rows.data(), nullptr);
    std::vector<uint64_t> pushed = {13, 11, 13};
    std::vector<float> g(3 * 4, 0.5f);
    tier->Accumulate(0, pushed.data(), 3, g.data(), nullptr);
    tier->Apply();
    std::vector<float> emb(keys.size() * 4), full(keys.size() * width);
    tier->Get(0, keys.data(), keys.size(), emb.data(), nullptr);
    tier->Rows(keys.data(), keys.size(), full.data(), nullptr);
    got_emb.push_back(emb);
    got_rows.push_back(full);
    uint64_t missing[2] = {12, 99};
    try {
      tier->Get(0, missing, 2, emb.data(), nullptr);
      ADD_FAILURE() << "a key that is not loaded must throw";
    } catch (const std::out_of_range& e) {
      EXPECT_NE(std::string(e.what()).find("keys[1] = 99"), std::string::npos) << e.what();
    }
  }
  EXPECT_EQ(got_emb[0], got_emb[1]);
  EXPECT_EQ(got_rows[0], got_rows[1]);
  auto one = DeviceTier::New({1, 64, opt, false, 1, nullptr, {}});
  int32_t owners[1] = {1};
  EXPECT_THROW(one->Insert(keys.data(), 1, rows.data(), owners), std::invalid_argument);
}

// Two hosts and memory: executed routes put a row mover between the tier's
// devices, so its positional calls go by key rather than in place.
std::shared_ptr<const TierRoutes> TwoHostRoutes() {
  Topology t;
  t.devices = {{"h0", DeviceKind::kHost, 0}, {"h1", DeviceKind::kHost, 0}, {"mem", DeviceKind::kCpu, 0}};
  t.links = {{0, 2, 1, 0.5, "memcpy"}, {1, 2, 1, 0.5, "memcpy"}};
  return PlanTierRoutes(t, 2, 1 << 20, /*execute=*/true);
}

TEST(DeviceTier, StepsByPositionEqualStepsByKeyInPlaceOrNot) {
  const SparseOptimizer opt = AdaGrad(4);
  const int32_t width = opt.row_floats();
  std::vector<uint64_t> keys;
  for (uint64_t k = 1; k <= 40; ++k) keys.push_back(k * 104729);
  std::vector<float> rows(keys.size() * width);
  opt.initial_rows(keys.data(), keys.size(), rows.data());
  // Two workers' examples: positions with repeats, the same key on both.
  const std::vector<int64_t> at0 = {0, 5, 5, 39, 12, 7}, at1 = {5, 20, 0, 33};
  std::vector<float> g0(at0.size() * 4), g1(at1.size() * 4);
  for (size_t i = 0; i < g0.size(); ++i) g0[i] = 0.01f * static_cast<float>(i % 7) - 0.02f;
  for (size_t i = 0; i < g1.size(); ++i) g1[i] = 0.03f * static_cast<float>(i % 5) - 0.05f;
  const auto keys_at = [&](const std::vector<int64_t>& at) {
    std::vector<uint64_t> k;
    for (int64_t p : at) k.push_back(keys[static_cast<size_t>(p)]);
    return k;
  };

  // By key, the reference.
  auto by_key = DeviceTier::New({2, 128, opt, false, 1, nullptr, {}});
  by_key->Insert(keys.data(), keys.size(), rows.data(), nullptr);
  std::vector<float> want_emb0(at0.size() * 4);
  by_key->Get(0, keys_at(at0).data(), at0.size(), want_emb0.data(), nullptr);
  by_key->Accumulate(0, keys_at(at0).data(), at0.size(), g0.data(), nullptr);
  by_key->Accumulate(1, keys_at(at1).data(), at1.size(), g1.data(), nullptr);
  by_key->Apply();
  std::vector<float> want_rows(keys.size() * width);
  by_key->Rows(keys.data(), keys.size(), want_rows.data(), nullptr);

  for (const bool in_place : {true, false}) {
    SCOPED_TRACE(in_place ? "in place" : "through the row mover");
    auto tier = DeviceTier::New({2, 128, opt, false, 1, in_place ? nullptr : TwoHostRoutes(), {}});
    EXPECT_EQ(tier->reads_in_place(), in_place);
    tier->Insert(keys.data(), keys.size(), rows.data(), nullptr);
    std::vector<float> emb0(at0.size() * 4);
    EXPECT_THROW(tier->GetAt(0, at0.data(), at0.size(), emb0.data(), {}), std::logic_error);  // before Bind
    tier->Bind(keys.data(), keys.size(), nullptr);
    tier->GetAt(0, at0.data(), at0.size(), emb0.data(), {});
    EXPECT_EQ(emb0, want_emb0);
    tier->AccumulateAt(0, at0.data(), at0.size(), g0.data(), {});
    // Worker 1 by key: its gradients join the positions' sums, one step a key.
    tier->Accumulate(1, keys_at(at1).data(), at1.size(), g1.data(), nullptr);
    std::vector<int64_t> positions;
    const std::vector<uint64_t> updated = tier->ApplyBound(&positions);
    ASSERT_EQ(updated.size(), 7u);  // 0, 5, 7, 12, 20, 33, 39
    ASSERT_EQ(positions.size(), updated.size());
    for (size_t j = 0; j < updated.size(); ++j) EXPECT_EQ(updated[j], keys[static_cast<size_t>(positions[j])]);
    std::vector<int64_t> all(keys.size());
    for (size_t i = 0; i < all.size(); ++i) all[i] = static_cast<int64_t>(i);
    std::vector<float> got_rows(keys.size() * width);
    tier->RowsAt(all.data(), all.size(), got_rows.data());
    for (size_t i = 0; i < got_rows.size(); ++i) EXPECT_NEAR(got_rows[i], want_rows[i], 1e-6f) << i;
    const TransferMatrix want = by_key->transfers(), got = tier->transfers();
    EXPECT_EQ(got.rows, want.rows);
    EXPECT_EQ(got.bytes, want.bytes);

    const int64_t outside[2] = {3, 40};
    try {
      tier->GetAt(1, outside, 2, emb0.data(), {});
      ADD_FAILURE() << "a position past the bound keys must throw";
    } catch (const std::out_of_range& e) {
      EXPECT_NE(std::string(e.what()).find("positions[1] = 40"), std::string::npos) << e.what();
    }
    // Two rows of 4 floats in a matrix 10 wide: only where the tier reads in place.
    std::vector<float> wide(10, -1.0f);
    const int64_t two[2] = {1, 2};
    if (in_place) {
      tier->GetAt(0, two, 2, wide.data(), RowLayout{2, 10});
      EXPECT_EQ(wide[8], -1.0f);
      EXPECT_EQ(wide[4], rows[2 * static_cast<size_t>(width)]);
    } else {
      EXPECT_THROW(tier->GetAt(0, two, 2, wide.data(), RowLayout{2, 10}), std::invalid_argument);
    }
    tier->Clear();
    EXPECT_THROW(tier->RowsAt(two, 2, got_rows.data()), std::logic_error);  // Clear unbinds
  }
}

TEST(DeviceTier, KeysGroupedByDeviceGoWhereTheirOwnersSayAsScatteredOnesDo) {
  // Grouped owners (a run a device: the parts point into the input) and the same
  // pairs scattered (copied out per device) load and read back the same rows.
  const SparseOptimizer opt = AdaGrad(4);
  const int32_t width = opt.row_floats();
  const std::vector<uint64_t> grouped_keys = {11, 12, 13, 21, 22, 31};
  const std::vector<int32_t> grouped_owners = {1, 1, 1, 0, 0, 2};
  const std::vector<uint64_t> scattered_keys = {11, 21, 12, 31, 22, 13};
  const std::vector<int32_t> scattered_owners = {1, 0, 1, 2, 0, 1};
  std::vector<float> rows(grouped_keys.size() * static_cast<size_t>(width));
  for (size_t i = 0; i < rows.size(); ++i) rows[i] = static_cast<float>(i);
  const auto row_of = [&](uint64_t key) {  // the row the grouped input gave key
    const auto at = static_cast<size_t>(std::find(grouped_keys.begin(), grouped_keys.end(), key) - grouped_keys.begin());
    return std::vector<float>(rows.begin() + static_cast<std::ptrdiff_t>(at * width),
                              rows.begin() + static_cast<std::ptrdiff_t>((at + 1) * width));
  };
  std::vector<float> scattered_rows;
  for (uint64_t k : scattered_keys) {
    const std::vector<float> r = row_of(k);
    scattered_rows.insert(scattered_rows.end(), r.begin(), r.end());
  }
  auto a = DeviceTier::New({3, 64, opt, false, 1, nullptr, {}});
  auto b = DeviceTier::New({3, 64, opt, false, 1, nullptr, {}});
  a->Insert(grouped_keys.data(), grouped_keys.size(), rows.data(), grouped_owners.data());
  b->Insert(scattered_keys.data(), scattered_keys.size(), scattered_rows.data(), scattered_owners.data());
  for (auto* tier : {a.get(), b.get()}) {
    std::vector<float> got(rows.size());
    tier->Rows(grouped_keys.data(), grouped_keys.size(), got.data(), grouped_owners.data());
    EXPECT_EQ(got, rows);
    tier->Rows(scattered_keys.data(), scattered_keys.size(), got.data(), scattered_owners.data());
    EXPECT_EQ(got, scattered_rows);
  }
  // A key missing from its device is named by its index in the whole input.
  const std::vector<uint64_t> asked = {11, 12, 22, 31};
  const std::vector<int32_t> wrong = {1, 1, 2, 2};  // 22 lives on device 0
  std::vector<float> got(asked.size() * static_cast<size_t>(width));
  try {
    a->Rows(asked.data(), asked.size(), got.data(), wrong.data());
    ADD_FAILURE() << "a key not on its device must throw";
  } catch (const std::out_of_range& e) {
    EXPECT_NE(std::string(e.what()).find("keys[2] = 22 is not loaded on device 2"), std::string::npos) << e.what();
  }
}

TEST(DeviceTier, AKeyBoundOnTwoDevicesIsReadOnEachAndSteppedOnOneThenCopied) {
  // Herald's caches: key 7 has a copy on devices 0 and 1, key 9 on device 1 only.
  const SparseOptimizer opt = AdaGrad(4);
  const int32_t width = opt.row_floats();
  const std::vector<uint64_t> keys = {7, 7, 9};
  const std::vector<int32_t> owners = {0, 1, 1};
  std::vector<float> rows(keys.size() * static_cast<size_t>(width));
  opt.initial_rows(keys.data(), keys.size(), rows.data());
  for (float& x : std::span(rows).subspan(static_cast<size_t>(width), 4)) x += 1.0f;  // device 1's copy of 7 differs
  const std::vector<float> g = {0.5f, -0.25f, 1.0f, 2.0f};

  // The reference: one key's gradients from both workers on one table, one step.
  auto one = DeviceTier::New({1, 64, opt, false, 1, nullptr, {}});
  one->Insert(keys.data(), 1, rows.data(), nullptr);
  one->Accumulate(0, keys.data(), 1, g.data(), nullptr);
  one->Accumulate(0, keys.data(), 1, g.data(), nullptr);
  one->Apply();
  std::vector<float> want(static_cast<size_t>(width));
  one->Rows(keys.data(), 1, want.data(), nullptr);

  for (const bool in_place : {true, false}) {
    SCOPED_TRACE(in_place ? "in place" : "through the row mover");
    auto tier = DeviceTier::New({2, 64, opt, false, 1, in_place ? nullptr : TwoHostRoutes(), {}});
    tier->Insert(keys.data(), keys.size(), rows.data(), owners.data());
    tier->Bind(keys.data(), keys.size(), owners.data());
    // Each worker reads its own copy.
    const int64_t mine0 = 0, mine1 = 1;
    std::vector<float> e0(4), e1(4);
    tier->GetAt(0, &mine0, 1, e0.data(), {});
    tier->GetAt(1, &mine1, 1, e1.data(), {});
    EXPECT_EQ(e0, std::vector<float>(rows.begin(), rows.begin() + 4));
    EXPECT_EQ(e1[0], rows[static_cast<size_t>(width)]);
    // Both send their gradient to the copy on device 0 (the key's primary).
    tier->AccumulateAt(0, &mine0, 1, g.data(), {});
    tier->AccumulateAt(1, &mine0, 1, g.data(), {});
    if (in_place) {  // by key, the in-place sums cannot tell the copies apart (by the row mover, owners do)
      try {
        tier->Accumulate(1, keys.data(), 1, g.data(), nullptr);
        ADD_FAILURE() << "by key, a key bound on two devices must throw";
      } catch (const std::logic_error& e) {
        EXPECT_NE(std::string(e.what()).find("key 7 is bound on devices 0 and 1"), std::string::npos) << e.what();
      }
    }
    const std::vector<uint64_t> updated = tier->Apply();
    EXPECT_EQ(updated, std::vector<uint64_t>{7});  // one step
    tier->CopyRowsAt(&mine0, &mine1, 1);
    std::vector<float> got(2 * static_cast<size_t>(width));
    const int64_t both[2] = {0, 1};
    tier->RowsAt(both, 2, got.data());
    for (int32_t j = 0; j < width; ++j) {
      EXPECT_NEAR(got[static_cast<size_t>(j)], want[static_cast<size_t>(j)], 1e-6f) << j;
      EXPECT_EQ(got[static_cast<size_t>(width + j)], got[static_cast<size_t>(j)]) << j;
    }
    // Key 9 untouched; the gets came from each worker's own device, the gradients crossed 1 -> 0.
    std::vector<float> nine(static_cast<size_t>(width));
    const int64_t at9 = 2;
    tier->RowsAt(&at9, 1, nine.data());
    EXPECT_EQ(nine, std::vector<float>(rows.begin() + 2 * width, rows.end()));
    const TransferMatrix m = tier->transfers();
    EXPECT_EQ(m.rows, (std::vector<uint64_t>{2, 0, 1, 1}));
    const int64_t outside = 3;
    EXPECT_THROW(tier->CopyRowsAt(&mine0, &outside, 1), std::out_of_range);
  }
}

// Herald's caches keep rows between batches and write below only those
// trained since they last did: each row's bit follows what changes it.
std::vector<uint8_t> TrainedOf(const DeviceTier& tier, const std::vector<uint64_t>& keys,
                               const std::vector<int32_t>& owners) {
  std::vector<uint8_t> out(keys.size(), 2);
  tier.Trained(keys.data(), keys.size(), owners.data(), out.data());
  return out;
}

std::vector<std::pair<uint64_t, int32_t>> Taken(DeviceTier& tier) {
  std::vector<uint64_t> keys;
  std::vector<int32_t> owners;
  tier.TakeTrained(&keys, &owners);
  EXPECT_EQ(keys.size(), owners.size());
  std::vector<std::pair<uint64_t, int32_t>> out;
  for (size_t i = 0; i < keys.size(); ++i) out.emplace_back(keys[i], owners[i]);
  std::sort(out.begin(), out.end());
  return out;
}

TEST(DeviceTier, TrainedBitsAreSetBySteppedAndCopiedRowsAndClearedByLoadsAndTakes) {
  const SparseOptimizer opt = AdaGrad(4);
  const int32_t width = opt.row_floats();
  // Key 7 on devices 0 and 1 (its primary 0), 9 on 1, 11 on 0.
  const std::vector<uint64_t> keys = {7, 7, 9, 11};
  const std::vector<int32_t> owners = {0, 1, 1, 0};
  std::vector<float> rows(keys.size() * static_cast<size_t>(width));
  opt.initial_rows(keys.data(), keys.size(), rows.data());
  const std::vector<float> g = {0.5f, -0.25f, 1.0f, 2.0f};
  using Pairs = std::vector<std::pair<uint64_t, int32_t>>;
  for (const bool in_place : {true, false}) {
    SCOPED_TRACE(in_place ? "in place" : "through the row mover (gradient tables)");
    DeviceTierOptions o{2, 64, opt, false, 1, in_place ? nullptr : TwoHostRoutes(), {}};
    o.track_trained = true;
    auto tier = DeviceTier::New(o);
    ASSERT_EQ(tier->reads_in_place(), in_place);
    tier->Insert(keys.data(), keys.size(), rows.data(), owners.data());
    EXPECT_EQ(TrainedOf(*tier, keys, owners), (std::vector<uint8_t>{0, 0, 0, 0}));  // loaded: as MEM-PS has them
    tier->Bind(keys.data(), keys.size(), owners.data());
    const int64_t at7 = 0, at7_on_1 = 1, at11 = 3;
    tier->AccumulateAt(1, &at7, 1, g.data(), {});
    EXPECT_EQ(tier->Apply(), std::vector<uint64_t>{7});
    EXPECT_EQ(TrainedOf(*tier, keys, owners), (std::vector<uint8_t>{1, 0, 0, 0}));  // stepped on its primary
    tier->CopyRowsAt(&at7, &at7_on_1, 1);
    EXPECT_EQ(TrainedOf(*tier, keys, owners), (std::vector<uint8_t>{1, 1, 0, 0}));  // the replica as new
    tier->CopyRowsAt(&at11, &at7_on_1, 1);  // a clean row copied over a trained one makes it clean
    EXPECT_EQ(TrainedOf(*tier, keys, owners), (std::vector<uint8_t>{1, 0, 0, 0}));
    tier->CopyRowsAt(&at7, &at7_on_1, 1);

    // A load (Assign: 7 on device 1 from MEM-PS; Insert: 13, new on 0) writes clean rows;
    // an Insert of a present key keeps its row, and its bit.
    tier->Assign(keys.data() + 1, 1, rows.data() + width, owners.data() + 1);
    const std::vector<uint64_t> more = {7, 13};
    const std::vector<int32_t> on0 = {0, 0};
    std::vector<float> more_rows(2 * static_cast<size_t>(width));
    opt.initial_rows(more.data(), 2, more_rows.data());
    tier->Insert(more.data(), 2, more_rows.data(), on0.data());
    EXPECT_EQ(TrainedOf(*tier, {7, 7, 9, 11, 13}, {0, 1, 1, 0, 0}), (std::vector<uint8_t>{1, 0, 0, 0, 0}));

    // A fetched row takes its source's bit (SetTrained); only rows a table holds take one.
    tier->SetTrained(keys.data() + 2, 1, owners.data() + 2, true);
    const uint64_t absent = 12;
    const int32_t one = 1;
    tier->SetTrained(&absent, 1, &one, true);
    EXPECT_EQ(TrainedOf(*tier, {9, 12}, {1, 1}), (std::vector<uint8_t>{1, 0}));

    // Taken once, with every bit cleared; a key's bit is its copy's on the device named.
    EXPECT_EQ(Taken(*tier), (Pairs{{7, 0}, {9, 1}}));
    EXPECT_EQ(Taken(*tier), Pairs{});
    EXPECT_EQ(TrainedOf(*tier, keys, owners), (std::vector<uint8_t>{0, 0, 0, 0}));
    tier->SetTrained(keys.data(), keys.size(), owners.data(), true);
    tier->SetTrained(keys.data() + 1, 1, owners.data() + 1, false);
    EXPECT_EQ(Taken(*tier), (Pairs{{7, 0}, {9, 1}, {11, 0}}));
    tier->SetTrained(keys.data(), keys.size(), owners.data(), true);
    tier->Clear();
    tier->Insert(keys.data(), keys.size(), rows.data(), owners.data());
    EXPECT_EQ(Taken(*tier), Pairs{});  // Clear took every bit with the rows
  }
}

// CopyRowsAt copies pair by pair in order: a position an earlier pair wrote
// gives a later pair what it was given, one written later gives its old row,
// and each bit goes with its row. Through the row mover too, where the tier
// reads every source before it writes any target.
TEST(DeviceTier, CopyRowsAtFollowsAChainInOrder) {
  const SparseOptimizer opt = AdaGrad(4);
  const auto width = static_cast<size_t>(opt.row_floats());
  // Key 7 on devices 0 and 1, 9 on 1, 11 on 0; each position's row its own.
  const std::vector<uint64_t> keys = {7, 7, 9, 11};
  const std::vector<int32_t> owners = {0, 1, 1, 0};
  std::vector<float> rows(keys.size() * width);
  for (size_t i = 0; i < rows.size(); ++i) rows[i] = static_cast<float>(i);
  const auto row = [&](size_t p) { return std::vector<float>(rows.begin() + p * width, rows.begin() + (p + 1) * width); };
  for (const bool in_place : {true, false}) {
    SCOPED_TRACE(in_place ? "in place" : "through the row mover");
    DeviceTierOptions o{2, 64, opt, false, 1, in_place ? nullptr : TwoHostRoutes(), {}};
    o.track_trained = true;
    auto tier = DeviceTier::New(o);
    ASSERT_EQ(tier->reads_in_place(), in_place);
    tier->Insert(keys.data(), keys.size(), rows.data(), owners.data());
    tier->Bind(keys.data(), keys.size(), owners.data());
    tier->SetTrained(keys.data() + 1, 1, owners.data() + 1, true);  // 7 on device 1 only
    // 7@1 onto 9, then 11 onto 7@1, then 7@1 (11's row by then) onto 7@0.
    const int64_t from[3] = {1, 3, 1}, to[3] = {2, 1, 0};
    tier->CopyRowsAt(from, to, 3);
    std::vector<float> got(keys.size() * width);
    const int64_t all[4] = {0, 1, 2, 3};
    tier->RowsAt(all, 4, got.data());
    const std::vector<float> want[4] = {row(3), row(3), row(1), row(3)};
    for (size_t p = 0; p < 4; ++p) {
      EXPECT_EQ(std::vector<float>(got.begin() + p * width, got.begin() + (p + 1) * width), want[p]) << p;
    }
    EXPECT_EQ(TrainedOf(*tier, keys, owners), (std::vector<uint8_t>{0, 0, 1, 0}));  // 9 took 7@1's bit
  }
}

// Many bits set and cleared in every order (by SetTrained, by the steps of
// bound positions, by loads over trained rows), taken, and Cleared with the
// rows: each call reads as a plain set of (key, device) would.
TEST(DeviceTier, TrainedBitsOfManyRowsReadAsASetOfThem) {
  const SparseOptimizer opt = AdaGrad(2);
  const int32_t width = opt.row_floats();
  for (const bool in_place : {true, false}) {
    SCOPED_TRACE(in_place ? "in place" : "through the row mover (gradient tables)");
    DeviceTierOptions o{2, 8192, opt, false, 1, in_place ? nullptr : TwoHostRoutes(), {}};
    o.track_trained = true;
    auto tier = DeviceTier::New(o);
    ASSERT_EQ(tier->reads_in_place(), in_place);
    std::mt19937_64 random(7);
    std::vector<uint64_t> keys;
    for (uint64_t k = 1; k <= 1500; ++k) keys.push_back(k);  // neighbours, and keys anywhere
    for (int i = 0; i < 1500; ++i) keys.push_back(random() >> 1);
    std::vector<int32_t> owners(keys.size());
    for (size_t i = 0; i < keys.size(); ++i) owners[i] = static_cast<int32_t>(random() % 2);
    std::vector<float> rows(keys.size() * static_cast<size_t>(width));
    opt.initial_rows(keys.data(), keys.size(), rows.data());
    const auto load = [&] {
      tier->Insert(keys.data(), keys.size(), rows.data(), owners.data());
      tier->Bind(keys.data(), keys.size(), owners.data());
    };
    load();
    std::set<std::pair<uint64_t, int32_t>> model;
    const std::vector<float> grad(static_cast<size_t>(opt.dim), 0.5f);
    for (int round = 0; round < 40; ++round) {
      SCOPED_TRACE(round);
      std::vector<uint64_t> some;
      std::vector<int32_t> on;
      std::vector<int64_t> at;
      const int how = static_cast<int>(random() % 4);  // 0, 1: SetTrained; 2: Apply; 3: Assign
      const bool trained = how == 2 || (how < 2 && random() % 3 != 0);
      for (size_t i = 0; i < keys.size(); ++i) {
        if (random() % 4 != 0) continue;
        some.push_back(keys[i]);
        on.push_back(owners[i]);
        at.push_back(static_cast<int64_t>(i));
        if (trained) {
          model.emplace(keys[i], owners[i]);
        } else {
          model.erase({keys[i], owners[i]});
        }
      }
      if (how == 2) {
        for (int64_t p : at) tier->AccumulateAt(owners[static_cast<size_t>(p)], &p, 1, grad.data(), {});
        std::vector<int64_t> stepped;
        EXPECT_EQ(tier->ApplyBound(&stepped).size(), at.size());
      } else if (how == 3) {
        const size_t loaded = some.size();
        for (uint64_t k = 0; k < 20; ++k) {  // and keys the tables do not hold, skipped
          some.push_back((uint64_t{1} << 62) + k);
          on.push_back(static_cast<int32_t>(k % 2));
        }
        std::vector<float> written(some.size() * static_cast<size_t>(width), 1.0f);
        ASSERT_EQ(tier->Assign(some.data(), some.size(), written.data(), on.data()), loaded);
      } else {
        tier->SetTrained(some.data(), some.size(), on.data(), trained);
      }
      std::vector<uint8_t> want(keys.size());
      for (size_t i = 0; i < keys.size(); ++i) want[i] = model.count({keys[i], owners[i]}) ? 1 : 0;
      ASSERT_EQ(TrainedOf(*tier, keys, owners), want);
      if (round % 10 == 9) {
        const auto taken = Taken(*tier);
        ASSERT_EQ(taken, (std::vector<std::pair<uint64_t, int32_t>>(model.begin(), model.end())));
        model.clear();
      }
      if (round == 24) {
        tier->Clear();
        load();
        model.clear();
      }
    }
  }
}

// RowsTrained and Upsert are the calls Herald's fetches make in one pass each:
// a tier driven by them reads, row for row and bit for bit, as a twin driven
// by the separate calls (Rows and Trained; Assign, Insert and SetTrained),
// through stale copies overwritten, fresh rows inserted, and bits both ways.
TEST(DeviceTier, RowsTrainedAndUpsertDoWhatTheSeparateCallsDo) {
  const SparseOptimizer opt = AdaGrad(2);
  const int32_t width = opt.row_floats();
  for (const bool in_place : {true, false}) {
    SCOPED_TRACE(in_place ? "in place" : "through the row mover (gradient tables)");
    DeviceTierOptions o{3, 4096, opt, false, 1, nullptr, {}};
    o.track_trained = true;
    if (!in_place) {
      o.devices = 2;
      o.routes = TwoHostRoutes();
    }
    const int32_t devices = o.devices;
    auto joint = DeviceTier::New(o), twin = DeviceTier::New(o);
    ASSERT_EQ(joint->reads_in_place(), in_place);
    std::mt19937_64 random(11);
    std::vector<uint64_t> universe;  // keys a table may hold, each (key, device) once
    std::vector<int32_t> universe_on;
    for (uint64_t k = 1; k <= 600; ++k) {
      universe.push_back(k % 3 == 0 ? random() >> 1 : k);
      universe_on.push_back(static_cast<int32_t>(random() % static_cast<uint64_t>(devices)));
    }
    std::vector<uint8_t> held(universe.size(), 0);  // what the tables hold, as the test knows it
    for (int round = 0; round < 30; ++round) {
      SCOPED_TRACE(round);
      // A fetch: some held (stale copies, overwritten), some not (inserted), each with a bit.
      std::vector<uint64_t> some;
      std::vector<int32_t> on;
      std::vector<size_t> which;
      for (size_t i = 0; i < universe.size(); ++i) {
        if (random() % 3 != 0) continue;
        some.push_back(universe[i]);
        on.push_back(universe_on[i]);
        which.push_back(i);
      }
      std::vector<float> rows(some.size() * static_cast<size_t>(width));
      for (float& x : rows) x = static_cast<float>(random() % 1000) / 8.0f;
      const bool none = round % 5 == 0;  // null bits: every row clean
      std::vector<uint8_t> bits(some.size(), 0);
      if (!none) {
        for (uint8_t& b : bits) b = random() % 2 == 0 ? 1 : 0;
      }
      joint->Upsert(some.data(), some.size(), rows.data(), on.data(), none ? nullptr : bits.data());
      twin->Assign(some.data(), some.size(), rows.data(), on.data());
      twin->Insert(some.data(), some.size(), rows.data(), on.data());
      std::vector<uint64_t> set_keys;
      std::vector<int32_t> set_on;
      for (size_t j = 0; j < some.size(); ++j) {
        held[which[j]] = 1;
        if (bits[j]) {
          set_keys.push_back(some[j]);
          set_on.push_back(on[j]);
        }
      }
      twin->SetTrained(set_keys.data(), set_keys.size(), set_on.data(), true);
      if (round % 7 == 3) {  // bits set outside the loads (a step's), on both
        std::vector<uint64_t> k;
        std::vector<int32_t> d;
        for (size_t i = 0; i < universe.size(); ++i) {
          if (held[i] && random() % 4 == 0) {
            k.push_back(universe[i]);
            d.push_back(universe_on[i]);
          }
        }
        joint->SetTrained(k.data(), k.size(), d.data(), true);
        twin->SetTrained(k.data(), k.size(), d.data(), true);
      }

      // Every held row read both ways, in a shuffled order (the owners not in runs).
      std::vector<uint64_t> keys;
      std::vector<int32_t> owners;
      for (size_t i = 0; i < universe.size(); ++i) {
        if (!held[i]) continue;
        keys.push_back(universe[i]);
        owners.push_back(universe_on[i]);
      }
      std::vector<size_t> order(keys.size());
      for (size_t i = 0; i < order.size(); ++i) order[i] = i;
      std::shuffle(order.begin(), order.end(), random);
      std::vector<uint64_t> k2(keys.size());
      std::vector<int32_t> o2(keys.size());
      for (size_t i = 0; i < order.size(); ++i) {
        k2[i] = keys[order[i]];
        o2[i] = owners[order[i]];
      }
      std::vector<float> got(k2.size() * static_cast<size_t>(width), -1.0f), want(got.size(), -2.0f);
      std::vector<uint8_t> got_bits(k2.size(), 2);
      joint->RowsTrained(k2.data(), k2.size(), o2.data(), got.data(), got_bits.data());
      twin->Rows(k2.data(), k2.size(), want.data(), o2.data());
      ASSERT_EQ(got, want);
      ASSERT_EQ(got_bits, TrainedOf(*twin, k2, o2));
      ASSERT_EQ(joint->size(), twin->size());
      if (round % 10 == 9) {
        ASSERT_EQ(Taken(*joint), Taken(*twin));
      }
    }

    // A key its owner does not hold is named; another device's copy does not count.
    std::vector<uint64_t> keys = {universe[0], 1ull << 61};
    std::vector<int32_t> owners = {universe_on[0], 0};
    std::vector<float> out(2 * static_cast<size_t>(width));
    std::vector<uint8_t> out_bits(2);
    try {
      joint->RowsTrained(keys.data(), 2, owners.data(), out.data(), out_bits.data());
      ADD_FAILURE() << "an absent key must be named";
    } catch (const std::out_of_range& e) {
      EXPECT_NE(std::string(e.what()).find("keys[1] = " + std::to_string(1ull << 61)), std::string::npos)
          << e.what();
    }
    const int32_t bad = devices;
    EXPECT_THROW(joint->RowsTrained(keys.data(), 1, &bad, out.data(), out_bits.data()), std::invalid_argument);
    EXPECT_THROW(joint->Upsert(keys.data(), 1, out.data(), &bad, nullptr), std::invalid_argument);
  }
}

// A table with no room left refuses an Upsert's new key as Insert does; the
// rows it held before stay readable.
TEST(DeviceTier, UpsertOfMoreKeysThanATableHoldsIsRefused) {
  const SparseOptimizer opt = AdaGrad(2);
  const int32_t width = opt.row_floats();
  DeviceTierOptions o{1, 8, opt, false, 1, nullptr, {}};
  o.track_trained = true;
  auto tier = DeviceTier::New(o);
  std::vector<uint64_t> keys(9);
  for (uint64_t i = 0; i < keys.size(); ++i) keys[i] = 100 + i;
  std::vector<float> rows(keys.size() * static_cast<size_t>(width), 1.0f);
  tier->Upsert(keys.data(), 8, rows.data(), nullptr, nullptr);
  EXPECT_THROW(tier->Upsert(keys.data() + 8, 1, rows.data(), nullptr, nullptr), TableFullError);
  std::vector<float> got(8 * static_cast<size_t>(width));
  std::vector<uint8_t> bits(8, 2);
  tier->RowsTrained(keys.data(), 8, nullptr, got.data(), bits.data());
  EXPECT_EQ(got, std::vector<float>(got.size(), 1.0f));
  EXPECT_EQ(bits, std::vector<uint8_t>(8, 0));
}

// Without trained bits Upsert is Assign then Insert, and a bit given is
// refused; bound to MEM-PS's rows, Upsert is refused as Insert is, and
// RowsTrained reads the rows where they lie, with no bits.
TEST(DeviceTier, UpsertAndRowsTrainedWithoutBitsOrOnHostRows) {
  const SparseOptimizer opt = AdaGrad(2);
  const int32_t width = opt.row_floats();
  const std::vector<uint64_t> keys = {5, 6};
  std::vector<float> rows(2 * static_cast<size_t>(width));
  for (size_t i = 0; i < rows.size(); ++i) rows[i] = static_cast<float>(i);
  const uint8_t bits[2] = {1, 0};
  {
    auto tier = DeviceTier::New({2, 64, opt, false, 1, nullptr, {}});
    tier->Upsert(keys.data(), 2, rows.data(), nullptr, nullptr);
    std::vector<float> got(rows.size());
    tier->Rows(keys.data(), 2, got.data(), nullptr);
    EXPECT_EQ(got, rows);
    for (const auto& call : std::vector<std::function<void()>>{
             [&] { tier->Upsert(keys.data(), 2, rows.data(), nullptr, bits); },
             [&] {
               uint8_t out[2];
               tier->RowsTrained(keys.data(), 2, nullptr, got.data(), out);
             }}) {
      try {
        call();
        ADD_FAILURE() << "a tier without track_trained must refuse the trained bits";
      } catch (const std::logic_error& e) {
        EXPECT_NE(std::string(e.what()).find("track_trained is off"), std::string::npos) << e.what();
      }
    }
  }
  DeviceTierOptions o{1, 8, opt, false, 1, nullptr, {}};
  o.track_trained = true;
  auto tier = DeviceTier::New(o);
  ASSERT_TRUE(tier->binds_host_rows());
  std::vector<uint8_t*> at = {reinterpret_cast<uint8_t*>(rows.data()),
                              reinterpret_cast<uint8_t*>(rows.data() + width)};
  tier->BindHostRows(keys.data(), 2, nullptr, at.data());
  EXPECT_THROW(tier->Upsert(keys.data(), 2, rows.data(), nullptr, nullptr), std::logic_error);
  const uint64_t reversed[2] = {6, 5};
  std::vector<float> got(rows.size());
  uint8_t out[2] = {2, 2};
  tier->RowsTrained(reversed, 2, nullptr, got.data(), out);
  EXPECT_EQ(std::vector<float>(got.begin(), got.begin() + width), std::vector<float>(rows.begin() + width, rows.end()));
  EXPECT_EQ(out[0], 0);
  EXPECT_EQ(out[1], 0);
}

TEST(DeviceTier, TrainedBitsAreRefusedByATierThatDoesNotTrackThem) {
  const SparseOptimizer opt = AdaGrad(4);
  auto tier = DeviceTier::New({2, 64, opt, false, 1, nullptr, {}});
  const uint64_t key = 5;
  uint8_t bit = 0;
  std::vector<uint64_t> keys;
  std::vector<int32_t> owners;
  for (const auto& call : std::vector<std::function<void()>>{
           [&] { tier->Trained(&key, 1, nullptr, &bit); }, [&] { tier->SetTrained(&key, 1, nullptr, true); },
           [&] { tier->TakeTrained(&keys, &owners); }}) {
    try {
      call();
      ADD_FAILURE() << "a tier without track_trained must refuse the trained bits";
    } catch (const std::logic_error& e) {
      EXPECT_NE(std::string(e.what()).find("track_trained is off"), std::string::npos) << e.what();
    }
  }
}

TEST(DeviceTier, BindNamesAKeyNotLoadedAndRefusesPendingGradients) {
  const SparseOptimizer opt = AdaGrad(4);
  std::vector<uint64_t> keys = {21, 22, 23};
  std::vector<float> rows(keys.size() * opt.row_floats());
  opt.initial_rows(keys.data(), keys.size(), rows.data());
  auto tier = DeviceTier::New({2, 64, opt, false, 1, nullptr, {}});
  tier->Insert(keys.data(), 2, rows.data(), nullptr);  // 23 is not loaded
  try {
    tier->Bind(keys.data(), keys.size(), nullptr);
    ADD_FAILURE() << "a key not loaded must throw";
  } catch (const std::out_of_range& e) {
    EXPECT_NE(std::string(e.what()).find("keys[2] = 23"), std::string::npos) << e.what();
  }
  std::vector<float> g(4, 1.0f);
  tier->Accumulate(0, keys.data(), 1, g.data(), nullptr);
  EXPECT_THROW(tier->Bind(keys.data(), 2, nullptr), std::logic_error);
  tier->Apply();
  tier->Bind(keys.data(), 2, nullptr);
  const int64_t first = 0;
  tier->AccumulateAt(1, &first, 1, g.data(), {});
  EXPECT_THROW(tier->Bind(keys.data(), 2, nullptr), std::logic_error);
}

TEST(DeviceTier, GradientTablesOfABatchsSizeStepAsTheRowsSizeDoes) {
  const SparseOptimizer opt = AdaGrad(4);
  const int32_t width = opt.row_floats();
  std::vector<uint64_t> keys = {21, 22, 23, 24, 25, 26};
  std::vector<float> rows(keys.size() * width);
  opt.initial_rows(keys.data(), keys.size(), rows.data());
  std::vector<uint64_t> pushed = {23, 21, 26, 23, 25};
  std::vector<float> g(pushed.size() * 4);
  for (size_t i = 0; i < g.size(); ++i) g[i] = 0.25f * static_cast<float>(i % 7) - 0.5f;
  std::vector<std::vector<float>> after;
  for (uint64_t gradient_slots : {0, 8}) {  // 0: the tables keep the rows' 256 slots
    auto tier = DeviceTier::New({2, 256, opt, /*use_cuda=*/false, /*threads=*/1, nullptr, {}});
    tier->Insert(keys.data(), keys.size(), rows.data(), nullptr);
    if (gradient_slots) {
      tier->SetGradientCapacity(0, gradient_slots);
      tier->SetGradientCapacity(1, gradient_slots);
    }
    for (int step = 0; step < 3; ++step) {
      tier->Accumulate(step % 2, pushed.data(), pushed.size(), g.data(), nullptr);
      std::vector<uint64_t> stepped = tier->Apply();
      std::sort(stepped.begin(), stepped.end());
      EXPECT_EQ(stepped, (std::vector<uint64_t>{21, 23, 25, 26}));
    }
    std::vector<float> full(keys.size() * width);
    tier->Rows(keys.data(), keys.size(), full.data(), nullptr);
    after.push_back(full);
  }
  EXPECT_EQ(after[0], after[1]);
  EXPECT_NE(after[0], rows);

  auto tier = DeviceTier::New({1, 256, opt, false, 1, nullptr, {}});
  tier->Insert(keys.data(), keys.size(), rows.data(), nullptr);
  EXPECT_THROW(tier->SetGradientCapacity(0, 0), std::invalid_argument);
  EXPECT_THROW(tier->SetGradientCapacity(1, 8), std::invalid_argument);  // the tier has device 0 only
  tier->SetGradientCapacity(0, 8);
  tier->Accumulate(0, pushed.data(), 1, g.data(), nullptr);
  EXPECT_THROW(tier->SetGradientCapacity(0, 64), std::logic_error);  // a gradient waits for Apply
  tier->Apply();
  // The gradient table holds 8 keys now, whatever the rows' table holds.
  std::vector<uint64_t> many(9);
  for (size_t i = 0; i < many.size(); ++i) many[i] = 100 + i;
  std::vector<float> zeros(many.size() * width, 0.0f), many_g(many.size() * 4, 1.0f);
  tier->Insert(many.data(), many.size(), zeros.data(), nullptr);
  EXPECT_THROW(tier->Accumulate(0, many.data(), many.size(), many_g.data(), nullptr), TableFullError);
}

// Keys 10 and 11 on devices 0 and 1, AdaGrad rows of dim 4, each given `g`
// (their gradients, dim floats a key) by `workers` workers. Apply must refuse
// the batch with `message`, before either row steps: device 0's table,
// applied first, was stepped before device 1's refused (its own check alone
// comes too late). So must ApplyBound, with the keys bound to positions.
void ExpectApplyRefusedOnEveryDevice(const std::vector<float>& g, int workers, const char* message) {
  const SparseOptimizer opt = AdaGrad(4);
  const int32_t width = opt.row_floats();
  std::vector<uint64_t> keys = {10, 11};
  const int32_t owners[2] = {0, 1};
  std::vector<float> rows(keys.size() * width);
  opt.initial_rows(keys.data(), keys.size(), rows.data());
  auto tier = DeviceTier::New({2, 64, opt, /*use_cuda=*/false, /*threads=*/1, nullptr, {}});
  tier->Insert(keys.data(), keys.size(), rows.data(), owners);
  for (int w = 0; w < workers; ++w) tier->Accumulate(w, keys.data(), 2, g.data(), owners);
  try {
    tier->Apply();
    ADD_FAILURE() << "a batch that should be refused was stepped";
  } catch (const DivergedError& e) {
    EXPECT_STREQ(e.what(), message);
  }
  std::vector<float> after(rows.size());
  tier->Rows(keys.data(), keys.size(), after.data(), owners);
  EXPECT_EQ(after, rows);

  auto bound = DeviceTier::New({2, 64, opt, false, 1, nullptr, {}});
  bound->Insert(keys.data(), keys.size(), rows.data(), owners);
  bound->Bind(keys.data(), keys.size(), owners);
  const int64_t at[2] = {0, 1};
  for (int w = 0; w < workers; ++w) bound->AccumulateAt(w, at, 2, g.data(), {});
  std::vector<int64_t> stepped;
  EXPECT_THROW(bound->ApplyBound(&stepped), DivergedError);
  EXPECT_TRUE(stepped.empty());
  bound->Rows(keys.data(), keys.size(), after.data(), owners);
  EXPECT_EQ(after, rows);
}

// Key 11's gradients from two workers, 3e38 each, overflow in their sum on
// device 1; key 10's, on device 0, do not.
TEST(DeviceTier, ASumThatIsNotFiniteOnOneDeviceStepsNoRowOnAny) {
  ExpectApplyRefusedOnEveryDevice({0.5f, 0.5f, 0.5f, 0.5f, 1.0f, 3e38f, 1.0f, 1.0f}, 2,
                                  "device tier apply (device 1): 1 non-finite value in the summed gradients of 1 key "
                                  "(key 11 first: inf): training diverged (a gradient pushed so, or finite ones whose "
                                  "sum overflowed); no row was stepped");
}

// Key 11's gradient sum on device 1 is finite (1e20), but its square is not:
// AdaGrad's sum of squares would be inf, after which the row never moves
// again. Key 10's step, on device 0, is fine.
TEST(DeviceTier, AStepThatWouldLeaveARowNotFiniteOnOneDeviceStepsNoRowOnAny) {
  ExpectApplyRefusedOnEveryDevice({0.5f, 0.5f, 0.5f, 0.5f, 1.0f, 1e20f, 1.0f, 1.0f}, 1,
                                  "device tier apply (device 1): the step of 1 key would leave a value that is not "
                                  "finite in its row (key 11 first: its AdaGrad sum of squared gradients, column 1, "
                                  "would be inf): training diverged (a learning rate, or finite gradient sums, too "
                                  "large for float32); no row was stepped");
}

// Every row a tier holds, by key.
std::map<uint64_t, std::vector<float>> TierRows(const DeviceTier& tier) {
  const uint64_t n = tier.size();
  const auto width = static_cast<uint64_t>(tier.row_floats());
  std::vector<uint64_t> keys(n);
  std::vector<float> rows(n * width);
  EXPECT_EQ(tier.ReadBack(keys.data(), rows.data(), n), n);
  std::map<uint64_t, std::vector<float>> by_key;
  for (uint64_t i = 0; i < n; ++i) by_key[keys[i]].assign(rows.begin() + i * width, rows.begin() + (i + 1) * width);
  return by_key;
}

// Keys the tier was not given (30, 31) get gradients on device 1, whose table
// has one slot free. Its apply refused the step (TableFullError), but device
// 0's, applied first, had stepped key 10, and a device's own table kept the
// steps of the keys it met before it filled: the caller could not tell which
// rows stepped. No row steps on any device now and no slot is claimed; the
// gradients wait, and an Apply again refuses again, stepping nothing twice.
// With one device, its table's own apply refuses the step the same way.
TEST(DeviceTier, AStepThatFindsNoSlotOnOneDeviceStepsNoRowOnAny) {
  const SparseOptimizer opt = AdaGrad(4);
  const int32_t width = opt.row_floats();
  for (const int32_t devices : {2, 1}) {
    SCOPED_TRACE(std::to_string(devices) + " devices");
    const int32_t last = devices - 1;
    std::vector<uint64_t> keys = {10, 20, 21, 22, 23, 24, 25, 26};  // 7 on the last device, its table of 8 slots
    std::vector<int32_t> owners(keys.size(), last);
    if (devices == 2) owners[0] = 0;
    std::vector<float> rows(keys.size() * width);
    opt.initial_rows(keys.data(), keys.size(), rows.data());
    auto tier = DeviceTier::New({devices, 8, opt, /*use_cuda=*/false, /*threads=*/1, nullptr, {}});
    tier->SetGradientCapacity(last, 64);  // room for every gradient: the rows' table is the one that fills
    // (one device: key 10 is not loaded either)
    const uint64_t loaded = devices == 2 ? keys.size() : keys.size() - 1;
    tier->Insert(keys.data() + keys.size() - loaded, loaded, rows.data() + (keys.size() - loaded) * width,
                 owners.data() + keys.size() - loaded);
    const auto before = TierRows(*tier);
    std::vector<uint64_t> pushed = keys;
    pushed.insert(pushed.end(), {30, 31});
    std::vector<int32_t> pushed_owners = owners;
    pushed_owners.insert(pushed_owners.end(), {last, last});
    std::vector<float> g(pushed.size() * 4);
    for (size_t i = 0; i < g.size(); ++i) g[i] = 0.25f * static_cast<float>(i % 7) - 0.5f;
    tier->Accumulate(0, pushed.data(), pushed.size(), g.data(), pushed_owners.data());
    const std::string said = devices == 2 ? "device tier apply (device 1): hash table full: the step needs a slot for "
                                            "each of 2 keys the table lacks, and 1 is free (capacity 8, size 7); no "
                                            "row was stepped"
                                          : "apply_summed_gradients: hash table full: the step needs a slot for each "
                                            "of 3 keys the table lacks, and 1 is free (capacity 8, size 7); no row "
                                            "was stepped";
    for (int again = 0; again < 2; ++again) {
      try {
        tier->Apply();
        ADD_FAILURE() << "a step a table had no room for was taken";
      } catch (const TableFullError& e) {
        EXPECT_EQ(std::string(e.what()), said);
      }
      EXPECT_EQ(tier->size(), loaded);
      EXPECT_EQ(TierRows(*tier), before);
    }
  }
}

// A gradient pushed by key for a key the batch did not bind: the in-place
// sums have no place for it (std::out_of_range, nothing added), but a tier
// whose rows cross a row mover (every CUDA tier, host partitions with
// executed routes) added it to its owner's gradient table, and its Apply
// stepped the bound keys' rows and the stray key's (claiming a slot for it)
// before it named the key. Both refuse the call now, with one message, and
// add nothing of it; through the row mover so does a bound key sent to
// another device than the one it is bound on (its step would claim a row
// there). A key bound on two devices is still reached by key with its owner.
TEST(DeviceTier, AccumulateByKeyRefusesAKeyNotBoundAndAddsNothing) {
  const SparseOptimizer opt = AdaGrad(4);
  const int32_t width = opt.row_floats();
  const std::vector<uint64_t> keys = {10, 11, 12};
  const std::vector<int32_t> owners = {0, 1, 1};
  std::vector<float> rows(keys.size() * width);
  opt.initial_rows(keys.data(), keys.size(), rows.data());
  const std::vector<float> g = {0.5f, -0.25f, 1.0f, 2.0f, 1.0f, 1.0f, -1.0f, 0.5f};
  for (const bool in_place : {true, false}) {
    SCOPED_TRACE(in_place ? "in place" : "through the row mover");
    auto tier = DeviceTier::New({2, 64, opt, false, 1, in_place ? nullptr : TwoHostRoutes(), {}});
    ASSERT_EQ(tier->reads_in_place(), in_place);
    tier->Insert(keys.data(), keys.size(), rows.data(), owners.data());
    tier->Bind(keys.data(), keys.size(), owners.data());
    const auto before = TierRows(*tier);
    const std::vector<uint64_t> stray = {11, 999};
    const std::vector<int32_t> stray_owners = {1, 1};
    try {
      tier->Accumulate(0, stray.data(), stray.size(), g.data(), stray_owners.data());
      ADD_FAILURE() << "a key not bound was accumulated";
    } catch (const std::out_of_range& e) {
      EXPECT_STREQ(e.what(), "device tier accumulate: keys[1] = 999 is not among the 3 keys bound");
    }
    if (!in_place) {
      const std::vector<uint64_t> elsewhere = {11, 10};  // 10 is bound on device 0
      try {
        tier->Accumulate(0, elsewhere.data(), elsewhere.size(), g.data(), stray_owners.data());
        ADD_FAILURE() << "a key sent to a device it is not bound on was accumulated";
      } catch (const std::invalid_argument& e) {
        EXPECT_STREQ(e.what(), "device tier accumulate: owners[1] = 1, but keys[1] = 10 is bound on device 0");
      }
    }
    std::vector<int64_t> positions;
    std::vector<uint64_t> stepped;
    EXPECT_NO_THROW(stepped = tier->ApplyBound(&positions));
    EXPECT_TRUE(stepped.empty());  // nothing of the refused calls waited
    EXPECT_TRUE(positions.empty());
    EXPECT_EQ(tier->size(), keys.size());
    EXPECT_EQ(TierRows(*tier), before);
  }

  // Key 7 bound on both devices: by key, its owner picks the copy.
  const std::vector<uint64_t> twice = {7, 7};
  const std::vector<int32_t> both = {0, 1};
  std::vector<float> twice_rows(twice.size() * width);
  opt.initial_rows(twice.data(), twice.size(), twice_rows.data());
  auto tier = DeviceTier::New({2, 64, opt, false, 1, TwoHostRoutes(), {}});
  tier->Insert(twice.data(), twice.size(), twice_rows.data(), both.data());
  tier->Bind(twice.data(), twice.size(), both.data());
  tier->Accumulate(0, twice.data(), 1, g.data(), both.data() + 1);
  EXPECT_EQ(tier->Apply(), std::vector<uint64_t>{7});
  std::vector<float> got(twice_rows.size());
  const int64_t at[2] = {0, 1};
  tier->RowsAt(at, 2, got.data());
  EXPECT_TRUE(std::equal(got.begin(), got.begin() + width, twice_rows.begin()));  // device 0's copy did not step
  EXPECT_NE(got[static_cast<size_t>(width)], twice_rows[static_cast<size_t>(width)]);
}

// An accumulate whose keys a device's gradient table has no room for: the
// devices before it had added their gradients, and the table those of the
// keys it met before it filled, then TableFullError; a retry after making
// room added them twice. Refused whole now, before any device adds: nothing
// of the call waits for Apply. A call that repeats keys the table lacks
// needs a slot for each once. By key and by position, with and without a
// row mover.
TEST(DeviceTier, AnAccumulateAGradientTableHasNoRoomForAddsNothing) {
  const SparseOptimizer opt = AdaGrad(4);
  const int32_t width = opt.row_floats();
  std::vector<uint64_t> keys = {10, 20, 21, 22, 23, 24, 25, 30, 31, 32};
  std::vector<int32_t> owners(keys.size(), 1);
  owners[0] = 0;
  std::vector<float> rows(keys.size() * width);
  opt.initial_rows(keys.data(), keys.size(), rows.data());
  const auto position = [&](uint64_t key) {
    return static_cast<int64_t>(std::find(keys.begin(), keys.end(), key) - keys.begin());
  };
  // (keys, owner of each): the first fills 6 of device 1's 8 gradient slots,
  // the second needs 3 more (30, 31, 32), the third 2 (30 three times, 31).
  const std::vector<std::vector<uint64_t>> calls = {
      {20, 21, 22, 23, 24, 25}, {10, 21, 30, 31, 30, 32}, {30, 30, 30, 31}};
  const auto owners_of = [&](const std::vector<uint64_t>& call) {
    std::vector<int32_t> o;
    for (uint64_t k : call) o.push_back(owners[static_cast<size_t>(position(k))]);
    return o;
  };
  const auto grads_of = [](const std::vector<uint64_t>& call, float scale) {
    std::vector<float> g(call.size() * 4);
    for (size_t i = 0; i < g.size(); ++i) g[i] = scale * (0.25f * static_cast<float>(i % 7) - 0.5f);
    return g;
  };
  // The reference: tables with room, given the first and third calls.
  auto reference = DeviceTier::New({2, 64, opt, false, 1, nullptr, {}});
  reference->Insert(keys.data(), keys.size(), rows.data(), owners.data());
  for (const size_t c : {0u, 2u}) {
    reference->Accumulate(0, calls[c].data(), calls[c].size(), grads_of(calls[c], 1.0f + c).data(),
                          owners_of(calls[c]).data());
  }
  reference->Apply();
  const auto want = TierRows(*reference);

  for (const int way : {0, 1, 2}) {
    const bool moved = way != 0, bound = way == 2;
    SCOPED_TRACE(std::string(moved ? "through the row mover" : "on the tables") + (bound ? ", by position" : ", by key"));
    auto tier = DeviceTier::New({2, 64, opt, false, 1, moved ? TwoHostRoutes() : nullptr, {}});
    ASSERT_FALSE(tier->reads_in_place() && bound);
    tier->SetGradientCapacity(1, 8);
    tier->Insert(keys.data(), keys.size(), rows.data(), owners.data());
    if (bound) tier->Bind(keys.data(), keys.size(), owners.data());  // 9 keys on device 1, 8 gradient slots
    const auto accumulate = [&](size_t c) {
      const std::vector<float> g = grads_of(calls[c], 1.0f + c);
      if (!bound) return tier->Accumulate(0, calls[c].data(), calls[c].size(), g.data(), owners_of(calls[c]).data());
      std::vector<int64_t> at;
      for (uint64_t k : calls[c]) at.push_back(position(k));
      tier->AccumulateAt(0, at.data(), at.size(), g.data(), {});
    };
    accumulate(0);
    for (int again = 0; again < 2; ++again) {
      try {
        accumulate(1);
        ADD_FAILURE() << "an accumulate a gradient table had no room for was taken";
      } catch (const TableFullError& e) {
        EXPECT_STREQ(e.what(), "device tier accumulate (device 1): gradient table full: the call needs a slot for "
                               "each of 3 keys the table lacks, and 2 are free (capacity 8, size 6); no gradient "
                               "was added");
      }
    }
    accumulate(2);
    std::vector<uint64_t> stepped = tier->Apply();
    std::sort(stepped.begin(), stepped.end());
    EXPECT_EQ(stepped, (std::vector<uint64_t>{20, 21, 22, 23, 24, 25, 30, 31}));
    EXPECT_EQ(TierRows(*tier), want);
  }
}

TEST(DeviceTier, AssignOverwritesOnlyLoadedKeys) {
  const SparseOptimizer opt = AdaGrad(2);
  const int32_t width = opt.row_floats();
  auto tier = DeviceTier::New({2, 64, opt, /*use_cuda=*/false, /*threads=*/1, nullptr, {}});
  std::vector<uint64_t> keys = {10, 11, 12, 13};
  std::vector<float> rows(keys.size() * width, 1.0f);
  tier->Insert(keys.data(), keys.size(), rows.data(), nullptr);
  // 11 and 13 are loaded, 99 is not: it is skipped, not added.
  std::vector<uint64_t> newer = {13, 99, 11};
  std::vector<float> newer_rows(newer.size() * width);
  for (size_t i = 0; i < newer_rows.size(); ++i) newer_rows[i] = 2.0f + static_cast<float>(i);
  EXPECT_EQ(tier->Assign(newer.data(), newer.size(), newer_rows.data(), nullptr), 2u);
  EXPECT_EQ(tier->size(), keys.size());
  std::vector<float> got(keys.size() * width);
  tier->Rows(keys.data(), keys.size(), got.data(), nullptr);
  for (int32_t j = 0; j < width; ++j) {
    EXPECT_EQ(got[0 * width + j], 1.0f);                        // 10 untouched
    EXPECT_EQ(got[1 * width + j], newer_rows[2 * width + j]);  // 11 <- third row
    EXPECT_EQ(got[2 * width + j], 1.0f);                        // 12 untouched
    EXPECT_EQ(got[3 * width + j], newer_rows[0 * width + j]);  // 13 <- first row
  }
}

// Writing back a batch: every key's own row, from each device's table, and
// never more than max_rows (the caller sized its buffers by it).
TEST(DeviceTier, ReadBackGivesEachKeyItsOwnRowFromEveryDeviceWithinMaxRows) {
  const SparseOptimizer opt = AdaGrad(4);
  const int32_t width = opt.row_floats();
  auto tier = DeviceTier::New({2, 64, opt, /*use_cuda=*/false, /*threads=*/1, nullptr, {}});
  std::vector<uint64_t> keys = {10, 11, 12, 13, 14, 15, 16, 17, 18, 19};
  std::vector<int32_t> owners = {0, 0, 0, 0, 1, 1, 1, 1, 1, 1};
  std::map<uint64_t, std::vector<float>> want;
  std::vector<float> rows;
  for (uint64_t k : keys) {
    for (int32_t c = 0; c < width; ++c) want[k].push_back(static_cast<float>(k * 100 + c));
    rows.insert(rows.end(), want[k].begin(), want[k].end());
  }
  tier->Insert(keys.data(), keys.size(), rows.data(), owners.data());

  std::vector<uint64_t> got_keys(keys.size(), 0);
  std::vector<float> got_rows(keys.size() * width, -1.0f);
  ASSERT_EQ(tier->ReadBack(got_keys.data(), got_rows.data(), keys.size()), keys.size());
  std::vector<uint64_t> sorted = got_keys;
  std::sort(sorted.begin(), sorted.end());
  EXPECT_EQ(sorted, keys);
  for (size_t j = 0; j < got_keys.size(); ++j) {
    const std::vector<float> row(got_rows.begin() + j * width, got_rows.begin() + (j + 1) * width);
    EXPECT_EQ(row, want[got_keys[j]]) << "ReadBack's row " << j << ", key " << got_keys[j];
  }

  // Device 0 has 4 rows: device 1 may add 3, and nothing past the 7th is written.
  std::fill(got_keys.begin(), got_keys.end(), 0);
  std::fill(got_rows.begin(), got_rows.end(), -1.0f);
  ASSERT_EQ(tier->ReadBack(got_keys.data(), got_rows.data(), 7), 7u);
  for (size_t j = 0; j < 7; ++j) {
    const std::vector<float> row(got_rows.begin() + j * width, got_rows.begin() + (j + 1) * width);
    EXPECT_EQ(row, want[got_keys[j]]) << "ReadBack's row " << j << ", key " << got_keys[j];
  }
  for (size_t j = 7; j < keys.size(); ++j) EXPECT_EQ(got_keys[j], 0u) << "written past max_rows at " << j;
  for (size_t i = 7 * width; i < got_rows.size(); ++i) {
    EXPECT_EQ(got_rows[i], -1.0f) << "written past max_rows at " << i;
  }
}

// Bound to MEM-PS's pinned rows: a device owning one key over its capacity is
// refused, Assign counts the keys it wrote, ReadBack stops at max_rows.
TEST(DeviceTier, HostRowsKeepCapacityAndCountWhatAssignAndReadBackDid) {
  const SparseOptimizer opt = AdaGrad(2);
  const int32_t width = opt.row_floats();
  auto tier = DeviceTier::New({1, 3, opt, /*use_cuda=*/false, /*threads=*/1, nullptr, {}});
  ASSERT_TRUE(tier->binds_host_rows());
  std::vector<uint64_t> keys = {5, 6, 7, 8};
  std::vector<float> store(keys.size() * width, 1.0f);
  std::vector<uint8_t*> at(keys.size());
  for (size_t i = 0; i < keys.size(); ++i) at[i] = reinterpret_cast<uint8_t*>(store.data() + i * width);
  EXPECT_THROW(tier->BindHostRows(keys.data(), 4, nullptr, at.data()), TableFullError);  // 4 rows, capacity 3
  tier->BindHostRows(keys.data(), 3, nullptr, at.data());  // exactly the capacity
  EXPECT_EQ(tier->size(), 3u);

  std::vector<uint64_t> newer = {7, 99, 5};  // 99 is not bound: skipped
  std::vector<float> newer_rows(newer.size() * width);
  for (size_t i = 0; i < newer_rows.size(); ++i) newer_rows[i] = 2.0f + static_cast<float>(i);
  EXPECT_EQ(tier->Assign(newer.data(), newer.size(), newer_rows.data(), nullptr), 2u);
  for (int32_t c = 0; c < width; ++c) {
    EXPECT_EQ(store[0 * width + c], newer_rows[2 * width + c]);  // 5 <- third row
    EXPECT_EQ(store[1 * width + c], 1.0f);                        // 6 untouched
    EXPECT_EQ(store[2 * width + c], newer_rows[0 * width + c]);  // 7 <- first row
  }

  std::vector<uint64_t> got_keys(3, 0);
  std::vector<float> got_rows(3 * width, -1.0f);
  ASSERT_EQ(tier->ReadBack(got_keys.data(), got_rows.data(), 2), 2u);
  EXPECT_EQ(got_keys, (std::vector<uint64_t>{5, 6, 0}));
  for (int32_t c = 0; c < width; ++c) EXPECT_EQ(got_rows[2 * width + c], -1.0f) << "written past max_rows";
}

// A worker outside [0, devices) is refused, not counted in some other pair's cell.
TEST(DeviceTier, RefusesAWorkerThatIsNotADevice) {
  const SparseOptimizer opt = AdaGrad(2);
  const int32_t width = opt.row_floats();
  auto tier = DeviceTier::New({2, 64, opt, /*use_cuda=*/false, /*threads=*/1, nullptr, {}});
  std::vector<uint64_t> keys = {1, 2, 3};
  std::vector<float> rows(keys.size() * width, 1.0f);
  tier->Insert(keys.data(), keys.size(), rows.data(), nullptr);
  std::vector<float> emb(keys.size() * 2), g(keys.size() * 2, 1.0f);
  for (int32_t worker : {-1, 2}) {
    EXPECT_THROW(tier->Get(worker, keys.data(), keys.size(), emb.data(), nullptr), std::invalid_argument);
    EXPECT_THROW(tier->Accumulate(worker, keys.data(), keys.size(), g.data(), nullptr), std::invalid_argument);
  }
  const TransferMatrix m = tier->transfers();
  for (uint64_t r : m.rows) EXPECT_EQ(r, 0u);
  EXPECT_TRUE(tier->Apply().empty());
}

TEST(DeviceTier, UniqueKeysKeepsFirstAppearance) {
  std::vector<uint64_t> keys = {9, 4, 9, 7, 4, 9};
  std::vector<int64_t> inverse(keys.size());
  EXPECT_EQ(UniqueKeys(keys.data(), keys.size(), inverse.data()), (std::vector<uint64_t>{9, 4, 7}));
  EXPECT_EQ(inverse, (std::vector<int64_t>{0, 1, 0, 2, 1, 0}));
  keys[2] = kEmptyKey;
  EXPECT_THROW(UniqueKeys(keys.data(), keys.size(), inverse.data()), std::invalid_argument);
}

TEST(DeviceTier, SumByInverseAddsRowsOfTheSameKey) {
  const std::vector<int64_t> inverse = {0, 1, 0, 2, 1, 0};
  std::vector<float> rows(inverse.size() * 2);
  for (size_t i = 0; i < rows.size(); ++i) rows[i] = static_cast<float>(i);
  std::vector<float> out(3 * 2, -1.0f);
  SumByInverse(inverse.data(), inverse.size(), rows.data(), 2, 3, out.data());
  EXPECT_EQ(out, (std::vector<float>{0 + 4 + 10, 1 + 5 + 11, 2 + 8, 3 + 9, 6, 7}));
  const std::vector<int64_t> bad = {0, 3};
  EXPECT_THROW(SumByInverse(bad.data(), 2, rows.data(), 2, 3, out.data()), std::out_of_range);
}

using test_support::CallFailingAllocation;
using test_support::FailingAllocationCall;
using test_support::ForEveryAllocation;
using test_support::PinBreakingCache;
using test_support::RowStore;
using test_support::UncountedReleaseCache;


// At dim 4 a row's width is known at run time; at 16 Get copies rows of a
// width fixed at compile time (WithRowWidth).
TEST(HostBatch, StepsPinnedRowsInPlaceLikeOneTable) {
  // 16: a width the copies know at compile time; 6 and 33: widths whose
  // sums end past the last whole group of four floats.
  for (const int32_t dim : {4, 6, 16, 33}) {
    SCOPED_TRACE("dim " + std::to_string(dim));
    RowStore store(AdaGrad(dim));
    const SparseOptimizer& opt = store.opt;
    const int32_t width = opt.row_floats();
    auto cache = store.Cache(64);
    std::vector<uint64_t> keys = {11, 12, 13, 14, 15};
    cache->Pull(keys.data(), keys.size(), nullptr, /*pin=*/true, nullptr);
    HostBatch batch(*cache, keys.data(), keys.size(), opt);

    // Positions of repeated keys, then their embeddings, one row per example.
    std::vector<uint64_t> examples = {13, 11, 13, 15};
    std::vector<int64_t> at(examples.size());
    batch.Positions(examples.data(), examples.size(), at.data());
    EXPECT_EQ(at, (std::vector<int64_t>{2, 0, 2, 4}));
    std::vector<float> emb(examples.size() * dim), initial(examples.size() * width);
    batch.Get(at.data(), at.size(), emb.data());
    opt.initial_rows(examples.data(), examples.size(), initial.data());
    for (size_t i = 0; i < examples.size(); ++i) {
      for (int d = 0; d < dim; ++d) EXPECT_EQ(emb[i * dim + d], initial[i * width + d]);
    }
    std::vector<float> g(examples.size() * dim);
    for (size_t i = 0; i < g.size(); ++i) g[i] = 0.1f * static_cast<float>(i + 1);
    batch.Accumulate(at.data(), at.size(), g.data());
    EXPECT_EQ(batch.Apply(), 3u);
    EXPECT_EQ(batch.Apply(), 0u);  // the gradients were consumed
    EXPECT_EQ(batch.UpdatedKeys(), (std::vector<uint64_t>{11, 13, 15}));

    // The same gradients through one table.
    auto table = NewHashTable({64, width, 1, -1});
    table->apply_gradients(examples.data(), examples.size(), g.data(), opt);
    std::vector<uint64_t> updated = {11, 13, 15};
    std::vector<float> want(3 * width), got(3 * width);
    table->find(updated.data(), 3, want.data(), nullptr);
    std::vector<int64_t> upd_at = {0, 2, 4};
    batch.Rows(upd_at.data(), 3, got.data());
    EXPECT_EQ(got, want);
    // They are MEM-PS's rows: a read of the pinned keys sees the step.
    std::vector<float> cached(3 * width);
    cache->ReadPinned(updated.data(), 3, reinterpret_cast<uint8_t*>(cached.data()));
    EXPECT_EQ(cached, want);

    // Release: unpinned, the updated rows dirty (flushed to the store), the others clean.
    batch.Release();
    batch.Release();
    EXPECT_EQ(cache->stats().pinned, 0u);
    EXPECT_EQ(cache->stats().dirty, 3u);
    cache->FlushDirty();
    ASSERT_EQ(store.stored.size(), 3u);
    EXPECT_EQ(store.stored[13], std::vector<float>(want.begin() + width, want.begin() + 2 * width));
    EXPECT_THROW(batch.Apply(), std::logic_error);
  }
}

TEST(HostBatch, GetsAndAccumulatesRowsLaidOutInAWiderMatrix) {
  RowStore store(AdaGrad(2));
  auto cache = store.Cache(16);
  std::vector<uint64_t> keys = {5, 6, 7};
  cache->Pull(keys.data(), keys.size(), nullptr, /*pin=*/true, nullptr);
  HostBatch batch(*cache, keys.data(), keys.size(), store.opt);
  // Two examples of two fields: their 4 rows go to the first 4 columns of a
  // (2, 5) matrix whose last column (a dense feature) must stay untouched.
  const std::vector<int64_t> at = {2, 0, 1, 2};
  std::vector<float> compact(8);
  batch.Get(at.data(), 4, compact.data());
  std::vector<float> wide(10, -1.0f);
  batch.Get(at.data(), 4, wide.data(), RowLayout{2, 5});
  EXPECT_EQ(std::vector<float>(wide.begin(), wide.begin() + 4), std::vector<float>(compact.begin(), compact.begin() + 4));
  EXPECT_EQ(std::vector<float>(wide.begin() + 5, wide.begin() + 9), std::vector<float>(compact.begin() + 4, compact.end()));
  EXPECT_EQ(wide[4], -1.0f);
  EXPECT_EQ(wide[9], -1.0f);
  // The same rows through the whole-batch path (more examples than keys, twice over).
  const std::vector<int64_t> many = {0, 1, 2, 0, 1, 2, 0, 1};
  std::vector<float> many_compact(16), many_wide(4 * 5, -1.0f);
  batch.Get(many.data(), 8, many_compact.data());
  batch.Get(many.data(), 8, many_wide.data(), RowLayout{2, 5});
  for (int e = 0; e < 4; ++e) {
    for (int c = 0; c < 4; ++c) EXPECT_EQ(many_wide[e * 5 + c], many_compact[e * 4 + c]);
    EXPECT_EQ(many_wide[e * 5 + 4], -1.0f);
  }

  // Gradients read from the wider layout sum as the compact ones do.
  std::vector<float> grads_wide = {1, 2, 3, 4, 99, 5, 6, 7, 8, 99};
  std::vector<float> grads_compact = {1, 2, 3, 4, 5, 6, 7, 8};
  HostBatch twin_batch(*cache, keys.data(), keys.size(), store.opt);  // a second pin of the same rows
  batch.Accumulate(at.data(), 4, grads_wide.data(), RowLayout{2, 5});
  batch.Apply();
  std::vector<float> after_wide(3 * store.opt.row_floats());
  const std::vector<int64_t> all = {0, 1, 2};
  batch.Rows(all.data(), 3, after_wide.data());
  RowStore fresh_store(AdaGrad(2));
  auto fresh = fresh_store.Cache(16);
  fresh->Pull(keys.data(), keys.size(), nullptr, true, nullptr);
  HostBatch fresh_batch(*fresh, keys.data(), keys.size(), fresh_store.opt);
  fresh_batch.Accumulate(at.data(), 4, grads_compact.data());
  fresh_batch.Apply();
  std::vector<float> after_compact(after_wide.size());
  fresh_batch.Rows(all.data(), 3, after_compact.data());
  EXPECT_EQ(after_wide, after_compact);
  twin_batch.Release();

  // Rows that do not fit the layout are refused, naming the layout.
  try {
    batch.Get(at.data(), 3, wide.data(), RowLayout{2, 5});
    FAIL() << "3 rows in groups of 2 were accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("3 rows do not fit groups of 2 rows of 2 floats every 5 floats"),
              std::string::npos) << e.what();
  }
  EXPECT_THROW(batch.Accumulate(at.data(), 4, grads_wide.data(), RowLayout{2, 3}), std::invalid_argument);
}

// Keys 11, 12, 13 pinned in MEM-PS (AdaGrad rows of dim 6) and a host batch
// of them given a gradient of 0.25 a float at positions `at`, but the floats
// `set` (index into the gradients, value): Apply must refuse the batch with
// `message`, before any pinned row steps, and the batch release as one that
// never stepped.
void ExpectHostBatchApplyRefused(const std::vector<int64_t>& at, const std::vector<std::pair<size_t, float>>& set,
                                 const char* message) {
  RowStore store(AdaGrad(6));
  const SparseOptimizer& opt = store.opt;
  const int32_t width = opt.row_floats();
  auto cache = store.Cache(64);
  std::vector<uint64_t> keys = {11, 12, 13};
  cache->Pull(keys.data(), keys.size(), nullptr, /*pin=*/true, nullptr);
  HostBatch batch(*cache, keys.data(), keys.size(), opt);
  std::vector<float> before(keys.size() * width), after(keys.size() * width);
  const std::vector<int64_t> all = {0, 1, 2};
  batch.Rows(all.data(), all.size(), before.data());
  std::vector<float> g(at.size() * 6, 0.25f);
  for (const auto& [i, v] : set) g[i] = v;
  batch.Accumulate(at.data(), at.size(), g.data());
  try {
    batch.Apply();
    ADD_FAILURE() << "a batch that should be refused was stepped";
  } catch (const DivergedError& e) {
    EXPECT_STREQ(e.what(), message);
  }
  batch.Rows(all.data(), all.size(), after.data());
  EXPECT_EQ(after, before);
  EXPECT_TRUE(batch.UpdatedKeys().empty());
  batch.Release();
  EXPECT_EQ(cache->stats().pinned, 0u);
}

// A key's gradients that overflow in their sum (or a NaN pushed) made its
// MEM-PS row -inf or NaN. The step refuses them now, naming the key.
TEST(HostBatch, ASumThatIsNotFiniteIsRefusedNamingTheKeyAndNoRowSteps) {
  // Key 13's last float (past the groups of four) twice: -inf when summed.
  ExpectHostBatchApplyRefused({0, 2, 2}, {{6 + 5, -2e38f}, {12 + 5, -2e38f}},
                              "host batch apply: 1 non-finite value in the summed gradients of 1 key (key 13 first: "
                              "-inf): training diverged (a gradient pushed so, or finite ones whose sum overflowed); "
                              "no row was stepped");
}

// A key's finite gradient sum whose step overflows (AdaGrad's square of
// 1e20) made its MEM-PS row's sum of squares inf, after which the row never
// moved again. The step refuses it now, naming the key.
TEST(HostBatch, AStepThatWouldLeaveARowNotFiniteIsRefusedNamingTheKeyAndNoRowSteps) {
  // Key 13's last float: its square is inf.
  ExpectHostBatchApplyRefused({0, 2, 1}, {{6 + 5, -1e20f}},
                              "host batch apply: the step of 1 key would leave a value that is not finite in its row "
                              "(key 13 first: its AdaGrad sum of squared gradients, column 5, would be inf): training "
                              "diverged (a learning rate, or finite gradient sums, too large for float32); no row was "
                              "stepped");
}

TEST(HostBatch, TakesTheAddressesThatPinGave) {
  RowStore store(AdaGrad(2));
  auto cache = store.Cache(16);
  std::vector<uint64_t> keys = {4, 8, 15};
  cache->Pull(keys.data() + 1, 1, nullptr, /*pin=*/false, nullptr);  // 8 cached already: a hit
  std::vector<uint8_t> hit(3);
  std::vector<uint8_t*> addresses(3);
  EXPECT_EQ(cache->Pin(keys.data(), 3, hit.data(), addresses.data()), 1u);
  EXPECT_EQ(hit, (std::vector<uint8_t>{0, 1, 0}));
  std::vector<uint8_t*> again(3);
  cache->PinnedRows(keys.data(), 3, again.data());
  EXPECT_EQ(addresses, again);
  // An address that does not hold the key's row is refused, and nothing is unpinned.
  std::vector<uint8_t*> swapped = {addresses[1], addresses[0], addresses[2]};
  std::vector<uint8_t> none(3, 0);
  EXPECT_THROW(cache->UnpinUpdated(keys.data(), 3, none.data(), swapped.data()), std::invalid_argument);
  std::vector<uint8_t*> outside = {addresses[0], addresses[1], addresses[2] + 1};
  EXPECT_THROW(cache->UnpinUpdated(keys.data(), 3, none.data(), outside.data()), std::invalid_argument);
  EXPECT_EQ(cache->stats().pinned, 3u);
  HostBatch batch(*cache, keys.data(), 3, addresses.data(), store.opt);
  std::vector<int64_t> at = {2, 0};
  std::vector<float> emb(4), want(2 * store.opt.row_floats());
  batch.Get(at.data(), 2, emb.data());
  std::vector<uint64_t> which = {15, 4};
  store.opt.initial_rows(which.data(), 2, want.data());
  EXPECT_EQ(emb[0], want[0]);
  EXPECT_EQ(emb[3], want[store.opt.row_floats() + 1]);
  std::vector<uint64_t> probe = {15};
  std::vector<int64_t> pos(1);
  batch.Positions(probe.data(), 1, pos.data());  // builds the index now
  EXPECT_EQ(pos[0], 2);
  batch.Release();
  EXPECT_EQ(cache->stats().pinned, 0u);

  // A repeated key given with addresses is refused when the index is built.
  std::vector<uint64_t> twice = {4, 4};
  cache->Pin(twice.data(), 2, nullptr, addresses.data());
  HostBatch repeated(*cache, twice.data(), 2, addresses.data(), store.opt);
  EXPECT_THROW(repeated.Positions(probe.data(), 0, pos.data()), std::invalid_argument);
}

TEST(HostBatch, ErrorsNameTheKeyOrPosition) {
  RowStore store(AdaGrad(2));
  auto cache = store.Cache(16);
  std::vector<uint64_t> keys = {1, 2};
  EXPECT_THROW(HostBatch(*cache, keys.data(), 2, store.opt), std::invalid_argument);  // not pinned
  cache->Pull(keys.data(), 2, nullptr, true, nullptr);
  std::vector<uint64_t> twice = {1, 1};
  try {
    HostBatch repeated(*cache, twice.data(), 2, store.opt);
    FAIL() << "a repeated key was accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("keys[1] = 1 repeats"), std::string::npos) << e.what();
  }
  SparseOptimizer wide = AdaGrad(3);
  EXPECT_THROW(HostBatch(*cache, keys.data(), 2, wide), std::invalid_argument);  // row width
  HostBatch batch(*cache, keys.data(), 2, store.opt);
  std::vector<uint64_t> absent = {2, 9};
  std::vector<int64_t> at(2);
  try {
    batch.Positions(absent.data(), 2, at.data());
    FAIL() << "an absent key was found";
  } catch (const std::out_of_range& e) {
    EXPECT_NE(std::string(e.what()).find("keys[1] = 9 is not in the batch"), std::string::npos) << e.what();
  }
  std::vector<int64_t> bad = {0, 2};
  std::vector<float> out(4);
  EXPECT_THROW(batch.Get(bad.data(), 2, out.data()), std::out_of_range);
  EXPECT_THROW(batch.Accumulate(bad.data(), 2, out.data()), std::out_of_range);
  // The first position outside the batch is named, a negative one too.
  std::vector<int64_t> many(40, 1);
  many[17] = -3;
  many[29] = 2;
  std::vector<float> rows(many.size() * 2);
  for (const bool get : {true, false}) {
    try {
      if (get) {
        batch.Get(many.data(), many.size(), rows.data());
      } else {
        batch.Accumulate(many.data(), many.size(), rows.data());
      }
      FAIL() << "a negative position was accepted";
    } catch (const std::out_of_range& e) {
      EXPECT_NE(std::string(e.what()).find("positions[17] = -3 is outside [0, 2)"), std::string::npos) << e.what();
    }
  }
}

// Steps the first three keys of `batch` by 0.5 each.
void StepFirstThree(HostBatch& batch) {
  std::vector<int64_t> at = {0, 1, 2};
  std::vector<float> g(6, 0.5f);
  batch.Accumulate(at.data(), 3, g.data());
  batch.Apply();
}

// A host batch of keys 1, 2 and 3, each stepped, whose pin of key 2 something
// else took (unpinned behind its back).
std::unique_ptr<HostBatch> SteppedBatchWithKey2UnpinnedElsewhere(const RowStore& store, MemCache& cache) {
  std::vector<uint64_t> keys = {1, 2, 3};
  cache.Pull(keys.data(), keys.size(), nullptr, true, nullptr);
  auto batch = std::make_unique<HostBatch>(cache, keys.data(), keys.size(), store.opt);
  StepFirstThree(*batch);
  const uint64_t stolen = 2;
  cache.Unpin(&stolen, 1);
  return batch;
}

// Something else unpinned one of a batch's keys: Release still releases the
// others (the updated ones dirty), then says which key it could not release;
// the cache counts the failure.
TEST(HostBatch, ReleaseOfAKeyUnpinnedBehindItsBackReleasesTheRestAndThrows) {
  RowStore store(AdaGrad(2));
  auto cache = store.Cache(16);
  auto batch = SteppedBatchWithKey2UnpinnedElsewhere(store, *cache);
  try {
    batch->Release();
    FAIL() << "a release that could not unpin key 2 succeeded";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("1 of 3 keys were no longer pinned by this batch (keys[1] = 2 (updated))"),
              std::string::npos)
        << e.what();
  }
  const MemCacheStats st = cache->stats();
  EXPECT_EQ(st.pinned, 0u);
  EXPECT_EQ(st.dirty, 3u);  // keys 1 and 3, and key 2's step, kept
  EXPECT_EQ(st.failed_releases, 1u);
  batch->Release();  // released: nothing more to do, nothing counted
  EXPECT_EQ(cache->stats().failed_releases, 1u);
}

// The same, with key 2's row evicted between the foreign unpin and the
// release: its step left with the row (clean until the release could mark
// it), and the error names it lost.
TEST(HostBatch, AStepWhoseRowWasEvictedBeforeTheReleaseIsNamedLost) {
  RowStore store(AdaGrad(2));
  auto cache = store.Cache(16);
  auto batch = SteppedBatchWithKey2UnpinnedElsewhere(store, *cache);
  for (uint64_t other = 100; other < 164; ++other) cache->Pull(&other, 1, nullptr, /*pin=*/false, nullptr);
  ASSERT_FALSE(cache->Contains(2));
  try {
    batch->Release();
    FAIL() << "a release that could not unpin key 2 succeeded";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("the steps of keys[1] = 2 are lost"), std::string::npos) << e.what();
  }
  EXPECT_EQ(cache->stats().pinned, 0u);
}

// What the release of `batch` said refusing it; a failure saying `if_passed`
// (and "") if it passed.
std::string ReleaseRefusal(HostBatch& batch, const std::string& if_passed) {
  try {
    batch.Release();
  } catch (const std::runtime_error& e) {
    return e.what();
  }
  ADD_FAILURE() << if_passed;
  return "";
}

// Something else unpins key 2 during the release's own UnpinUpdated, past
// its check that the keys are pinned (PinBreakingCache): the release names
// it and keeps its step, and releases nothing twice (the next batch's pins
// on keys 1 and 3 stay).
TEST(HostBatch, AKeyUnpinnedDuringTheReleaseIsNamedAndItsStepKept) {
  RowStore store(AdaGrad(2));
  PinBreakingCache cache(store.Cache(16));
  const std::vector<uint64_t> keys = {1, 2, 3}, next = {1, 3};
  cache.Pull(keys.data(), keys.size(), nullptr, true, nullptr);
  {
    HostBatch batch(cache, keys.data(), keys.size(), store.opt);
    StepFirstThree(batch);
    cache.Pull(next.data(), next.size(), nullptr, true, nullptr);
    cache.victim = 2;
    const std::string error = ReleaseRefusal(batch, "a release that met key 2 unpinned during it succeeded");
    EXPECT_NE(error.find("1 of 3 keys were no longer pinned by this batch (keys[1] = 2 (updated))"), std::string::npos)
        << error;
    EXPECT_NE(error.find("the updated ones' steps were kept"), std::string::npos) << error;
    EXPECT_EQ(cache.victim, kEmptyKey) << "the foreign unpin did not happen";
    EXPECT_EQ(cache.stats().dirty, 3u);  // keys 1 and 3, and key 2's step, kept
  }  // the destructor has nothing left to release
  const MemCacheStats st = cache.stats();
  EXPECT_EQ(st.pinned, 2u);  // the next batch's
  EXPECT_EQ(st.failed_releases, 1u);
}

// A release that meets a key something else unpinned (before it: the keys
// go one by one; or during its call: PinBreakingCache) and runs out of
// memory is retried as its owner would retry it: every allocation of the
// first attempt is failed in turn (the cache's releases' own are not: its
// tests fail those). The retry releases what the first left pinned and no
// key twice (the next batch's pins stay), keeps every step (dirty), names
// the key, and each failed attempt is counted.
TEST(HostBatch, AReleaseThatMeetsAnUnpinnedKeyAndRunsOutOfMemoryIsFinishedByItsRetry) {
  for (bool during : {false, true}) {
    SCOPED_TRACE(during ? "unpinned during the release" : "unpinned before the release");
    ForEveryAllocation([&](uint64_t k) {
      RowStore store(AdaGrad(2));
      auto breaking = std::make_unique<PinBreakingCache>(store.Cache(16));
      PinBreakingCache& pin_breaker = *breaking;
      UncountedReleaseCache cache(std::move(breaking));
      const std::vector<uint64_t> keys = {1, 2, 3, 4, 5}, next = {1, 3, 4, 5};
      cache.Pull(keys.data(), keys.size(), nullptr, true, nullptr);
      HostBatch batch(cache, keys.data(), keys.size(), store.opt);
      StepFirstThree(batch);
      if (during) {
        pin_breaker.victim = 2;
      } else {
        const uint64_t stolen = 2;
        cache.Unpin(&stolen, 1, nullptr);
      }
      cache.Pull(next.data(), next.size(), nullptr, true, nullptr);  // the next batch's pins

      const std::string named = "1 of 5 keys were no longer pinned by this batch (keys[1] = 2 (updated))";
      const FailingAllocationCall first = CallFailingAllocation(k, [&] { batch.Release(); });
      if (!first.ran_out && !first.refused) ADD_FAILURE() << "a release that met key 2 unpinned passed";
      if (first.refused) {
        EXPECT_NE(first.error.find(named), std::string::npos) << first.error;
      }
      if (first.ran_out) {
        const std::string error = ReleaseRefusal(batch, "a retried release that met key 2 unpinned passed");
        EXPECT_NE(error.find(named), std::string::npos) << error;
      }
      EXPECT_EQ(pin_breaker.victim, kEmptyKey) << "the foreign unpin did not happen";
      const MemCacheStats st = cache.stats();
      EXPECT_EQ(st.failed_releases, first.ran_out ? 2u : 1u);
      EXPECT_EQ(st.pinned, next.size()) << "the next batch's pins";
      EXPECT_EQ(st.dirty, 3u);  // keys 1 to 3's steps, kept
      EXPECT_NO_THROW(cache.Unpin(next.data(), next.size(), nullptr));
      EXPECT_EQ(cache.stats().pinned, 0u) << "a pin of the batch left behind";
      return first;
    });
  }
}

// MEM-PS whose one-key UnpinUpdated of `failing` fails once with bad_alloc
// (having released nothing, as MemCache's contract says); everything else is
// the real cache's.
class OneKeyUnpinFailingCache final : public test_support::ForwardingCache {
 public:
  using ForwardingCache::ForwardingCache;
  uint64_t failing = kEmptyKey;  // reset once met

  void UnpinUpdated(const uint64_t* k, uint64_t n, const uint8_t* updated, uint8_t* const* at) override {
    if (n == 1 && k[0] == failing) {
      failing = kEmptyKey;
      throw std::bad_alloc();
    }
    ForwardingCache::UnpinUpdated(k, n, updated, at);
  }
};

// A release stopped midway by a failure (the keys going one by one, some
// released already) leaves a batch whose rows are no longer all its own: no
// call but Release reads or steps them, and the retry finishes the release.
TEST(HostBatch, ABatchWhoseReleaseStoppedMidwayRefusesEveryCallButRelease) {
  RowStore store(AdaGrad(2));
  OneKeyUnpinFailingCache cache(store.Cache(16));
  const std::vector<uint64_t> keys = {1, 2, 3, 4};
  cache.Pull(keys.data(), keys.size(), nullptr, true, nullptr);
  HostBatch batch(cache, keys.data(), keys.size(), store.opt);
  const uint64_t stolen = 2;
  cache.Unpin(&stolen, 1, nullptr);  // the keys go one by one
  cache.failing = 4;                 // after keys 1 and 3 are released
  EXPECT_THROW(batch.Release(), std::bad_alloc);
  EXPECT_EQ(cache.failing, kEmptyKey);
  const std::vector<int64_t> at = {0};
  std::vector<float> emb(2);
  std::vector<float> g(2, 0.5f);
  EXPECT_THROW(batch.Get(at.data(), 1, emb.data()), std::logic_error);
  EXPECT_THROW(batch.Accumulate(at.data(), 1, g.data()), std::logic_error);
  EXPECT_THROW(batch.Apply(), std::logic_error);
  const std::string error = ReleaseRefusal(batch, "a retried release of a key no longer pinned passed");
  EXPECT_NE(error.find("1 of 4 keys were no longer pinned by this batch (keys[1] = 2)"), std::string::npos) << error;
  EXPECT_EQ(cache.stats().pinned, 0u);
  EXPECT_EQ(cache.stats().failed_releases, 2u);
}

// A batch dropped unreleased is released by its destructor, which cannot
// throw: a failure shows in the cache's stats and on stderr, and the keys it
// could release are released.
TEST(HostBatch, DestructorThatCannotReleaseAKeySaysSo) {
  RowStore store(AdaGrad(2));
  auto cache = store.Cache(16);
  std::vector<uint64_t> keys = {1, 2, 3};
  cache->Pull(keys.data(), keys.size(), nullptr, true, nullptr);
  testing::internal::CaptureStderr();
  {
    HostBatch batch(*cache, keys.data(), keys.size(), store.opt);
    const uint64_t stolen = 3;
    cache->Unpin(&stolen, 1);
  }
  const std::string err = testing::internal::GetCapturedStderr();
  EXPECT_NE(err.find("a host batch of 3 keys released by its destructor: host batch release: 1 of 3 keys"),
            std::string::npos)
      << err;
  const MemCacheStats st = cache->stats();
  EXPECT_EQ(st.pinned, 0u);
  EXPECT_EQ(st.failed_releases, 1u);
  // A batch released cleanly counts nothing.
  cache->Pull(keys.data(), keys.size(), nullptr, true, nullptr);
  { HostBatch batch(*cache, keys.data(), keys.size(), store.opt); }
  EXPECT_EQ(cache->stats().pinned, 0u);
  EXPECT_EQ(cache->stats().failed_releases, 1u);
}

// One thread steps a batch's pinned rows while another pins, loads and evicts
// other keys of the same shards (run under TSan): only the pins are shared.
TEST(HostBatch, ApplyRacesNothingWithOtherPins) {
  RowStore store(AdaGrad(4));
  auto cache = store.Cache(96);
  std::vector<uint64_t> mine(32);
  for (uint64_t i = 0; i < mine.size(); ++i) mine[i] = i;
  cache->Pull(mine.data(), mine.size(), nullptr, true, nullptr);
  std::thread other([&] {
    for (uint64_t round = 0; round < 200; ++round) {
      std::vector<uint64_t> keys;
      for (uint64_t j = 0; j < 16; ++j) keys.push_back(1000 + (round * 7 + j * 13) % 300);
      std::sort(keys.begin(), keys.end());
      keys.erase(std::unique(keys.begin(), keys.end()), keys.end());
      std::vector<uint8_t> rows(keys.size() * cache->row_bytes());
      cache->Pull(keys.data(), keys.size(), rows.data(), true, nullptr);
      std::vector<uint8_t> updated(keys.size(), 1);
      cache->UnpinUpdated(keys.data(), keys.size(), updated.data(), nullptr);
    }
  });
  std::vector<float> g(mine.size() * 4, 0.5f);
  std::vector<int64_t> at(mine.size());
  for (int step = 0; step < 200; ++step) {
    cache->Pull(mine.data(), mine.size(), nullptr, true, nullptr);  // the next batch's pins
    HostBatch batch(*cache, mine.data(), mine.size(), store.opt);
    batch.Positions(mine.data(), mine.size(), at.data());
    batch.Accumulate(at.data(), at.size(), g.data());
    batch.Apply();
    batch.Release();
  }
  other.join();
  cache->Unpin(mine.data(), mine.size());
  EXPECT_EQ(cache->stats().pinned, 0u);
  // 200 AdaGrad steps of g = 0.5 on every key of `mine`.
  auto table = NewHashTable({64, store.opt.row_floats(), 1, -1});
  for (int step = 0; step < 200; ++step) table->apply_gradients(mine.data(), mine.size(), g.data(), store.opt);
  std::vector<float> want(mine.size() * store.opt.row_floats()), got(want.size());
  table->find(mine.data(), mine.size(), want.data(), nullptr);
  cache->Pull(mine.data(), mine.size(), reinterpret_cast<uint8_t*>(got.data()), false, nullptr);
  EXPECT_EQ(got, want);
}

TEST(DeviceTier, StagingRowsAreKeptAcrossLoadsAndGrowWhenAsked) {
  SparseOptimizer opt;
  opt.dim = 2;
  auto tier = DeviceTier::New({2, 64, opt, /*use_cuda=*/false, /*threads=*/1, nullptr, {}});
  float* a = tier->StagingRows(100);
  for (int i = 0; i < 100; ++i) a[i] = static_cast<float>(i);  // (ASan: all 100 are the buffer's)
  EXPECT_EQ(tier->StagingRows(50), a);  // reused, not reallocated
  float* b = tier->StagingRows(1000);
  for (int i = 0; i < 1000; ++i) b[i] = 1.0f;
  EXPECT_EQ(tier->StagingRows(1000), b);
}

}  // namespace
}  // namespace hps
