// Test support shared by the ps-layer tests: MEM-PS over a map standing in
// for SSD-PS. Misses read the map (else the optimizer's initial row);
// evictions and flushes write it.
#pragma once

#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <vector>

#include "hps/mem_cache.h"
#include "hps/optimizer.h"

namespace hps::test_support {

struct RowStore {
  explicit RowStore(const SparseOptimizer& o) : opt(o) {}
  SparseOptimizer opt;
  std::mutex mutex;
  std::map<uint64_t, std::vector<float>> stored;

  std::unique_ptr<MemCache> Cache(uint64_t capacity) {
    MemCacheOptions o;
    o.row_bytes = static_cast<uint32_t>(opt.row_floats() * sizeof(float));
    o.capacity = capacity;
    o.shards = 2;
    const uint32_t width = static_cast<uint32_t>(opt.row_floats());
    return MemCache::New(
        o,
        [this, width](const uint64_t* keys, uint64_t n, uint8_t* rows, uint8_t* dirty) {
          std::lock_guard lock(mutex);
          for (uint64_t i = 0; i < n; ++i) {
            float* row = reinterpret_cast<float*>(rows) + i * width;
            const auto it = stored.find(keys[i]);
            if (it == stored.end()) {
              opt.initial_rows(keys + i, 1, row);
            } else {
              std::memcpy(row, it->second.data(), width * sizeof(float));
            }
            dirty[i] = 0;
          }
        },
        [this, width](const uint64_t* keys, uint64_t n, const uint8_t* rows) {
          std::lock_guard lock(mutex);
          for (uint64_t i = 0; i < n; ++i) {
            const float* row = reinterpret_cast<const float*>(rows) + i * width;
            stored[keys[i]].assign(row, row + width);
          }
        });
  }
};

}  // namespace hps::test_support
