#include "cache/broken_pins.h"

#include <algorithm>
#include <exception>
#include <new>
#include <stdexcept>
#include <string>
#include <utility>

namespace hps::detail {
namespace {

// An occurrence that a release's check found pinned and its change found
// unpinned: its index in the call's keys, and where its row was then.
struct UnpinnedKey {
  uint64_t i;
  uint8_t* row;
};

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

// WriteBack's: the caller's rows are their only copies, kept by
// cache.KeepUpdated (lost: all, if keeping failed).
[[noreturn]] void KeepUnpinnedRows(MemCache& cache, const uint64_t* keys, uint64_t n, const uint8_t* rows,
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

// UnpinUpdated's: their rows were stepped where they lie, and are marked
// dirty there by cache.MarkUpdated unless they left their slots (lost).
[[noreturn]] void MarkUnpinnedSteps(MemCache& cache, const uint64_t* keys, uint64_t n, const uint8_t* updated,
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

// Unpin's: nothing to keep.
[[noreturn]] void ThrowUnpinned(const uint64_t* keys, uint64_t n, const std::vector<UnpinnedKey>& unpinned) {
  Throw("unpin", keys, n, unpinned, {}, "their rows are as they were");
}

// A shorter report, for when memory ran out on the way to the full one:
// every update of theirs that `release` carries is counted lost.
[[noreturn]] void ThrowUnreported(Release release, const char* what, const uint64_t* keys, uint64_t n,
                                  const uint8_t* updated, const UnpinnedRecord& record) {
  std::vector<uint64_t> unpinned, lost;
  unpinned.reserve(record.count);
  for (const std::vector<uint64_t>& mine : record.at) unpinned.insert(unpinned.end(), mine.begin(), mine.end());
  std::sort(unpinned.begin(), unpinned.end());
  for (uint64_t i : unpinned) {
    if (release == Release::kWriteBack || (release == Release::kUnpinUpdated && updated[i])) lost.push_back(i);
  }
  const uint64_t first = unpinned.front();
  throw BrokenPinError("MEM-PS " + std::string(what) + ": " + std::to_string(unpinned.size()) + " of " +
                           std::to_string(n) + " keys (the first keys[" + std::to_string(first) + "] = " +
                           std::to_string(keys[first]) +
                           ") were no longer pinned when it came to release them: something else unpinned them "
                           "during the call; memory ran out reporting them, so their updates may be lost, and the "
                           "other keys were released",
                       std::move(unpinned), std::move(lost));
}

}  // namespace

void ReportUnpinned(MemCache& cache, Release release, const char* what, const uint64_t* keys, uint64_t n,
                    const uint8_t* data, const UnpinnedRecord& record) {
  try {
    std::vector<UnpinnedKey> unpinned;
    unpinned.reserve(record.count);
    for (size_t s = 0; s < record.at.size(); ++s) {
      for (size_t j = 0; j < record.at[s].size(); ++j) {
        unpinned.push_back({record.at[s][j], record.row_of(cache, s, record.slots[s][j])});
      }
    }
    // Found shard by shard: named by increasing index.
    std::sort(unpinned.begin(), unpinned.end(), [](const UnpinnedKey& a, const UnpinnedKey& b) { return a.i < b.i; });
    switch (release) {
      case Release::kWriteBack: KeepUnpinnedRows(cache, keys, n, data, unpinned);
      case Release::kUnpinUpdated: MarkUnpinnedSteps(cache, keys, n, data, unpinned);
      case Release::kUnpin: ThrowUnpinned(keys, n, unpinned);
    }
  } catch (const std::bad_alloc&) {
    ThrowUnreported(release, what, keys, n, data, record);
  }
  throw std::logic_error("MEM-PS: unknown release");  // not reached: each case throws
}

}  // namespace hps::detail
