// The rare path of a MEM-PS release (WriteBack, Unpin, UnpinUpdated) that
// finds keys something else unpinned between its check and its change: their
// updates kept as a refused release keeps them, then BrokenPinError. Apart
// from mem_cache.cc so that its hot paths' inlining stays as it was: grown
// by this code, that unit ran out of GCC's inlining budget and stopped
// inlining the push_back of Fetch's loop (callgrind, W4-sized batches).
#pragma once

#include <cstdint>
#include <vector>

#include "hps/mem_cache.h"

namespace hps::detail {

// An occurrence that a release's check found pinned and its change found
// unpinned: its index in the call's keys, and where its row was then.
struct UnpinnedKey {
  uint64_t i;
  uint8_t* row;
};

// WriteBack's unpinned keys (increasing i): the caller's rows are their only
// copies, kept by cache.KeepUpdated (dirty in MEM-PS, or stored if evicted
// since); then BrokenPinError names them (lost: all, if keeping failed).
[[noreturn]] void KeepUnpinnedRows(MemCache& cache, const uint64_t* keys, uint64_t n, const uint8_t* rows,
                                   const std::vector<UnpinnedKey>& unpinned);
// UnpinUpdated's: their rows were stepped where they lie, and are marked
// dirty there by cache.MarkUpdated unless they left their slots meanwhile
// (lost); then BrokenPinError names them.
[[noreturn]] void MarkUnpinnedSteps(MemCache& cache, const uint64_t* keys, uint64_t n, const uint8_t* updated,
                                    const std::vector<UnpinnedKey>& unpinned);
// Unpin's: nothing to keep; BrokenPinError names them.
[[noreturn]] void ThrowUnpinned(const uint64_t* keys, uint64_t n, const std::vector<UnpinnedKey>& unpinned);
// Adds one (out of line: see above).
void NoteUnpinned(std::vector<UnpinnedKey>* unpinned, uint64_t i, uint8_t* row);
// Sorts them by i (a release finds them shard by shard).
void SortUnpinned(std::vector<UnpinnedKey>* unpinned);

}  // namespace hps::detail
