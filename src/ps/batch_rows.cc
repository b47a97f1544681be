#include "ps/batch_rows.h"

#include <cstring>
#include <memory>
#include <stdexcept>
#include <type_traits>
#include <utility>

#include "table/nonfinite.h"
#include "table/optimizer_kernels.h"
#include "table/table_kernels.h"

namespace hps::detail {
namespace {

// Rows lie scattered (over MEM-PS's arena, or a table's slots): each read is
// a cache (and often a TLB) miss. Asking for the row a few iterations ahead
// keeps several misses in flight instead of one.
constexpr uint64_t kLookahead = 8;

// Walks the offsets of consecutive rows of a block laid out as `layout`
// (rows of dim floats) without a division per row.
class RowOffsets {
 public:
  RowOffsets(RowLayout layout, uint64_t dim) : layout_(layout), dim_(dim) {}
  uint64_t operator*() const { return group_start_ + in_group_ * dim_; }
  void operator++() {
    if (++in_group_ == layout_.group) {
      in_group_ = 0;
      group_start_ += layout_.group_stride;
    }
  }

 private:
  RowLayout layout_;
  uint64_t dim_;
  uint64_t group_start_ = 0;
  uint64_t in_group_ = 0;
};

// Calls body(width) with the row width as a compile-time constant for the
// common embedding dims, else as a plain value: a copy of a known size is a
// few vector moves inline, where a size known only at run time costs a call
// to memcpy per row.
template <typename Body>
void WithRowWidth(uint64_t dim, Body body) {
  switch (dim) {
    case 8: return body(std::integral_constant<uint64_t, 8>{});
    case 16: return body(std::integral_constant<uint64_t, 16>{});
    case 32: return body(std::integral_constant<uint64_t, 32>{});
    case 64: return body(std::integral_constant<uint64_t, 64>{});
    case 128: return body(std::integral_constant<uint64_t, 128>{});
    default: return body(dim);
  }
}

// The compact copy's floats, kept by each thread from batch to batch: a fresh
// buffer a batch (a MB or two) cost a page fault every 4 KiB and a zero fill,
// a fifth of the get. Larger copies than kKeptScratchFloats get a buffer of
// their own, so that no thread keeps one batch's peak for good.
constexpr uint64_t kKeptScratchFloats = uint64_t{1} << 22;  // 16 MiB

class CompactScratch {
 public:
  explicit CompactScratch(uint64_t floats) {
    thread_local std::unique_ptr<float[]> kept;
    thread_local uint64_t kept_floats = 0;
    if (floats > kKeptScratchFloats) {
      own_.reset(new float[floats]);
      data_ = own_.get();
      return;
    }
    if (floats > kept_floats) {
      kept.reset();  // the old buffer goes before the larger one comes
      kept.reset(new float[floats]);
      kept_floats = floats;
    }
    data_ = kept.get();
  }
  float* data() const { return data_; }

