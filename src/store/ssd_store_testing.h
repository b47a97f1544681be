// Test seams of SSD-PS (src/store/ssd_store.cc), for tests that must bring
// about an ordering that otherwise only a race between a put and a
// compaction reaches (tests/native/ssd_durability_test.cc), or a state that
// otherwise takes a store's lifetime to reach. Not for use
// outside tests. Set them before opening a store and reset them after.
#pragma once

#include <cstdint>
#include <functional>

namespace hps::detail {

struct SsdStoreTestSeams {
  // Record ids for at most this many files (0: as many as 32-bit ids
  // address), so that a test can run a store out of them with a few files.
  // Read at open.
  uint64_t max_files = 0;
  // Runs inside each put with more than one file, before each file after the
  // first enters the index, with no lock held but the put's own. Must not
  // throw: nothing may fail there (a throw ends the process).
  std::function<void()> put_between_files;
  // Runs inside a commit() that ran a compaction itself (background_compaction
  // = false), once the compaction has finished and before the commit reports
  // how it went, with no lock held: where another thread's commit may land.
  std::function<void()> commit_after_its_compaction;
  // The size past which MANIFEST is rolled however small its rolled log
  // (0: detail::kManifestRollFloorBytes), so that a test rolls it within a
  // few commits. Read at open.
  uint64_t manifest_roll_floor_bytes = 0;
};

extern SsdStoreTestSeams ssd_store_test_seams;

}  // namespace hps::detail
