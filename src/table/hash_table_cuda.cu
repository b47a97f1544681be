// The CUDA launcher of the hash table: slots and rows in device memory, one
// thread per key running the bodies of table_kernels.h. The bulk calls take
// host arrays (the same contract as the CPU launcher), stage them through
// device buffers and block until done.
//
// Threads may share a key here, so accumulation uses atomic adds, and
// operations that both claim and read a row run as two kernels: the kernel
// boundary orders a claimer's row write before any reader of that row.
#include <cuda_runtime.h>

#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include "hps/hash_table.h"
#include "table/nonfinite.h"
#include "table/table_kernels.h"
#include "util/cuda_check.h"

namespace hps {
namespace {

using detail::FindOrClaim;
using detail::FindSlot;
using detail::TableRef;

constexpr int kBlock = 256;
unsigned Blocks(uint64_t n) { return static_cast<unsigned>((n + kBlock - 1) / kBlock); }

struct Counters {
  unsigned long long claimed;
  unsigned long long counted;
  unsigned long long full;
  unsigned long long diverged;  // CheckSumsKernel's steps that would leave a row not finite
  unsigned long long lacking;   // CheckSumsKernel's keys the table lacks, each of which its step claims
};

__device__ void Count(unsigned long long* c) { atomicAdd(c, 1ULL); }

__global__ void FillKeys(uint64_t* keys, uint64_t n) {
  const uint64_t i = blockIdx.x * uint64_t{blockDim.x} + threadIdx.x;
  if (i < n) keys[i] = kEmptyKey;
}

__global__ void InsertKernel(TableRef t, const uint64_t* keys, uint64_t n, const float* rows,
                             uint8_t* inserted, Counters* c) {
  const uint64_t i = blockIdx.x * uint64_t{blockDim.x} + threadIdx.x;
  if (i >= n) return;
  bool claimed = false;
  const int64_t slot = FindOrClaim(t, keys[i], &claimed);
  if (slot < 0) Count(&c->full);
  if (claimed) {
    detail::CopyRow(t.row(slot), rows + i * t.stride, t.stride);
    Count(&c->claimed);
    Count(&c->counted);
  }
  inserted[i] = claimed ? 1 : 0;
}

__global__ void FindKernel(TableRef t, const uint64_t* keys, uint64_t n, uint32_t columns,
                           float* out, uint8_t* found, Counters* c) {
  const uint64_t i = blockIdx.x * uint64_t{blockDim.x} + threadIdx.x;
  if (i >= n) return;
  const int64_t slot = FindSlot(t, keys[i]);
  if (slot >= 0) {
    detail::CopyRow(out + i * columns, t.row(slot), columns);
    Count(&c->counted);
  } else {
    detail::ZeroRow(out + i * columns, columns);
  }
  found[i] = slot >= 0 ? 1 : 0;
}

__global__ void AccumulateKernel(TableRef t, const uint64_t* keys, uint64_t n, const float* deltas,
                                 Counters* c) {
  const uint64_t i = blockIdx.x * uint64_t{blockDim.x} + threadIdx.x;
  if (i >= n) return;
  bool claimed = false;
  const int64_t slot = FindOrClaim(t, keys[i], &claimed);
  if (slot < 0) {
    Count(&c->full);
    return;
  }
  if (claimed) Count(&c->claimed);
  detail::AddRow<true>(t.row(slot), deltas + i * t.stride, t.stride);
}

// writes (null: every key is distinct): whether keys[i] is its key's last in
// the call, the one whose row is stored.
__global__ void AssignKernel(TableRef t, const uint64_t* keys, uint64_t n, const float* rows,
                             const uint8_t* writes, uint8_t* found, Counters* c) {
  const uint64_t i = blockIdx.x * uint64_t{blockDim.x} + threadIdx.x;
  if (i >= n) return;
  const int64_t slot = FindSlot(t, keys[i]);
  if (slot >= 0) {
    if (writes == nullptr || writes[i]) detail::CopyRow(t.row(slot), rows + i * t.stride, t.stride);
    Count(&c->counted);
  }
  found[i] = slot >= 0 ? 1 : 0;
}

// Phase one of lookup_or_init: make every key present, initialised.
__global__ void EnsureKernel(TableRef t, const uint64_t* keys, uint64_t n, SparseOptimizer opt,
                             Counters* c) {
  const uint64_t i = blockIdx.x * uint64_t{blockDim.x} + threadIdx.x;
  if (i >= n) return;
  bool claimed = false;
  const int64_t slot = FindOrClaim(t, keys[i], &claimed);
  if (slot < 0) Count(&c->full);
  if (claimed) {
    detail::InitRow(opt, keys[i], t.row(slot));
    Count(&c->claimed);
  }
}

// One thread per slot of the gradient-sum table: each distinct key once.
__global__ void ApplyKernel(TableRef t, TableRef sums, SparseOptimizer opt, Counters* c) {
  const uint64_t s = blockIdx.x * uint64_t{blockDim.x} + threadIdx.x;
  if (s >= sums.slots) return;
  const uint64_t key = sums.keys[s];
  if (key == kEmptyKey) return;
  bool claimed = false;
  const int64_t slot = FindOrClaim(t, key, &claimed);
  if (slot < 0) {
    Count(&c->full);
    return;
  }
  if (claimed) {
    detail::InitRow(opt, key, t.row(slot));
    Count(&c->claimed);
  }
  detail::ApplyUpdate(opt, t.row(slot), sums.row(s));
}

// One thread per slot: counts (in c->counted) the keys whose row holds a NaN
// or an infinity (its exponent bits all ones).
__global__ void NonFiniteKernel(TableRef t, Counters* c) {
  const uint64_t s = blockIdx.x * uint64_t{blockDim.x} + threadIdx.x;
  if (s >= t.slots || t.keys[s] == kEmptyKey) return;
  const float* row = t.row(s);
  for (uint32_t j = 0; j < t.stride; ++j) {
    if ((__float_as_uint(row[j]) & 0x7f800000u) == 0x7f800000u) {
      Count(&c->counted);
      return;
    }
  }
}

// One thread per slot of the gradient-sum table, before ApplyKernel: counts
// the sums that hold a NaN or an infinity (c->counted), the keys whose
// step, run dry on their row (or their initial row, where the table lacks
// them: nothing is claimed), would leave a value that is not finite
// (c->diverged), and the keys the table lacks (c->lacking).
__global__ void CheckSumsKernel(TableRef t, TableRef sums, SparseOptimizer opt, Counters* c) {
  const uint64_t s = blockIdx.x * uint64_t{blockDim.x} + threadIdx.x;
  if (s >= sums.slots) return;
  const uint64_t key = sums.keys[s];
  if (key == kEmptyKey) return;
  const float* grad = sums.row(s);
  for (uint32_t j = 0; j < sums.stride; ++j) {
    if (detail::NotFinite(grad[j])) {
      Count(&c->counted);
      return;
    }
  }
  const int64_t slot = FindSlot(t, key);
  if (slot < 0) Count(&c->lacking);
  const bool ok = slot >= 0 ? detail::StepStaysFinite(opt, detail::RowValues{t.row(slot)}, grad)
                            : detail::StepStaysFinite(opt, detail::InitialRowValue{&opt, key}, grad);
  if (!ok) Count(&c->diverged);
}

__global__ void ExportKernel(TableRef t, uint64_t* keys_out, float* rows_out, uint64_t max_rows,
                             Counters* c) {
  const uint64_t s = blockIdx.x * uint64_t{blockDim.x} + threadIdx.x;
  if (s >= t.slots) return;
  const uint64_t key = t.keys[s];
  if (key == kEmptyKey) return;
  const unsigned long long out = atomicAdd(&c->counted, 1ULL);
  if (out >= max_rows) return;
  keys_out[out] = key;
  detail::CopyRow(rows_out + out * t.stride, t.row(s), t.stride);
}

__global__ void SlotsKernel(TableRef t, const uint64_t* keys, uint64_t n, int64_t* slots, Counters* c) {
  const uint64_t i = blockIdx.x * uint64_t{blockDim.x} + threadIdx.x;
  if (i >= n) return;
  const int64_t slot = FindSlot(t, keys[i]);
  if (slot >= 0) Count(&c->counted);
  slots[i] = slot;
}

// slots: each checked on the host to lie in [0, t.slots).
__global__ void KeysAtKernel(TableRef t, const int64_t* slots, uint64_t n, uint64_t* keys) {
  const uint64_t i = blockIdx.x * uint64_t{blockDim.x} + threadIdx.x;
  if (i < n) keys[i] = t.keys[slots[i]];
}

// A device allocation freed with its owner.
template <class T>
class DeviceArray {
 public:
  explicit DeviceArray(uint64_t count) : count_(count) {
    if (count > 0) HPS_CUDA_TRY(cudaMalloc(&data_, count * sizeof(T)));
  }
  ~DeviceArray() {
    if (data_) cudaFree(data_);
  }
  DeviceArray(const DeviceArray&) = delete;
  DeviceArray& operator=(const DeviceArray&) = delete;

