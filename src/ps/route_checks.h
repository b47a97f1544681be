// The checks of a route plan that the host executor (topology.cc) and the CUDA
// one (topology_cuda.cu) both make before they move a byte, so that the CPU
// tests test what the GPUs' executor refuses.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "hps/topology.h"

namespace hps::detail {

// Over plan.routes (e * e, as bytes): each route is for its own pair, a pair
// with bytes has a route, and a relay's middleman is one of the e endpoints
// (the executors stage there, indexing their buffers by it); and the
// matrix's total fits in 64 bits, so that no segment offset or staging size
// (each a sum of some of its entries) wraps around to a small one. Throws
// std::invalid_argument starting with `executor` and naming the route.
// REQUIRES: plan.routes.size() == bytes.size() == e * e.
void CheckRoutes(const char* executor, const RoutePlan& plan, const std::vector<uint64_t>& bytes, size_t e);

}  // namespace hps::detail
