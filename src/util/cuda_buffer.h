// Device memory kept from call to call: grown when a call needs more, freed
// with its owner, on its GPU. (CUDA translation units only.)
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "util/cuda_check.h"

namespace hps::detail {

class GrowingBuffer {
 public:
  GrowingBuffer() = default;
  GrowingBuffer(const GrowingBuffer&) = delete;
  GrowingBuffer& operator=(const GrowingBuffer&) = delete;
  ~GrowingBuffer() { Free(); }
  // At least `bytes` on GPU `gpu` (null for 0 bytes); what it held before is not kept.
  void* Get(int gpu, uint64_t bytes) {
    if (bytes > bytes_ || (ptr_ != nullptr && gpu != gpu_)) {
      Free();
      if (bytes == 0) return nullptr;
      const CurrentDevice current(gpu);
      HPS_CUDA_TRY(cudaMalloc(&ptr_, bytes));
      gpu_ = gpu;
      bytes_ = bytes;
    }
    return ptr_;
  }

 private:
  void Free() {
    if (ptr_) {
      const CurrentDevice keep;  // (a destructor's too: it may run in the caller's thread at any time)
      cudaSetDevice(gpu_);
      cudaFree(ptr_);
    }
    ptr_ = nullptr;
    bytes_ = 0;
  }

  int gpu_ = 0;
  void* ptr_ = nullptr;
  uint64_t bytes_ = 0;
};

}  // namespace hps::detail