 private:
  std::unique_ptr<float[]> own_;
  float* data_ = nullptr;
};

// Four floats as one value (GCC's vector extension): a row's sums as vector
// adds. Left to itself gcc kept a 16-float row's sums scalar (a byte store of
// touched_ in the same loop may alias them), which took as long as the rest.
typedef float Float4 __attribute__((vector_size(16)));

inline void AddRow(float* __restrict to, const float* __restrict from, uint64_t dim) {
  // The bound as a multiple of 4 (not j + 4 <= dim): gcc 12 cannot tell that
  // j + 4 does not wrap and warns that the tail loop may run 2^62 times.
  const uint64_t whole = dim & ~uint64_t{3};
  uint64_t j = 0;
  for (; j < whole; j += 4) {
    Float4 a, b;
    std::memcpy(&a, to + j, sizeof a);
    std::memcpy(&b, from + j, sizeof b);
    a += b;
    std::memcpy(to + j, &a, sizeof a);
  }
  for (; j < dim; ++j) to[j] += from[j];
}

}  // namespace

BatchRows::BatchRows(const SparseOptimizer& optimizer, std::string who)
    : optimizer_(optimizer), who_(std::move(who)) {
  optimizer_.validate();
}

void BatchRows::Reset(uint64_t n) {
  rows_.assign(n, nullptr);
  grads_.assign(n * static_cast<uint64_t>(optimizer_.dim), 0.0f);
  touched_.assign(n, 0);
  updated_.assign(n, 0);
}

void BatchRows::CheckPositions(const int64_t* positions, uint64_t n, const char* what) const {
  // One branch-free pass (it vectorizes; a negative position is a huge unsigned
  // one), then the loop that names the first bad position only if there is one.
  const uint64_t size = rows_.size();
  bool any_outside = false;
  for (uint64_t i = 0; i < n; ++i) any_outside |= static_cast<uint64_t>(positions[i]) >= size;
  if (!any_outside) return;
  for (uint64_t i = 0; i < n; ++i) {
    if (static_cast<uint64_t>(positions[i]) >= size) {
      throw std::out_of_range(who_ + " " + what + ": positions[" + std::to_string(i) + "] = " +
                              std::to_string(positions[i]) + " is outside [0, " + std::to_string(size) + ")");
    }
  }
}

RowLayout BatchRows::CheckLayout(RowLayout layout, uint64_t n, const char* what) const {
  const uint64_t dim = static_cast<uint64_t>(optimizer_.dim);
  if (layout.group_stride == 0) layout.group_stride = layout.group * dim;
  if (layout.group == 0 || n % layout.group != 0 || layout.group_stride < layout.group * dim) {
    throw std::invalid_argument(who_ + " " + what + ": " + std::to_string(n) + " rows do not fit groups of " +
                                std::to_string(layout.group) + " rows of " + std::to_string(dim) +
                                " floats every " + std::to_string(layout.group_stride) + " floats");
  }
  return layout;
}

void BatchRows::Get(const int64_t* positions, uint64_t n, float* embeddings, RowLayout layout) const {
  CheckPositions(positions, n, "get");
  layout = CheckLayout(layout, n, "get");
  const uint64_t size = rows_.size();
  WithRowWidth(static_cast<uint64_t>(optimizer_.dim), [&](auto dim) {
    const uint64_t row_bytes = dim * sizeof(float);
    if (n <= 2 * size) {
      RowOffsets at(layout, dim);
      for (uint64_t i = 0; i < n; ++i, ++at) {
        if (i + kLookahead < n) __builtin_prefetch(rows_[positions[i + kLookahead]]);
        std::memcpy(embeddings + *at, rows_[positions[i]], row_bytes);
      }
      return;
    }
    // Many examples a key (a whole batch): each scattered row is read once into
    // a compact copy, which the examples then read from the cache.
    const CompactScratch compact(size * dim);
    for (uint64_t p = 0; p < size; ++p) {
      if (p + kLookahead < size) __builtin_prefetch(rows_[p + kLookahead]);
      std::memcpy(compact.data() + p * dim, rows_[p], row_bytes);
    }
    const float* __restrict from = compact.data();
    float* __restrict to = embeddings;
    RowOffsets at(layout, dim);
    for (uint64_t i = 0; i < n; ++i, ++at) std::memcpy(to + *at, from + positions[i] * dim, row_bytes);
  });
}

void BatchRows::Accumulate(const int64_t* positions, uint64_t n, const float* grads, RowLayout layout) {
  CheckPositions(positions, n, "accumulate");
  layout = CheckLayout(layout, n, "accumulate");
  float* sums = grads_.data();
  uint8_t* touched = touched_.data();
  WithRowWidth(static_cast<uint64_t>(optimizer_.dim), [&](auto dim) {
    RowOffsets at(layout, dim);
    for (uint64_t i = 0; i < n; ++i, ++at) {
      AddRow(sums + positions[i] * dim, grads + *at, dim);
      touched[positions[i]] = 1;
    }
  });
}

void BatchRows::RefuseNonFiniteSums(const uint64_t* keys) const {
  // The rows that got no gradient sum to zero: one pass over them all.
  if (AnyNonFinite(grads_.data(), grads_.size())) {
    detail::RefuseNonFinite(who_ + " apply", keys, grads_.data(), rows_.size(), static_cast<uint32_t>(optimizer_.dim));
  }
}

void BatchRows::RefuseNonFiniteStep(const uint64_t* keys, uint64_t count) const {
  const uint32_t dim = static_cast<uint32_t>(optimizer_.dim);
  for (uint64_t p = 0; p < rows_.size(); ++p) {
    if (touched_[p] && !StepStaysFinite(optimizer_, RowValues{Row(p)}, grads_.data() + p * dim)) {
      detail::RefuseNonFiniteStep(who_ + " apply", count, keys[p], optimizer_, Row(p), grads_.data() + p * dim);
    }
  }
  detail::RefuseNonFiniteStep(who_ + " apply", 0, 0, optimizer_, nullptr, nullptr);  // (not reached)
}

void BatchRows::RefuseNonFinite(const uint64_t* keys) const {
  RefuseNonFiniteSums(keys);
  // Then every step, run dry, before any row steps.
  const uint32_t dim = static_cast<uint32_t>(optimizer_.dim);
  const uint64_t row_bytes = sizeof(float) * static_cast<uint64_t>(optimizer_.row_floats());
  const uint64_t size = rows_.size();
  uint64_t bad = 0;
  for (uint64_t p = 0; p < size; ++p) {
    if (p + kLookahead < size && touched_[p + kLookahead]) {
      const char* ahead = reinterpret_cast<const char*>(rows_[p + kLookahead]);
      for (uint64_t line = 0; line < row_bytes; line += 64) __builtin_prefetch(ahead + line);
    }
    if (touched_[p]) bad += !StepStaysFinite(optimizer_, RowValues{Row(p)}, grads_.data() + p * dim);
  }
  if (bad != 0) RefuseNonFiniteStep(keys, bad);
}

uint64_t BatchRows::Apply(const uint64_t* keys, std::vector<int64_t>* stepped) {
  const uint32_t dim = static_cast<uint32_t>(optimizer_.dim);
  const uint32_t width = static_cast<uint32_t>(optimizer_.row_floats());
  const uint64_t row_bytes = sizeof(float) * uint64_t{width};
  const uint64_t size = rows_.size();
  uint64_t count = 0;
  for (uint64_t p = 0; p < size; ++p) count += touched_[p];
  // All or nothing: each row is copied to a journal as it steps, and a step
  // that leaves a value not finite (ApplyUpdateFinite) puts every row back.
  // (A dry run of each step first, to write none until all were known to be
  // finite, cost as much again as the step, its square roots and divisions.)
  // A gradient sum that is not finite leaves a value of its row so under every
  // optimizer (each sum's float reaches a value the step sets: SGD's row, the
  // AdaGrads' squares, Adam's moments), so it needs no pass of its own: the
  // sums are read only to name the cause once a step has failed.
  const CompactScratch journal(count * width);
  uint64_t bad = 0;
  for (uint64_t p = 0, k = 0; p < size; ++p) {
    if (p + kLookahead < size && touched_[p + kLookahead]) {
      const char* ahead = reinterpret_cast<const char*>(rows_[p + kLookahead]);
      for (uint64_t line = 0; line < row_bytes; line += 64) __builtin_prefetch(ahead + line, 1);
    }
    if (!touched_[p]) continue;
    std::memcpy(journal.data() + k++ * width, Row(p), row_bytes);
    bad += !ApplyUpdateFinite(optimizer_, Row(p), grads_.data() + p * dim);
  }
  if (bad != 0) {
    for (uint64_t p = 0, k = 0; p < size; ++p) {
      if (touched_[p]) std::memcpy(Row(p), journal.data() + k++ * width, row_bytes);
    }
    RefuseNonFiniteSums(keys);  // the cause named, if it was a sum
    RefuseNonFiniteStep(keys, bad);
  }
  if (stepped) stepped->reserve(stepped->size() + count);
  for (uint64_t p = 0; p < size; ++p) {
    if (!touched_[p]) continue;
    ZeroRow(grads_.data() + p * dim, dim);
    touched_[p] = 0;
    updated_[p] = 1;
    if (stepped) stepped->push_back(static_cast<int64_t>(p));
  }
  return count;
}

void BatchRows::Rows(const int64_t* positions, uint64_t n, float* rows) const {
  CheckPositions(positions, n, "rows");
  const uint32_t width = static_cast<uint32_t>(optimizer_.row_floats());
  for (uint64_t i = 0; i < n; ++i) CopyRow(rows + i * width, Row(positions[i]), width);
}

void BatchRows::CopyRows(const int64_t* from, const int64_t* to, uint64_t n) {
  CheckPositions(from, n, "copy (from)");
  CheckPositions(to, n, "copy (to)");
  const uint64_t row_bytes = sizeof(float) * static_cast<uint64_t>(optimizer_.row_floats());
  for (uint64_t i = 0; i < n; ++i) {
    if (from[i] != to[i]) std::memcpy(rows_[to[i]], rows_[from[i]], row_bytes);  // two pairs, two rows
  }
}

}  // namespace hps::detail
