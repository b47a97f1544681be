#include "hps/device_tier.h"

#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "hps/hash_table.h"
#include "mix64.h"

namespace hps {
namespace {

class Tier final : public DeviceTier {
 public:
  explicit Tier(const DeviceTierOptions& o) : o_(o), row_floats_(o.optimizer.row_floats()) {
    const bool cuda = o.use_cuda && CudaDeviceCount() >= o.devices;
    for (int32_t d = 0; d < o.devices; ++d) {
      HashTableOptions t;
      t.capacity = o.capacity;
      t.threads = o.threads;
      t.cuda_device = cuda ? d : -1;
      t.row_floats = row_floats_;
      rows_.push_back(NewHashTable(t));
      t.row_floats = o.optimizer.dim;
      grads_.push_back(NewHashTable(t));
    }
    kind_ = cuda ? "cuda" : "cpu";
    matrix_.devices = o.devices;
    matrix_.rows.assign(static_cast<size_t>(o.devices) * o.devices, 0);
    matrix_.bytes.assign(matrix_.rows.size(), 0);
  }

  int32_t devices() const override { return o_.devices; }
  std::string kind() const override { return kind_; }
  uint64_t size() const override {
    uint64_t n = 0;
    for (const auto& t : rows_) n += t->size();
    return n;
  }

  void Insert(const uint64_t* keys, uint64_t n, const float* rows, const int32_t* owners) override {
    CheckKeys(keys, n);
    const Parts parts = Partition(keys, n, owners, rows, row_floats_);
    for (int32_t d = 0; d < o_.devices; ++d) {
      if (parts.size[d] == 0) continue;
      rows_[d]->insert(parts.keys[d], parts.size[d], parts.rows[d], nullptr);
    }
  }

  uint64_t Assign(const uint64_t* keys, uint64_t n, const float* rows, const int32_t* owners) override {
    CheckKeys(keys, n);
    const Parts parts = Partition(keys, n, owners, rows, row_floats_);
    uint64_t assigned = 0;
    for (int32_t d = 0; d < o_.devices; ++d) {
      if (parts.size[d] == 0) continue;
      assigned += rows_[d]->assign(parts.keys[d], parts.size[d], parts.rows[d], nullptr);
    }
    return assigned;
  }

  void Get(int32_t worker, const uint64_t* keys, uint64_t n, float* embeddings,
           const int32_t* owners) override {
    CheckWorker(worker);
    const int32_t dim = o_.optimizer.dim;
    ReadOnOwners(keys, n, owners, embeddings, dim, [&](int32_t device, uint64_t rows) {
      Count(device, worker, rows, rows * dim * sizeof(float));
    });
  }

  void Accumulate(int32_t worker, const uint64_t* keys, uint64_t n, const float* grads,
                  const int32_t* owners) override {
    CheckWorker(worker);
    CheckKeys(keys, n);
    const int32_t dim = o_.optimizer.dim;
    const Parts parts = Partition(keys, n, owners, grads, dim);
    for (int32_t d = 0; d < o_.devices; ++d) {
      if (parts.size[d] == 0) continue;
      grads_[d]->accumulate(parts.keys[d], parts.size[d], parts.rows[d]);
      Count(worker, d, parts.size[d], parts.size[d] * dim * sizeof(float));
    }
  }

  std::vector<uint64_t> Apply() override {
    const int32_t dim = o_.optimizer.dim;
    std::vector<uint64_t> updated;
    std::vector<float> grads;
    for (int32_t d = 0; d < o_.devices; ++d) {
      const uint64_t n = grads_[d]->size();
      if (n == 0) continue;
      // The gradient table already holds one summed row per key: apply it as it is.
      rows_[d]->apply_summed_gradients(*grads_[d], o_.optimizer);
      const size_t at = updated.size();
      updated.resize(at + n);
      grads.resize(n * dim);
      updated.resize(at + grads_[d]->export_rows(updated.data() + at, grads.data(), n));
      grads_[d]->clear();
    }
    return updated;
  }

  void Rows(const uint64_t* keys, uint64_t n, float* rows, const int32_t* owners) const override {
    ReadOnOwners(keys, n, owners, rows, row_floats_, [](int32_t, uint64_t) {});
  }

  uint64_t ReadBack(uint64_t* keys, float* rows, uint64_t max_rows) const override {
    uint64_t done = 0;
    for (int32_t d = 0; d < o_.devices && done < max_rows; ++d) {
      done += rows_[d]->export_rows(keys + done, rows + done * row_floats_, max_rows - done);
    }
    return done;
  }

  void Clear() override {
    for (int32_t d = 0; d < o_.devices; ++d) {
      rows_[d]->clear();
      grads_[d]->clear();
    }
  }

  TransferMatrix transfers() const override { return matrix_; }
  void ResetTransfers() override {
    std::fill(matrix_.rows.begin(), matrix_.rows.end(), 0);
    std::fill(matrix_.bytes.begin(), matrix_.bytes.end(), 0);
  }

 private:
  // Keys (and their rows of `width` floats, when given) split by owner, with
  // each one's index in the call.
  // A batch's keys (and rows) split by owner. With one device the one part is
  // the caller's arrays, not a copy of them.
  struct Parts {
    std::vector<const uint64_t*> keys;
    std::vector<const float*> rows;
    std::vector<uint64_t> size;
    std::vector<std::vector<uint64_t>> key_store, index;  // index[d][j]: where part d's j-th key was
    std::vector<std::vector<float>> row_store;
    bool whole = false;  // part 0 is the input itself
    uint64_t Index(int32_t d, uint64_t j) const { return whole ? j : index[d][j]; }
  };