  T* get() const { return data_; }
  // cudaMemcpyDefault: `from` / `to` may be host memory or this GPU's (unified
  // addressing tells which), so rows can come from or go to a torch CUDA tensor.
  void upload(const T* from) { HPS_CUDA_TRY(cudaMemcpy(data_, from, bytes(), cudaMemcpyDefault)); }
  void download(T* to, uint64_t count) const {
    HPS_CUDA_TRY(cudaMemcpy(to, data_, count * sizeof(T), cudaMemcpyDefault));
  }
  uint64_t bytes() const { return count_ * sizeof(T); }

 private:
  uint64_t count_;
  T* data_ = nullptr;
};

class CudaHashTable final : public HashTable {
 public:
  CudaHashTable(uint64_t capacity, int32_t row_floats, int device)
      : device_(device),
        keys_((SetDevice(device), detail::RoundToBuckets(capacity))),
        rows_(detail::RoundToBuckets(capacity) * static_cast<uint64_t>(row_floats)),
        counters_(1) {
    ref_ = TableRef{keys_.get(), rows_.get(), detail::RoundToBuckets(capacity),
                    static_cast<uint32_t>(row_floats)};
    clear();
  }

  uint64_t capacity() const override { return ref_.slots; }
  int32_t row_floats() const override { return static_cast<int32_t>(ref_.stride); }
  uint64_t size() const override { return size_; }
  std::string device() const override { return "cuda:" + std::to_string(device_); }

