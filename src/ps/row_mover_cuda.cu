// The GPUs' RowMover (row_mover.h): buffers in each GPU's memory, the exchange
// by ExecuteOnCuda, and the host mover's row bodies as kernels. The caller's
// memory (ScatterOut's out, GatherIn's in) may be host memory or a GPU's:
// it is staged on the device with cudaMemcpyDefault.
#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

#include "ps/row_mover.h"
#include "util/cuda_buffer.h"
#include "util/cuda_check.h"

namespace hps::detail {
namespace {

constexpr int kBlock = 256;

__global__ void ScatterKernel(float* out, const float* in, const uint64_t* index, uint64_t n, uint32_t dim) {
  const uint64_t j = blockIdx.x * uint64_t{blockDim.x} + threadIdx.x;
  if (j < n) ScatterRow(out, in, index, j, dim);
}

__global__ void GatherKernel(float* out, const float* in, const uint64_t* index, uint64_t n, uint32_t dim) {
  const uint64_t j = blockIdx.x * uint64_t{blockDim.x} + threadIdx.x;
  if (j < n) GatherRow(out, in, index, j, dim);
}

unsigned Blocks(uint64_t n) { return static_cast<unsigned>((n + kBlock - 1) / kBlock); }

class CudaRowMover final : public RowMover {
 public:
  explicit CudaRowMover(std::vector<int32_t> gpus)
      : gpus_(std::move(gpus)), buffers_(gpus_.size() * kSlots), index_(gpus_.size()), stage_(gpus_.size()) {}

  float* Buffer(int32_t device, Slot slot, uint64_t floats) override {
    const detail::CurrentDevice keep;
    const auto d = static_cast<size_t>(device);
    return static_cast<float*>(buffers_.at(d * kSlots + slot).Get(gpus_.at(d), floats * sizeof(float)));
  }

  void Exchange(const RoutePlan& plan, const std::vector<uint64_t>& bytes, const std::vector<const uint8_t*>& send,
                const std::vector<uint8_t*>& receive) override {
    const detail::CurrentDevice keep;
    ExecuteOnCuda(plan, bytes, gpus_, send, receive, exchange_);
  }

  void ScatterOut(int32_t device, const uint64_t* index, uint64_t n, uint32_t dim, const float* in,
                  float* out) override {
    const detail::CurrentDevice keep;
    if (n == 0) return;
    const auto d = static_cast<size_t>(device);
    const uint64_t* d_index = Index(d, index, n);
    auto* staged = static_cast<float*>(stage_[d].Get(gpus_[d], n * dim * sizeof(float)));
    ScatterKernel<<<Blocks(n), kBlock>>>(staged, in, d_index, n, dim);
    HPS_CUDA_TRY(cudaGetLastError());
    HPS_CUDA_TRY(cudaMemcpy(out, staged, n * dim * sizeof(float), cudaMemcpyDefault));
    // A copy between two devices' memory does not wait for the host: `out`
    // (a torch tensor on another GPU, say) must be whole when this returns,
    // and the next Exchange must not overwrite `in` while the kernel reads it.
    HPS_CUDA_TRY(cudaDeviceSynchronize());
  }

  void GatherIn(int32_t device, const uint64_t* index, uint64_t n, uint32_t dim, const float* in,
                float* out) override {
    const detail::CurrentDevice keep;
    if (n == 0) return;
    const auto d = static_cast<size_t>(device);
    const uint64_t* d_index = Index(d, index, n);
    auto* staged = static_cast<float*>(stage_[d].Get(gpus_[d], n * dim * sizeof(float)));
    HPS_CUDA_TRY(cudaMemcpy(staged, in, n * dim * sizeof(float), cudaMemcpyDefault));
    GatherKernel<<<Blocks(n), kBlock>>>(out, staged, d_index, n, dim);
    HPS_CUDA_TRY(cudaGetLastError());
    HPS_CUDA_TRY(cudaDeviceSynchronize());
  }

 private:
  // The index uploaded to device d's GPU (which is made current).
  const uint64_t* Index(size_t d, const uint64_t* index, uint64_t n) {
    auto* p = static_cast<uint64_t*>(index_[d].Get(gpus_[d], n * sizeof(uint64_t)));
    HPS_CUDA_TRY(cudaSetDevice(gpus_[d]));
    HPS_CUDA_TRY(cudaMemcpy(p, index, n * sizeof(uint64_t), cudaMemcpyHostToDevice));
    return p;
  }

  std::vector<int32_t> gpus_;
  std::vector<GrowingBuffer> buffers_;  // [device * kSlots + slot]
  std::vector<GrowingBuffer> index_, stage_;
  CudaExchangeBuffers exchange_;  // the exchanges' staging and streams, kept from batch to batch
};

// Page-locked host memory: the GPUs' DMA engines read it directly.
class PageLockedHostStaging final : public HostStaging {
 public:
  PageLockedHostStaging() = default;
  PageLockedHostStaging(const PageLockedHostStaging&) = delete;
  PageLockedHostStaging& operator=(const PageLockedHostStaging&) = delete;
  ~PageLockedHostStaging() override {
    if (data_) cudaFreeHost(data_);
  }
  float* Get(uint64_t floats) override {
    if (floats > size_) {
      float* old = data_;
      data_ = nullptr;  // not freed again by the destructor if the free below fails
      size_ = 0;
      if (old) HPS_CUDA_TRY(cudaFreeHost(old));
      HPS_CUDA_TRY(cudaHostAlloc(reinterpret_cast<void**>(&data_), floats * sizeof(float), cudaHostAllocPortable));
      size_ = floats;
    }
    return data_;
  }

 private:
  float* data_ = nullptr;
  uint64_t size_ = 0;
};

}  // namespace

std::unique_ptr<HostStaging> NewHostStaging(bool page_locked) {
  if (!page_locked) return NewPlainHostStaging();
  return std::make_unique<PageLockedHostStaging>();
}

std::unique_ptr<RowMover> NewCudaRowMover(const std::vector<int32_t>& gpus) {
  return std::make_unique<CudaRowMover>(gpus);
}

}  // namespace hps::detail
