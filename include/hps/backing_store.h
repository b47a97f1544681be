// What stands behind MEM-PS in a parameter server: SSD-PS, a write buffer in
// front of it, and the initializer for keys never stored.
//
// MEM-PS evicts dirty rows one batch at a time; putting each batch would make
// many small SSD-PS files, so they gather in the write buffer until
// `write_buffer_rows` of them make one put. A miss reads the buffer first
// (a row on its way to disk is never read stale from disk), then SSD-PS, and
// a key found in neither gets its initial row, a pure function of (seed, key).
//
// It is MEM-PS's loader and sink (loader() / sink()), native so that a miss
// runs no Python: the Python version cost the prefetch thread ~9 ms of CPU a
// W5 batch, in the interpreter and numpy, beside a trainer that needs both
// the cores and the interpreter.
//
// Thread-safe: the buffer has its own lock, held neither during SSD-PS reads
// nor by MEM-PS. MEM-PS calls Load and Sink under its miss lock, so a key is
// never loaded while its evicted row is on the way into the buffer.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include "hps/mem_cache.h"
#include "hps/optimizer.h"
#include "hps/ssd_store.h"

namespace hps {

namespace detail {
class KeyIndex;
}

struct BackingStoreCounts {
  uint64_t rows_loaded = 0;   ///< rows MEM-PS asked for (its misses)
  uint64_t pending_hits = 0;  ///< of them, found in the write buffer
  uint64_t ssd_hits = 0;      ///< found on SSD-PS
  uint64_t initialized = 0;   ///< found nowhere: initial rows
  uint64_t puts = 0;          ///< SSD-PS puts of the buffer
  uint64_t rows_put = 0;      ///< rows in those puts
  uint64_t pending_rows = 0;  ///< rows in the buffer now
};

class BackingStore {
 public:
  // `ssd` must outlive this; its rows must be the optimizer's (row_floats x 4
  // bytes). Throws std::invalid_argument naming the bad argument.
  BackingStore(SsdStore* ssd, const SparseOptimizer& optimizer, uint64_t write_buffer_rows);
  ~BackingStore();
  BackingStore(const BackingStore&) = delete;
  BackingStore& operator=(const BackingStore&) = delete;

  // Rows (n, row_bytes) of distinct keys: the buffer's copy, else SSD-PS's,
  // else the initial row. dirty (optional) is all 0: every row also exists
  // in the buffer, on disk, or as (seed, key).
  void Load(const uint64_t* keys, uint64_t n, uint8_t* rows, uint8_t* dirty);
  // Rows (n, row_bytes) join the buffer, a key's newer row replacing its
  // older one; a full buffer goes to SSD-PS in one put. If that put throws,
  // the rows stay in the buffer.
  void Sink(const uint64_t* keys, uint64_t n, const uint8_t* rows);
  // Puts the buffer to SSD-PS now (not committed: SsdStore::Commit does that).
  void Flush();

  RowLoader loader();
  RowSink sink();
  uint32_t row_bytes() const { return row_bytes_; }
  BackingStoreCounts counts() const;

 private:
  void FlushLocked();  // REQUIRES: mutex_ held

  SsdStore* ssd_;
  SparseOptimizer optimizer_;
  uint32_t row_bytes_;
  uint64_t write_buffer_rows_;

  mutable std::mutex mutex_;  // guards the buffer: index_, keys_, rows_
  std::unique_ptr<detail::KeyIndex> index_;  // key -> its place in keys_ / rows_
  std::vector<uint64_t> keys_;
  std::vector<uint8_t> rows_;

  std::atomic<uint64_t> rows_loaded_{0}, pending_hits_{0}, ssd_hits_{0}, initialized_{0}, puts_{0},
      rows_put_{0};
};

}  // namespace hps
