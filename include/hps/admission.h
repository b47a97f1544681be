// Admission: a key gets a trainable row only after it has been seen
// `threshold` times. The occurrences are counted in a count-min sketch of
// `rows` arrays of saturating uint8 counters, `bytes` in all (so the memory is
// bounded whatever the number of distinct keys), each array indexed by its own
// seeded hash of the key (Mix64 of the key plus a per-array seed).
//
// Estimate(key) = the minimum of the key's counters: never below the true
// count (each occurrence raised every counter it reads, or they were above it
// already), above it only where every one of the key's counters is shared
// with other keys. Conservative update: an occurrence raises only the
// counters equal to the current minimum, which keeps estimates as low as a
// count-min sketch can. Counters saturate at 255, so thresholds go up to 255.
//
// Batches: Admit counts every occurrence of a batch first, then marks an
// occurrence admitted when its key's estimate after the whole batch is >=
// threshold, so every occurrence of a key in one batch gets the same answer
// (a key seen for the f-th time in a batch is admitted for all its
// occurrences in that batch). Query marks without counting (evaluation).
//
// Checkpoints: counters() is the whole state besides the options; Restore
// takes a copy of it back, and the same batches then give the same answers.
//
// Thread safety: none; one thread (the pipeline's read stage) counts.
#pragma once

#include <cstdint>
#include <vector>

namespace hps {

struct AdmissionOptions {
  uint64_t bytes = 4 << 20;  ///< counters in all (one byte each), split over `rows`; >= rows
  int32_t rows = 4;          ///< hash arrays, 1 to 16
  int32_t threshold = 2;     ///< occurrences a key needs before it is admitted, 1 to 255
  uint64_t seed = 0;         ///< seeds the arrays' hashes
};

// What Admit did to one batch.
struct AdmissionCounts {
  uint64_t admitted = 0;       // occurrences marked admitted
  uint64_t newly_admitted = 0;  // occurrences whose own count took their key's estimate to the threshold
};

class AdmissionSketch {
 public:
  // Throws std::invalid_argument naming the option: bytes 0 or below rows,
  // rows outside [1, 16], threshold outside [1, 255].
  explicit AdmissionSketch(const AdmissionOptions& options);

  // Counts keys[0, n) (each occurrence once), then sets admitted[i] to 1 when
  // keys[i]'s estimate is >= threshold, else 0.
  AdmissionCounts Admit(const uint64_t* keys, uint64_t n, uint8_t* admitted);
  // admitted[i] as Admit would set it, counting nothing; returns how many.
  uint64_t Query(const uint64_t* keys, uint64_t n, uint8_t* admitted) const;
  // The estimate of a key's count (0 to 255).
  uint32_t Estimate(uint64_t key) const;

  const AdmissionOptions& options() const { return options_; }
  uint64_t width() const { return width_; }  // counters an array
  // The counters, rows() arrays of width() one after the other: the state to checkpoint.
  const std::vector<uint8_t>& counters() const { return counters_; }
  // Replaces the counters with a saved copy; throws std::invalid_argument
  // unless n == counters().size().
  void Restore(const uint8_t* counters, uint64_t n);

 private:
  uint64_t Slot(uint64_t key, int32_t row) const;

  AdmissionOptions options_;
  uint64_t width_;
  std::vector<uint64_t> seeds_;    // (rows,)
  std::vector<uint8_t> counters_;  // (rows, width)
};

}  // namespace hps
