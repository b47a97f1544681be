// Keys as every layer sees them: the reserved empty-slot key and the bulk
// helpers over key arrays. A leaf header (layer: util), so that the file
// formats, the stores and the caches check keys without including the hash
// table.
#pragma once

#include <cstdint>
#include <vector>

namespace hps {

// Reserved as the empty-slot marker; rejected as a key at every API boundary.
inline constexpr uint64_t kEmptyKey = ~uint64_t{0};

// Throws std::invalid_argument if a key equals kEmptyKey, naming its index.
void CheckKeys(const uint64_t* keys, uint64_t n);

// The distinct keys in order of first appearance; inverse[i] (n entries) is
// the index of keys[i] among them. A hash pass, cheaper than sorting. Throws
// like CheckKeys.
std::vector<uint64_t> UniqueKeys(const uint64_t* keys, uint64_t n, int64_t* inverse);

// The other half of UniqueKeys for gradients: out (n_unique, width) gets, in
// row inverse[i], the sum of rows[i] (n, width). One pass in order, so the sums
// are deterministic. Throws std::out_of_range for an index outside [0, n_unique).
void SumByInverse(const int64_t* inverse, uint64_t n, const float* rows, int32_t width, uint64_t n_unique,
                  float* out);

}  // namespace hps
