// The hash table's native API, meant to run under AddressSanitizer/UBSan and
// ThreadSanitizer (HPS_SANITIZE): every call below spans several threads.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <map>
#include <random>
#include <stdexcept>
#include <string>
#include <system_error>
#include <thread>
#include <utility>
#include <vector>

#include "hps/hash_table.h"
#include "hps/optimizer.h"
#include "table/table_kernels.h"  // HomeSlot

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
  // A table of SGD rows (dim floats) is of the sums' width: applied to itself
  // it took its lock shared, then exclusive, and hung.
  SparseOptimizer sgd;
  sgd.dim = 4;
  auto rows = Table(64, sgd.row_floats(), 1);
  try {
    rows->apply_summed_gradients(*rows, sgd);
    FAIL() << "a table's own rows were applied as its sums";
  } catch (const std::invalid_argument& e) {
    EXPECT_STREQ(e.what(), "apply_summed_gradients: sums must be another table");
  }
}

// Finite gradients of one key that overflow in their sum (or a NaN pushed)
// made its row -inf or NaN with no error. The step refuses the call now,
// naming the key, before any row changes; a finite sum of the same call too.
TEST(HashTable, ASumThatIsNotFiniteIsRefusedNamingTheKeyAndNoRowSteps) {
  SparseOptimizer opt;
  opt.dim = 5;  // a whole group of four floats and one more: both loops of the check
  opt.opt.kind = OptimizerKind::kAdaGrad;
  opt.opt.lr = 0.1f;
  // Past 4096 x 16 floats of sums the check runs in parts on two threads.
  for (const uint64_t n : {uint64_t{3}, kBatch}) {
    SCOPED_TRACE("n " + std::to_string(n));
    auto keys = RandomKeys(n, 1u << 30, 13);
    keys[0] = 77;  // 77's gradients overflow, the others' are fine
    keys[n - 1] = 77;
    std::vector<float> grads(opt.dim * n, 0.5f);
    for (int32_t j = 0; j < opt.dim; ++j) grads[j] = grads[(n - 1) * opt.dim + j] = 3e38f;
    auto table = Table(4 * n, opt.row_floats(), 2);
    std::vector<float> before(opt.dim * n), after(opt.dim * n);
    table->lookup_or_init(keys.data(), n, opt, before.data());
    try {
      table->apply_gradients(keys.data(), n, grads.data(), opt);
      ADD_FAILURE() << "a sum of inf was stepped";
    } catch (const DivergedError& e) {
      EXPECT_STREQ(e.what(), "apply_gradients: 5 non-finite values in the summed gradients of 1 key (key 77 first: "
                             "inf): training diverged (a gradient pushed so, or finite ones whose sum overflowed); "
                             "no row was stepped");
    }
    table->lookup_or_init(keys.data(), n, opt, after.data());
    EXPECT_EQ(before, after);

    // Summed in a table of their own: the last float of one row a NaN.
    auto sums = Table(4 * n, opt.dim, 2);
    grads[0] = grads[(n - 1) * opt.dim] = 0.5f;
    grads[opt.dim - 1] = grads[n * opt.dim - 1] = 0.5f;
    grads[opt.dim + opt.dim - 1] = std::nanf("");
    sums->accumulate(keys.data(), n, grads.data());
    EXPECT_THROW(sums->refuse_nonfinite("sums"), DivergedError);
    try {
      table->apply_summed_gradients(*sums, opt);
      ADD_FAILURE() << "a sum of inf was stepped";
    } catch (const DivergedError& e) {
      const std::string said = e.what();
      EXPECT_EQ(said.rfind("apply_summed_gradients: 4 non-finite values in the summed gradients of 2 keys (key ", 0),
                0u) << said;
    }
    table->lookup_or_init(keys.data(), n, opt, after.data());
    EXPECT_EQ(before, after);
  }
}

