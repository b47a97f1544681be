#include "table/nonfinite.h"

#include <cmath>
#include <sstream>

#include "hps/errors.h"
#include "hps/keys.h"  // kEmptyKey

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

}  // namespace hps::detail
