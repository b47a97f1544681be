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

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <vector>

#include "hps/keys.h"  // kEmptyKey
#include "util/mix64.h"

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

// Gives the whole pages inside [data, data + bytes), memory about to be
// freed, back to the OS (madvise MADV_DONTNEED): they read as zeros when next
// touched, which malloc allows of memory it has not handed out again; the
// partial pages at either end, where malloc keeps its headers, stay.
inline void ReleaseWholePages(void* data, uint64_t bytes) {
  static const uint64_t page = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
  const uint64_t start = reinterpret_cast<uint64_t>(data);
  const uint64_t begin = (start + page - 1) / page * page;
  const uint64_t end = (start + bytes) / page * page;
  if (end > begin) madvise(reinterpret_cast<void*>(begin), end - begin, MADV_DONTNEED);
}

// The SSD-PS index in 10 bytes a slot instead of 12: the same contract as
// KeyIndex (exact; kNone is never a value), for the index that holds every key
// on disk (W12: 200M keys take 2.5 GiB instead of 3.0 GiB, beside a 4 GiB
// MEM-PS in an 8 GiB job). Mix64 is a bijection, so a key is known by its
// hash: the hash's top 16 bits pick one of 2^16 shards and a slot keeps the
// other 48 (a uint32 and a uint16), never the key. A slot is empty when its
// value is kNone. Slots are packed 10-byte records, so a probe reads one cache
// line where KeyIndex reads two (a key's and a value's). MEM-PS keeps KeyIndex
// on its hot path; this one serves the SSD-PS, whose lookups precede disk reads.
//
// Not thread-safe: the store's lock guards it.
class CompactKeyIndex {
 public:
  static constexpr uint32_t kNone = KeyIndex::kNone;

  CompactKeyIndex() : shards_(kShards) {}

  // The value stored under key, or kNone.
  uint32_t Find(uint64_t key) const {
    const uint64_t h = Mix64(key);
    const Shard& s = shards_[h >> kRestBits];
    if (s.mask == 0) return kNone;
    const uint32_t lo = static_cast<uint32_t>(h);
    const uint16_t hi = static_cast<uint16_t>(h >> 32);
    for (uint64_t i = h & s.mask;; i = (i + 1) & s.mask) {
      const Slot& slot = s.slots[i];
      if (slot.value == kNone) return kNone;
      if (slot.lo == lo && slot.hi == hi) return slot.value;
    }
  }

  // Asks for the cache line where key's probe starts.
  void Prefetch(uint64_t key) const {
    const uint64_t h = Mix64(key);
    const Shard& s = shards_[h >> kRestBits];
    if (s.mask == 0) return;
    __builtin_prefetch(&s.slots[h & s.mask]);
  }

  // Stores value (not kNone) under key; returns the value it replaced, or kNone.
  uint32_t Upsert(uint64_t key, uint32_t value) {
    if (value == kNone) throw std::invalid_argument("CompactKeyIndex::Upsert: kNone is not a value");
    const uint64_t h = Mix64(key);
    Shard& s = shards_[h >> kRestBits];
    if ((s.size + 1) * 5 > s.capacity() * 4) Grow(&s);
    const uint32_t lo = static_cast<uint32_t>(h);
    const uint16_t hi = static_cast<uint16_t>(h >> 32);
    for (uint64_t i = h & s.mask;; i = (i + 1) & s.mask) {
      Slot& slot = s.slots[i];
      if (slot.value == kNone) {
        slot.lo = lo;
        slot.hi = hi;
        slot.value = value;
        ++s.size;
        ++size_;
        return kNone;
      }
      if (slot.lo == lo && slot.hi == hi) {
        const uint32_t old = slot.value;
        slot.value = value;
        return old;
      }
    }
  }

