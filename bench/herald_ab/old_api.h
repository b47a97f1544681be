// The baseline scheduler behind a thin interface: run.sh compiles a revision's
// herald.cc with the namespace hps renamed hps_old, so that it links beside
// the working tree's hps::Herald in one binary.
#pragma once

#include <cstdint>
#include <vector>

struct OldPlan {
  std::vector<int32_t> assignment;
  std::vector<uint64_t> fetch_offsets, fetch_keys;
  std::vector<int32_t> fetch_from;
  std::vector<uint64_t> comm_offsets, comm_keys, evicted, lost_keys;
  std::vector<int32_t> lost_from;
  uint64_t pulls = 0, peer_pulls = 0, pushes = 0, evict_pushes = 0, shared = 0, distinct = 0;
};

class OldHerald {
 public:
  OldHerald(int32_t workers, uint64_t capacity, bool location_aware, bool on_demand);
  ~OldHerald();
  OldHerald(const OldHerald&) = delete;
  OldHerald& operator=(const OldHerald&) = delete;
  OldPlan Schedule(const uint64_t* offsets, uint64_t n, const uint64_t* keys, const uint64_t* upcoming,
                   uint64_t n_upcoming);
  OldPlan Schedule(const uint64_t* keys, uint64_t n, int32_t fields);
  uint64_t cached(int32_t worker) const;
  std::vector<uint64_t> Cached(int32_t worker) const;
  uint64_t memory_bytes() const;
  void Clear();

 private:
  void* impl_;
};
