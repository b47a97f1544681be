// The bulk helpers over key arrays declared in include/hps/keys.h.
#include "hps/keys.h"

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "util/mix64.h"

namespace hps {

void CheckKeys(const uint64_t* keys, uint64_t n) {
  for (uint64_t i = 0; i < n; ++i) {
    if (keys[i] == kEmptyKey) {
      throw std::invalid_argument("keys[" + std::to_string(i) +
                                  "] is 0xffffffffffffffff (-1 as int64), the reserved empty-slot "
                                  "key; hash or remap it before use");
    }
  }
}

std::vector<uint64_t> UniqueKeys(const uint64_t* keys, uint64_t n, int64_t* inverse) {
  CheckKeys(keys, n);
  // Indices are uint32 with UINT32_MAX kept free (KeyIndex::kNone's value).
  if (n >= UINT32_MAX) throw std::invalid_argument("UniqueKeys: more than 2^32 - 2 keys");
  // Open addressing sized for the distinct keys, grown as they come, not for n:
  // batches repeat keys (W5: 106k keys, 21k distinct), and a table that stays
  // in L2 (64k slots, 768 KiB) probes several times faster than one sized for
  // n (the KeyIndex this replaced: 256k slots, 3 MiB, a third of the prefetch
  // stage's own CPU).
  uint64_t capacity = 1024;
  while (capacity < n / 2) capacity *= 2;
  std::vector<uint64_t> slot_keys(capacity, kEmptyKey);
  std::vector<uint32_t> slot_at(capacity);
  std::vector<uint64_t> uniq;
  uniq.reserve(std::min<uint64_t>(n, capacity / 2));
  auto slot_of = [&](uint64_t key) {
    const uint64_t mask = capacity - 1;
    uint64_t i = detail::Mix64(key) & mask;
    while (slot_keys[i] != key && slot_keys[i] != kEmptyKey) i = (i + 1) & mask;
    return i;
  };
  for (uint64_t k = 0; k < n; ++k) {
    const uint64_t i = slot_of(keys[k]);
    if (slot_keys[i] == keys[k]) {
      inverse[k] = slot_at[i];
      continue;
    }
    const auto at = static_cast<uint32_t>(uniq.size());
    slot_keys[i] = keys[k];
    slot_at[i] = at;
    uniq.push_back(keys[k]);
    inverse[k] = at;
    if (2 * uniq.size() > capacity) {  // load above 1/2: double and re-place the distinct keys
      capacity *= 2;
      slot_keys.assign(capacity, kEmptyKey);
      slot_at.resize(capacity);
      for (uint32_t u = 0; u < uniq.size(); ++u) {
        const uint64_t j = slot_of(uniq[u]);
        slot_keys[j] = uniq[u];
        slot_at[j] = u;
      }
    }
  }
  return uniq;
}

void SumByInverse(const int64_t* inverse, uint64_t n, const float* rows, int32_t width, uint64_t n_unique,
                  float* out) {
  std::fill(out, out + n_unique * static_cast<uint64_t>(width), 0.0f);
  for (uint64_t i = 0; i < n; ++i) {
    const int64_t at = inverse[i];
    if (at < 0 || static_cast<uint64_t>(at) >= n_unique) {
      throw std::out_of_range("SumByInverse: inverse[" + std::to_string(i) + "] = " + std::to_string(at) +
                              " is outside [0, " + std::to_string(n_unique) + ")");
    }
    float* dst = out + static_cast<uint64_t>(at) * width;
    const float* src = rows + i * static_cast<uint64_t>(width);
    for (int32_t j = 0; j < width; ++j) dst[j] += src[j];
  }
}

}  // namespace hps
