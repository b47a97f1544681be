// The hash table's native API, meant to run under AddressSanitizer/UBSan and
// ThreadSanitizer (HPS_SANITIZE): every call below spans several threads.
#include <gtest/gtest.h>

#include <cstdint>
#include <map>
#include <random>
#include <stdexcept>
#include <system_error>
#include <thread>
#include <vector>

#include "hps/hash_table.h"
#include "hps/optimizer.h"

namespace hps {
namespace {

constexpr uint64_t kBatch = 20000;  // > 2 x 4096, so calls split across threads

std::vector<uint64_t> RandomKeys(uint64_t n, uint64_t universe, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<uint64_t> keys(n);
  for (auto& k : keys) k = (rng() % universe) * 0x9E3779B97F4A7C15ULL;
  return keys;
}

std::unique_ptr<HashTable> Table(uint64_t capacity, int32_t width, int32_t threads) {
  return NewHashTable({capacity, width, threads, -1});
}

TEST(HashTable, AccumulateMatchesMapOnTwoThreads) {
  auto table = Table(3 * kBatch, 2, 2);
  std::map<uint64_t, float> expected;
  for (uint64_t round = 0; round < 3; ++round) {
    const auto keys = RandomKeys(kBatch, kBatch, round);
    std::vector<float> deltas(2 * kBatch, 1.0f);
    table->accumulate(keys.data(), keys.size(), deltas.data());
    for (uint64_t k : keys) expected[k] += 1.0f;
  }
  ASSERT_EQ(table->size(), expected.size());
  std::vector<uint64_t> keys(table->size());
  std::vector<float> rows(2 * table->size());
  ASSERT_EQ(table->export_rows(keys.data(), rows.data(), keys.size()), keys.size());
  for (size_t i = 0; i < keys.size(); ++i) {
    EXPECT_EQ(rows[2 * i], expected.at(keys[i]));
    EXPECT_EQ(rows[2 * i + 1], expected.at(keys[i]));
  }
}

TEST(HashTable, FindColumnsCopiesTheFirstColumnsOfEachRow) {
  auto table = Table(2 * kBatch, 3, 2);
  const auto keys = RandomKeys(kBatch, 4 * kBatch, 11);  // mostly distinct
  std::vector<float> rows(3 * kBatch);
  for (uint64_t i = 0; i < rows.size(); ++i) rows[i] = static_cast<float>(i);
  table->insert(keys.data(), kBatch, rows.data(), nullptr);
  std::vector<uint64_t> asked(keys.begin(), keys.begin() + 100);
  asked.push_back(12345);  // absent: a zero row, found = 0
  std::vector<float> whole(3 * asked.size()), first(2 * asked.size(), -1.0f);
  std::vector<uint8_t> found(asked.size());
  const uint64_t hits = table->find(asked.data(), asked.size(), whole.data(), nullptr);
  EXPECT_EQ(table->find_columns(asked.data(), asked.size(), 2, first.data(), found.data()), hits);
  for (uint64_t i = 0; i < asked.size(); ++i) {
    EXPECT_EQ(first[2 * i], whole[3 * i]) << i;
    EXPECT_EQ(first[2 * i + 1], whole[3 * i + 1]) << i;
  }
  EXPECT_EQ(found.back(), 0);
  EXPECT_EQ(first[2 * 100], 0.0f);
  EXPECT_THROW(table->find_columns(asked.data(), 1, 0, first.data(), nullptr), std::invalid_argument);
  EXPECT_THROW(table->find_columns(asked.data(), 1, 4, first.data(), nullptr), std::invalid_argument);
}

TEST(HashTable, InsertKeepsFirstDuplicateAndFindCopiesRows) {
  auto table = Table(2 * kBatch, 1, 2);
  const auto keys = RandomKeys(kBatch, kBatch / 2, 7);
  std::vector<float> rows(kBatch);
  for (uint64_t i = 0; i < kBatch; ++i) rows[i] = static_cast<float>(i);
  std::vector<uint8_t> inserted(kBatch);
  const uint64_t count = table->insert(keys.data(), kBatch, rows.data(), inserted.data());
  std::map<uint64_t, float> first;
  for (uint64_t i = 0; i < kBatch; ++i) {
    const bool is_first = first.emplace(keys[i], rows[i]).second;
    EXPECT_EQ(inserted[i], is_first ? 1 : 0) << "at " << i;
  }
  EXPECT_EQ(count, first.size());
  std::vector<float> out(kBatch);
  std::vector<uint8_t> found(kBatch);
  EXPECT_EQ(table->find(keys.data(), kBatch, out.data(), found.data()), kBatch);
  for (uint64_t i = 0; i < kBatch; ++i) EXPECT_EQ(out[i], first.at(keys[i]));
}

TEST(HashTable, ConcurrentCallersOnSharedKeys) {
  auto table = Table(4 * kBatch, 4, 2);
  const auto keys = RandomKeys(kBatch, kBatch, 3);
  std::vector<float> ones(4 * kBatch, 1.0f);
  std::vector<std::thread> callers;
  for (int c = 0; c < 3; ++c) {
    callers.emplace_back([&, c] {
      std::vector<float> out(4 * kBatch);
      for (int r = 0; r < 3; ++r) {
        if (c == 2) {
          table->find(keys.data(), kBatch, out.data(), nullptr);
        } else {
          table->accumulate(keys.data(), kBatch, ones.data());
        }
      }
    });
  }
  for (auto& t : callers) t.join();
  std::map<uint64_t, float> count;
  for (uint64_t k : keys) count[k] += 6.0f;  // 2 accumulating callers x 3 rounds
  std::vector<float> out(4 * kBatch);
  table->find(keys.data(), kBatch, out.data(), nullptr);
  for (uint64_t i = 0; i < kBatch; ++i) ASSERT_EQ(out[4 * i], count.at(keys[i]));
}

TEST(HashTable, FullTableThrowsAndKeepsPlacedKeys) {
  auto table = Table(100, 1, 2);
  EXPECT_EQ(table->capacity(), 104u);  // whole buckets of 8 slots
  const auto keys = RandomKeys(kBatch, 1000000, 11);
  std::vector<float> rows(kBatch, 1.0f);
  EXPECT_THROW(table->insert(keys.data(), kBatch, rows.data(), nullptr), TableFullError);
  EXPECT_EQ(table->size(), 104u);
}

TEST(HashTable, RejectsTheEmptyKey) {
  auto table = Table(16, 1, 1);
  const uint64_t keys[2] = {1, kEmptyKey};
  const float rows[2] = {1, 2};
  EXPECT_THROW(table->insert(keys, 2, rows, nullptr), std::invalid_argument);
  EXPECT_EQ(table->size(), 0u);
}

// A capacity whose bytes overflow 64 bits mapped a wrapped size, and the first
// insert wrote past it (a SEGV from Python's hps.HashTable(2**62, 4)).
TEST(HashTable, RefusesACapacityWhoseBytesOverflow) {
  EXPECT_THROW(Table(uint64_t{1} << 62, 4, 1), std::invalid_argument);
  EXPECT_THROW(Table(UINT64_MAX, 1, 1), std::invalid_argument);
  EXPECT_THROW(Table(UINT64_MAX / 12, 1, 1), std::invalid_argument);  // 12 bytes a slot: the rounding's margin
  // Representable but larger than the machine: the mapping's own error.
  EXPECT_THROW(Table(uint64_t{1} << 50, 1, 1), std::system_error);
}

TEST(HashTable, OptimizerStepsOnDuplicates) {
  SparseOptimizer opt;
  opt.dim = 4;
  opt.opt.kind = OptimizerKind::kAdam;
  opt.opt.lr = 0.01f;
  auto table = Table(3 * kBatch, opt.row_floats(), 2);
  const auto keys = RandomKeys(kBatch, kBatch / 4, 5);
  std::vector<float> grads(4 * kBatch, 0.5f);
  std::vector<float> before(4 * kBatch), after(4 * kBatch);
  table->lookup_or_init(keys.data(), kBatch, opt, before.data());
  table->apply_gradients(keys.data(), kBatch, grads.data(), opt);
  table->lookup_or_init(keys.data(), kBatch, opt, after.data());
  // Adam's first step moves each weight by ~lr against the gradient's sign.
  for (uint64_t i = 0; i < 4 * kBatch; ++i) EXPECT_NEAR(before[i] - after[i], 0.01f, 1e-4f);
}

TEST(HashTable, SummedGradientsStepLikeRawOnes) {
  SparseOptimizer opt;
  opt.dim = 4;
  opt.opt.kind = OptimizerKind::kAdaGrad;
  opt.opt.lr = 0.1f;
  const auto keys = RandomKeys(kBatch, kBatch / 4, 7);
  std::vector<float> grads(4 * kBatch);
  for (uint64_t i = 0; i < grads.size(); ++i) grads[i] = static_cast<float>(i % 7) - 3.0f;
  auto raw = Table(3 * kBatch, opt.row_floats(), 2);
  raw->apply_gradients(keys.data(), kBatch, grads.data(), opt);
  auto summed = Table(3 * kBatch, opt.row_floats(), 2);
  auto sums = Table(3 * kBatch, opt.dim, 2);
  sums->accumulate(keys.data(), kBatch, grads.data());
  summed->apply_summed_gradients(*sums, opt);
  std::vector<float> want(opt.row_floats() * kBatch), got(opt.row_floats() * kBatch);
  raw->find(keys.data(), kBatch, want.data(), nullptr);
  summed->find(keys.data(), kBatch, got.data(), nullptr);
  // Both sum a key's gradients in a table first; the order of the adds may differ.
  for (uint64_t i = 0; i < want.size(); ++i) EXPECT_NEAR(got[i], want[i], 1e-5f) << i;
  auto wrong_width = Table(64, opt.row_floats(), 1);
  EXPECT_THROW(summed->apply_summed_gradients(*wrong_width, opt), std::invalid_argument);
}

TEST(HashTable, ClearZeroesRows) {
  auto table = Table(2 * kBatch, 2, 2);
  const auto keys = RandomKeys(kBatch, 1u << 30, 9);
  std::vector<float> ones(2 * kBatch, 1.0f), out(2 * kBatch);
  table->accumulate(keys.data(), kBatch, ones.data());
  table->clear();
  EXPECT_EQ(table->size(), 0u);
  table->accumulate(keys.data(), kBatch, ones.data());
  table->find(keys.data(), kBatch, out.data(), nullptr);
  for (float v : out) ASSERT_GE(v, 1.0f);
}

}  // namespace
}  // namespace hps