  uint64_t insert(const uint64_t* keys, uint64_t n, const float* rows, uint8_t* inserted) override {
    std::lock_guard lock(mutex_);
    CheckKeys(keys, n);
    if (n == 0) return 0;
    const detail::CurrentDevice current(device_);
    auto d_keys = Upload(keys, n);
    auto d_rows = Upload(rows, n * ref_.stride);
    DeviceArray<uint8_t> d_flags(n);
    ResetCounters();
    InsertKernel<<<Blocks(n), kBlock>>>(ref_, d_keys->get(), n, d_rows->get(), d_flags.get(),
                                        counters_.get());
    const Counters c = Finish();
    if (inserted) d_flags.download(inserted, n);
    Settle(c);
    return c.counted;
  }

  uint64_t find(const uint64_t* keys, uint64_t n, float* rows_out, uint8_t* found) const override {
    return find_columns(keys, n, row_floats(), rows_out, found);
  }

  uint64_t find_columns(const uint64_t* keys, uint64_t n, int32_t columns, float* rows_out,
                        uint8_t* found) const override {
    std::lock_guard lock(mutex_);
    CheckKeys(keys, n);
    detail::CheckColumns(columns, row_floats());
    return Gather(keys, n, static_cast<uint32_t>(columns), rows_out, found);
  }

  uint64_t row_addresses(const uint64_t*, uint64_t, float**, int64_t*) override {
    throw std::logic_error("hash table on " + device() + ": its rows lie in GPU memory, with no host address");
  }

  uint64_t slots(const uint64_t* keys, uint64_t n, int64_t* slots_out) const override {
    std::lock_guard lock(mutex_);
    CheckKeys(keys, n);
    if (n == 0) return 0;
    const detail::CurrentDevice current(device_);
    auto d_keys = Upload(keys, n);
    DeviceArray<int64_t> d_slots(n);
    ResetCounters();
    SlotsKernel<<<Blocks(n), kBlock>>>(ref_, d_keys->get(), n, d_slots.get(), counters_.get());
    const Counters c = Finish();
    d_slots.download(slots_out, n);
    return c.counted;
  }

  void keys_at(const int64_t* slots, uint64_t n, uint64_t* keys_out) const override {
    std::lock_guard lock(mutex_);
    detail::CheckSlots(slots, n, ref_.slots);
    if (n == 0) return;
    const detail::CurrentDevice current(device_);
    auto d_slots = Upload(slots, n);
    DeviceArray<uint64_t> d_keys(n);
    KeysAtKernel<<<Blocks(n), kBlock>>>(ref_, d_slots->get(), n, d_keys.get());
    Finish();
    d_keys.download(keys_out, n);
  }