  Parts Partition(const uint64_t* keys, uint64_t n, const int32_t* owners, const float* rows, int32_t width) const {
    const auto devices = static_cast<size_t>(o_.devices);
    Parts p;
    p.keys.assign(devices, nullptr);
    p.rows.assign(devices, nullptr);
    p.size.assign(devices, 0);
    std::vector<int32_t> owner(o_.devices == 1 ? 0 : n);
    for (uint64_t i = 0; i < n; ++i) {
      const int32_t d = owners ? owners[i] : (o_.devices == 1 ? 0 : ModuloOwner(keys[i], o_.devices));
      if (d < 0 || d >= o_.devices) {
        throw std::invalid_argument("device tier: owners[" + std::to_string(i) + "] = " + std::to_string(d) +
                                    " is not a device in [0, " + std::to_string(o_.devices) + ")");
      }
      if (o_.devices > 1) owner[i] = d;
      ++p.size[static_cast<size_t>(d)];
    }
    if (o_.devices == 1) {
      p.whole = true;
      p.keys[0] = keys;
      p.rows[0] = rows;
      return p;
    }
    p.key_store.resize(devices);
    p.index.resize(devices);
    p.row_store.resize(devices);
    for (size_t d = 0; d < devices; ++d) {
      p.key_store[d].reserve(p.size[d]);
      p.index[d].reserve(p.size[d]);
      if (rows) p.row_store[d].reserve(p.size[d] * static_cast<uint64_t>(width));
    }
    for (uint64_t i = 0; i < n; ++i) {
      const auto d = static_cast<size_t>(owner[i]);
      p.key_store[d].push_back(keys[i]);
      p.index[d].push_back(i);
      if (rows) p.row_store[d].insert(p.row_store[d].end(), rows + i * width, rows + (i + 1) * width);
    }
    for (size_t d = 0; d < devices; ++d) {
      p.keys[d] = p.key_store[d].data();
      p.rows[d] = rows ? p.row_store[d].data() : nullptr;
    }
    return p;
  }

  // Finds keys on their owners and copies the first `width` floats of each
  // row to out (n, width); sent(device, rows) is told what each device gave.
  template <typename Sent>
  void ReadOnOwners(const uint64_t* keys, uint64_t n, const int32_t* owners, float* out, int32_t width,
                    Sent sent) const {
    CheckKeys(keys, n);
    const Parts parts = Partition(keys, n, owners, nullptr, 0);
    std::vector<float> found_rows;
    std::vector<uint8_t> found;
    for (int32_t d = 0; d < o_.devices; ++d) {
      const uint64_t size = parts.size[static_cast<size_t>(d)];
      if (size == 0) continue;
      found.resize(size);
      if (parts.whole && width == row_floats_) {  // straight into out
        rows_[d]->find(parts.keys[d], size, out, found.data());
        for (uint64_t j = 0; j < size; ++j) {
          if (!found[j]) NotLoaded(keys, j, d);
        }
      } else {
        found_rows.resize(size * row_floats_);
        rows_[d]->find(parts.keys[d], size, found_rows.data(), found.data());
        for (uint64_t j = 0; j < size; ++j) {
          const uint64_t i = parts.Index(d, j);
          if (!found[j]) NotLoaded(keys, i, d);
          std::memcpy(out + i * width, found_rows.data() + j * row_floats_, width * sizeof(float));
        }
      }
      sent(d, size);
    }
  }

  [[noreturn]] static void NotLoaded(const uint64_t* keys, uint64_t i, int32_t device) {
    throw std::out_of_range("device tier: keys[" + std::to_string(i) + "] = " + std::to_string(keys[i]) +
                            " is not loaded on device " + std::to_string(device) +
                            "; insert the batch's working set first");
  }

  void CheckWorker(int32_t worker) const {
    if (worker < 0 || worker >= o_.devices) {
      throw std::invalid_argument("device tier: worker " + std::to_string(worker) + " is not a device in [0, " +
                                  std::to_string(o_.devices) + ")");
    }
  }

  void Count(int32_t from, int32_t to, uint64_t rows, uint64_t bytes) {
    const size_t at = static_cast<size_t>(from) * o_.devices + to;
    matrix_.rows[at] += rows;
    matrix_.bytes[at] += bytes;
  }

  DeviceTierOptions o_;
  int32_t row_floats_;
  std::string kind_;
  std::vector<std::unique_ptr<HashTable>> rows_, grads_;
  TransferMatrix matrix_;
};

}  // namespace

int32_t DeviceTier::ModuloOwner(uint64_t key, int32_t devices) {
  return static_cast<int32_t>(detail::Mix64(key) % static_cast<uint64_t>(devices));  // ids sharing low bits still spread
}

std::unique_ptr<DeviceTier> DeviceTier::New(const DeviceTierOptions& options) {
  if (options.devices <= 0) throw std::invalid_argument("device tier: devices must be > 0");
  if (options.capacity == 0) throw std::invalid_argument("device tier: capacity must be > 0 rows per device");
  options.optimizer.validate();
  return std::make_unique<Tier>(options);
}

}  // namespace hps
