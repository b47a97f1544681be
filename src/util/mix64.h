// murmur3's 64-bit finaliser, the one key hash of the native core: hash
// tables, the SSD-PS index, MEM-PS shards and the device tier's owners all
// place keys by it, so sequential keys never land in sequential places.
#pragma once

#include <cstdint>

#include "hps/config.h"  // HPS_HD

namespace hps::detail {

HPS_HD inline uint64_t Mix64(uint64_t k) {
  k ^= k >> 33;
  k *= 0xff51afd7ed558ccdULL;
  k ^= k >> 33;
  k *= 0xc4ceb9fe1a85ec53ULL;
  k ^= k >> 33;
  return k;
}

// The inverse of x -> x * c mod 2^64 for odd c (Newton's iteration: right to
// 3 bits at first, each step doubles them).
constexpr uint64_t InverseOdd(uint64_t c) {
  uint64_t inv = c;
  for (int i = 0; i < 5; ++i) inv *= 2 - c * inv;
  return inv;
}

// The key whose Mix64 is h (Mix64 is a bijection: x ^= x >> 33 is its own
// inverse on 64 bits, and odd factors have inverses), so that an index that
// keeps a key's hash, not the key (CompactKeyIndex), can still name its keys.
inline uint64_t Unmix64(uint64_t h) {
  constexpr uint64_t kInverse2 = InverseOdd(0xc4ceb9fe1a85ec53ULL), kInverse1 = InverseOdd(0xff51afd7ed558ccdULL);
  h ^= h >> 33;
  h *= kInverse2;
  h ^= h >> 33;
  h *= kInverse1;
  h ^= h >> 33;
  return h;
}

}  // namespace hps::detail