  void accumulate(const uint64_t* keys, uint64_t n, const float* deltas) override {
    std::lock_guard lock(mutex_);
    CheckKeys(keys, n);
    if (n == 0) return;
    const detail::CurrentDevice current(device_);
    auto d_keys = Upload(keys, n);
    auto d_deltas = Upload(deltas, n * ref_.stride);
    ResetCounters();
    AccumulateKernel<<<Blocks(n), kBlock>>>(ref_, d_keys->get(), n, d_deltas->get(),
                                            counters_.get());
    Settle(Finish());
  }

  uint64_t assign(const uint64_t* keys, uint64_t n, const float* rows, uint8_t* found) override {
    std::lock_guard lock(mutex_);
    CheckKeys(keys, n);
    if (n == 0) return 0;
    const detail::CurrentDevice current(device_);
    auto d_keys = Upload(keys, n);
    auto d_rows = Upload(rows, n * ref_.stride);
    DeviceArray<uint8_t> d_found(n);
    // Of duplicate keys only the last writes, as the CPU launcher's call order
    // leaves it: threads copying into one row at once would leave a mix of
    // their rows, none of them the caller's.
    std::unique_ptr<DeviceArray<uint8_t>> d_writes;
    std::vector<int64_t> inverse(n);
    const uint64_t distinct = UniqueKeys(keys, n, inverse.data()).size();
    if (distinct < n) {
      std::vector<uint64_t> last(distinct);
      for (uint64_t i = 0; i < n; ++i) last[static_cast<uint64_t>(inverse[i])] = i;
      std::vector<uint8_t> writes(n, 0);
      for (uint64_t i : last) writes[i] = 1;
      d_writes = Upload(writes.data(), n);
    }
    ResetCounters();
    AssignKernel<<<Blocks(n), kBlock>>>(ref_, d_keys->get(), n, d_rows->get(),
                                        d_writes ? d_writes->get() : nullptr, d_found.get(),
                                        counters_.get());
    const Counters c = Finish();
    if (found) d_found.download(found, n);
    return c.counted;
  }

  void lookup_or_init(const uint64_t* keys, uint64_t n, const SparseOptimizer& opt,
                      float* embeddings_out) override {
    std::lock_guard lock(mutex_);
    CheckOptimizer(opt);
    CheckKeys(keys, n);
    if (n == 0) return;
    const detail::CurrentDevice current(device_);
    auto d_keys = Upload(keys, n);
    ResetCounters();
    EnsureKernel<<<Blocks(n), kBlock>>>(ref_, d_keys->get(), n, opt, counters_.get());
    Settle(Finish());
    Gather(keys, n, static_cast<uint32_t>(opt.dim), embeddings_out, nullptr);
  }

  void apply_gradients(const uint64_t* keys, uint64_t n, const float* grads,
                       const SparseOptimizer& opt) override {
    std::lock_guard lock(mutex_);
    CheckOptimizer(opt);
    CheckKeys(keys, n);
    if (n == 0) return;
    CudaHashTable sums(std::max<uint64_t>(2 * n, 64), opt.dim, device_);
    sums.accumulate(keys, n, grads);
    ApplySums(sums, opt, "apply_gradients");
  }

  void apply_summed_gradients(const HashTable& sums, const SparseOptimizer& opt) override {
    if (&sums == this) throw std::invalid_argument("apply_summed_gradients: sums must be another table");
    std::lock_guard lock(mutex_);
    CheckOptimizer(opt);
    const CudaHashTable& cuda = CheckSums(sums, opt, "apply_summed_gradients");
    // The sums' slots are read by the kernel: no call on that table meanwhile
    // (as the CPU table holds its lock shared).
    std::lock_guard sums_lock(cuda.mutex_);
    ApplySums(cuda, opt, "apply_summed_gradients");
  }

  void refuse_nonfinite(const std::string& what) const override {
    std::lock_guard lock(mutex_);
    RefuseNonFiniteRows(what);
  }

  void refuse_failing_steps(const HashTable& sums, const SparseOptimizer& opt,
                            const std::string& what) const override {
    if (&sums == this) throw std::invalid_argument("refuse_failing_steps: sums must be another table");
    std::lock_guard lock(mutex_);
    CheckOptimizer(opt);
    const CudaHashTable& cuda = CheckSums(sums, opt, "refuse_failing_steps");
    std::lock_guard sums_lock(cuda.mutex_);  // (as apply_summed_gradients takes them)
    RefuseFailingSteps(cuda, opt, what);
  }

