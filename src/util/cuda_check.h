// The CUDA sources' error check (for .cu files only): a failed runtime call
// becomes std::runtime_error naming the file, line, call and CUDA's reason.
#pragma once

#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

namespace hps::detail {

inline void CudaCheck(cudaError_t status, const char* what, const char* file, int line) {
  if (status != cudaSuccess) {
    throw std::runtime_error(std::string(file) + ":" + std::to_string(line) + ": " + what + ": " +
                             cudaGetErrorString(status));
  }
}

}  // namespace hps::detail

#define HPS_CUDA_TRY(call) ::hps::detail::CudaCheck((call), #call, __FILE__, __LINE__)
