// The first layer run beside a batch's gather and accumulate: the vector
// kernels against the plain loops (blocks whose rows and columns are not
// multiples of the kernels' tiles), and HostBatch's GetProjected and
// AccumulateProjected against Get, the product and Accumulate.
#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <vector>

#include "hps/device_tier.h"
#include "hps/mem_cache.h"
#include "ps/first_layer.h"
#include "row_store.h"

namespace hps {
namespace {

std::vector<float> Random(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::vector<float> v(n);
  for (float& x : v) x = u(rng);
  return v;
}

void ExpectNear(const std::vector<float>& got, const std::vector<float>& want, const char* what) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i) ASSERT_NEAR(got[i], want[i], 1e-4f) << what << " float " << i;
}

TEST(FirstLayer, KernelsEqualThePlainLoops) {
  for (uint64_t outputs : {16u, 8u, 5u}) {
    for (uint64_t rows : {1u, 2u, 7u, 33u}) {
      const uint64_t inputs = 45, stride = 47, columns = 40;  // columns: a block of 32 and 8 more
      const std::vector<float> x = Random(rows * stride, 1), weight = Random(outputs * inputs, 2),
                               bias = Random(outputs, 3), grad = Random(rows * outputs, 4);
      std::vector<float> weight_t(inputs * outputs);
      for (uint64_t j = 0; j < outputs; ++j)
        for (uint64_t k = 0; k < inputs; ++k) weight_t[k * outputs + j] = weight[j * inputs + k];
      std::vector<float> got(rows * outputs), want(rows * outputs);
      detail::ProjectRows(x.data(), rows, inputs, stride, weight_t.data(), outputs, bias.data(), got.data());
      detail::ProjectRowsPlain(x.data(), rows, inputs, stride, weight_t.data(), outputs, bias.data(), want.data());
      ExpectNear(got, want, "forward");
      std::vector<double> exact(outputs);  // the plain loop against the sum itself, for one row
      for (uint64_t j = 0; j < outputs; ++j) {
        double s = bias[j];
        for (uint64_t k = 0; k < inputs; ++k) s += double{x[k]} * weight[j * inputs + k];
        EXPECT_NEAR(want[j], s, 1e-4) << "output " << j;
      }
      std::vector<float> back(rows * columns), back_want(rows * columns);
      detail::ProjectBack(grad.data(), rows, outputs, weight.data(), inputs, columns, back.data());
      detail::ProjectBackPlain(grad.data(), rows, outputs, weight.data(), inputs, columns, back_want.data());
      ExpectNear(back, back_want, "backward");
      double s = 0;
      for (uint64_t j = 0; j < outputs; ++j) s += double{grad[j]} * weight[j * inputs + columns - 1];
      EXPECT_NEAR(back_want[columns - 1], s, 1e-4);
    }
  }
  EXPECT_FALSE(detail::ProjectionIsFast(8));
}

SparseOptimizer Sgd(int32_t dim) {
  SparseOptimizer o;
  o.dim = dim;
  o.opt.kind = OptimizerKind::kSgd;
  o.opt.lr = 1.0f;
  o.init.seed = 9;
  return o;
}

TEST(FirstLayer, HostBatchProjectsBesideGetAndAccumulate) {
  const SparseOptimizer opt = Sgd(4);
  const uint64_t fields = 3, examples = 37, dense = 2, outputs = 16;
  const uint64_t inputs = fields * 4 + dense;
  std::vector<uint64_t> keys = {11, 12, 13, 14, 15, 16, 17};
  std::vector<float> outs[2], xs[2], steps[2];  // [fused]
  for (const bool fused : {true, false}) {
    test_support::RowStore store(opt);
    auto cache = store.Cache(64);
    cache->Pull(keys.data(), keys.size(), nullptr, /*pin=*/true, nullptr);
    HostBatch batch(*cache, keys.data(), keys.size(), opt);
    std::vector<int64_t> positions(examples * fields);
    for (uint64_t i = 0; i < positions.size(); ++i) positions[i] = static_cast<int64_t>((i * 5 + i / 7) % keys.size());
    const std::vector<float> weight = Random(outputs * inputs, 5), bias = Random(outputs, 6),
                             grad = Random(examples * outputs, 7), dense_columns = Random(examples * dense, 8);
    std::vector<float> x(examples * inputs), out(examples * outputs);
    for (uint64_t e = 0; e < examples; ++e)
      for (uint64_t c = 0; c < dense; ++c) x[e * inputs + fields * 4 + c] = dense_columns[e * dense + c];
    const int64_t skip = 3;  // a frozen key's position: no gradient
    if (fused) {
      batch.GetProjected(positions.data(), positions.size(), x.data(), {fields, inputs}, weight.data(), outputs,
                         bias.data(), out.data());
      batch.AccumulateProjected(positions.data(), positions.size(), fields, grad.data(), weight.data(), outputs,
                                inputs, skip);
    } else {
      batch.Get(positions.data(), positions.size(), x.data(), {fields, inputs});
      for (uint64_t e = 0; e < examples; ++e) {
        for (uint64_t j = 0; j < outputs; ++j) {
          double s = bias[j];
          for (uint64_t k = 0; k < inputs; ++k) s += double{x[e * inputs + k]} * weight[j * inputs + k];
          out[e * outputs + j] = static_cast<float>(s);
        }
      }
      std::vector<float> rows(positions.size() * 4, 0.0f);
      for (uint64_t e = 0; e < examples; ++e) {
        for (uint64_t c = 0; c < fields * 4; ++c) {
          double s = 0;
          for (uint64_t j = 0; j < outputs; ++j) s += double{grad[e * outputs + j]} * weight[j * inputs + c];
          if (positions[e * fields + c / 4] != skip) rows[e * fields * 4 + c] = static_cast<float>(s);
        }
      }
      batch.Accumulate(positions.data(), positions.size(), rows.data());
    }
    batch.Apply();
    std::vector<int64_t> all(keys.size());
    for (uint64_t p = 0; p < keys.size(); ++p) all[p] = static_cast<int64_t>(p);
    std::vector<float> stepped(keys.size() * 4);
    batch.Rows(all.data(), all.size(), stepped.data());
    outs[fused] = out, xs[fused] = x, steps[fused] = stepped;
    if (fused) {  // (the reference steps the skipped key with a zero gradient: the same row under SGD)
      const std::vector<uint64_t> updated = batch.UpdatedKeys();
      EXPECT_EQ(std::count(updated.begin(), updated.end(), keys[skip]), 0) << "the skipped key was stepped";
      EXPECT_EQ(updated.size(), keys.size() - 1);
    }
    batch.Release();
  }
  ExpectNear(outs[1], outs[0], "out");
  ExpectNear(xs[1], xs[0], "x");
  ExpectNear(steps[1], steps[0], "stepped rows");
  // A weight narrower than the fields' columns is refused, naming the shapes.
  test_support::RowStore store(opt);
  auto cache = store.Cache(64);
  cache->Pull(keys.data(), keys.size(), nullptr, true, nullptr);
  HostBatch batch(*cache, keys.data(), keys.size(), opt);
  const std::vector<int64_t> positions = {0, 1, 2};
  const std::vector<float> grad(16), weight(16 * 8);
  EXPECT_THROW(batch.AccumulateProjected(positions.data(), 3, 3, grad.data(), weight.data(), 16, 8, -1),
               std::invalid_argument);
  batch.Release();
}

