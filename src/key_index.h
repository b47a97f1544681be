// The SSD-PS index: uint64 key -> uint32 value (a record id), in as little
// memory as a hash map can take, since it holds every key on disk.
//
// Open addressing with linear probing over separate key and value arrays
// (12 bytes a slot), split into kShards independently grown tables so that a
// resize copies one shard, not the whole index: the peak stays near the
// steady size instead of 3x it. Loads stay between 0.4 and 0.8 (about 20
// bytes a key; std::unordered_map took ~40 plus the allocator's share).
// Erase shifts the rest of the probe run back into the hole, so there are
// no tombstones. MEM-PS indexes its slots with it too.
//
// Not thread-safe: the store's lock guards it.
#pragma once

#include <algorithm>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <vector>

#include "hps/hash_table.h"  // kEmptyKey
#include "mix64.h"

namespace hps::detail {

class KeyIndex {
 public:
  static constexpr uint32_t kNone = UINT32_MAX;  // "absent"; never a stored value

  KeyIndex() : shards_(kShards) {}
  // Sized for about `expected` keys up front, so that filling it does not
  // regrow each shard a dozen times (UniqueKeys knows its upper bound).
  explicit KeyIndex(uint64_t expected) : shards_(kShards) {
    const uint64_t per_shard = expected / kShards + 1;
    uint64_t capacity = kMinCapacity;
    while (per_shard * 5 > capacity * 3) capacity *= 2;  // load <= 0.6 when full
    for (Shard& s : shards_) Allocate(&s, capacity);
  }

  // The value stored under key, or kNone.
  uint32_t Find(uint64_t key) const {
    const uint64_t h = Mix64(key);
    const Shard& s = shards_[h >> (64 - kShardBits)];
    if (s.mask == 0) return kNone;
    for (uint64_t i = h & s.mask;; i = (i + 1) & s.mask) {
      if (s.keys[i] == key) return s.values[i];
      if (s.keys[i] == kEmptyKey) return kNone;
    }
  }

  // Asks for the cache lines where key's probe starts, so that a Find a few
  // keys later does not wait for them.
  void Prefetch(uint64_t key) const {
    const uint64_t h = Mix64(key);
    const Shard& s = shards_[h >> (64 - kShardBits)];
    if (s.mask == 0) return;
    __builtin_prefetch(&s.keys[h & s.mask]);
    __builtin_prefetch(&s.values[h & s.mask]);
  }

  // Stores value (not kNone) under key; returns the value it replaced, or kNone.
  uint32_t Upsert(uint64_t key, uint32_t value) {
    const uint64_t h = Mix64(key);
    Shard& s = shards_[h >> (64 - kShardBits)];
    if ((s.size + 1) * 5 > s.capacity() * 4) Grow(&s);
    for (uint64_t i = h & s.mask;; i = (i + 1) & s.mask) {
      if (s.keys[i] == key) {
        const uint32_t old = s.values[i];
        s.values[i] = value;
        return old;
      }
      if (s.keys[i] == kEmptyKey) {
        s.keys[i] = key;
        s.values[i] = value;
        ++s.size;
        ++size_;
        return kNone;
      }
    }
  }

  // Replaces key's value if it is `expected`; returns whether it was.
  bool Replace(uint64_t key, uint32_t expected, uint32_t value) {
    const uint64_t h = Mix64(key);
    Shard& s = shards_[h >> (64 - kShardBits)];
    if (s.mask == 0) return false;
    for (uint64_t i = h & s.mask;; i = (i + 1) & s.mask) {
      if (s.keys[i] == key) {
        if (s.values[i] != expected) return false;
        s.values[i] = value;
        return true;
      }
      if (s.keys[i] == kEmptyKey) return false;
    }
  }

  // Removes key; returns the value it had, or kNone if it was absent.
  uint32_t Erase(uint64_t key) {
    const uint64_t h = Mix64(key);
    Shard& s = shards_[h >> (64 - kShardBits)];
    if (s.mask == 0) return kNone;
    uint64_t i = h & s.mask;
    while (s.keys[i] != key) {
      if (s.keys[i] == kEmptyKey) return kNone;
      i = (i + 1) & s.mask;
    }
    const uint32_t old = s.values[i];
    uint64_t hole = i;
    for (uint64_t j = (i + 1) & s.mask; s.keys[j] != kEmptyKey; j = (j + 1) & s.mask) {
      // An entry may fill the hole unless its home slot lies in (hole, j]:
      // then a probe for it would stop at the hole.
      const uint64_t home = Mix64(s.keys[j]) & s.mask;
      const bool stays = hole <= j ? (hole < home && home <= j) : (hole < home || home <= j);
      if (stays) continue;
      s.keys[hole] = s.keys[j];
      s.values[hole] = s.values[j];
      hole = j;
    }
    s.keys[hole] = kEmptyKey;
    --s.size;
    --size_;
    return old;
  }

  uint64_t size() const { return size_; }

  uint64_t memory_bytes() const {
    uint64_t bytes = 0;
    for (const Shard& s : shards_) bytes += s.capacity() * (sizeof(uint64_t) + sizeof(uint32_t));
    return bytes;
  }

 private:
  static constexpr int kShardBits = 8;
  static constexpr uint64_t kShards = uint64_t{1} << kShardBits;
  static constexpr uint64_t kMinCapacity = 16;

  struct Shard {
    std::unique_ptr<uint64_t[]> keys;
    std::unique_ptr<uint32_t[]> values;
    uint64_t mask = 0;  // capacity - 1; 0 before the first insert
    uint64_t size = 0;
    uint64_t capacity() const { return mask == 0 ? 0 : mask + 1; }
  };


  static void Allocate(Shard* s, uint64_t capacity) {
    s->keys.reset(new uint64_t[capacity]);
    s->values.reset(new uint32_t[capacity]);
    s->mask = capacity - 1;
    std::fill(s->keys.get(), s->keys.get() + capacity, kEmptyKey);
  }

  static void Grow(Shard* s) {
    const uint64_t capacity = s->mask == 0 ? kMinCapacity : 2 * s->capacity();
    Shard grown;
    Allocate(&grown, capacity);
    grown.size = s->size;
    for (uint64_t j = 0; j < s->capacity(); ++j) {
      const uint64_t key = s->keys[j];
      if (key == kEmptyKey) continue;
      uint64_t i = Mix64(key) & grown.mask;
      while (grown.keys[i] != kEmptyKey) i = (i + 1) & grown.mask;
      grown.keys[i] = key;
      grown.values[i] = s->values[j];
    }
    *s = std::move(grown);
  }

  std::vector<Shard> shards_;
  uint64_t size_ = 0;
};

}  // namespace hps::detail
