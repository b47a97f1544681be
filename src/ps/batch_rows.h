// A batch's rows addressed by position among its distinct keys: the get,
// accumulate and apply steps that a HostBatch runs on MEM-PS's pinned rows and
// a host-partition DeviceTier on its tables' rows. Each key is looked up once,
// when its row's address is set; every step after that indexes an array.
//
// Thread safety: one thread at a time (the batch's).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "hps/device_tier.h"  // RowLayout
#include "hps/optimizer.h"

namespace hps::detail {

class BatchRows {
 public:
  // `who` names the batch in errors ("host batch", "device tier").
  BatchRows(const SparseOptimizer& optimizer, std::string who);

  // n positions, every gradient zero, none updated; the rows' addresses are
  // the caller's to set (addresses()).
  void Reset(uint64_t n);
  uint64_t size() const { return rows_.size(); }
  uint8_t** addresses() { return rows_.data(); }
  uint8_t* const* addresses() const { return rows_.data(); }

  // std::out_of_range names the first position outside [0, size).
  void CheckPositions(const int64_t* positions, uint64_t n, const char* what) const;
  // The embeddings (n, dim) of the rows at positions (repeats allowed), laid out as `layout` says.
  void Get(const int64_t* positions, uint64_t n, float* embeddings, RowLayout layout) const;
  // Adds gradients (n, dim), laid out as `layout` says, to the rows at positions (repeats sum up).
  void Accumulate(const int64_t* positions, uint64_t n, const float* grads, RowLayout layout);
  // One optimizer step per row that got gradients, in place; the gradients
  // are cleared. Appends the positions stepped to `stepped` (if given), in
  // order; returns how many. A sum that is not finite, or a step that would
  // leave a row not finite (RefuseNonFinite), makes it throw DivergedError
  // first, changing nothing. keys: each position's key (size()), for the error.
  uint64_t Apply(const uint64_t* keys, std::vector<int64_t>* stepped = nullptr);
  // Throws DivergedError, naming the first such position's key (keys: each
  // position's), where a gradient sum holds a NaN or an infinity, or where a
  // step would leave a value of its row that is not finite (a finite sum too
  // large for the learning rate or the optimizer's squares).
  void RefuseNonFinite(const uint64_t* keys) const;
  // The full rows (n, row_floats) at positions, as they are now.
  void Rows(const int64_t* positions, uint64_t n, float* rows) const;
  // Overwrites the full row at to[i] with the one at from[i], in order
  // (gradients waiting stay with their positions).
  void CopyRows(const int64_t* from, const int64_t* to, uint64_t n);
  // Whether the row at `position` has gradients waiting for Apply.
  bool touched(uint64_t position) const { return touched_[position] != 0; }
  // 1 at each position some Apply stepped.
  const std::vector<uint8_t>& updated() const { return updated_; }

 private:
  // RefuseNonFinite's first half: the gradient sums.
  void RefuseNonFiniteSums(const uint64_t* keys) const;
  // Throws DivergedError naming the first position whose step would leave a
  // value not finite, and `count` such positions. REQUIRES: there is one.
  [[noreturn]] void RefuseNonFiniteStep(const uint64_t* keys, uint64_t count) const;
  // The layout with its stride filled in; std::invalid_argument if n rows do not fit it.
  RowLayout CheckLayout(RowLayout layout, uint64_t n, const char* what) const;
  float* Row(uint64_t position) const { return reinterpret_cast<float*>(rows_[position]); }

  const SparseOptimizer optimizer_;
  const std::string who_;
  std::vector<uint8_t*> rows_;     // each position's row (embedding + optimizer state)
  std::vector<float> grads_;       // (size, dim), summed until Apply
  std::vector<uint8_t> touched_;   // got a gradient since the last Apply
  std::vector<uint8_t> updated_;   // stepped by some Apply
};

}  // namespace hps::detail