// On host partitions the device tier runs the same steps on its bound rows,
// counting the transfers as GetAt and AccumulateAt count them; before Bind it
// refuses.
TEST(FirstLayer, TheDeviceTierProjectsWhereItReadsInPlace) {
  const SparseOptimizer opt = Sgd(4);
  const uint64_t fields = 2, examples = 9, outputs = 16, inputs = fields * 4 + 1;
  const std::vector<uint64_t> keys = {21, 22, 23, 24, 25};
  std::vector<int64_t> positions(examples * fields);
  for (uint64_t i = 0; i < positions.size(); ++i) positions[i] = static_cast<int64_t>((i * 3) % keys.size());
  const std::vector<float> weight = Random(outputs * inputs, 11), bias = Random(outputs, 12),
                           grad = Random(examples * outputs, 13);
  std::vector<float> results[2];
  TransferMatrix counted[2];
  for (const bool projected : {true, false}) {
    test_support::RowStore store(opt);
    auto cache = store.Cache(64);
    auto tier = DeviceTier::New({2, 64, opt, /*use_cuda=*/false, /*threads=*/1, nullptr, {}});
    std::vector<float> rows(keys.size() * 4);
    cache->Pull(keys.data(), keys.size(), reinterpret_cast<uint8_t*>(rows.data()), false, nullptr);
    tier->Insert(keys.data(), keys.size(), rows.data(), nullptr);
    tier->Bind(keys.data(), keys.size(), nullptr);
    std::vector<float> x(examples * inputs, 0.5f), out(examples * outputs);
    if (projected) {
      tier->GetProjectedAt(1, positions.data(), positions.size(), x.data(), {fields, inputs}, weight.data(), outputs,
                           bias.data(), out.data());
      tier->AccumulateProjectedAt(1, positions.data(), positions.size(), fields, grad.data(), weight.data(),
                                  outputs, inputs, -1);
    } else {
      tier->GetAt(1, positions.data(), positions.size(), x.data(), {fields, inputs});
      std::vector<float> g(positions.size() * 4);
      detail::ProjectBackPlain(grad.data(), examples, outputs, weight.data(), inputs, fields * 4, g.data());
      tier->AccumulateAt(1, positions.data(), positions.size(), g.data(), {});
      std::vector<float> weight_t(inputs * outputs);
      for (uint64_t j = 0; j < outputs; ++j)
        for (uint64_t k = 0; k < inputs; ++k) weight_t[k * outputs + j] = weight[j * inputs + k];
      detail::ProjectRowsPlain(x.data(), examples, inputs, inputs, weight_t.data(), outputs, bias.data(), out.data());
    }
    std::vector<int64_t> stepped;
    tier->ApplyBound(&stepped);
    std::vector<int64_t> all = {0, 1, 2, 3, 4};
    std::vector<float> now(keys.size() * 4);
    tier->RowsAt(all.data(), all.size(), now.data());
    results[projected] = out;
    results[projected].insert(results[projected].end(), now.begin(), now.end());
    counted[projected] = tier->transfers();
  }
  ExpectNear(results[1], results[0], "out and stepped rows");
  EXPECT_EQ(counted[1].rows, counted[0].rows);
  uint64_t total = 0;
  for (uint64_t r : counted[1].rows) total += r;
  EXPECT_EQ(total, 2 * positions.size());  // each row to worker 1 and its gradient back
  auto unbound = DeviceTier::New({1, 64, opt, false, 1, nullptr, {}});
  std::vector<float> x(examples * inputs), out(examples * outputs);
  EXPECT_THROW(unbound->GetProjectedAt(0, positions.data(), positions.size(), x.data(), {fields, inputs},
                                      weight.data(), outputs, bias.data(), out.data()),
               std::logic_error);
}

}  // namespace
}  // namespace hps