  uint64_t export_rows(uint64_t* keys_out, float* rows_out, uint64_t max_rows) const override {
    std::lock_guard lock(mutex_);
    const detail::CurrentDevice current(device_);
    const uint64_t n = std::min(max_rows, size_);
    DeviceArray<uint64_t> d_keys(n);
    DeviceArray<float> d_rows(n * ref_.stride);
    ResetCounters();
    ExportKernel<<<Blocks(ref_.slots), kBlock>>>(ref_, d_keys.get(), d_rows.get(), n,
                                                 counters_.get());
    Finish();
    d_keys.download(keys_out, n);
    d_rows.download(rows_out, n * ref_.stride);
    return n;
  }

  void clear() override {
    std::lock_guard lock(mutex_);
    const detail::CurrentDevice current(device_);
    FillKeys<<<Blocks(ref_.slots), kBlock>>>(ref_.keys, ref_.slots);
    // A launch that failed (no kernel image for this GPU, say) is reported
    // here, not blamed on the next call; synchronising does not report it.
    HPS_CUDA_TRY(cudaGetLastError());
    HPS_CUDA_TRY(cudaMemset(ref_.rows, 0, rows_.bytes()));
    HPS_CUDA_TRY(cudaDeviceSynchronize());
    size_ = 0;
  }

 private:
  // REQUIRES: mutex_ held.
  void RefuseNonFiniteRows(const std::string& what) const {
    const detail::CurrentDevice current(device_);
    ResetCounters();
    NonFiniteKernel<<<Blocks(ref_.slots), kBlock>>>(ref_, counters_.get());
    if (Finish().counted == 0) return;
    // Seldom: the table to the host, for the message to name the key.
    std::vector<uint64_t> keys(ref_.slots);
    std::vector<float> rows(ref_.slots * ref_.stride);
    keys_.download(keys.data(), keys.size());
    rows_.download(rows.data(), rows.size());
    detail::RefuseNonFinite(what, keys.data(), rows.data(), ref_.slots, ref_.stride);
  }

  // apply_summed_gradients' and refuse_failing_steps' sums: a table on this
  // device with rows of opt.dim floats, else std::invalid_argument.
  const CudaHashTable& CheckSums(const HashTable& sums, const SparseOptimizer& opt, const char* what) const {
    const auto* cuda = dynamic_cast<const CudaHashTable*>(&sums);
    if (cuda == nullptr || cuda->device_ != device_ || sums.row_floats() != opt.dim) {
      throw std::invalid_argument(std::string(what) + ": sums must be a table on " + device() +
                                  " with rows of dim = " + std::to_string(opt.dim) + " floats, got " +
                                  sums.device() + " with " + std::to_string(sums.row_floats()));
    }
    return *cuda;
  }

  // REQUIRES: mutex_ and sums' held (or sums the call's own). The sums' check
  // (as RefuseNonFiniteRows'), every step's, run dry, and the room for the
  // keys this table lacks, in one kernel and one sync; the tables come to the
  // host only to name the key.
  void RefuseFailingSteps(const CudaHashTable& sums, const SparseOptimizer& opt, const std::string& what) const {
    const detail::CurrentDevice current(device_);
    ResetCounters();
    CheckSumsKernel<<<Blocks(sums.ref_.slots), kBlock>>>(ref_, sums.ref_, opt, counters_.get());
    const Counters c = Finish();
    if (c.counted == 0 && c.diverged == 0) {
      // ApplyKernel claims a slot for each key the table lacks as it steps the
      // keys: where one found none, the others' steps would stand.
      if (c.lacking > ref_.slots - size_) detail::RefuseFullStep(what, c.lacking, ref_.slots, size_);
      return;
    }
    // Seldom: the tables to the host, for the message to name the key.
    std::vector<uint64_t> sum_keys(sums.ref_.slots);
    std::vector<float> sum_rows(sums.ref_.slots * sums.ref_.stride);
    sums.keys_.download(sum_keys.data(), sum_keys.size());
    sums.rows_.download(sum_rows.data(), sum_rows.size());
    if (c.counted != 0) {
      detail::RefuseNonFinite(what, sum_keys.data(), sum_rows.data(), sums.ref_.slots, sums.ref_.stride);
    }
    std::vector<uint64_t> keys(ref_.slots);
    std::vector<float> rows(ref_.slots * ref_.stride);
    keys_.download(keys.data(), keys.size());
    rows_.download(rows.data(), rows.size());
    detail::RefuseNonFiniteSteps(what, TableRef{keys.data(), rows.data(), ref_.slots, ref_.stride},
                                 TableRef{sum_keys.data(), sum_rows.data(), sums.ref_.slots, sums.ref_.stride}, opt);
  }

