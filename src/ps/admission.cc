// The admission sketch declared in include/hps/admission.h.
#include "hps/admission.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "util/mix64.h"

namespace hps {
namespace {

constexpr int32_t kMaxRows = 16;
constexpr uint32_t kMaxCount = 255;  // a saturated counter

__extension__ typedef unsigned __int128 Uint128;

}  // namespace

AdmissionSketch::AdmissionSketch(const AdmissionOptions& options) : options_(options), width_(0) {
  if (options.rows < 1 || options.rows > kMaxRows) {
    throw std::invalid_argument("AdmissionSketch: rows = " + std::to_string(options.rows) + " is outside [1, " +
                                std::to_string(kMaxRows) + "]");
  }
  if (options.bytes == 0 || options.bytes < static_cast<uint64_t>(options.rows)) {
    throw std::invalid_argument("AdmissionSketch: bytes = " + std::to_string(options.bytes) +
                                " is below rows = " + std::to_string(options.rows) + " (one counter a byte)");
  }
  if (options.threshold < 1 || options.threshold > static_cast<int32_t>(kMaxCount)) {
    throw std::invalid_argument("AdmissionSketch: threshold = " + std::to_string(options.threshold) +
                                " is outside [1, 255] (counters are 8 bits)");
  }
  width_ = options.bytes / static_cast<uint64_t>(options.rows);
  counters_.assign(width_ * static_cast<uint64_t>(options.rows), 0);
  for (int32_t r = 0; r < options.rows; ++r) {
    seeds_.push_back(detail::Mix64(options.seed * kMaxRows + static_cast<uint64_t>(r) + 1));
  }
}

// The counter of `key` in array `row`: its hash scaled onto [0, width)
// (multiply-shift, no division), offset to the array.
inline uint64_t AdmissionSketch::Slot(uint64_t key, int32_t row) const {
  const uint64_t h = detail::Mix64(key + seeds_[row]);
  return static_cast<uint64_t>(row) * width_ + static_cast<uint64_t>((static_cast<Uint128>(h) * width_) >> 64);
}

uint32_t AdmissionSketch::Estimate(uint64_t key) const {
  uint32_t m = kMaxCount;
  for (int32_t r = 0; r < options_.rows; ++r) m = std::min<uint32_t>(m, counters_[Slot(key, r)]);
  return m;
}

AdmissionCounts AdmissionSketch::Admit(const uint64_t* keys, uint64_t n, uint8_t* admitted) {
  const int32_t rows = options_.rows;
  const auto threshold = static_cast<uint32_t>(options_.threshold);
  AdmissionCounts counts;
  uint64_t slot[kMaxRows];
  for (uint64_t i = 0; i < n; ++i) {
    uint32_t m = kMaxCount;
    for (int32_t r = 0; r < rows; ++r) {
      slot[r] = Slot(keys[i], r);
      m = std::min<uint32_t>(m, counters_[slot[r]]);
    }
    if (m == kMaxCount) continue;  // saturated
    // Conservative update: only the counters at the minimum rise.
    for (int32_t r = 0; r < rows; ++r) {
      if (counters_[slot[r]] == m) counters_[slot[r]] = static_cast<uint8_t>(m + 1);
    }
    counts.newly_admitted += (m + 1 == threshold);
  }
  counts.admitted = Query(keys, n, admitted);
  return counts;
}

uint64_t AdmissionSketch::Query(const uint64_t* keys, uint64_t n, uint8_t* admitted) const {
  const auto threshold = static_cast<uint32_t>(options_.threshold);
  uint64_t yes = 0;
  for (uint64_t i = 0; i < n; ++i) {
    const bool in = Estimate(keys[i]) >= threshold;
    admitted[i] = in ? 1 : 0;
    yes += in;
  }
  return yes;
}

void AdmissionSketch::Restore(const uint8_t* counters, uint64_t n) {
  if (n != counters_.size()) {
    throw std::invalid_argument("AdmissionSketch::Restore: counters has " + std::to_string(n) +
                                " bytes, the sketch " + std::to_string(counters_.size()) +
                                " (saved with other bytes or rows?)");
  }
  if (n != 0) std::memcpy(counters_.data(), counters, n);
}

}  // namespace hps