  // Replaces key's value if it is `expected`; returns whether it was.
  bool Replace(uint64_t key, uint32_t expected, uint32_t value) {
    if (value == kNone) throw std::invalid_argument("CompactKeyIndex::Replace: kNone is not a value");
    const uint64_t h = Mix64(key);
    Shard& s = shards_[h >> kRestBits];
    if (s.mask == 0) return false;
    const uint32_t lo = static_cast<uint32_t>(h);
    const uint16_t hi = static_cast<uint16_t>(h >> 32);
    for (uint64_t i = h & s.mask;; i = (i + 1) & s.mask) {
      Slot& slot = s.slots[i];
      if (slot.value == kNone) return false;
      if (slot.lo == lo && slot.hi == hi) {
        if (slot.value != expected) return false;
        slot.value = value;
        return true;
      }
    }
  }

  // Removes key; returns the value it had, or kNone if it was absent.
  uint32_t Erase(uint64_t key) {
    const uint64_t h = Mix64(key);
    Shard& s = shards_[h >> kRestBits];
    if (s.mask == 0) return kNone;
    const uint32_t lo = static_cast<uint32_t>(h);
    const uint16_t hi = static_cast<uint16_t>(h >> 32);
    uint64_t i = h & s.mask;
    for (;; i = (i + 1) & s.mask) {
      if (s.slots[i].value == kNone) return kNone;
      if (s.slots[i].lo == lo && s.slots[i].hi == hi) break;
    }
    const uint32_t old = s.slots[i].value;
    uint64_t hole = i;
    for (uint64_t j = (i + 1) & s.mask; s.slots[j].value != kNone; j = (j + 1) & s.mask) {
      // As KeyIndex::Erase: an entry may fill the hole unless its home slot
      // lies in (hole, j]. Its home is its hash's low bits, which the slot keeps.
      const uint64_t home = s.slots[j].lo & s.mask;
      const bool stays = hole <= j ? (hole < home && home <= j) : (hole < home || home <= j);
      if (stays) continue;
      s.slots[hole] = s.slots[j];
      hole = j;
    }
    s.slots[hole].value = kNone;
    --s.size;
    --size_;
    return old;
  }

  uint64_t size() const { return size_; }

  // Room for inserts made where a failure must not be (a put's keys entering
  // the index one file at a time): CountNewKeys adds to (*counts)[s] (kShards
  // entries) the keys of keys[0, n) in shard s that the index lacks (the keys
  // distinct) and returns how many it added, and Reserve grows each shard s
  // to take counts[s] more keys. Until something else inserts, upserting
  // those keys then grows nothing, so allocates nothing and cannot throw.
  // CountNewKeys may be called under a reader's lock, Reserve needs the
  // writer's; both may be called in pieces. Reserve's pieces keep readers
  // from waiting for all the growth of a big put at once (its shards pass
  // their load together): it grows shards from `shard` on until it has
  // allocated max_slots slots (one shard at least) or looked at max_slots
  // shards, and returns the shard to go on from (kShards: done). It moves no
  // key: when it throws (bad_alloc; length_error past kMaxCapacity), the
  // shards it grew are only larger.
  static constexpr uint64_t kShards = uint64_t{1} << 16;
  uint64_t CountNewKeys(const uint64_t* keys, uint64_t n, std::vector<uint32_t>* counts) const {
    counts->resize(kShards);
    uint64_t added = 0;
    constexpr uint64_t kAhead = 8;  // probes in flight: each likely misses the cache
    for (uint64_t i = 0; i < n; ++i) {
      if (i + kAhead < n) Prefetch(keys[i + kAhead]);
      if (Find(keys[i]) != kNone) continue;
      ++(*counts)[Mix64(keys[i]) >> kRestBits];
      ++added;
    }
    return added;
  }
  uint64_t Reserve(const std::vector<uint32_t>& counts, uint64_t shard, uint64_t max_slots) {
    uint64_t grown = 0;
    const uint64_t end = std::min(kShards, shard + max_slots);
    for (; shard < end && grown < max_slots; ++shard) {
      if (counts[shard] == 0) continue;
      Shard& s = shards_[shard];
      uint64_t capacity = s.mask == 0 ? kMinCapacity : s.capacity();
      while ((s.size + counts[shard]) * 5 > capacity * 4) capacity *= 2;  // Upsert's bound, for the last of them
      if (capacity == s.capacity()) continue;
      GrowTo(&s, capacity);
      grown += capacity;
    }
    return shard;
  }

