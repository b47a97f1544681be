// The admission sketch (include/hps/admission.h): estimates against exact
// counts, admission at the f-th occurrence, saturation, restore, bad options.
#include "hps/admission.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <vector>

namespace {

// A Zipf-like stream: key k with probability ~ 1 / (k + 1).
std::vector<uint64_t> SkewedKeys(std::mt19937_64& rng, uint64_t n, uint64_t universe) {
  std::vector<uint64_t> keys(n);
  std::uniform_real_distribution<double> u(0.0, 1.0);
  for (auto& k : keys) k = static_cast<uint64_t>(std::exp(u(rng) * std::log(static_cast<double>(universe)))) - 1;
  return keys;
}

TEST(AdmissionSketch, EstimatesAreNeverBelowTheTrueCount) {
  // A small sketch (4 x 256 counters) against 5,000 distinct keys: many collisions.
  hps::AdmissionSketch s({.bytes = 1024, .rows = 4, .threshold = 3});
  std::mt19937_64 rng(7);
  std::unordered_map<uint64_t, uint32_t> truth;
  std::vector<uint8_t> admitted;
  for (int b = 0; b < 20; ++b) {
    const auto keys = SkewedKeys(rng, 500, 5000);
    admitted.resize(keys.size());
    s.Admit(keys.data(), keys.size(), admitted.data());
    for (uint64_t k : keys) ++truth[k];
    for (size_t i = 0; i < keys.size(); ++i) {
      EXPECT_EQ(admitted[i], s.Estimate(keys[i]) >= 3) << "batch " << b << " key " << keys[i];
    }
  }
  uint64_t over = 0;
  for (auto [k, c] : truth) {
    ASSERT_GE(s.Estimate(k), std::min<uint32_t>(c, 255)) << "key " << k;
    over += s.Estimate(k) > c;
  }
  EXPECT_GT(over, 0u) << "a sketch this small should overestimate some keys";
}

TEST(AdmissionSketch, ExactForFewKeysInALargeSketch) {
  hps::AdmissionSketch s({.bytes = 1 << 20, .rows = 4, .threshold = 255});
  std::mt19937_64 rng(3);
  std::unordered_map<uint64_t, uint32_t> truth;
  const auto keys = SkewedKeys(rng, 20000, 300);
  std::vector<uint8_t> admitted(keys.size());
  for (size_t a = 0; a < keys.size(); a += 1000) {
    s.Admit(keys.data() + a, 1000, admitted.data() + a);
  }
  for (uint64_t k : keys) ++truth[k];
  for (auto [k, c] : truth) EXPECT_EQ(s.Estimate(k), std::min<uint32_t>(c, 255)) << "key " << k;
}

TEST(AdmissionSketch, AdmitsAtExactlyTheFthOccurrence) {
  for (int32_t f : {1, 2, 4, 8}) {
    hps::AdmissionSketch s({.bytes = 4096, .rows = 4, .threshold = f});
    const uint64_t key = 0x1234'5678'9abc'def0ULL, other = 42;
    for (int32_t seen = 1; seen <= f + 2; ++seen) {
      const uint64_t batch[2] = {key, other + static_cast<uint64_t>(seen) * 1000};  // a fresh key beside it
      uint8_t admitted[2];
      const hps::AdmissionCounts c = s.Admit(batch, 2, admitted);
      EXPECT_EQ(admitted[0], seen >= f) << "f " << f << " occurrence " << seen;
      EXPECT_EQ(admitted[1], f == 1) << "f " << f << " occurrence " << seen;
      EXPECT_EQ(c.admitted, (seen >= f) + (f == 1));
      EXPECT_EQ(c.newly_admitted, (seen == f) + (f == 1));
    }
  }
}

TEST(AdmissionSketch, EveryOccurrenceInABatchGetsTheSameAnswer) {
  hps::AdmissionSketch s({.bytes = 4096, .rows = 4, .threshold = 3});
  const std::vector<uint64_t> batch = {5, 6, 5, 7, 5};  // key 5 reaches 3 at its last occurrence
  std::vector<uint8_t> admitted(batch.size());
  EXPECT_EQ(s.Admit(batch.data(), batch.size(), admitted.data()).admitted, 3u);
  EXPECT_EQ(admitted, (std::vector<uint8_t>{1, 0, 1, 0, 1}));
  // A query counts nothing.
  const uint64_t six[3] = {6, 6, 6};
  uint8_t q[3];
  EXPECT_EQ(s.Query(six, 3, q), 0u);
  EXPECT_EQ(s.Estimate(6), 1u);
}

TEST(AdmissionSketch, SaturatesAt255) {
  hps::AdmissionSketch s({.bytes = 64, .rows = 2, .threshold = 255});
  std::vector<uint64_t> batch(300, 99);
  std::vector<uint8_t> admitted(batch.size());
  const hps::AdmissionCounts c = s.Admit(batch.data(), 254, admitted.data());
  EXPECT_EQ(c.admitted, 0u);
  EXPECT_EQ(s.Estimate(99), 254u);
  EXPECT_EQ(s.Admit(batch.data(), batch.size(), admitted.data()).admitted, batch.size());
  EXPECT_EQ(s.Estimate(99), 255u);
  for (uint8_t c8 : s.counters()) EXPECT_LE(c8, 255);
  EXPECT_EQ(s.Admit(batch.data(), 1, admitted.data()).newly_admitted, 0u);  // already there
  EXPECT_EQ(s.Estimate(99), 255u);
}

TEST(AdmissionSketch, RestoredCountersGiveTheSameAnswers) {
  const hps::AdmissionOptions o{.bytes = 2048, .rows = 4, .threshold = 4, .seed = 11};
  hps::AdmissionSketch a(o);
  std::mt19937_64 rng(5);
  std::vector<uint8_t> x(400), y(400);
  for (int b = 0; b < 5; ++b) {
    const auto keys = SkewedKeys(rng, 400, 2000);
    a.Admit(keys.data(), keys.size(), x.data());
  }
  const std::vector<uint8_t> saved = a.counters();
  hps::AdmissionSketch b(o);
  b.Restore(saved.data(), saved.size());
  EXPECT_EQ(b.counters(), a.counters());
  for (int i = 0; i < 5; ++i) {
    const auto keys = SkewedKeys(rng, 400, 2000);
    const hps::AdmissionCounts ca = a.Admit(keys.data(), keys.size(), x.data());
    const hps::AdmissionCounts cb = b.Admit(keys.data(), keys.size(), y.data());
    EXPECT_EQ(x, y) << "batch " << i;
    EXPECT_EQ(ca.admitted, cb.admitted);
    EXPECT_EQ(ca.newly_admitted, cb.newly_admitted);
  }
  EXPECT_EQ(a.counters(), b.counters());
  EXPECT_THROW(b.Restore(saved.data(), saved.size() - 1), std::invalid_argument);
}

void ExpectRejected(const hps::AdmissionOptions& o, const std::string& name) {
  try {
    hps::AdmissionSketch s(o);
    FAIL() << name << " accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find(name + " = "), std::string::npos) << e.what();
  }
}

TEST(AdmissionSketch, RejectsBadOptions) {
  ExpectRejected({.bytes = 0}, "bytes");
  ExpectRejected({.bytes = 3, .rows = 4}, "bytes");
  ExpectRejected({.threshold = 0}, "threshold");
  ExpectRejected({.threshold = 256}, "threshold");
  ExpectRejected({.rows = 0}, "rows");
  ExpectRejected({.rows = 17}, "rows");
  hps::AdmissionSketch s({.bytes = 10, .rows = 4, .threshold = 1});
  EXPECT_EQ(s.width(), 2u);
  EXPECT_EQ(s.counters().size(), 8u);
}

// The counters a key's occurrence can raise: one per array, found by counting
// the key once in an empty sketch of the same options.
std::vector<uint64_t> CountersOf(const hps::AdmissionOptions& o, uint64_t key) {
  hps::AdmissionSketch empty(o);
  uint8_t admitted;
  empty.Admit(&key, 1, &admitted);
  std::vector<uint64_t> at;
  for (uint64_t i = 0; i < empty.counters().size(); ++i) {
    if (empty.counters()[i] != 0) at.push_back(i);
  }
  return at;
}

// The header's arithmetic, counter by counter: each array has one counter
// of a key; an occurrence raises those of its counters equal to their
// minimum (conservative update), none once it is 255; Estimate is that
// minimum. A small sketch, so that keys share counters and the rules differ
// from plain count-min's.
TEST(AdmissionSketch, CountersFollowTheConservativeUpdateAndEstimatesTheirMinimum) {
  const hps::AdmissionOptions o{.bytes = 3 * 16, .rows = 3, .threshold = 2, .seed = 9};
  hps::AdmissionSketch s(o);
  std::vector<uint8_t> model(s.counters().size(), 0);
  std::mt19937_64 rng(13);
  std::vector<uint8_t> admitted;
  for (int b = 0; b < 40; ++b) {
    const auto keys = SkewedKeys(rng, 50, 60);
    for (uint64_t k : keys) {
      const std::vector<uint64_t> at = CountersOf(o, k);
      ASSERT_EQ(at.size(), 3u) << "key " << k;
      for (int32_t r = 0; r < 3; ++r) ASSERT_EQ(at[r] / s.width(), static_cast<uint64_t>(r)) << "key " << k;
      uint8_t m = 255;
      for (uint64_t i : at) m = std::min(m, model[i]);
      if (m == 255) continue;
      for (uint64_t i : at) model[i] += model[i] == m;
    }
    admitted.resize(keys.size());
    s.Admit(keys.data(), keys.size(), admitted.data());
    ASSERT_EQ(s.counters(), model) << "batch " << b;
  }
  for (uint64_t k = 0; k < 60; ++k) {
    uint32_t m = 255;
    for (uint64_t i : CountersOf(o, k)) m = std::min<uint32_t>(m, model[i]);
    EXPECT_EQ(s.Estimate(k), m) << "key " << k;
  }
  // One array: the estimate is the key's one counter, 0 for a key never seen.
  hps::AdmissionSketch one({.bytes = 64, .rows = 1, .threshold = 1});
  EXPECT_EQ(one.Estimate(123), 0u);
}

// Each array has its own hash over its whole width, and the seed changes
// them: keys land on every counter of every array, at offsets that differ
// from array to array and from seed to seed.
TEST(AdmissionSketch, ArraysHashKeysIndependentlyOverTheirWholeWidth) {
  const hps::AdmissionOptions o{.bytes = 4 * 8, .rows = 4, .threshold = 1, .seed = 1};
  hps::AdmissionOptions reseeded = o;
  reseeded.seed = 2;
  std::vector<uint8_t> hit(32, 0);
  bool arrays_differ = false, seeds_differ = false;
  for (uint64_t k = 0; k < 200; ++k) {
    const std::vector<uint64_t> at = CountersOf(o, k);
    ASSERT_EQ(at.size(), 4u);
    for (uint64_t i : at) hit[i] = 1;
    arrays_differ |= at[0] % 8 != at[1] % 8 || at[1] % 8 != at[2] % 8 || at[2] % 8 != at[3] % 8;
    seeds_differ |= CountersOf(reseeded, k) != at;
  }
  EXPECT_EQ(hit, std::vector<uint8_t>(32, 1)) << "a counter no key reaches";
  EXPECT_TRUE(arrays_differ) << "every array hashes a key to the same offset";
  EXPECT_TRUE(seeds_differ) << "the seed changes no key's counters";
}

// The bounds of the options are accepted: 16 arrays, one counter each, threshold 255.
TEST(AdmissionSketch, AcceptsTheBoundsOfItsOptions) {
  hps::AdmissionSketch rows16({.bytes = 16, .rows = 16, .threshold = 255});
  EXPECT_EQ(rows16.width(), 1u);
  EXPECT_EQ(rows16.counters().size(), 16u);
  hps::AdmissionSketch one({.bytes = 1, .rows = 1, .threshold = 1});
  EXPECT_EQ(one.width(), 1u);
}

}  // namespace
