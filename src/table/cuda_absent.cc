// Built instead of hash_table_cuda.cu when CUDA is off or not found: the CUDA
// entry points report that this build has no CUDA.
#include <stdexcept>

#include "hps/hash_table.h"

namespace hps {

std::unique_ptr<HashTable> NewCudaHashTable(const HashTableOptions& options) {
  throw std::runtime_error("hash table: CUDA device " + std::to_string(options.cuda_device) +
                           " requested, but this build of hps has no CUDA support "
                           "(configure with HPS_CUDA=ON and nvcc on the PATH)");
}

bool CudaCompiled() { return false; }

int CudaDeviceCount() { return 0; }

}  // namespace hps