  // Calls fn(key, value) for each key whose value lies in [first, end), in
  // no order: a scan of every slot, for what must learn a file's keys
  // without reading them (SSD-PS, once they failed their CRC or the device
  // failed their read). A slot keeps the key's hash, whose inverse is the key.
  template <typename Fn>
  void ForEachValueIn(uint32_t first, uint64_t end, Fn&& fn) const {
    for (uint64_t shard = 0; shard < kShards; ++shard) {
      const Shard& s = shards_[shard];
      for (uint64_t i = 0; i < s.capacity(); ++i) {
        const Slot& slot = s.slots[i];
        if (slot.value == kNone || slot.value < first || slot.value >= end) continue;
        fn(Unmix64(shard << kRestBits | uint64_t{slot.hi} << 32 | slot.lo), slot.value);
      }
    }
  }

  // The slots and the shard table.
  uint64_t memory_bytes() const {
    uint64_t bytes = shards_.size() * sizeof(Shard);
    for (const Shard& s : shards_) bytes += s.capacity() * sizeof(Slot);
    return bytes;
  }

  // The hash's bits 0-47 (those that the shard does not say) and the value;
  // packed, so that a probe reads one cache line (or two where a slot straddles).
  struct __attribute__((packed)) Slot {
    uint32_t lo;     // bits 0-31: the home slot is lo & mask
    uint16_t hi;     // bits 32-47
    uint32_t value;  // kNone: an empty slot
  };
  static_assert(sizeof(Slot) == 10, "10 bytes a slot");

 private:
  static constexpr int kShardBits = 16;
  static constexpr int kRestBits = 64 - kShardBits;
  static_assert(kShards == uint64_t{1} << kShardBits);
  static constexpr uint64_t kMinCapacity = 16;
  // Homes are lo & mask: a shard stays below 2^32 slots (2^48 keys in all).
  static constexpr uint64_t kMaxCapacity = uint64_t{1} << 32;
  static_assert(kRestBits == 48, "a slot keeps the 48 bits of the hash below the shard's");

  struct Shard {
    std::unique_ptr<Slot[]> slots;
    uint64_t mask = 0;  // capacity - 1; 0 before the first insert
    uint64_t size = 0;
    uint64_t capacity() const { return mask == 0 ? 0 : mask + 1; }
  };

  static void Allocate(Shard* s, uint64_t capacity) {
    s->slots.reset(new Slot[capacity]);
    s->mask = capacity - 1;
    for (uint64_t i = 0; i < capacity; ++i) s->slots[i].value = kNone;
  }

  static void Grow(Shard* s) { GrowTo(s, s->mask == 0 ? kMinCapacity : 2 * s->capacity()); }

  // capacity: a power of two above s's.
  static void GrowTo(Shard* s, uint64_t capacity) {
    if (capacity > kMaxCapacity) throw std::length_error("CompactKeyIndex: a shard past 2^32 slots");
    Shard grown;
    Allocate(&grown, capacity);
    grown.size = s->size;
    for (uint64_t j = 0; j < s->capacity(); ++j) {
      if (s->slots[j].value == kNone) continue;
      uint64_t i = s->slots[j].lo & grown.mask;
      while (grown.slots[i].value != kNone) i = (i + 1) & grown.mask;
      grown.slots[i] = s->slots[j];
    }
    // Shards grow in whichever thread puts (a write-back, a checkpoint's
    // flush), so their arrays come from several malloc arenas, and a freed one
    // is a hole that only its own arena reuses: W12's job held ~1.5x the
    // index's bytes and was OOM-killed at 8 GiB as the shards doubled near
    // 107M keys. The old array's pages go back to the OS before it is freed.
    ReleaseWholePages(s->slots.get(), s->capacity() * sizeof(Slot));
    *s = std::move(grown);
  }

  std::vector<Shard> shards_;
  uint64_t size_ = 0;
};

}  // namespace hps::detail
