// How a device tier moves rows between its devices for a Get or Accumulate
// that crosses them: scratch buffers on each device, the exchange of a route
// plan, and the scatter and gather of rows by index on one device. Host
// partitions move rows with memcpy (ExecuteOnHost); GPUs with kernels and
// peer copies (ExecuteOnCuda). Both run the same row bodies (ScatterRow,
// GatherRow), and the tier's logic above them is one, so the CPU tests test
// what the GPUs run.
//
// Thread safety: one call at a time (the tier's calls are serialised).
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "hps/config.h"
#include "hps/topology.h"
#include "table/table_kernels.h"  // CopyRow

namespace hps::detail {

// out row index[j] <- in row j (the worker's embeddings, put in example order).
HPS_HD inline void ScatterRow(float* out, const float* in, const uint64_t* index, uint64_t j, uint32_t dim) {
  CopyRow(out + index[j] * dim, in + j * dim, dim);
}
// out row j <- in row index[j] (the worker's gradients, put in owner order).
HPS_HD inline void GatherRow(float* out, const float* in, const uint64_t* index, uint64_t j, uint32_t dim) {
  CopyRow(out + j * dim, in + index[j] * dim, dim);
}

class RowMover {
 public:
  enum Slot { kSend = 0, kReceive = 1, kSlots = 2 };
  virtual ~RowMover() = default;

  // Scratch for `floats` floats on device d, kept for the next call (grown
  // when too small); its contents are not kept across calls.
  virtual float* Buffer(int32_t device, Slot slot, uint64_t floats) = 0;
  // The plan's exchange between buffers (topology.h's executors' layout).
  virtual void Exchange(const RoutePlan& plan, const std::vector<uint64_t>& bytes,
                        const std::vector<const uint8_t*>& send, const std::vector<uint8_t*>& receive) = 0;
  // On device `device`: caller's out (n rows, host memory or, on a GPU, that
  // device's) row index[j] <- buffer `in` row j.
  virtual void ScatterOut(int32_t device, const uint64_t* index, uint64_t n, uint32_t dim, const float* in,
                          float* out) = 0;
  // On device `device`: buffer `out` row j <- caller's in row index[j].
  virtual void GatherIn(int32_t device, const uint64_t* index, uint64_t n, uint32_t dim, const float* in,
                        float* out) = 0;
};

std::unique_ptr<RowMover> NewHostRowMover(int32_t devices);
// Endpoint e (the tier's devices, then a topology's other endpoints) is CUDA
// device gpus[e]. Throws std::runtime_error in a build without CUDA.
std::unique_ptr<RowMover> NewCudaRowMover(const std::vector<int32_t>& gpus);

// Host memory that grows on demand and is kept (DeviceTier::StagingRows):
// page-locked (cudaHostAlloc) for a CUDA tier, plain otherwise and in a build
// without CUDA. Get's memory is valid until the next Get.
class HostStaging {
 public:
  virtual ~HostStaging() = default;
  virtual float* Get(uint64_t floats) = 0;
};
std::unique_ptr<HostStaging> NewHostStaging(bool page_locked);
std::unique_ptr<HostStaging> NewPlainHostStaging();

// A plan that sends every pair's rows straight from source to destination
// (what a tier without a topology does), over `endpoints` endpoints.
RoutePlan DirectPlan(int32_t endpoints);

}  // namespace hps::detail
