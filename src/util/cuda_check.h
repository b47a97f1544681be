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

// The calling thread's current device, restored when the scope ends; and,
// given a device, that device made current for the scope. A public call that
// selects its GPU leaves the caller's current device as it found it: torch,
// among others, takes the current device for a tensor made without one, which
// would otherwise land on whichever GPU the tier touched last.
class CurrentDevice {
 public:
  CurrentDevice() {
    if (cudaGetDevice(&saved_) != cudaSuccess) {
      cudaGetLastError();  // no device: nothing to restore, and no sticky error left
      saved_ = -1;
    }
  }
  explicit CurrentDevice(int device) : CurrentDevice() {
    CudaCheck(cudaSetDevice(device), "cudaSetDevice(device)", __FILE__, __LINE__);
  }
  CurrentDevice(const CurrentDevice&) = delete;
  CurrentDevice& operator=(const CurrentDevice&) = delete;
  ~CurrentDevice() {
    if (saved_ >= 0) cudaSetDevice(saved_);
  }

 private:
  int saved_ = -1;
};

}  // namespace hps::detail

#define HPS_CUDA_TRY(call) ::hps::detail::CudaCheck((call), #call, __FILE__, __LINE__)