// A finite gradient sum can still step a row past float32's range: SGD's
// lr * g (lr 10, g 1e38: -inf), AdaGrad's and Adam's squares (g 1e20, 1e30: a
// sum of squares or second moment of inf, after which the row never moves
// again). Such a row was stored, served and checkpointed with no error. The
// step refuses the call now, naming the key and the value, before any row
// changes; a key the table lacks is not claimed either.
TEST(HashTable, AStepThatWouldLeaveARowNotFiniteIsRefusedNamingTheKeyAndNoRowSteps) {
  struct Case {
    OptimizerKind kind;
    float lr, g;
    const char* said;
  };
  const Case cases[] = {
      {OptimizerKind::kSgd, 10.0f, 1e38f, "its embedding, column 2, would be -inf"},
      {OptimizerKind::kAdaGrad, 0.1f, 1e20f, "its AdaGrad sum of squared gradients, column 2, would be inf"},
      {OptimizerKind::kRowWiseAdaGrad, 0.1f, 1e20f, "its row-wise AdaGrad sum of squared gradients would be inf"},
      {OptimizerKind::kAdam, 0.1f, 1e30f, "its Adam second moment, column 2, would be inf"},
  };
  const std::string tail = "): training diverged (a learning rate, or finite gradient sums, too large for float32); "
                           "no row was stepped";
  for (const Case& c : cases) {
    SparseOptimizer opt;
    opt.dim = 5;
    opt.opt.kind = c.kind;
    opt.opt.lr = c.lr;
    const int32_t width = opt.row_floats();
    // Past 4096 x 16 floats of sums the check runs in parts on two threads.
    for (const uint64_t n : {uint64_t{3}, kBatch}) {
      SCOPED_TRACE(ToString(c.kind) + ", n " + std::to_string(n));
      auto keys = RandomKeys(n, 1u << 30, 17);
      keys[0] = 77;  // 77's step overflows, the others' are fine
      std::vector<float> grads(opt.dim * n, 0.5f);
      grads[2] = c.g;
      auto table = Table(4 * n, width, 2);
      std::vector<float> emb(opt.dim * n), before(width * n), after(width * n);
      table->lookup_or_init(keys.data(), n, opt, emb.data());
      table->find(keys.data(), n, before.data(), nullptr);
      const uint64_t size = table->size();
      try {
        table->apply_gradients(keys.data(), n, grads.data(), opt);
        ADD_FAILURE() << "a step to a value that is not finite was taken";
      } catch (const DivergedError& e) {
        EXPECT_EQ(std::string(e.what()), "apply_gradients: the step of 1 key would leave a value that is not finite "
                                         "in its row (key 77 first: " + std::string(c.said) + tail);
      }
      table->find(keys.data(), n, after.data(), nullptr);
      EXPECT_EQ(before, after);

      // Summed in a table of their own, and a key the table lacks (99: its step
      // from its initial row overflows too).
      keys[n - 1] = 99;
      std::copy(grads.begin(), grads.begin() + opt.dim, grads.end() - opt.dim);
      auto sums = Table(4 * n, opt.dim, 2);
      sums->accumulate(keys.data(), n, grads.data());
      try {
        table->apply_summed_gradients(*sums, opt);
        ADD_FAILURE() << "a step to a value that is not finite was taken";
      } catch (const DivergedError& e) {
        const std::string said = e.what();
        EXPECT_EQ(said.rfind("apply_summed_gradients: the step of 2 keys would leave a value that is not finite in "
                             "their rows (key ", 0), 0u) << said;
      }
      table->find(keys.data(), n - 1, after.data(), nullptr);
      EXPECT_EQ(std::vector<float>(before.begin(), before.end() - width),
                std::vector<float>(after.begin(), after.end() - width));
      EXPECT_EQ(table->size(), size);
      EXPECT_EQ(table->find(keys.data() + n - 1, 1, after.data(), nullptr), 0u);
    }
  }
}

// Every key's row, by key: the whole table, as export_rows gives it.
std::map<uint64_t, std::vector<float>> RowsByKey(const HashTable& table) {
  const uint64_t n = table.size();
  const auto width = static_cast<uint64_t>(table.row_floats());
  std::vector<uint64_t> keys(n);
  std::vector<float> rows(n * width);
  EXPECT_EQ(table.export_rows(keys.data(), rows.data(), n), n);
  std::map<uint64_t, std::vector<float>> by_key;
  for (uint64_t i = 0; i < n; ++i) by_key[keys[i]].assign(rows.begin() + i * width, rows.begin() + (i + 1) * width);
  return by_key;
}

