// KeyIndex (MEM-PS's slots, small indexes) and CompactKeyIndex (SSD-PS's index,
// which keeps 48 bits of a key's hash instead of the key): both must be exact.
// The keys here are made from chosen hashes (Unmix64), so that they
// share a shard, a home slot, or all but a few bits of their hashes.
#include <gtest/gtest.h>

#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <random>
#include <unordered_map>
#include <vector>

#include "format/key_index.h"
#include "util/mix64.h"

namespace hps::detail {
namespace {

uint64_t Hash(uint64_t shard16, uint64_t hi16, uint64_t lo32) { return shard16 << 48 | hi16 << 32 | lo32; }

template <typename Index>
class KeyIndexTest : public ::testing::Test {};

using Indexes = ::testing::Types<KeyIndex, CompactKeyIndex>;
TYPED_TEST_SUITE(KeyIndexTest, Indexes);

TEST(Unmix64, InvertsMix64) {
  std::mt19937_64 rng(1);
  for (int i = 0; i < 1000; ++i) {
    const uint64_t h = rng();
    EXPECT_EQ(Mix64(Unmix64(h)), h);
    EXPECT_EQ(Unmix64(Mix64(h)), h);
  }
}

// Keys whose hashes agree in every bit a slot does not keep (another shard),
// in the low 32 bits (same home, other hi) or in the hi bits and the low bits
// under any mask (same home, other lo) are told apart.
TYPED_TEST(KeyIndexTest, KeysWithHashesSharingBitsAreDistinct) {
  TypeParam index;
  const std::vector<uint64_t> hashes = {
      Hash(0x1234, 0x00aa, 0x00000007),
      Hash(0x1235, 0x00aa, 0x00000007),  // another shard, the same 48 bits
      Hash(0xf234, 0x00aa, 0x00000007),  // another shard by the top bits only
      Hash(0x1234, 0x00ab, 0x00000007),  // the same shard and low 32 bits
      Hash(0x1234, 0x80aa, 0x00000007),  // the same shard and low 32 bits, hi's top bit
      Hash(0x1234, 0x00aa, 0x80000007),  // the same home under any mask below 2^31
      Hash(0x1234, 0x00aa, 0x00010007),
  };
  for (size_t i = 0; i < hashes.size(); ++i) {
    EXPECT_EQ(index.Upsert(Unmix64(hashes[i]), static_cast<uint32_t>(100 + i)), TypeParam::kNone);
  }
  EXPECT_EQ(index.size(), hashes.size());
  for (size_t i = 0; i < hashes.size(); ++i) EXPECT_EQ(index.Find(Unmix64(hashes[i])), 100 + i) << i;
  // Absent keys that share all but one bit with a stored one.
  for (uint64_t h : {Hash(0x1234, 0x00aa, 0x00000017), Hash(0x1234, 0x40aa, 0x00000007),
                     Hash(0x1236, 0x00aa, 0x00000007), Hash(0x1234, 0x00aa, 0x40000007)}) {
    EXPECT_EQ(index.Find(Unmix64(h)), TypeParam::kNone);
    EXPECT_EQ(index.Erase(Unmix64(h)), TypeParam::kNone);
    EXPECT_FALSE(index.Replace(Unmix64(h), 100, 1));
  }
  // Updating or erasing one leaves its near twins alone.
  EXPECT_EQ(index.Upsert(Unmix64(hashes[3]), 7), 103u);
  EXPECT_TRUE(index.Replace(Unmix64(hashes[4]), 104, 8));
  EXPECT_FALSE(index.Replace(Unmix64(hashes[4]), 104, 9));
  EXPECT_EQ(index.Erase(Unmix64(hashes[0])), 100u);
  EXPECT_EQ(index.Find(Unmix64(hashes[0])), TypeParam::kNone);
  const std::vector<uint32_t> want = {TypeParam::kNone, 101, 102, 7, 8, 105, 106};
  for (size_t i = 0; i < hashes.size(); ++i) EXPECT_EQ(index.Find(Unmix64(hashes[i])), want[i]) << i;
  EXPECT_EQ(index.size(), hashes.size() - 1);
}

// One probe run of keys that share their home slot, the last of the shard's 16
// (the run wraps around to slot 0), and keys homed inside the run: erasing
// from its start, middle and end shifts the rest back and loses none.
TYPED_TEST(KeyIndexTest, EraseShiftsWrappedRunsBack) {
  for (int erase_at : {0, 1, 4, 8}) {
    TypeParam index;
    std::vector<uint64_t> keys;
    for (uint64_t i = 0; i < 6; ++i) keys.push_back(Unmix64(Hash(0x0777, i, 0x0000000f | i << 20)));
    for (uint64_t i = 0; i < 3; ++i) keys.push_back(Unmix64(Hash(0x0777, 0x10 + i, i << 20)));  // home 0
    keys.push_back(Unmix64(Hash(0x0777, 0x20, 0x00000002)));  // home 2, inside the run
    std::unordered_map<uint64_t, uint32_t> want;
    for (size_t i = 0; i < keys.size(); ++i) {
      index.Upsert(keys[i], static_cast<uint32_t>(i + 1));
      want[keys[i]] = static_cast<uint32_t>(i + 1);
    }
    EXPECT_EQ(index.Erase(keys[erase_at]), static_cast<uint32_t>(erase_at + 1));
    want.erase(keys[erase_at]);
    for (const auto& [key, value] : want) EXPECT_EQ(index.Find(key), value) << "erase_at " << erase_at;
    EXPECT_EQ(index.Find(keys[erase_at]), TypeParam::kNone);
    EXPECT_EQ(index.size(), want.size());
    // And each of the rest, one by one, down to an empty index.
    for (const auto& [key, value] : want) {
      EXPECT_EQ(index.Erase(key), value);
      EXPECT_EQ(index.Find(key), TypeParam::kNone);
    }
    EXPECT_EQ(index.size(), 0u);
  }
}

// Random upserts, replaces and erases against std::unordered_map, over keys few
// enough to repeat and many enough to grow every shard several times.
TYPED_TEST(KeyIndexTest, MatchesAMapThroughGrowthAndErases) {
  TypeParam index;
  std::unordered_map<uint64_t, uint32_t> want;
  std::mt19937_64 rng(7);
  std::vector<uint64_t> pool;
  for (int i = 0; i < 300000; ++i) pool.push_back(rng());
  for (int step = 0; step < 1500000; ++step) {
    const uint64_t key = pool[rng() % (step < 600000 ? pool.size() : 2000)];
    const uint32_t value = static_cast<uint32_t>(rng() % 1000000);
    const auto it = want.find(key);
    const uint32_t had = it == want.end() ? TypeParam::kNone : it->second;
    switch (rng() % 4) {
      case 0:
      case 1:
        ASSERT_EQ(index.Upsert(key, value), had);
        want[key] = value;
        break;
      case 2:
        ASSERT_EQ(index.Erase(key), had);
        want.erase(key);
        break;
      default:
        ASSERT_EQ(index.Replace(key, had == TypeParam::kNone ? value : had, value), had != TypeParam::kNone);
        if (had != TypeParam::kNone) want[key] = value;
    }
  }
  ASSERT_EQ(index.size(), want.size());
  for (const auto& [key, value] : want) ASSERT_EQ(index.Find(key), value);
  for (uint64_t key : pool) {
    if (!want.count(key)) {
      ASSERT_EQ(index.Find(key), TypeParam::kNone);
    }
  }
}

// The point of CompactKeyIndex: 10 bytes a slot where KeyIndex takes 12, at the
// same loads (both grow past 0.8).
TEST(CompactKeyIndex, TakesTenBytesASlot) {
  KeyIndex wide;
  CompactKeyIndex compact;
  std::mt19937_64 rng(3);
  const uint64_t n = 4000000;
  for (uint64_t i = 0; i < n; ++i) {
    const uint64_t key = rng();
    wide.Upsert(key, static_cast<uint32_t>(i));
    compact.Upsert(key, static_cast<uint32_t>(i));
  }
  const double per_key = static_cast<double>(compact.memory_bytes()) / n;
  EXPECT_LE(per_key, 10.0 / 0.4 + 1.0);
  EXPECT_LT(compact.memory_bytes(), wide.memory_bytes() * 10 / 12 + (uint64_t{3} << 20));
  EXPECT_EQ(sizeof(CompactKeyIndex::Slot), 10u);
}

// A growth's old array leaves memory (its whole pages), not just malloc's
// free list: shards grow in whichever thread puts, and a hole in another
// thread's arena stayed resident (W12's job: OOM-killed at 8 GiB).
TEST(ReleaseWholePages, LeavesOnlyThePartialPagesAtTheEndsResident) {
  const uint64_t page = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
  const uint64_t pages = 16;
  void* raw = mmap(nullptr, pages * page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  ASSERT_NE(raw, MAP_FAILED);
  char* base = static_cast<char*>(raw);
  std::memset(base, 7, pages * page);
  auto resident = [&] {
    std::vector<unsigned char> in(pages);
    EXPECT_EQ(mincore(base, pages * page, in.data()), 0);
    std::vector<int> out;
    for (unsigned char c : in) out.push_back(c & 1);
    return out;
  };
  EXPECT_EQ(resident(), std::vector<int>(pages, 1));
  // An "array" from 100 bytes into page 2 to 100 bytes into page 12: pages
  // 3-11 are whole; 2 and 12 are partial and stay, as do the pages around.
  ReleaseWholePages(base + 2 * page + 100, 10 * page);
  std::vector<int> want(pages, 1);
  for (uint64_t p = 3; p < 12; ++p) want[p] = 0;
  EXPECT_EQ(resident(), want);
  EXPECT_EQ(base[2 * page + 99], 7);  // the partial pages keep their bytes
  EXPECT_EQ(base[12 * page + 99], 7);
  EXPECT_EQ(base[5 * page], 0);  // a released page reads as zeros
  ReleaseWholePages(base + 100, page - 200);  // less than a page: nothing
  EXPECT_EQ(base[100], 7);
  munmap(raw, pages * page);
}

// A put makes room for its new keys before any enters the index, so that
// entering them cannot fail (run out of memory) halfway. Room for the keys
// the index lacks only, each in its own shard: here 70 new keys of one
// shard, which grows from 64 slots to 128 at once, and one in an empty shard.
// Made in pieces, each under its own lock: a piece stops once it has
// allocated its slots (one shard at least) or looked at as many shards.
TEST(CompactKeyIndex, ReserveMakesRoomSoThatUpsertingTheNewKeysGrowsNothing) {
  CompactKeyIndex index;
  std::vector<uint64_t> keys;
  for (uint64_t i = 0; i < 100; ++i) keys.push_back(Unmix64(Hash(7, i, i * 977)));
  keys.push_back(Unmix64(Hash(9, 0, 1)));
  for (uint64_t i = 0; i < 30; ++i) index.Upsert(keys[i], static_cast<uint32_t>(i));
  const uint64_t before = index.memory_bytes();
  std::vector<uint32_t> counts;
  EXPECT_EQ(index.CountNewKeys(keys.data(), 30, &counts), 0u);  // all present: no room needed
  EXPECT_EQ(counts.size(), CompactKeyIndex::kShards);
  EXPECT_EQ(index.CountNewKeys(keys.data(), keys.size(), &counts), 71u);
  EXPECT_EQ(counts[7], 70u);
  EXPECT_EQ(counts[9], 1u);
  EXPECT_EQ(index.Reserve(counts, 0, 16), 8u) << "shard 7's 128 slots fill the piece";
  EXPECT_EQ(index.memory_bytes() - before, (128 - 64) * sizeof(CompactKeyIndex::Slot));
  EXPECT_EQ(index.Reserve(counts, 8, 16), 10u) << "shard 9's 16";
  EXPECT_EQ(index.Reserve(counts, 10, 16), 26u) << "16 shards looked at, none grown";
  uint64_t shard = 26;
  while (shard < CompactKeyIndex::kShards) shard = index.Reserve(counts, shard, 1 << 12);
  const uint64_t reserved = index.memory_bytes();
  EXPECT_EQ(reserved - before, (128 - 64 + 16) * sizeof(CompactKeyIndex::Slot));
  EXPECT_EQ(index.Reserve(counts, 0, CompactKeyIndex::kShards), CompactKeyIndex::kShards);
  EXPECT_EQ(index.memory_bytes(), reserved) << "room made once";
  for (uint64_t i = 0; i < keys.size(); ++i) index.Upsert(keys[i], static_cast<uint32_t>(1000 + i));
  EXPECT_EQ(index.memory_bytes(), reserved);
  EXPECT_EQ(index.size(), keys.size());
  for (uint64_t i = 0; i < keys.size(); ++i) EXPECT_EQ(index.Find(keys[i]), 1000 + i) << i;
}

// SSD-PS learns the live keys of a file whose keys it cannot read from its
// index, which keeps hashes: every key whose value is in the range, named
// exactly (keys of shared shards and homes among them), and no other.
TEST(CompactKeyIndex, ForEachValueInNamesTheKeysOfARangeOfValues) {
  CompactKeyIndex index;
  std::vector<uint64_t> keys;
  for (uint64_t i = 0; i < 50; ++i) keys.push_back(Unmix64(Hash(7, i, 5 + i % 2)));  // one shard, two homes
  std::mt19937_64 rng(3);
  for (uint64_t i = 0; i < 2000; ++i) keys.push_back(rng() >> 1);
  for (uint64_t i = 0; i < keys.size(); ++i) index.Upsert(keys[i], static_cast<uint32_t>(i));
  index.Erase(keys[40]);
  std::unordered_map<uint64_t, uint32_t> seen;
  index.ForEachValueIn(30, 1030, [&](uint64_t key, uint32_t value) { EXPECT_TRUE(seen.emplace(key, value).second); });
  EXPECT_EQ(seen.size(), 999u);
  for (uint32_t i = 30; i < 1030; ++i) {
    if (i == 40) {
      EXPECT_EQ(seen.count(keys[i]), 0u);
    } else {
      EXPECT_EQ(seen[keys[i]], i) << i;
    }
  }
}

TEST(CompactKeyIndex, RefusesTheEmptyMarkerAsAValue) {
  CompactKeyIndex index;
  EXPECT_THROW(index.Upsert(1, CompactKeyIndex::kNone), std::invalid_argument);
  index.Upsert(1, 5);
  EXPECT_THROW(index.Replace(1, 5, CompactKeyIndex::kNone), std::invalid_argument);
  EXPECT_EQ(index.Find(1), 5u);
  EXPECT_EQ(index.size(), 1u);
}

}  // namespace
}  // namespace hps::detail
