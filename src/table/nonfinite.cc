#include "table/nonfinite.h"

#include <cmath>
#include <sstream>
#include <utility>

#include "hps/errors.h"
#include "hps/keys.h"  // kEmptyKey
#include "table/optimizer_kernels.h"

namespace hps::detail {

void RefuseNonFinite(const std::string& what, const uint64_t* keys, const float* sums, uint64_t n, uint32_t dim) {
  uint64_t values = 0, rows = 0, first = 0;
  float first_value = 0.0f;
  for (uint64_t i = 0; i < n; ++i) {
    if (keys[i] == kEmptyKey) continue;
    const float* row = sums + i * dim;
    uint64_t bad = 0;
    for (uint32_t j = 0; j < dim; ++j) {
      if (std::isfinite(row[j])) continue;
      if (rows == 0 && bad == 0) {
        first = keys[i];
        first_value = row[j];
      }
      ++bad;
    }
    values += bad;
    rows += bad != 0;
  }
  std::ostringstream out;
  out << what << ": " << values << " non-finite value" << (values == 1 ? "" : "s") << " in the summed gradients of "
      << rows << " key" << (rows == 1 ? "" : "s") << " (key " << first << " first: "
      << (std::isnan(first_value) ? "nan" : first_value > 0 ? "inf" : "-inf")
      << "): training diverged (a gradient pushed so, or finite ones whose sum overflowed); no row was stepped";
  throw DivergedError(out.str());
}

namespace {

// What float i of a row of `opt` holds, for a message: "its embedding, column
// 2,", "its row-wise AdaGrad sum of squared gradients".
std::string RowPart(const SparseOptimizer& opt, uint32_t i) {
  const uint32_t dim = static_cast<uint32_t>(opt.dim);
  const auto column = [](uint32_t j) { return ", column " + std::to_string(j) + ","; };
  if (i < dim) return "its embedding" + column(i);
  i -= dim;
  switch (opt.opt.kind) {
    case OptimizerKind::kAdaGrad:
      return "its AdaGrad sum of squared gradients" + column(i);
    case OptimizerKind::kRowWiseAdaGrad:
      return "its row-wise AdaGrad sum of squared gradients";
    case OptimizerKind::kAdam:
      if (i < dim) return "its Adam first moment" + column(i);
      if (i < 2 * dim) return "its Adam second moment" + column(i - dim);
      return "its Adam step count";
    case OptimizerKind::kSgd:
      break;
  }
  return "its float " + std::to_string(i + dim);
}

// The first value of the step that is not finite: (index, value).
template <class Values>
std::pair<uint32_t, float> FirstNonFinite(const SparseOptimizer& opt, const Values& values, const float* grad) {
  DryRow<Values, /*kFirst=*/true> dry{values};
  StepRow(opt, dry, grad);
  return {dry.first, dry.first_value};
}

}  // namespace

void RefuseNonFiniteStep(const std::string& what, uint64_t keys, uint64_t key, const SparseOptimizer& opt,
                         const float* row, const float* grad) {
  std::ostringstream out;
  if (keys == 0) {
    // (The GPU's kernel found one, the host's same steps none: the two
    // compilers contracted a multiply and an add differently, at the edge.)
    out << what << ": a step would leave a value that is not finite in a row: training diverged (a learning rate, "
        << "or finite gradient sums, too large for float32); no row was stepped";
    throw DivergedError(out.str());
  }
  const auto [at, value] = row ? FirstNonFinite(opt, RowValues{row}, grad)
                               : FirstNonFinite(opt, InitialRowValue{&opt, key}, grad);
  const bool one = keys == 1;
  out << what << ": the step of " << keys << " key" << (one ? "" : "s")
      << " would leave a value that is not finite in " << (one ? "its row" : "their rows") << " (key " << key
      << " first: " << RowPart(opt, at) << " would be "
      << (std::isnan(value) ? "nan" : value > 0 ? "inf" : "-inf")
      << "): training diverged (a learning rate, or finite gradient sums, too large for float32); no row was stepped";
  throw DivergedError(out.str());
}

void RefuseNonFiniteSteps(const std::string& what, const TableRef& table, const TableRef& sums,
                          const SparseOptimizer& opt) {
  uint64_t keys = 0, first = kEmptyKey;
  const float* first_row = nullptr;
  const float* first_grad = nullptr;
  for (uint64_t s = 0; s < sums.slots; ++s) {
    const uint64_t key = sums.keys[s];
    if (key == kEmptyKey) continue;
    const int64_t slot = FindSlot(table, key);
    const float* row = slot >= 0 ? table.row(static_cast<uint64_t>(slot)) : nullptr;
    const bool ok = row ? StepStaysFinite(opt, RowValues{row}, sums.row(s))
                        : StepStaysFinite(opt, InitialRowValue{&opt, key}, sums.row(s));
    if (ok) continue;
    if (keys++ == 0) {
      first = key;
      first_row = row;
      first_grad = sums.row(s);
    }
  }
  RefuseNonFiniteStep(what, keys, first, opt, first_row, first_grad);
}

}  // namespace hps::detail