// How many keys have another row in `b` than in `a`, or a row in one only.
uint64_t RowsChanged(const std::map<uint64_t, std::vector<float>>& a, const std::map<uint64_t, std::vector<float>>& b) {
  uint64_t changed = 0;
  for (const auto& [key, row] : a) {
    const auto it = b.find(key);
    changed += it == b.end() || it->second != row;
  }
  for (const auto& [key, row] : b) changed += a.count(key) == 0;
  return changed;
}

// A step claims a slot for each key the table lacks as it steps the keys.
// Where the table filled midway, the keys met before the full one kept their
// step (and their slots) and the rest had none, and the caller, told only that
// the table was full, could not tell which: a retry after making room stepped
// the first ones twice. The step is refused now with no row stepped and no
// slot claimed, and a retry in a table with room steps each key once.
TEST(HashTable, AStepThatFillsTheTableMidwayStepsNoRowAndClaimsNoSlot) {
  SparseOptimizer opt;
  opt.dim = 3;
  opt.opt.kind = OptimizerKind::kAdaGrad;
  opt.opt.lr = 0.1f;
  const int32_t width = opt.row_floats();
  // kBatch: past 4096 x 16 slots of sums, the step runs in parts on two threads.
  for (const uint64_t present : {uint64_t{3}, kBatch - 3}) {
    for (const int32_t threads : {1, 2}) {
      SCOPED_TRACE(std::to_string(present) + " keys present, " + std::to_string(threads) + " threads");
      auto table = Table(present, width, threads);
      const uint64_t free = table->capacity() - present;  // 5, or 3
      ASSERT_GT(free, 0u);
      const uint64_t lacking = free + 5;
      std::vector<uint64_t> keys(present + lacking);
      for (uint64_t i = 0; i < keys.size(); ++i) keys[i] = (i + 1) * 0x9E3779B97F4A7C15ULL;
      std::vector<float> emb(present * opt.dim);
      table->lookup_or_init(keys.data(), present, opt, emb.data());
      const auto before = RowsByKey(*table);
      std::vector<float> grads(keys.size() * opt.dim);
      for (uint64_t i = 0; i < grads.size(); ++i) grads[i] = 0.25f + static_cast<float>(i % 5);
      const std::string said = ": hash table full: the step needs a slot for each of " + std::to_string(lacking) +
                               " keys the table lacks, and " + std::to_string(free) + " are free (capacity " +
                               std::to_string(table->capacity()) + ", size " + std::to_string(present) +
                               "); no row was stepped";
      try {
        table->apply_gradients(keys.data(), keys.size(), grads.data(), opt);
        ADD_FAILURE() << "a step the table had no room for was taken";
      } catch (const TableFullError& e) {
        EXPECT_EQ(std::string(e.what()), "apply_gradients" + said);
      }
      EXPECT_EQ(table->size(), present);
      EXPECT_EQ(RowsChanged(before, RowsByKey(*table)), 0u);

      auto sums = Table(4 * keys.size(), opt.dim, threads);
      sums->accumulate(keys.data(), keys.size(), grads.data());
      try {
        table->apply_summed_gradients(*sums, opt);
        ADD_FAILURE() << "a step the table had no room for was taken";
      } catch (const TableFullError& e) {
        EXPECT_EQ(std::string(e.what()), "apply_summed_gradients" + said);
      }
      EXPECT_EQ(table->size(), present);
      EXPECT_EQ(RowsChanged(before, RowsByKey(*table)), 0u);

      // Room made (the rows moved to a larger table), the step again: each
      // key steps once, as in a table that had room from the start.
      auto larger = Table(2 * keys.size(), width, threads);
      auto roomy = Table(2 * keys.size(), width, threads);
      std::vector<uint64_t> held(present);
      std::vector<float> rows(present * width);
      ASSERT_EQ(table->export_rows(held.data(), rows.data(), present), present);
      larger->insert(held.data(), present, rows.data(), nullptr);
      roomy->lookup_or_init(keys.data(), present, opt, emb.data());
      larger->apply_gradients(keys.data(), keys.size(), grads.data(), opt);
      roomy->apply_gradients(keys.data(), keys.size(), grads.data(), opt);
      EXPECT_EQ(RowsChanged(RowsByKey(*roomy), RowsByKey(*larger)), 0u);
    }
  }
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

// ---- optimizer steps against their formulas, computed here in double ----

// One row's weights and state, stepped as include/hps/optimizer.h documents
// (torch.optim's Adagrad and Adam). eps is large in the cases below so that
// where it enters the denominator shows in the result.
struct ReferenceRow {
  std::vector<double> w, h, m, v;
  double rowwise_h = 0, t = 0;

  void Step(const SparseOptimizer& o, const std::vector<double>& g) {
    const auto& p = o.opt;
    const size_t dim = w.size();
    switch (p.kind) {
      case OptimizerKind::kSgd:
        for (size_t j = 0; j < dim; ++j) w[j] -= p.lr * g[j];
        break;
      case OptimizerKind::kAdaGrad:
        for (size_t j = 0; j < dim; ++j) {
          h[j] += g[j] * g[j];
          w[j] -= p.lr * g[j] / (std::sqrt(h[j]) + p.eps);
        }
        break;
      case OptimizerKind::kRowWiseAdaGrad: {
        double mean_sq = 0;
        for (double x : g) mean_sq += x * x / static_cast<double>(dim);
        rowwise_h += mean_sq;
        for (size_t j = 0; j < dim; ++j) w[j] -= p.lr * g[j] / (std::sqrt(rowwise_h) + p.eps);
        break;
      }
      case OptimizerKind::kAdam: {
        t += 1;
        const double b1 = p.beta1, b2 = p.beta2;
        for (size_t j = 0; j < dim; ++j) {
          m[j] = b1 * m[j] + (1 - b1) * g[j];
          v[j] = b2 * v[j] + (1 - b2) * g[j] * g[j];
          const double m_hat = m[j] / (1 - std::pow(b1, t));
          const double v_hat = v[j] / (1 - std::pow(b2, t));
          w[j] -= p.lr * m_hat / (std::sqrt(v_hat) + p.eps);
        }
        break;
      }
    }
  }

  // The row as the table stores it: [w | state].
  std::vector<double> Stored(OptimizerKind kind) const {
    std::vector<double> row = w;
    if (kind == OptimizerKind::kAdaGrad) row.insert(row.end(), h.begin(), h.end());
    if (kind == OptimizerKind::kRowWiseAdaGrad) row.push_back(rowwise_h);
    if (kind == OptimizerKind::kAdam) {
      row.insert(row.end(), m.begin(), m.end());
      row.insert(row.end(), v.begin(), v.end());
      row.push_back(t);
    }
    return row;
  }
};

SparseOptimizer Optimizer(OptimizerKind kind, float lr, float eps, float beta1 = 0.9f,
                          float beta2 = 0.999f) {
  SparseOptimizer o;
  o.dim = 3;
  o.opt.kind = kind;
  o.opt.lr = lr;
  o.opt.eps = eps;
  o.opt.beta1 = beta1;
  o.opt.beta2 = beta2;
  o.opt.initial_accumulator = 0.25f;
  o.init.kind = InitKind::kUniform;
  o.init.scale = 0.5f;
  o.init.seed = 17;
  return o;
}

class OptimizerStep : public ::testing::TestWithParam<SparseOptimizer> {};

// Keys 1 and 2 are stepped six times; key 3 is first seen by a push, which must
// start it from its initial row. Each push carries key 1 twice, whose gradients
// are summed before the step. Every float of each row, state included, is
// checked after every step.
TEST_P(OptimizerStep, MatchesTheFormulaStepByStep) {
  const SparseOptimizer opt = GetParam();
  const auto kind = opt.opt.kind;
  const size_t dim = static_cast<size_t>(opt.dim);
  auto table = Table(64, opt.row_floats(), 1);
  const std::vector<uint64_t> keys = {1, 2, 3};
  // initial_rows writes every float of a row, state included (NaN shows a gap).
  std::vector<float> init(keys.size() * opt.row_floats(), NAN);
  opt.initial_rows(keys.data(), keys.size(), init.data());
  std::map<uint64_t, ReferenceRow> ref;
  for (size_t i = 0; i < keys.size(); ++i) {
    ReferenceRow& r = ref[keys[i]];
    r.w.assign(init.begin() + i * opt.row_floats(), init.begin() + i * opt.row_floats() + dim);
    r.h.assign(dim, opt.opt.initial_accumulator);
    r.rowwise_h = opt.opt.initial_accumulator;
    r.m.assign(dim, 0.0);
    r.v.assign(dim, 0.0);
    const auto want = r.Stored(kind);
    for (size_t j = 0; j < want.size(); ++j) EXPECT_EQ(init[i * opt.row_floats() + j], want[j]) << j;
  }
  std::vector<float> pulled(2 * dim);
  table->lookup_or_init(keys.data(), 2, opt, pulled.data());
  for (int step = 0; step < 6; ++step) {
    const std::vector<uint64_t> pushed = step == 0 ? std::vector<uint64_t>{1, 2, 1}
                                                   : std::vector<uint64_t>{1, 2, 1, 3};
    std::vector<float> grads(pushed.size() * dim);
    for (size_t i = 0; i < grads.size(); ++i) {
      grads[i] = 0.3f * static_cast<float>((i * 7 + step * 3) % 11) - 1.5f;
    }
    table->apply_gradients(pushed.data(), pushed.size(), grads.data(), opt);
    std::map<uint64_t, std::vector<double>> summed;
    for (size_t i = 0; i < pushed.size(); ++i) {
      auto& g = summed[pushed[i]];
      g.resize(dim);
      for (size_t j = 0; j < dim; ++j) g[j] += grads[i * dim + j];
    }
    for (const auto& [key, g] : summed) ref[key].Step(opt, g);
    const uint64_t present = step == 0 ? 2 : 3;
    ASSERT_EQ(table->size(), present);
    std::vector<float> rows(present * opt.row_floats());
    ASSERT_EQ(table->find(keys.data(), present, rows.data(), nullptr), present);
    for (uint64_t i = 0; i < present; ++i) {
      const auto want = ref[keys[i]].Stored(kind);
      for (size_t j = 0; j < want.size(); ++j) {
        EXPECT_NEAR(rows[i * opt.row_floats() + j], want[j], 1e-5 + 1e-5 * std::abs(want[j]))
            << "step " << step << ", key " << keys[i] << ", column " << j;
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Kinds, OptimizerStep,
    ::testing::Values(Optimizer(OptimizerKind::kSgd, 0.1f, 0.0f),
                      Optimizer(OptimizerKind::kAdaGrad, 0.05f, 0.1f),
                      Optimizer(OptimizerKind::kRowWiseAdaGrad, 0.05f, 0.1f),
                      Optimizer(OptimizerKind::kAdam, 0.01f, 0.1f),
                      Optimizer(OptimizerKind::kAdam, 0.02f, 1e-3f, 0.0f, 0.99f),
                      Optimizer(OptimizerKind::kAdam, 0.01f, 1e-8f, 0.5f, 0.7f)),
    [](const auto& info) { return "case" + std::to_string(info.index); });

// Each bad setting is refused by name, and the edges of the documented ranges
// are accepted (Adam with beta1 = beta2 = 0 is the sign of the gradient). eps =
// 0 was an edge too: with v (or AdaGrad's h) still 0, a zero gradient stepped
// the row by 0 / 0, NaN for good; SGD, which does not read it, takes it.
TEST(Optimizer, ValidateRefusesEachBadSettingAndAcceptsTheEdges) {
  SparseOptimizer ok = Optimizer(OptimizerKind::kAdam, 0.01f, std::numeric_limits<float>::denorm_min(), 0.0f, 0.0f);
  ok.opt.initial_accumulator = 0.0f;
  EXPECT_NO_THROW(ok.validate());
  EXPECT_NO_THROW(Optimizer(OptimizerKind::kSgd, 0.01f, 0.0f).validate());
  const std::vector<std::pair<std::string, void (*)(SparseOptimizer&)>> bad = {
      {"dim must be > 0", [](SparseOptimizer& o) { o.dim = 0; }},
      {"lr must be a finite number > 0", [](SparseOptimizer& o) { o.opt.lr = 0.0f; }},
      {"lr must be a finite number > 0", [](SparseOptimizer& o) { o.opt.lr = INFINITY; }},
      {"eps must be a finite number > 0 (with eps = 0, adam can", [](SparseOptimizer& o) { o.opt.eps = 0.0f; }},
      {"eps must be a finite number > 0 (with eps = 0, adam can", [](SparseOptimizer& o) { o.opt.eps = -1e-8f; }},
      {"eps must be a finite number > 0 (with eps = 0, adam can", [](SparseOptimizer& o) { o.opt.eps = NAN; }},
      {"eps must be a finite number > 0 (with eps = 0, adagrad can", [](SparseOptimizer& o) {
         o.opt.kind = OptimizerKind::kAdaGrad;
         o.opt.eps = 0.0f;
       }},
      {"eps must be a finite number >= 0", [](SparseOptimizer& o) {
         o.opt.kind = OptimizerKind::kSgd;
         o.opt.eps = -1.0f;
       }},
      {"beta1 must be in [0, 1)", [](SparseOptimizer& o) { o.opt.beta1 = 1.0f; }},
      {"beta2 must be in [0, 1)", [](SparseOptimizer& o) { o.opt.beta2 = 1.0f; }},
      {"beta2 must be in [0, 1)", [](SparseOptimizer& o) { o.opt.beta2 = -0.1f; }},
      {"initial_accumulator must be", [](SparseOptimizer& o) { o.opt.initial_accumulator = -1.0f; }},
  };
  for (const auto& [message, spoil] : bad) {
    SparseOptimizer o = ok;
    spoil(o);
    try {
      o.validate();
      ADD_FAILURE() << "accepted a setting that should fail with: " << message;
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find(message), std::string::npos) << e.what();
    }
  }
}

// initial_embeddings is initial_rows' first dim floats, bit for bit, for every
// optimizer (state or none), initializer, seed and dim, at the edges of the key
// range too; and it writes dim floats a key, no more (the guard floats stay).
TEST(Optimizer, InitialEmbeddingsAreTheInitialRowsFirstDimFloats) {
  const std::vector<uint64_t> keys = {0, 1, 2, 0x8000000000000000ULL, kEmptyKey - 1, 0x9E3779B97F4A7C15ULL};
  const size_t n = keys.size();
  for (const auto kind : {OptimizerKind::kSgd, OptimizerKind::kAdaGrad, OptimizerKind::kRowWiseAdaGrad,
                          OptimizerKind::kAdam}) {
    for (const auto init : {InitKind::kZeros, InitKind::kUniform, InitKind::kNormal}) {
      for (const int32_t dim : {1, 3, 16, 33}) {
        for (const uint64_t seed : {uint64_t{0}, uint64_t{7}, kEmptyKey}) {
          SparseOptimizer o = Optimizer(kind, 0.05f, 1e-8f);
          o.dim = dim;
          o.init.kind = init;
          o.init.seed = seed;
          const size_t d = static_cast<size_t>(dim), stride = static_cast<size_t>(o.row_floats());
          std::vector<float> rows(n * stride, NAN);
          o.initial_rows(keys.data(), n, rows.data());
          std::vector<float> embeddings(n * d + 1, NAN);
          o.initial_embeddings(keys.data(), n, embeddings.data());
          for (size_t i = 0; i < n; ++i) {
            for (size_t j = 0; j < d; ++j) {
              // memcmp, not ==: the bits (a -0.0 or a NaN would compare otherwise).
              ASSERT_EQ(std::memcmp(&embeddings[i * d + j], &rows[i * stride + j], sizeof(float)), 0)
                  << ToString(kind) << " init " << static_cast<int>(init) << " dim " << dim << " seed " << seed
                  << " key " << keys[i] << " column " << j;
            }
          }
          EXPECT_TRUE(std::isnan(embeddings[n * d])) << "wrote past n x dim floats";
        }
      }
    }
  }
  SparseOptimizer bad = Optimizer(OptimizerKind::kSgd, 0.05f, 0.0f);
  bad.dim = 0;
  float out = 0.0f;
  EXPECT_THROW(bad.initial_embeddings(keys.data(), 1, &out), std::invalid_argument);
}

// ---- probing at the edges: a table of one bucket, filled ----

// With 8 slots every key's probe starts at slot 0, so the last key placed sits
// 7 steps from its home and the first one in slot 0.
TEST(HashTable, OneFullBucketFindsEveryKeyAndRefusesTheNinth) {
  auto table = Table(8, 1, 1);
  ASSERT_EQ(table->capacity(), 8u);
  std::vector<uint64_t> keys;
  std::vector<float> rows;
  for (uint64_t k = 0; k < 9; ++k) {
    keys.push_back(1000 + k);
    rows.push_back(static_cast<float>(k + 1));
  }
  std::vector<uint8_t> inserted(9, 7);
  try {
    table->insert(keys.data(), 9, rows.data(), inserted.data());
    FAIL() << "a ninth key fit in eight slots";
  } catch (const TableFullError& e) {
    EXPECT_NE(std::string(e.what()).find("1 key(s) found no free slot"), std::string::npos) << e.what();
  }
  EXPECT_EQ(table->size(), 8u);
  for (uint64_t i = 0; i < 8; ++i) EXPECT_EQ(inserted[i], 1) << i;
  EXPECT_EQ(inserted[8], 0);
  std::vector<float> out(9, -1.0f);
  std::vector<uint8_t> found(9, 7);
  EXPECT_EQ(table->find(keys.data(), 9, out.data(), found.data()), 8u);
  for (uint64_t i = 0; i < 8; ++i) {
    EXPECT_EQ(found[i], 1) << i;
    EXPECT_EQ(out[i], rows[i]) << i;
  }
  EXPECT_EQ(found[8], 0);
  EXPECT_EQ(out[8], 0.0f);
  std::vector<float> twice(rows.begin(), rows.end());
  for (float& x : twice) x *= 2;
  EXPECT_EQ(table->assign(keys.data(), 9, twice.data(), found.data()), 8u);
  EXPECT_EQ(found[0], 1);
  EXPECT_EQ(found[8], 0);
  table->find(keys.data(), 8, out.data(), nullptr);
  for (uint64_t i = 0; i < 8; ++i) EXPECT_EQ(out[i], twice[i]) << i;

  SparseOptimizer sgd;
  sgd.dim = 1;
  auto full = Table(8, 1, 1);
  std::vector<float> ones(9, 1.0f);
  EXPECT_THROW(full->apply_gradients(keys.data(), 9, ones.data(), sgd), TableFullError);
  EXPECT_EQ(full->size(), 0u);  // a step is all or nothing: the 8 keys that found slots are not kept either
}

// A probe that runs off the last slot goes on at slot 0: with the last of two
// buckets full, a ninth key homed there lands in the first bucket.
TEST(HashTable, AProbePastTheLastSlotWrapsToTheFirst) {
  auto table = Table(16, 1, 1);
  ASSERT_EQ(table->capacity(), 16u);
  std::vector<uint64_t> keys;
  for (uint64_t k = 1; keys.size() < 9; ++k) {
    if (detail::HomeSlot(k, 16) == 8) keys.push_back(k);
  }
  std::vector<float> rows(keys.begin(), keys.end());
  EXPECT_EQ(table->insert(keys.data(), keys.size(), rows.data(), nullptr), keys.size());
  std::vector<float> out(keys.size());
  std::vector<uint8_t> found(keys.size());
  EXPECT_EQ(table->find(keys.data(), keys.size(), out.data(), found.data()), keys.size());
  for (size_t i = 0; i < keys.size(); ++i) EXPECT_EQ(out[i], rows[i]) << i;
  std::vector<float> ones(keys.size(), 1.0f);
  table->accumulate(keys.data(), keys.size(), ones.data());
  EXPECT_EQ(table->size(), keys.size());
}

// export_rows writes no more than max_rows, also when the table holds more.
TEST(HashTable, ExportStopsAtMaxRows) {
  auto table = Table(3 * kBatch, 2, 2);
  const auto keys = RandomKeys(kBatch, 1u << 30, 21);
  std::vector<float> rows(2 * kBatch);
  for (uint64_t i = 0; i < kBatch; ++i) rows[2 * i] = rows[2 * i + 1] = static_cast<float>(keys[i] % 1000);
  table->insert(keys.data(), kBatch, rows.data(), nullptr);
  constexpr uint64_t kMax = 10, kSpare = 1000;
  std::vector<uint64_t> out_keys(kMax + kSpare, 0);
  std::vector<float> out_rows(2 * (kMax + kSpare), -1.0f);
  EXPECT_EQ(table->export_rows(out_keys.data(), out_rows.data(), kMax), kMax);
  for (uint64_t i = 0; i < kMax; ++i) {
    EXPECT_EQ(out_rows[2 * i], static_cast<float>(out_keys[i] % 1000)) << i;
  }
  for (uint64_t i = kMax; i < kMax + kSpare; ++i) ASSERT_EQ(out_keys[i], 0u) << i;
  for (uint64_t i = 2 * kMax; i < out_rows.size(); ++i) ASSERT_EQ(out_rows[i], -1.0f) << i;
}

// A clear of a mostly empty table (the branch that visits occupied slots only)
// leaves neither keys nor row values behind.
TEST(HashTable, ClearOfAMostlyEmptyTableZeroesItsRows) {
  auto table = Table(4 * kBatch, 4, 2);
  const std::vector<uint64_t> keys = {3, 5, 8, 13, 21};
  std::vector<float> ones(4 * keys.size(), 1.0f), out(4 * keys.size(), -1.0f);
  for (int round = 0; round < 2; ++round) {
    table->accumulate(keys.data(), keys.size(), ones.data());
    EXPECT_EQ(table->size(), keys.size());
    table->find(keys.data(), keys.size(), out.data(), nullptr);
    for (float v : out) EXPECT_EQ(v, 1.0f) << "round " << round;
    table->clear();
    EXPECT_EQ(table->size(), 0u);
    std::vector<uint8_t> found(keys.size(), 7);
    EXPECT_EQ(table->find(keys.data(), keys.size(), out.data(), found.data()), 0u);
    for (uint8_t f : found) EXPECT_EQ(f, 0);
  }
  // One key is enough to need clearing.
  table->accumulate(keys.data(), 1, ones.data());
  table->clear();
  EXPECT_EQ(table->size(), 0u);
  table->accumulate(keys.data(), 1, ones.data());
  table->find(keys.data(), 1, out.data(), nullptr);
  EXPECT_EQ(out[0], 1.0f);
}

// A key's slot (HashTable::slots) names it until clear, whatever joins the
// table after it, and keys_at reads it back: the device tier keeps its trained
// bits in an array indexed by these slots.
TEST(HashTable, SlotsNameEachKeyUntilClearAndKeysAtReadsThemBack) {
  auto table = Table(3 * kBatch, 2, 2);
  const auto keys = RandomKeys(kBatch, 1u << 30, 23);
  std::vector<float> rows(2 * kBatch, 1.0f);
  table->insert(keys.data(), kBatch / 2, rows.data(), nullptr);
  std::vector<int64_t> first(kBatch, -2);
  const uint64_t hits = table->slots(keys.data(), kBatch, first.data());
  std::vector<int64_t> present;
  for (uint64_t i = 0; i < kBatch; ++i) {
    if (first[i] >= 0) present.push_back(first[i]);
    ASSERT_LT(first[i], static_cast<int64_t>(table->capacity())) << i;
  }
  EXPECT_EQ(hits, present.size());
  EXPECT_EQ(hits, table->size());
  std::vector<float*> at(kBatch);
  std::vector<int64_t> with_rows(kBatch, -2);
  EXPECT_EQ(table->row_addresses(keys.data(), kBatch, at.data(), with_rows.data()), hits);
  EXPECT_EQ(with_rows, first);
  for (uint64_t i = 0; i < kBatch; ++i) ASSERT_EQ(at[i] == nullptr, first[i] < 0) << i;

  table->insert(keys.data(), kBatch, rows.data(), nullptr);  // the others join; the first keep their slots
  std::vector<int64_t> later(kBatch, -2);
  EXPECT_EQ(table->slots(keys.data(), kBatch, later.data()), table->size());
  std::vector<int64_t> all;
  for (uint64_t i = 0; i < kBatch; ++i) {
    ASSERT_GE(later[i], 0) << i;
    if (first[i] >= 0) {
      ASSERT_EQ(later[i], first[i]) << i;
    }
    all.push_back(later[i]);
  }
  std::vector<uint64_t> back(kBatch, 0);
  table->keys_at(all.data(), all.size(), back.data());
  EXPECT_EQ(back, keys);

  table->clear();
  EXPECT_EQ(table->slots(keys.data(), kBatch, later.data()), 0u);
  for (int64_t s : later) ASSERT_EQ(s, -1);
  table->keys_at(all.data(), 3, back.data());
  for (uint64_t i = 0; i < 3; ++i) EXPECT_EQ(back[i], kEmptyKey);

  for (const int64_t bad : {int64_t{-1}, static_cast<int64_t>(table->capacity())}) {
    try {
      table->keys_at(&bad, 1, back.data());
      ADD_FAILURE() << "keys_at took slot " << bad;
    } catch (const std::out_of_range& e) {
      EXPECT_NE(std::string(e.what()).find("slots[0] = " + std::to_string(bad)), std::string::npos) << e.what();
    }
  }
}

}  // namespace
}  // namespace hps
