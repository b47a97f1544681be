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

}  // namespace hps::detail