  // REQUIRES: mutex_ and sums' held (or sums the call's own); sums holds each
  // key once (a table does). A sum that is not finite, a step that would
  // leave a row not finite, or more keys the table lacks than it has free
  // slots refuses the whole call before any row steps.
  void ApplySums(const CudaHashTable& sums, const SparseOptimizer& opt, const char* what) {
    RefuseFailingSteps(sums, opt, what);
    const detail::CurrentDevice current(device_);
    ResetCounters();
    ApplyKernel<<<Blocks(sums.ref_.slots), kBlock>>>(ref_, sums.ref_, opt, counters_.get());
    Settle(Finish());
  }

  static void SetDevice(int device) { HPS_CUDA_TRY(cudaSetDevice(device)); }

  template <class T>
  static std::unique_ptr<DeviceArray<T>> Upload(const T* host, uint64_t count) {
    auto d = std::make_unique<DeviceArray<T>>(count);
    d->upload(host);
    return d;
  }

  uint64_t Gather(const uint64_t* keys, uint64_t n, uint32_t columns, float* out,
                  uint8_t* found) const {
    if (n == 0) return 0;
    const detail::CurrentDevice current(device_);
    auto d_keys = Upload(keys, n);
    DeviceArray<float> d_out(n * columns);
    DeviceArray<uint8_t> d_found(n);
    ResetCounters();
    FindKernel<<<Blocks(n), kBlock>>>(ref_, d_keys->get(), n, columns, d_out.get(), d_found.get(),
                                      counters_.get());
    const Counters c = Finish();
    d_out.download(out, n * columns);
    if (found) d_found.download(found, n);
    return c.counted;
  }

  void CheckOptimizer(const SparseOptimizer& opt) const {
    opt.validate();
    if (opt.row_floats() != row_floats()) {
      throw std::invalid_argument("optimizer needs rows of " + std::to_string(opt.row_floats()) +
                                  " floats, but the table's rows have " +
                                  std::to_string(row_floats()));
    }
  }

  void ResetCounters() const { HPS_CUDA_TRY(cudaMemset(counters_.get(), 0, sizeof(Counters))); }

  Counters Finish() const {
    HPS_CUDA_TRY(cudaGetLastError());
    HPS_CUDA_TRY(cudaDeviceSynchronize());
    Counters c{};
    counters_.download(&c, 1);
    return c;
  }

  void Settle(const Counters& c) {
    size_ += c.claimed;
    if (c.full > 0) {
      throw TableFullError("hash table on " + device() + " full: " + std::to_string(c.full) +
                           " key(s) found no free slot (capacity " + std::to_string(ref_.slots) +
                           ", size " + std::to_string(size_) + ")");
    }
  }

  int device_;
  DeviceArray<uint64_t> keys_;
  DeviceArray<float> rows_;
  DeviceArray<Counters> counters_;
  TableRef ref_{};
  uint64_t size_ = 0;
  // Calls are serialised: they share the counters and the host-side size, and
  // kernels on one device's default stream run one after another anyway.
  mutable std::mutex mutex_;
};

}  // namespace

std::unique_ptr<HashTable> NewCudaHashTable(const HashTableOptions& options) {
  const int devices = CudaDeviceCount();
  if (options.cuda_device >= devices) {
    throw std::runtime_error("hash table: CUDA device " + std::to_string(options.cuda_device) +
                             " requested, but " + std::to_string(devices) +
                             " usable CUDA device(s) found");
  }
  const detail::CurrentDevice keep;  // the constructor allocates on the table's device
  return std::make_unique<CudaHashTable>(options.capacity, options.row_floats,
                                         options.cuda_device);
}

bool CudaCompiled() { return true; }

int CudaDeviceCount() {
  int n = 0;
  // No driver, or one too old ("driver version is insufficient"), means no GPU.
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky error so later calls start clean
    return 0;
  }
  return n;
}

}  // namespace hps
