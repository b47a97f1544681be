#include "cache/broken_pins.h"

#include <algorithm>
#include <exception>
#include <string>
#include <utility>

namespace hps::detail {
namespace {

// The text of the exception being handled. REQUIRES: called in a catch block.
std::string CurrentError() {
  try {
    throw;
  } catch (const std::exception& e) {
    return e.what();
  } catch (...) {
    return "an unknown exception";
  }
}

// BrokenPinError for a release whose `unpinned` keys something else unpinned
// during it; `outcome` says what became of their updates, `lost`
// (increasing indices) names those not kept.
[[noreturn]] void Throw(const char* what, const uint64_t* keys, uint64_t n, const std::vector<UnpinnedKey>& unpinned,
                        std::vector<uint64_t> lost, const std::string& outcome) {
  const auto named = [&](const std::vector<uint64_t>& at) {
    std::string which;
    for (size_t j = 0; j < at.size() && j < 8; ++j) {
      which += (j > 0 ? ", keys[" : "keys[") + std::to_string(at[j]) + "] = " + std::to_string(keys[at[j]]);
    }
    if (at.size() > 8) which += ", ...";
    return which;
  };
  std::vector<uint64_t> at;
  for (const UnpinnedKey& u : unpinned) at.push_back(u.i);
  std::string message = "MEM-PS " + std::string(what) + ": " + std::to_string(at.size()) + " of " + std::to_string(n) +
                        " keys were no longer pinned when it came to release them (" + named(at) +
                        "): something else unpinned them during the call; " + outcome;
  if (!lost.empty()) message += "; the updates of " + named(lost) + " are lost";
  message += ", and the other keys were released";
  throw BrokenPinError(message, std::move(at), std::move(lost));
}

}  // namespace

void KeepUnpinnedRows(MemCache& cache, const uint64_t* keys, uint64_t n, const uint8_t* rows,
                      const std::vector<UnpinnedKey>& unpinned) {
  const uint32_t row_bytes = cache.row_bytes();
  std::vector<uint64_t> kept_keys;
  std::vector<uint8_t> kept_rows;
  std::vector<uint64_t> lost;
  std::string outcome = "their rows were kept (dirty in MEM-PS, or stored if evicted since)";
  try {
    for (const UnpinnedKey& u : unpinned) {
      kept_keys.push_back(keys[u.i]);
      kept_rows.insert(kept_rows.end(), rows + u.i * row_bytes, rows + (u.i + 1) * row_bytes);
    }
    cache.KeepUpdated(kept_keys.data(), kept_keys.size(), kept_rows.data());
  } catch (...) {  // the sink's failure, or bad_alloc: reported with the keys, never in their place
    lost.clear();
    for (const UnpinnedKey& u : unpinned) lost.push_back(u.i);
    outcome = "their rows were not kept (" + CurrentError() + "): the caller's copies are all that is left";
  }
  Throw("write back", keys, n, unpinned, std::move(lost), outcome);
}

void MarkUnpinnedSteps(MemCache& cache, const uint64_t* keys, uint64_t n, const uint8_t* updated,
                       const std::vector<UnpinnedKey>& unpinned) {
  std::vector<uint64_t> stepped, stepped_at;
  std::vector<uint8_t*> where;
  std::vector<uint64_t> lost;
  std::string outcome = "the updated ones' steps were kept (dirty in MEM-PS)";
  try {
    for (const UnpinnedKey& u : unpinned) {
      if (!updated[u.i]) continue;
      stepped.push_back(keys[u.i]);
      stepped_at.push_back(u.i);
      where.push_back(u.row);
    }
    for (uint64_t j : cache.MarkUpdated(stepped.data(), stepped.size(), where.data())) lost.push_back(stepped_at[j]);
    if (!lost.empty()) outcome = "the other updated ones' steps were kept (dirty in MEM-PS)";
  } catch (...) {  // bad_alloc: reported with the keys, never in their place
    lost.clear();
    for (const UnpinnedKey& u : unpinned) {
      if (updated[u.i]) lost.push_back(u.i);
    }
    outcome = "their steps may not have been kept (" + CurrentError() + ")";
  }
  Throw("unpin", keys, n, unpinned, std::move(lost), outcome);
}

void ThrowUnpinned(const uint64_t* keys, uint64_t n, const std::vector<UnpinnedKey>& unpinned) {
  Throw("unpin", keys, n, unpinned, {}, "their rows are as they were");
}

void NoteUnpinned(std::vector<UnpinnedKey>* unpinned, uint64_t i, uint8_t* row) { unpinned->push_back({i, row}); }

void SortUnpinned(std::vector<UnpinnedKey>* unpinned) {
  std::sort(unpinned->begin(), unpinned->end(), [](const UnpinnedKey& a, const UnpinnedKey& b) { return a.i < b.i; });
}

}  // namespace hps::detail
