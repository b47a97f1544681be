// The device tier under the sanitizers: a batch through two host partitions,
// against the same optimizer applied to one table, and the transfer matrix.
#include <gtest/gtest.h>

#include <algorithm>
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

TEST(DeviceTier, UniqueKeysKeepsFirstAppearance) {
  std::vector<uint64_t> keys = {9, 4, 9, 7, 4, 9};
  std::vector<int64_t> inverse(keys.size());
  EXPECT_EQ(UniqueKeys(keys.data(), keys.size(), inverse.data()), (std::vector<uint64_t>{9, 4, 7}));
  EXPECT_EQ(inverse, (std::vector<int64_t>{0, 1, 0, 2, 1, 0}));
  keys[2] = kEmptyKey;
  EXPECT_THROW(UniqueKeys(keys.data(), keys.size(), inverse.data()), std::invalid_argument);
}

}  // namespace
}  // namespace hps
