// The device tier under the sanitizers: a batch through two host partitions,
// against the same optimizer applied to one table, and the transfer matrix.
#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <vector>

#include "hps/device_tier.h"
#include "hps/hash_table.h"

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
  auto tier = DeviceTier::New({2, 64, opt, /*use_cuda=*/false, /*threads=*/1});
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

// One device reads and writes the caller's arrays in place (no partition copy).
TEST(DeviceTier, OneDeviceMatchesTheSameStepsOnTwo) {
  const SparseOptimizer opt = AdaGrad(4);
  const int32_t width = opt.row_floats();
  std::vector<uint64_t> keys = {11, 12, 13, 14, 15};
  std::vector<float> rows(keys.size() * width);
  opt.initial_rows(keys.data(), keys.size(), rows.data());
  std::vector<std::vector<float>> got_rows, got_emb;
  for (int32_t devices : {1, 2}) {
    auto tier = DeviceTier::New({devices, 64, opt, /*use_cuda=*/false, /*threads=*/1});
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
  auto one = DeviceTier::New({1, 64, opt, false, 1});
  int32_t owners[1] = {1};
  EXPECT_THROW(one->Insert(keys.data(), 1, rows.data(), owners), std::invalid_argument);
}

TEST(DeviceTier, AssignOverwritesOnlyLoadedKeys) {
  const SparseOptimizer opt = AdaGrad(2);
  const int32_t width = opt.row_floats();
  auto tier = DeviceTier::New({2, 64, opt, /*use_cuda=*/false, /*threads=*/1});
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

}  // namespace
}  // namespace hps
