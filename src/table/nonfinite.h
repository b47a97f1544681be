// Gradient sums that are not numbers, which an optimizer step refuses: a NaN
// or an infinity pushed, or finite gradients whose sum overflowed. Stepped,
// such a sum makes its row NaN for good (SGD: -inf, then inf - inf at the
// next step), and every later pull and checkpoint holds it. Checked once a
// step, over the sums, before any row changes; the caller's lock covers them.
//
// Then the steps themselves: a finite sum can still step a row past float32's
// range (SGD's lr * g, AdaGrad's and Adam's g * g), after which the row is
// -inf, or its sum of squares inf and the row never moves again. Each step is
// run dry first (StepStaysFinite, optimizer_kernels.h), and refused, before
// any row changes, if it would leave a value that is not finite.
#pragma once

#include <cstdint>
#include <cstring>
#include <string>

#include "hps/optimizer.h"
#include "table/table_kernels.h"  // TableRef

namespace hps::detail {

// Whether any of the n floats is a NaN or an infinity (its exponent bits all
// ones): one branch-free pass, four floats at a time as one value (GCC's vector
// extension; gcc at -O2 left the plain loop scalar). Inline: a table's check
// calls it row by row.
inline bool AnyNonFinite(const float* values, uint64_t n) {
  constexpr uint32_t kExponent = 0x7f800000u;
  typedef uint32_t Bits4 __attribute__((vector_size(16)));
  const Bits4 exponent = {kExponent, kExponent, kExponent, kExponent};
  Bits4 any = {0, 0, 0, 0};
  const uint64_t whole = n & ~uint64_t{3};  // (not i + 4 <= n: see batch_rows.cc's AddRow)
  uint64_t i = 0;
  for (; i < whole; i += 4) {
    Bits4 b;
    std::memcpy(&b, values + i, sizeof b);
    any |= (Bits4)((b & exponent) == exponent);  // all ones in a lane that is not finite
  }
  uint32_t tail = 0;
  for (; i < n; ++i) {
    uint32_t b;
    std::memcpy(&b, values + i, sizeof b);
    tail |= (b & kExponent) == kExponent;
  }
  return (any[0] | any[1] | any[2] | any[3] | tail) != 0;
}

// Throws DivergedError for the sums (n rows of dim floats, keys[i]'s at
// i * dim; a row whose key is kEmptyKey is skipped, a free slot of a table):
// "<what>: N non-finite values in the summed gradients of K keys (key X
// first: inf): ...". REQUIRES: AnyNonFinite found one among them.
[[noreturn]] void RefuseNonFinite(const std::string& what, const uint64_t* keys, const float* sums, uint64_t n,
                                  uint32_t dim);

// Throws DivergedError for steps that would leave a row not finite: `keys` of
// them, the first `key`, whose row is `row` (nullptr: the key's initial row,
// for a table that lacks it) and gradient sum `grad`: "<what>: the step of N
// keys would leave a value that is not finite in their rows (key X first: its
// AdaGrad sum of squared gradients, column 2, would be inf): ...". REQUIRES:
// that step is one (StepStaysFinite is false).
[[noreturn]] void RefuseNonFiniteStep(const std::string& what, uint64_t keys, uint64_t key, const SparseOptimizer& opt,
                                      const float* row, const float* grad);

// The same for a table's step with a table of sums (both in host memory; rows
// of opt.row_floats() and opt.dim floats), counting the keys and naming the
// first in the sums' slot order, as apply_summed_gradients steps them (a key
// the table lacks from its initial row). REQUIRES: some step is one.
[[noreturn]] void RefuseNonFiniteSteps(const std::string& what, const TableRef& table, const TableRef& sums,
                                       const SparseOptimizer& opt);

}  // namespace hps::detail
