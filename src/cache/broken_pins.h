// The rare path of a MEM-PS release (WriteBack, Unpin, UnpinUpdated) that
// finds keys something else unpinned between its check and its change: their
// updates kept as a refused release keeps them, then BrokenPinError, even if
// memory runs out meanwhile (the release is done: bad_alloc would say it
// changed nothing). Apart from mem_cache.cc so that its hot paths' inlining
// stays as it was: grown by this code, that unit ran out of GCC's inlining
// budget and stopped inlining the push_back of Fetch's loop (callgrind,
// W4-sized batches).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "hps/mem_cache.h"

namespace hps::detail {

// The release that found them, and what it carries: WriteBack the caller's
// rows, UnpinUpdated which keys were updated, Unpin nothing.
enum class Release { kWriteBack, kUnpinUpdated, kUnpin };

// Where a release's change pass left the occurrences it found unpinned (it
// records them in its own lists, so that it cannot run out of memory
// midway): per shard s, at[s][j] their indices in the call's keys and
// slots[s][j] their slots, whose rows row_of(cache, s, slot) gives.
struct UnpinnedRecord {
  const std::vector<std::vector<uint64_t>>& at;
  const std::vector<std::vector<uint32_t>>& slots;
  uint64_t count;  // > 0
  uint8_t* (*row_of)(const MemCache& cache, size_t shard, uint32_t slot);
};

// Keeps their updates and throws BrokenPinError naming them (increasing
// indices): WriteBack's rows, the caller's only copies, by cache.KeepUpdated
// (dirty in MEM-PS, or stored if evicted since); UnpinUpdated's steps, made
// where the rows lie, by cache.MarkUpdated unless the rows left their slots
// meanwhile; lost() names those not kept. If memory runs out on the way, a
// shorter BrokenPinError counts every update of theirs lost (it may have
// been kept already; keeping it again is harmless); bad_alloc only if even
// that finds no memory. `data`: WriteBack's rows, UnpinUpdated's updated.
[[noreturn]] void ReportUnpinned(MemCache& cache, Release release, const char* what, const uint64_t* keys, uint64_t n,
                                 const uint8_t* data, const UnpinnedRecord& record);

}  // namespace hps::detail
