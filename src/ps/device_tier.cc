#include "hps/device_tier.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <map>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "hps/hash_table.h"
#include "format/key_index.h"
#include "ps/batch_rows.h"
#include "ps/row_mover.h"
#include "util/mix64.h"
#include "table/table_kernels.h"

namespace hps {
namespace {

// One device's trained bits (DeviceTier::Trained): a byte per slot of its
// rows table, beside the table's slots (HashTable::slots). A call that has a
// row's slot already (a bound position's: Apply's steps, CopyRowsAt) reads
// and writes its bit with no lookup at all, and one by key finds the slot in
// the table it probes anyway; a set of the trained keys beside the tables
// cost every step a second probe, a second cache miss, that the sequential
// schedule's batches did not pay. A key keeps its slot until its table's
// clear, and a free slot's bit is 0 (Clear zeroes the bits with the rows), so
// a row a load inserts starts clean. `set` counts the bits that are 1, so a
// device with none is passed over.
struct TrainedBits {
  std::vector<uint8_t> bit;  // (the rows table's capacity)
  uint64_t set = 0;

  bool Has(int64_t slot) const { return slot >= 0 && bit[static_cast<uint64_t>(slot)] != 0; }
  // A slot of -1 (a key the table does not hold) takes no bit: one without a
  // row would be taken later for a key the device cannot read.
  void Put(int64_t slot, bool trained) {
    if (slot < 0) return;
    uint8_t& b = bit[static_cast<uint64_t>(slot)];
    if ((b != 0) == trained) return;
    b = trained ? 1 : 0;
    trained ? ++set : --set;
  }
  void Prefetch(int64_t slot) const {
    if (slot >= 0) __builtin_prefetch(&bit[static_cast<uint64_t>(slot)]);
  }
  // Appends the slots whose bit is set and clears them all.
  void Take(std::vector<int64_t>* slots) {
    if (set == 0) return;
    const uint64_t n = bit.size();  // a multiple of 8 (the table's buckets)
    for (uint64_t s = 0; s < n; s += 8) {
      uint64_t word;
      std::memcpy(&word, bit.data() + s, sizeof(word));
      if (word == 0) continue;  // most of the slots
      for (uint64_t j = 0; j < 8; ++j) {
        if (bit[s + j] != 0) slots->push_back(static_cast<int64_t>(s + j));
      }
      std::memset(bit.data() + s, 0, 8);
    }
    set = 0;
  }
  void Clear() {
    if (set == 0) return;
    std::fill(bit.begin(), bit.end(), uint8_t{0});
    set = 0;
  }
};

class Tier final : public DeviceTier {
 public:
  explicit Tier(const DeviceTierOptions& o) : o_(o), row_floats_(o.optimizer.row_floats()) {
    const int32_t endpoints = o.routes ? static_cast<int32_t>(o.routes->topology.Endpoints().size()) : o.devices;
    std::vector<int32_t> gpus = o.cuda_devices;
    if (gpus.empty()) {
      for (int32_t e = 0; e < endpoints; ++e) gpus.push_back(e);
    } else if (gpus.size() != static_cast<size_t>(endpoints)) {
      throw std::invalid_argument("device tier: cuda_devices names " + std::to_string(gpus.size()) +
                                  " GPUs, but the tier has " + std::to_string(endpoints) +
                                  " endpoints (its devices, then the topology's others)");
    }
    // The tier's own devices decide: middlemen past them need a GPU only to relay.
    const int32_t have = CudaDeviceCount();
    bool cuda = o.use_cuda;
    for (int32_t d = 0; d < o.devices; ++d) cuda = cuda && gpus[static_cast<size_t>(d)] >= 0 &&
                                                     gpus[static_cast<size_t>(d)] < have;
    for (int32_t d = 0; d < o.devices; ++d) {
      HashTableOptions t;
      t.capacity = o.capacity;
      t.threads = o.threads;
      t.cuda_device = cuda ? gpus[static_cast<size_t>(d)] : -1;
      t.row_floats = row_floats_;
      rows_.push_back(NewHashTable(t));
      t.row_floats = o.optimizer.dim;
      grads_.push_back(NewHashTable(t));
      grad_options_.push_back(t);
    }
    if (o.track_trained) {
      trained_.resize(static_cast<size_t>(o.devices));
      for (int32_t d = 0; d < o.devices; ++d) trained_[static_cast<size_t>(d)].bit.assign(rows_[d]->capacity(), 0);
    }
    kind_ = cuda ? "cuda" : "cpu";
    matrix_.devices = o.devices;
    matrix_.rows.assign(static_cast<size_t>(o.devices) * o.devices, 0);
    matrix_.bytes.assign(matrix_.rows.size(), 0);
    if (const auto& r = o.routes) {
      if (r->devices != o.devices) {
        throw std::invalid_argument("device tier: routes planned for " + std::to_string(r->devices) +
                                    " devices, the tier has " + std::to_string(o.devices));
      }
      endpoints_ = static_cast<int32_t>(r->topology.Endpoints().size());
      links_.links = static_cast<int32_t>(r->topology.links.size());
      links_.rows.assign(4 * static_cast<size_t>(links_.links), 0);
      links_.bytes.assign(links_.rows.size(), 0);
      links_.route_rows.assign(4, 0);
    }
    // Rows that cross devices move through a RowMover: on GPUs always (peer
    // copies along the routes, or direct without a topology), on host
    // partitions when the routes are executed (else the tables' own copies).
    if (o.devices > 1 && cuda) {
      mover_ = detail::NewCudaRowMover(gpus);
    } else if (o.devices > 1 && o.routes && o.routes->execute) {
      mover_ = detail::NewHostRowMover(o.devices);
    }
    if (mover_ && !o.routes) {
      endpoints_ = o.devices;
      direct_ = detail::DirectPlan(o.devices);
    }
  }

  int32_t devices() const override { return o_.devices; }
  int32_t row_floats() const override { return row_floats_; }
  int32_t dim() const override { return o_.optimizer.dim; }
  std::string kind() const override { return kind_; }
  bool accepts_gpu_memory() const override { return kind_ == "cuda"; }  // (one table, or the CUDA mover)
  float* StagingRows(uint64_t floats) override {
    if (!staging_) staging_ = detail::NewHostStaging(kind_ == "cuda");
    return staging_->Get(floats);
  }
  uint64_t size() const override {
    if (host_rows_) return bound_keys_.size();  // the tables are empty
    uint64_t n = 0;
    for (const auto& t : rows_) n += t->size();
    return n;
  }

  void Insert(const uint64_t* keys, uint64_t n, const float* rows, const int32_t* owners) override {
    if (host_rows_) throw std::logic_error("device tier insert: the tier is bound to host rows; Clear it first");
    CheckKeys(keys, n);
    const Parts parts = Partition(keys, n, owners, rows, row_floats_);
    // A row inserted takes a free slot, whose bit is 0 (TrainedBits); a
    // present key keeps its row and its bit.
    parts.ForEach([&](int32_t d, uint64_t size) { rows_[d]->insert(parts.keys[d], size, parts.rows[d], nullptr); });
  }

  uint64_t Assign(const uint64_t* keys, uint64_t n, const float* rows, const int32_t* owners) override {
    CheckKeys(keys, n);
    if (host_rows_) {  // into the bound rows where they lie
      const uint64_t row_bytes = static_cast<uint64_t>(row_floats_) * sizeof(float);
      const detail::KeyIndex& index = BoundIndex("assign");
      uint64_t assigned = 0;
      for (uint64_t i = 0; i < n; ++i) {
        const uint32_t at = index.Find(keys[i]);
        if (at == detail::KeyIndex::kNone) continue;
        std::memcpy(in_place_->addresses()[at], rows + i * static_cast<uint64_t>(row_floats_), row_bytes);
        ++assigned;
      }
      return assigned;
    }
    const Parts parts = Partition(keys, n, owners, rows, row_floats_);
    uint64_t assigned = 0;
    std::vector<uint8_t> found;
    std::vector<uint64_t> written;
    std::vector<int64_t> slots;
    parts.ForEach([&](int32_t d, uint64_t size) {
      if (trained_.empty() || trained_[static_cast<size_t>(d)].set == 0) {
        assigned += rows_[d]->assign(parts.keys[d], size, parts.rows[d], nullptr);
        return;
      }
      found.assign(size, 0);
      assigned += rows_[d]->assign(parts.keys[d], size, parts.rows[d], found.data());
      // The rows written (from MEM-PS) are clean. (A load's keys are mostly
      // absent, to be inserted next: only those found are looked up again.)
      written.clear();
      for (uint64_t j = 0; j < size; ++j) {
        if (found[j]) written.push_back(parts.keys[d][j]);
      }
      slots.resize(written.size());
      rows_[d]->slots(written.data(), written.size(), slots.data());
      TrainedBits& bits = trained_[static_cast<size_t>(d)];
      for (int64_t slot : slots) bits.Put(slot, false);
    });
    return assigned;
  }

  void Get(int32_t worker, const uint64_t* keys, uint64_t n, float* embeddings,
           const int32_t* owners) override {
    CheckWorker(worker);
    const int32_t dim = o_.optimizer.dim;
    if (host_rows_) {
      std::vector<int64_t> positions(n);
      PositionsOf(keys, n, positions.data(), "get");
      return GetAt(worker, positions.data(), n, embeddings, RowLayout{});
    }
    if (mover_) return MovedGet(worker, keys, n, embeddings, owners);
    ReadOnOwners(keys, n, owners, embeddings, dim, [&](int32_t device, uint64_t rows) {
      Count(device, worker, rows, rows * dim * sizeof(float));
    });
  }

  void Accumulate(int32_t worker, const uint64_t* keys, uint64_t n, const float* grads,
                  const int32_t* owners) override {
    CheckWorker(worker);
    CheckKeys(keys, n);
    if (BoundInPlace()) {  // into the positions' sums, so that a key steps once however its gradients came
      std::vector<int64_t> positions(n);
      PositionsOf(keys, n, positions.data(), "accumulate");
      return AccumulateAt(worker, positions.data(), n, grads, RowLayout{});
    }
    // Into the gradient tables, where Apply would step any key (claiming a
    // row for one its owner lacks): a bound batch's keys only, each on the
    // device it is bound on, as the in-place sums take them.
    if (bound_) RefuseUnbound(keys, n, owners);
    AccumulateKeys(worker, keys, n, grads, owners);
  }

  std::vector<uint64_t> Apply() override { return Step(nullptr); }

  std::vector<uint64_t> ApplyBound(std::vector<int64_t>* positions) override {
    CheckBound("apply");
    return Step(positions);
  }

  void Bind(const uint64_t* keys, uint64_t n, const int32_t* owners) override {
    const Parts parts = BindKeys(keys, n, owners, "bind");
    // With trained bits, each position's slot in its owner's table: Apply and
    // CopyRowsAt reach the bits of the rows they step and copy by it.
    const bool slotted = !trained_.empty();
    if (slotted) bound_slots_.assign(n, -1);
    std::vector<int64_t> slots;
    if (reads_in_place()) {
      std::vector<float*> at;
      parts.ForEach([&](int32_t d, uint64_t size) {
        at.resize(size);
        slots.resize(slotted ? size : 0);
        rows_[d]->row_addresses(parts.keys[d], size, at.data(), slotted ? slots.data() : nullptr);
        for (uint64_t j = 0; j < size; ++j) {
          if (at[j] == nullptr) {
            Unbind();
            NotLoaded(keys, parts.Index(d, j), d);
          }
          in_place_->addresses()[parts.Index(d, j)] = reinterpret_cast<uint8_t*>(at[j]);
          if (slotted) bound_slots_[parts.Index(d, j)] = slots[j];
        }
      });
    } else if (slotted) {
      parts.ForEach([&](int32_t d, uint64_t size) {
        slots.resize(size);
        rows_[d]->slots(parts.keys[d], size, slots.data());
        for (uint64_t j = 0; j < size; ++j) bound_slots_[parts.Index(d, j)] = slots[j];
      });
    }
    bound_ = true;
  }

  bool binds_host_rows() const override { return reads_in_place() && o_.bind_host_rows; }

  void BindHostRows(const uint64_t* keys, uint64_t n, const int32_t* owners, uint8_t* const* rows) override {
    if (!binds_host_rows()) {
      throw std::logic_error("device tier bind host rows: the " + kind_ + " tier of " + std::to_string(o_.devices) +
                             " device(s) holds copies of its rows" +
                             (reads_in_place() ? " (bind_host_rows is off)" : ""));
    }
    for (int32_t d = 0; d < o_.devices; ++d) {
      if (rows_[d]->size() != 0) {
        throw std::logic_error("device tier bind host rows: device " + std::to_string(d) +
                               "'s table holds rows; Clear the tier first");
      }
    }
    const Parts parts = BindKeys(keys, n, owners, "bind host rows");
    parts.ForEach([&](int32_t d, uint64_t size) {
      if (size > o_.capacity) {
        Unbind();
        throw TableFullError("device tier bind host rows: device " + std::to_string(d) + " would own " +
                             std::to_string(size) + " keys, over its capacity of " + std::to_string(o_.capacity) +
                             " rows");
      }
    });
    std::copy(rows, rows + n, in_place_->addresses());
    host_rows_ = true;
    bound_ = true;
  }

  bool reads_in_place() const override { return kind_ == "cpu" && !mover_; }

  void GetAt(int32_t worker, const int64_t* positions, uint64_t n, float* embeddings, RowLayout layout) override {
    CheckWorker(worker);
    CheckBound("get");
    if (BoundInPlace()) {
      in_place_->Get(positions, n, embeddings, layout);
      CountAt(worker, positions, n, /*to_worker=*/true);
      return;
    }
    CheckCompact(layout, "get");
    std::vector<uint64_t> keys;
    std::vector<int32_t> owners;
    KeysAt(positions, n, &keys, &owners, "get");
    Get(worker, keys.data(), n, embeddings, owners.empty() ? nullptr : owners.data());
  }

  void AccumulateAt(int32_t worker, const int64_t* positions, uint64_t n, const float* grads,
                    RowLayout layout) override {
    CheckWorker(worker);
    CheckBound("accumulate");
    if (BoundInPlace()) {
      in_place_->Accumulate(positions, n, grads, layout);
      CountAt(worker, positions, n, /*to_worker=*/false);
      return;
    }
    CheckCompact(layout, "accumulate");
    std::vector<uint64_t> keys;
    std::vector<int32_t> owners;
    KeysAt(positions, n, &keys, &owners, "accumulate");
    AccumulateKeys(worker, keys.data(), n, grads, owners.empty() ? nullptr : owners.data());  // bound, as checked
  }

  void RowsAt(const int64_t* positions, uint64_t n, float* rows) const override {
    CheckBound("rows");
    if (BoundInPlace()) return in_place_->Rows(positions, n, rows);
    std::vector<uint64_t> keys;
    std::vector<int32_t> owners;
    KeysAt(positions, n, &keys, &owners, "rows");
    Rows(keys.data(), n, rows, owners.empty() ? nullptr : owners.data());
  }

  void CopyRowsAt(const int64_t* from, const int64_t* to, uint64_t n) override {
    CheckBound("copy");
    if (!BoundInPlace()) return CopyRowsByKey(from, to, n);
    in_place_->CopyRows(from, to, n);
    // Each copy takes its source's bit, in order as the rows went. (The
    // positions were checked above, and host rows have no bits.)
    if (trained_.empty() || host_rows_) return;
    for (uint64_t i = 0; i < n; ++i) {
      if (i + kTrainedAhead < n) {
        PrefetchTrained(static_cast<uint64_t>(from[i + kTrainedAhead]));
        PrefetchTrained(static_cast<uint64_t>(to[i + kTrainedAhead]));
      }
      const auto f = static_cast<uint64_t>(from[i]), t = static_cast<uint64_t>(to[i]);
      const bool trained = trained_[static_cast<size_t>(BoundOwner(f))].Has(bound_slots_[f]);
      trained_[static_cast<size_t>(BoundOwner(t))].Put(bound_slots_[t], trained);
    }
  }

  // CopyRowsAt on tables: every source's row (and bit) is read before any
  // target is written (Assign, by key), so a pair whose source an earlier
  // pair wrote reads that pair's source instead, as the copies in order
  // would have left it.
  void CopyRowsByKey(const int64_t* from, const int64_t* to, uint64_t n) {
    // The targets written so far, by position (copy_given_: the source each
    // one's row is now, kNone where none; put back to kNone below). This runs
    // for every batch's replica copies (WorkerCaches.apply on a tier of GPUs,
    // or of host partitions through the row mover), where a hash map built per
    // call cost its allocations and misses.
    const uint64_t size = bound_keys_.size();
    const auto bound = [size](int64_t p) { return static_cast<uint64_t>(p) < size; };
    if (copy_given_.size() < size) copy_given_.resize(size, detail::KeyIndex::kNone);
    std::vector<int64_t> sources(from, from + n);
    // Positions outside the bound keys, which RowsAt and KeysAt name below:
    // they chain as the others do, so that the error is the same. (A source
    // outside is not kept: RowsAt names its pair, or an earlier one, before
    // any later pair could read it.)
    std::map<int64_t, int64_t> outside;
    for (uint64_t i = 0; i < n; ++i) {
      if (bound(from[i])) {
        const uint32_t given = copy_given_[static_cast<uint64_t>(from[i])];
        if (given != detail::KeyIndex::kNone) sources[i] = given;
      } else if (const auto it = outside.find(from[i]); it != outside.end()) {
        sources[i] = it->second;
      }
      if (!bound(to[i])) {
        outside[to[i]] = sources[i];
      } else if (bound(sources[i])) {
        copy_given_[static_cast<uint64_t>(to[i])] = static_cast<uint32_t>(sources[i]);
      } else {
        copy_given_[static_cast<uint64_t>(to[i])] = detail::KeyIndex::kNone;
      }
    }
    for (uint64_t i = 0; i < n; ++i) {
      if (bound(to[i])) copy_given_[static_cast<uint64_t>(to[i])] = detail::KeyIndex::kNone;
    }
    std::vector<float> rows(n * static_cast<uint64_t>(row_floats_));
    RowsAt(sources.data(), n, rows.data());
    std::vector<uint64_t> keys;
    std::vector<int32_t> owners;
    KeysAt(to, n, &keys, &owners, "copy");
    std::vector<uint8_t> trained;  // the sources' bits, before Assign clears the targets'
    if (!trained_.empty()) {
      trained.resize(n);
      for (uint64_t i = 0; i < n; ++i) {
        const auto s = static_cast<uint64_t>(sources[i]);
        trained[i] = trained_[static_cast<size_t>(BoundOwner(s))].Has(bound_slots_[s]) ? 1 : 0;
      }
    }
    Assign(keys.data(), n, rows.data(), owners.empty() ? nullptr : owners.data());
    for (uint64_t i = 0; i < trained.size(); ++i) {
      const auto t = static_cast<uint64_t>(to[i]);
      trained_[static_cast<size_t>(BoundOwner(t))].Put(bound_slots_[t], trained[i] != 0);
    }
  }

  void Rows(const uint64_t* keys, uint64_t n, float* rows, const int32_t* owners) const override {
    if (host_rows_) {
      CheckKeys(keys, n);
      std::vector<int64_t> positions(n);
      PositionsOf(keys, n, positions.data(), "rows");
      return in_place_->Rows(positions.data(), n, rows);
    }
    ReadOnOwners(keys, n, owners, rows, row_floats_, [](int32_t, uint64_t) {});
  }

  uint64_t ReadBack(uint64_t* keys, float* rows, uint64_t max_rows) const override {
    if (host_rows_) {
      const uint64_t n = std::min<uint64_t>(max_rows, bound_keys_.size());
      std::vector<int64_t> positions(n);
      for (uint64_t i = 0; i < n; ++i) positions[i] = static_cast<int64_t>(i);
      std::copy(bound_keys_.begin(), bound_keys_.begin() + static_cast<std::ptrdiff_t>(n), keys);
      in_place_->Rows(positions.data(), n, rows);
      return n;
    }
    uint64_t done = 0;
    for (int32_t d = 0; d < o_.devices && done < max_rows; ++d) {
      done += rows_[d]->export_rows(keys + done, rows + done * row_floats_, max_rows - done);
    }
    return done;
  }

  void Clear() override {
    Unbind();
    for (int32_t d = 0; d < o_.devices; ++d) {
      rows_[d]->clear();
      grads_[d]->clear();
    }
    for (TrainedBits& t : trained_) t.Clear();
  }

  void Trained(const uint64_t* keys, uint64_t n, const int32_t* owners, uint8_t* trained) const override {
    CheckTracked("trained");
    CheckKeys(keys, n);
    const Parts parts = Partition(keys, n, owners, nullptr, 0);
    std::vector<int64_t> slots;
    parts.ForEach([&](int32_t d, uint64_t size) {
      const TrainedBits& bits = trained_[static_cast<size_t>(d)];
      if (bits.set == 0) {  // (no lookup)
        for (uint64_t j = 0; j < size; ++j) trained[parts.Index(d, j)] = 0;
        return;
      }
      slots.resize(size);
      rows_[d]->slots(parts.keys[d], size, slots.data());
      for (uint64_t j = 0; j < size; ++j) trained[parts.Index(d, j)] = bits.Has(slots[j]) ? 1 : 0;
    });
  }

  void SetTrained(const uint64_t* keys, uint64_t n, const int32_t* owners, bool trained) override {
    CheckTracked("set trained");
    CheckKeys(keys, n);
    const Parts parts = Partition(keys, n, owners, nullptr, 0);
    std::vector<int64_t> slots;
    parts.ForEach([&](int32_t d, uint64_t size) {
      TrainedBits& bits = trained_[static_cast<size_t>(d)];
      if (!trained && bits.set == 0) return;
      slots.resize(size);
      rows_[d]->slots(parts.keys[d], size, slots.data());  // -1: a key the table does not hold takes no bit
      for (uint64_t j = 0; j < size; ++j) bits.Put(slots[j], trained);
    });
  }

  void TakeTrained(std::vector<uint64_t>* keys, std::vector<int32_t>* owners) override {
    CheckTracked("take trained");
    uint64_t total = 0;
    for (const TrainedBits& t : trained_) total += t.set;
    keys->clear();
    owners->clear();
    keys->reserve(total);
    owners->reserve(total);
    std::vector<int64_t> slots;
    for (int32_t d = 0; d < o_.devices; ++d) {
      slots.clear();
      trained_[static_cast<size_t>(d)].Take(&slots);
      if (slots.empty()) continue;
      const size_t at = keys->size();
      keys->resize(at + slots.size());
      rows_[d]->keys_at(slots.data(), slots.size(), keys->data() + at);
      owners->insert(owners->end(), slots.size(), d);
    }
  }

  void RowsTrained(const uint64_t* keys, uint64_t n, const int32_t* owners, float* rows,
                   uint8_t* trained) const override {
    CheckTracked("rows trained");
    if (host_rows_) {  // (no bits)
      Rows(keys, n, rows, owners);
      std::fill(trained, trained + n, uint8_t{0});
      return;
    }
    CheckKeys(keys, n);
    const Parts parts = Partition(keys, n, owners, nullptr, 0);
    const uint64_t row_bytes = static_cast<uint64_t>(row_floats_) * sizeof(float);
    std::vector<float*> at;
    std::vector<int64_t> slots;
    std::vector<float> found_rows;
    std::vector<uint8_t> found;
    parts.ForEach([&](int32_t d, uint64_t size) {
      const TrainedBits& bits = trained_[static_cast<size_t>(d)];
      slots.resize(size);
      if (kind_ == "cpu") {  // the row's address and its slot from one probe
        at.resize(size);
        rows_[d]->row_addresses(parts.keys[d], size, at.data(), slots.data());
        for (uint64_t j = 0; j < size; ++j) {
          const uint64_t i = parts.Index(d, j);
          if (at[j] == nullptr) NotLoaded(keys, i, d);
          std::memcpy(rows + i * static_cast<uint64_t>(row_floats_), at[j], row_bytes);
          trained[i] = bits.Has(slots[j]) ? 1 : 0;
        }
        return;
      }
      // A table in GPU memory has no host addresses: a find, and the slots where bits are set.
      found_rows.resize(size * static_cast<uint64_t>(row_floats_));
      found.resize(size);
      rows_[d]->find(parts.keys[d], size, found_rows.data(), found.data());
      if (bits.set != 0) rows_[d]->slots(parts.keys[d], size, slots.data());
      for (uint64_t j = 0; j < size; ++j) {
        const uint64_t i = parts.Index(d, j);
        if (!found[j]) NotLoaded(keys, i, d);
        std::memcpy(rows + i * static_cast<uint64_t>(row_floats_),
                    found_rows.data() + j * static_cast<uint64_t>(row_floats_), row_bytes);
        trained[i] = bits.set != 0 && bits.Has(slots[j]) ? 1 : 0;
      }
    });
  }

  void Upsert(const uint64_t* keys, uint64_t n, const float* rows, const int32_t* owners,
              const uint8_t* trained) override {
    if (host_rows_) throw std::logic_error("device tier upsert: the tier is bound to host rows; Clear it first");
    if (trained != nullptr) CheckTracked("upsert");
    CheckKeys(keys, n);
    const Parts parts = Partition(keys, n, owners, rows, row_floats_);
    const uint64_t row_bytes = static_cast<uint64_t>(row_floats_) * sizeof(float);
    std::vector<uint8_t> inserted;
    std::vector<uint64_t> again, again_keys;  // again: the part's entries to find after the insert
    std::vector<float*> at;
    std::vector<int64_t> slots;
    std::vector<float> present_rows;
    std::vector<uint64_t> present_keys;
    parts.ForEach([&](int32_t d, uint64_t size) {
      inserted.resize(size);
      // An absent key takes a free slot, whose bit is 0 (TrainedBits).
      rows_[d]->insert(parts.keys[d], size, parts.rows[d], inserted.data());
      TrainedBits* bits = trained_.empty() ? nullptr : &trained_[static_cast<size_t>(d)];
      again.clear();
      again_keys.clear();
      for (uint64_t j = 0; j < size; ++j) {
        if (!inserted[j] || (trained != nullptr && trained[parts.Index(d, j)] != 0)) {
          again.push_back(j);
          again_keys.push_back(parts.keys[d][j]);
        }
      }
      if (again.empty()) return;
      const uint64_t m = again.size();
      slots.resize(m);
      if (kind_ == "cpu") {  // overwrite in place, the bit by the slot found with the row
        at.resize(m);
        rows_[d]->row_addresses(again_keys.data(), m, at.data(), slots.data());
        for (uint64_t k = 0; k < m; ++k) {
          const uint64_t j = again[k];
          if (!inserted[j] && at[k] != nullptr) std::memcpy(at[k], parts.rows[d] + j * static_cast<uint64_t>(row_floats_), row_bytes);
        }
      } else {
        present_keys.clear();
        present_rows.clear();
        for (uint64_t j : again) {
          if (inserted[j]) continue;
          present_keys.push_back(parts.keys[d][j]);
          const float* r = parts.rows[d] + j * static_cast<uint64_t>(row_floats_);
          present_rows.insert(present_rows.end(), r, r + row_floats_);
        }
        if (!present_keys.empty()) {
          rows_[d]->assign(present_keys.data(), present_keys.size(), present_rows.data(), nullptr);
        }
        if (bits != nullptr) rows_[d]->slots(again_keys.data(), m, slots.data());
      }
      if (bits == nullptr) return;
      for (uint64_t k = 0; k < m; ++k) {
        bits->Put(slots[k], trained != nullptr && trained[parts.Index(d, again[k])] != 0);
      }
    });
  }

  void SetGradientCapacity(int32_t device, uint64_t capacity) override {
    if (device < 0 || device >= o_.devices) {
      throw std::invalid_argument("device tier: device " + std::to_string(device) + " is outside [0, " +
                                  std::to_string(o_.devices) + ")");
    }
    if (capacity == 0) throw std::invalid_argument("device tier: a gradient table needs capacity > 0");
    const auto d = static_cast<size_t>(device);
    if (grads_[d]->size() != 0) {
      throw std::logic_error("device tier: device " + std::to_string(device) +
                             "'s gradient table resized while gradients wait for Apply");
    }
    grad_options_[d].capacity = capacity;
    grads_[d] = NewHashTable(grad_options_[d]);
  }

  TransferMatrix transfers() const override { return matrix_; }
  LinkCounters link_counters() const override { return links_; }
  void ResetTransfers() override {
    std::fill(matrix_.rows.begin(), matrix_.rows.end(), 0);
    std::fill(matrix_.bytes.begin(), matrix_.bytes.end(), 0);
    std::fill(links_.rows.begin(), links_.rows.end(), 0);
    std::fill(links_.bytes.begin(), links_.bytes.end(), 0);
    std::fill(links_.route_rows.begin(), links_.route_rows.end(), 0);
    links_.relayed_rows = links_.relayed_bytes = 0;
  }

 private:
  // A batch's keys (and their rows of `width` floats, when given) split by
  // owner, with each one's index in the call. With one device the one part is
  // the caller's arrays, not a copy of them.
  struct Parts {
    std::vector<const uint64_t*> keys;
    std::vector<const float*> rows;
    std::vector<uint64_t> size;
    std::vector<uint64_t> start;  // runs: part d is the input's [start[d], start[d] + size[d])
    std::vector<std::vector<uint64_t>> key_store, index;  // else index[d][j]: where part d's j-th key was
    std::vector<std::vector<float>> row_store;
    // Each device's entries are one run of the input (one device; a caller's
    // rows for one device, or grouped by device): the parts point into the
    // input, with no copy of its keys and rows.
    bool runs = false;
    uint64_t Index(int32_t d, uint64_t j) const { return runs ? start[static_cast<size_t>(d)] + j : index[d][j]; }
    // Calls part(d, size) for each device d that holds keys of the batch, in
    // device order: the walk of every call that splits a batch by owner, so
    // that a device given no keys is never called with an empty part.
    template <typename Part>
    void ForEach(Part&& part) const {
      for (size_t d = 0; d < size.size(); ++d) {
        if (size[d] != 0) part(static_cast<int32_t>(d), size[d]);
      }
    }
  };

  Parts Partition(const uint64_t* keys, uint64_t n, const int32_t* owners, const float* rows, int32_t width) const {
    const auto devices = static_cast<size_t>(o_.devices);
    Parts p;
    p.keys.assign(devices, nullptr);
    p.rows.assign(devices, nullptr);
    p.size.assign(devices, 0);
    p.start.assign(devices, 0);
    std::vector<int32_t> owner(o_.devices == 1 ? 0 : n);
    bool runs = true;
    int32_t last = -1;
    for (uint64_t i = 0; i < n; ++i) {
      const int32_t d = owners ? owners[i] : (o_.devices == 1 ? 0 : ModuloOwner(keys[i], o_.devices));
      if (d < 0 || d >= o_.devices) {
        throw std::invalid_argument("device tier: owners[" + std::to_string(i) + "] = " + std::to_string(d) +
                                    " is not a device in [0, " + std::to_string(o_.devices) + ")");
      }
      if (o_.devices > 1) owner[i] = d;
      if (d != last) {  // a run starts: the device's first, or its entries are not one run
        if (p.size[static_cast<size_t>(d)] != 0) runs = false;
        p.start[static_cast<size_t>(d)] = i;
        last = d;
      }
      ++p.size[static_cast<size_t>(d)];
    }
    if (runs) {
      p.runs = true;
      for (size_t d = 0; d < devices; ++d) {
        p.keys[d] = keys + p.start[d];
        p.rows[d] = rows ? rows + p.start[d] * static_cast<uint64_t>(width) : nullptr;
      }
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
    parts.ForEach([&](int32_t d, uint64_t size) {
      found.resize(size);
      if (parts.runs) {  // straight into out (which may be the GPU's memory: accepts_gpu_memory)
        const uint64_t at = parts.start[static_cast<size_t>(d)];
        rows_[d]->find_columns(parts.keys[d], size, width, out + at * static_cast<uint64_t>(width), found.data());
        for (uint64_t j = 0; j < size; ++j) {
          if (!found[j]) NotLoaded(keys, at + j, d);
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
    });
  }

  const RoutePlan& Plan() const { return o_.routes ? o_.routes->plan : direct_; }

  // Get across devices: each owner finds the worker's rows into a buffer of
  // its own (compacted, in the order its keys came), the plan's exchange
  // carries those segments to the worker (a relay staged on its middleman),
  // and the worker scatters them into the caller's out in example order.
  void MovedGet(int32_t worker, const uint64_t* keys, uint64_t n, float* out, const int32_t* owners) {
    CheckKeys(keys, n);
    const Parts parts = Partition(keys, n, owners, nullptr, 0);
    const auto e = static_cast<size_t>(endpoints_);
    const auto dim = static_cast<uint32_t>(o_.optimizer.dim);
    std::vector<uint64_t> bytes(e * e, 0), order;  // order: the example of each row received, by owner
    order.reserve(n);
    std::vector<const uint8_t*> sp(e, nullptr);
    std::vector<uint8_t*> rp(e, nullptr);
    std::vector<uint8_t> found;
    parts.ForEach([&](int32_t d, uint64_t size) {
      float* segment = mover_->Buffer(d, detail::RowMover::kSend, size * dim);
      found.resize(size);
      rows_[d]->find_columns(parts.keys[d], size, static_cast<int32_t>(dim), segment, found.data());
      for (uint64_t j = 0; j < size; ++j) {
        if (!found[j]) NotLoaded(keys, parts.Index(d, j), d);
        order.push_back(parts.Index(d, j));
      }
      sp[static_cast<size_t>(d)] = reinterpret_cast<const uint8_t*>(segment);
      bytes[static_cast<size_t>(d) * e + static_cast<size_t>(worker)] = size * dim * sizeof(float);
    });
    float* received = mover_->Buffer(worker, detail::RowMover::kReceive, n * dim);
    rp[static_cast<size_t>(worker)] = reinterpret_cast<uint8_t*>(received);
    mover_->Exchange(Plan(), bytes, sp, rp);
    mover_->ScatterOut(worker, order.data(), n, dim, received, out);
    parts.ForEach([&](int32_t d, uint64_t size) { Count(d, worker, size, size * dim * sizeof(float)); });
  }

  // Accumulate into the gradient tables (keys bound, where the tier is).
  void AccumulateKeys(int32_t worker, const uint64_t* keys, uint64_t n, const float* grads, const int32_t* owners) {
    if (mover_) return MovedAccumulate(worker, keys, n, grads, owners);
    const int32_t dim = o_.optimizer.dim;
    const Parts parts = Partition(keys, n, owners, grads, dim);
    RefuseFullGradients(parts);
    parts.ForEach([&](int32_t d, uint64_t size) {
      grads_[d]->accumulate(parts.keys[d], size, parts.rows[d]);
      Count(worker, d, size, size * dim * sizeof(float));
    });
  }

  // An accumulate is all or nothing: a gradient table that fills adds the
  // keys it met before (and the devices before it all of theirs), so that a
  // retry after making room would add those twice. Each device whose table
  // could fill counts the keys of the call it lacks (each once) against its
  // free slots, before any device adds; a claim fails only when no slot is
  // free (the probe goes all the way round), so no fewer suffice. A table
  // that has room for every entry of the call, or for every key bound on its
  // device (a bound batch's only), cannot fill: no lookup.
  void RefuseFullGradients(const Parts& parts) const {
    std::vector<int64_t> slots;
    std::vector<uint64_t> lacking;
    parts.ForEach([&](int32_t d, uint64_t size) {
      const HashTable& table = *grads_[d];
      const uint64_t room = table.capacity() - table.size();
      if (size <= room || (bound_ && bound_per_device_[static_cast<size_t>(d)] <= table.capacity())) return;
      slots.resize(size);
      table.slots(parts.keys[d], size, slots.data());
      lacking.clear();
      for (uint64_t j = 0; j < size; ++j) {
        if (slots[j] < 0) lacking.push_back(parts.keys[d][j]);
      }
      if (lacking.size() <= room) return;
      std::sort(lacking.begin(), lacking.end());  // (a key repeated in the call takes one slot)
      lacking.erase(std::unique(lacking.begin(), lacking.end()), lacking.end());
      if (lacking.size() <= room) return;
      throw TableFullError("device tier accumulate (device " + std::to_string(d) +
                           "): gradient table full: the call needs a slot for each of " +
                           std::to_string(lacking.size()) + (lacking.size() == 1 ? " key" : " keys") +
                           " the table lacks, and " + std::to_string(room) + (room == 1 ? " is" : " are") +
                           " free (capacity " + std::to_string(table.capacity()) + ", size " +
                           std::to_string(table.size()) + "); no gradient was added");
    });
  }

  // Throws, before anything is added, for a key of an accumulate by key that
  // the batch did not bind (std::out_of_range, as PositionsOf's) or bound on
  // another device than its owner there (std::invalid_argument). An owner
  // outside the devices is left to Partition to name.
  void RefuseUnbound(const uint64_t* keys, uint64_t n, const int32_t* owners) const {
    const detail::KeyIndex& index = BoundKeys();
    for (uint64_t i = 0; i < n; ++i) {
      uint32_t at = index.Find(keys[i]);
      if (at == detail::KeyIndex::kNone) NotBound(keys, i, "accumulate");
      if (o_.devices == 1 || (owners == nullptr && bound_by_hash_)) continue;  // the hash's owner, both times
      const int32_t d = owners ? owners[i] : ModuloOwner(keys[i], o_.devices);
      const uint32_t first = at;
      while (at != detail::KeyIndex::kNone && bound_owners_[at] != d) {  // a key bound on several devices
        at = bound_again_.empty() ? detail::KeyIndex::kNone : bound_again_[at];
      }
      if (at == detail::KeyIndex::kNone && d >= 0 && d < o_.devices) {
        throw std::invalid_argument("device tier accumulate: owners[" + std::to_string(i) + "] = " +
                                    std::to_string(d) + ", but keys[" + std::to_string(i) + "] = " +
                                    std::to_string(keys[i]) + " is bound on device " +
                                    std::to_string(bound_owners_[first]));
      }
    }
  }

  // Accumulate across devices: the worker gathers its gradients into owner
  // order in a buffer of its own, the exchange carries each owner's segment
  // to it, and each owner sums what it received.
  void MovedAccumulate(int32_t worker, const uint64_t* keys, uint64_t n, const float* grads,
                       const int32_t* owners) {
    const Parts parts = Partition(keys, n, owners, nullptr, 0);
    RefuseFullGradients(parts);
    const auto e = static_cast<size_t>(endpoints_);
    const auto dim = static_cast<uint32_t>(o_.optimizer.dim);
    std::vector<uint64_t> bytes(e * e, 0), order;
    order.reserve(n);
    parts.ForEach([&](int32_t d, uint64_t size) {
      for (uint64_t j = 0; j < size; ++j) order.push_back(parts.Index(d, j));
      bytes[static_cast<size_t>(worker) * e + static_cast<size_t>(d)] = size * dim * sizeof(float);
    });
    float* sent = mover_->Buffer(worker, detail::RowMover::kSend, n * dim);
    mover_->GatherIn(worker, order.data(), n, dim, grads, sent);
    std::vector<const uint8_t*> sp(e, nullptr);
    std::vector<uint8_t*> rp(e, nullptr);
    sp[static_cast<size_t>(worker)] = reinterpret_cast<const uint8_t*>(sent);
    std::vector<float*> received(static_cast<size_t>(o_.devices), nullptr);
    parts.ForEach([&](int32_t d, uint64_t size) {
      received[static_cast<size_t>(d)] = mover_->Buffer(d, detail::RowMover::kReceive, size * dim);
      rp[static_cast<size_t>(d)] = reinterpret_cast<uint8_t*>(received[static_cast<size_t>(d)]);
    });
    mover_->Exchange(Plan(), bytes, sp, rp);
    parts.ForEach([&](int32_t d, uint64_t size) {
      grads_[d]->accumulate(parts.keys[d], size, received[static_cast<size_t>(d)]);
      Count(worker, d, size, size * dim * sizeof(float));
    });
  }

  // Apply's steps: the positions' sums (a bound in-place tier), then the
  // gradient tables; `positions` (if given) gets each updated key's.
  std::vector<uint64_t> Step(std::vector<int64_t>* positions) {
    const int32_t dim = o_.optimizer.dim;
    std::vector<uint64_t> updated;
    RefuseFailingSteps();
    if (BoundInPlace()) {
      std::vector<int64_t> stepped;
      in_place_->Apply(bound_keys_.data(), &stepped);
      updated.reserve(stepped.size());
      for (int64_t p : stepped) updated.push_back(bound_keys_[static_cast<uint64_t>(p)]);
      if (!trained_.empty() && !host_rows_) {
        for (size_t i = 0; i < stepped.size(); ++i) {
          if (i + kTrainedAhead < stepped.size()) PrefetchTrained(static_cast<uint64_t>(stepped[i + kTrainedAhead]));
          const auto p = static_cast<uint64_t>(stepped[i]);
          trained_[static_cast<size_t>(BoundOwner(p))].Put(bound_slots_[p], true);
        }
      }
      if (positions) positions->insert(positions->end(), stepped.begin(), stepped.end());
    }
    const size_t by_key = updated.size();  // the keys stepped from the gradient tables start here
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
      if (!trained_.empty()) {
        std::vector<int64_t> slots(updated.size() - at);
        rows_[d]->slots(updated.data() + at, slots.size(), slots.data());
        TrainedBits& bits = trained_[static_cast<size_t>(d)];
        for (int64_t slot : slots) bits.Put(slot, true);
      }
    }
    if (positions && updated.size() > by_key) {
      const size_t at = positions->size();
      positions->resize(at + updated.size() - by_key);
      PositionsOf(updated.data() + by_key, updated.size() - by_key, positions->data() + at, "apply");
    }
    return updated;
  }

  // A step is all or nothing: where its sums lie in more than one place (the
  // positions' and a gradient table, or the tables of several devices), each
  // is checked before any steps, since each place's Apply refuses only its own
  // (and checks again: a second pass over the sums and the steps run dry,
  // where they are split). The sums first, then the steps, and with them the
  // room each device's table has for the keys it lacks: a device whose table
  // fills would leave the devices before it stepped.
  void RefuseFailingSteps() const {
    int places = BoundInPlace() ? 1 : 0;
    for (int32_t d = 0; d < o_.devices; ++d) places += grads_[d]->size() != 0;
    if (places < 2) return;
    const auto what = [](int32_t d) { return "device tier apply (device " + std::to_string(d) + ")"; };
    for (int32_t d = 0; d < o_.devices; ++d) {
      if (grads_[d]->size() != 0) grads_[d]->refuse_nonfinite(what(d));
    }
    if (BoundInPlace()) in_place_->RefuseNonFinite(bound_keys_.data());
    for (int32_t d = 0; d < o_.devices; ++d) {
      if (grads_[d]->size() != 0) rows_[d]->refuse_failing_steps(*grads_[d], o_.optimizer, what(d));
    }
  }

  // Bind's and BindHostRows's common part: the checks, the keys by position
  // and their owners, the in-place rows sized (reads_in_place) for the caller
  // to fill. Returns the keys split by owner.
  Parts BindKeys(const uint64_t* keys, uint64_t n, const int32_t* owners, const char* what) {
    CheckKeys(keys, n);
    if (n >= detail::KeyIndex::kNone) {
      throw std::invalid_argument("device tier " + std::string(what) + ": more than 2^32 - 2 keys");
    }
    for (const auto& g : grads_) {
      if (g->size() != 0) throw std::logic_error("device tier " + std::string(what) + ": gradients wait for Apply");
    }
    if (in_place_ && in_place_->size() != 0) {
      for (uint64_t p = 0; p < in_place_->size(); ++p) {
        if (in_place_->touched(p)) {
          throw std::logic_error("device tier " + std::string(what) + ": gradients wait for Apply");
        }
      }
    }
    Unbind();
    Parts parts = Partition(keys, n, owners, nullptr, 0);  // checks the owners
    bound_keys_.assign(keys, keys + n);
    bound_by_hash_ = owners == nullptr;
    bound_per_device_ = parts.size;
    bound_owners_.assign(o_.devices > 1 ? n : 0, 0);
    if (o_.devices > 1) {
      parts.ForEach([&](int32_t d, uint64_t size) {
        for (uint64_t j = 0; j < size; ++j) bound_owners_[parts.Index(d, j)] = d;
      });
    }
    if (reads_in_place()) {
      if (!in_place_) in_place_ = std::make_unique<detail::BatchRows>(o_.optimizer, "device tier");
      in_place_->Reset(n);
    }
    return parts;
  }

  bool BoundInPlace() const { return bound_ && in_place_ != nullptr; }
  int32_t BoundOwner(uint64_t position) const { return o_.devices > 1 ? bound_owners_[position] : 0; }

  void Unbind() {
    bound_ = false;
    host_rows_ = false;
    bound_keys_.clear();
    bound_owners_.clear();
    bound_slots_.clear();
    bound_index_.reset();
    bound_again_.clear();
    bound_per_device_.clear();
    if (in_place_) in_place_->Reset(0);
  }

  void CheckBound(const char* what) const {
    if (!bound_) throw std::logic_error(std::string("device tier ") + what + " by position before Bind");
  }

  void CheckCompact(RowLayout layout, const char* what) const {
    const uint64_t dim = static_cast<uint64_t>(o_.optimizer.dim);
    if (layout.group_stride != 0 && layout.group_stride != layout.group * dim) {
      throw std::invalid_argument("device tier " + std::string(what) + ": the " + kind_ + " tier of " +
                                  std::to_string(o_.devices) + " device(s) takes compact rows only (group_stride " +
                                  std::to_string(layout.group_stride) + ", not " +
                                  std::to_string(layout.group * dim) + ")");
    }
  }

  // The bound keys' key -> position index, built when a call by key first
  // needs it: a key bound on several devices at its last position, the
  // positions before chained in bound_again_ (empty where no key repeats).
  const detail::KeyIndex& BoundKeys() const {
    if (!bound_index_) {
      bound_again_.clear();  // (a build that ran out of memory may have begun it)
      auto index = std::make_unique<detail::KeyIndex>(bound_keys_.size());
      for (uint64_t i = 0; i < bound_keys_.size(); ++i) {
        const uint32_t before = index->Upsert(bound_keys_[i], static_cast<uint32_t>(i));
        if (before == detail::KeyIndex::kNone) continue;
        if (bound_again_.empty()) {
          bound_again_.assign(bound_keys_.size(), detail::KeyIndex::kNone);
          first_repeat_ = i;
        }
        bound_again_[i] = before;
      }
      bound_index_ = std::move(index);
    }
    return *bound_index_;
  }

  // The same, for the calls that find one position a key: std::logic_error
  // where a key is bound on several devices.
  const detail::KeyIndex& BoundIndex(const char* what) const {
    const detail::KeyIndex& index = BoundKeys();
    if (!bound_again_.empty()) {  // which copy a key names is not defined
      const uint64_t i = first_repeat_;
      throw std::logic_error("device tier " + std::string(what) + " by key: key " + std::to_string(bound_keys_[i]) +
                             " is bound on devices " + std::to_string(BoundOwner(bound_again_[i])) + " and " +
                             std::to_string(BoundOwner(i)) + "; reach a key bound on several devices by position");
    }
    return index;
  }

  // Where each of keys (n, bound) is among the bound keys.
  void PositionsOf(const uint64_t* keys, uint64_t n, int64_t* positions, const char* what) const {
    const detail::KeyIndex& index = BoundIndex(what);
    for (uint64_t i = 0; i < n; ++i) {
      const uint32_t at = index.Find(keys[i]);
      if (at == detail::KeyIndex::kNone) NotBound(keys, i, what);
      positions[i] = at;
    }
  }

  [[noreturn]] void NotBound(const uint64_t* keys, uint64_t i, const char* what) const {
    throw std::out_of_range("device tier " + std::string(what) + ": keys[" + std::to_string(i) + "] = " +
                            std::to_string(keys[i]) + " is not among the " + std::to_string(bound_keys_.size()) +
                            " keys bound");
  }

  // The bound keys at positions, and their owners (left empty with one device).
  void KeysAt(const int64_t* positions, uint64_t n, std::vector<uint64_t>* keys, std::vector<int32_t>* owners,
              const char* what) const {
    const uint64_t size = bound_keys_.size();
    keys->resize(n);
    if (o_.devices > 1) owners->resize(n);
    for (uint64_t i = 0; i < n; ++i) {
      const auto p = static_cast<uint64_t>(positions[i]);
      if (p >= size) {
        throw std::out_of_range("device tier " + std::string(what) + ": positions[" + std::to_string(i) + "] = " +
                                std::to_string(positions[i]) + " is outside [0, " + std::to_string(size) + ")");
      }
      (*keys)[i] = bound_keys_[p];
      if (o_.devices > 1) (*owners)[i] = bound_owners_[p];
    }
  }

  // The transfers of a positional Get (rows from their owners to the worker)
  // or Accumulate (gradients from the worker to the owners).
  void CountAt(int32_t worker, const int64_t* positions, uint64_t n, bool to_worker) {
    const uint64_t row_bytes = static_cast<uint64_t>(o_.optimizer.dim) * sizeof(float);
    std::vector<uint64_t> per(static_cast<size_t>(o_.devices), 0);
    if (o_.devices == 1) {
      per[0] = n;
    } else {
      for (uint64_t i = 0; i < n; ++i) ++per[static_cast<size_t>(bound_owners_[static_cast<uint64_t>(positions[i])])];
    }
    for (int32_t d = 0; d < o_.devices; ++d) {
      const uint64_t rows = per[static_cast<size_t>(d)];
      if (rows == 0) continue;
      if (to_worker) {
        Count(d, worker, rows, rows * row_bytes);
      } else {
        Count(worker, d, rows, rows * row_bytes);
      }
    }
  }

  [[noreturn]] static void NotLoaded(const uint64_t* keys, uint64_t i, int32_t device) {
    throw std::out_of_range("device tier: keys[" + std::to_string(i) + "] = " + std::to_string(keys[i]) +
                            " is not loaded on device " + std::to_string(device) +
                            "; insert the batch's working set first");
  }

  void CheckTracked(const char* what) const {
    if (trained_.empty()) {
      throw std::logic_error("device tier " + std::string(what) + ": the tier keeps no trained bits "
                             "(DeviceTierOptions::track_trained is off)");
    }
  }

  // How many rows ahead the loops over bound positions ask for the lines of
  // their bits (TrainedBits::Prefetch): the misses overlap.
  static constexpr uint64_t kTrainedAhead = 16;

  void PrefetchTrained(uint64_t position) const {
    trained_[static_cast<size_t>(BoundOwner(position))].Prefetch(bound_slots_[position]);
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
    if (!o_.routes || from == to) return;
    // Along the pair's route: every link direction it crosses, by phase.
    const TierRoutes& r = *o_.routes;
    const Route& route = r.plan.routes[static_cast<size_t>(from) * endpoints_ + to];
    links_.route_rows[static_cast<size_t>(route.kind)] += rows;
    if (route.kind == RouteKind::kRelay) {
      links_.relayed_rows += rows;
      links_.relayed_bytes += bytes;
    }
    for (size_t ph = 0; ph < 2; ++ph) {
      for (int32_t hop : r.hops[ph][at]) {
        const size_t i = ph * 2 * static_cast<size_t>(links_.links) + static_cast<size_t>(hop);
        links_.rows[i] += rows;
        links_.bytes[i] += bytes;
      }
    }
  }

  DeviceTierOptions o_;
  int32_t row_floats_;
  std::string kind_;
  std::vector<std::unique_ptr<HashTable>> rows_, grads_;
  std::vector<HashTableOptions> grad_options_;  // each gradient table's, to build it again at another size
  TransferMatrix matrix_;
  int32_t endpoints_ = 0;  // the routes' E (the tier's devices with a direct plan)
  LinkCounters links_;
  std::unique_ptr<detail::RowMover> mover_;  // null: rows cross devices by the tables' own copies
  RoutePlan direct_;                         // the mover's plan without routes
  std::unique_ptr<detail::HostStaging> staging_;  // StagingRows' buffer, made at the first load
  // The batch Bind named: its keys by position, their owners (several
  // devices), a key -> position index built when a call by key needs it, and
  // (reads_in_place) the rows where the tables hold them, with their sums.
  bool bound_ = false;
  std::vector<uint64_t> bound_keys_;
  std::vector<int32_t> bound_owners_;
  mutable std::unique_ptr<detail::KeyIndex> bound_index_;
  mutable std::vector<uint32_t> bound_again_;  // with bound_index_: a repeated key's position before, else kNone
  mutable uint64_t first_repeat_ = 0;          // the first position whose key repeats one before it
  std::vector<uint64_t> bound_per_device_;     // the keys bound on each device: its gradient table's most
  bool bound_by_hash_ = false;                 // bound with the modulo hash's owners
  std::unique_ptr<detail::BatchRows> in_place_;
  bool host_rows_ = false;  // BindHostRows: in_place_ points at the caller's rows, the tables are empty
  std::vector<TrainedBits> trained_;  // each device's trained bits; empty without options.track_trained
  std::vector<int64_t> bound_slots_;  // with trained_: each bound position's slot in its owner's table (-1: none)
  std::vector<uint32_t> copy_given_;  // CopyRowsByKey's, by position: all kNone between calls
};

}  // namespace

std::shared_ptr<const TierRoutes> PlanTierRoutes(const Topology& topology, int32_t devices, uint64_t pair_bytes,
                                                 bool execute) {
  topology.Validate();
  const std::vector<int32_t> ep = topology.Endpoints();
  if (devices <= 0) throw std::invalid_argument("tier routes: devices must be > 0");
  if (pair_bytes == 0) throw std::invalid_argument("tier routes: pair_bytes must be > 0");
  if (ep.size() < static_cast<size_t>(devices)) {
    throw std::invalid_argument("tier routes: the topology has " + std::to_string(ep.size()) +
                                " endpoints (GPUs and host partitions), fewer than the tier's " +
                                std::to_string(devices) + " devices");
  }
  const size_t e = ep.size();
  const auto g = static_cast<size_t>(devices);
  std::vector<uint64_t> bytes(e * e, 0);
  for (size_t s = 0; s < g; ++s)
    for (size_t d = 0; d < g; ++d)
      if (s != d) bytes[s * e + d] = pair_bytes;
  auto r = std::make_shared<TierRoutes>();
  r->topology = topology;
  r->plan = PlanRoutes(topology, bytes, Schedule::kRelay);
  r->execute = execute;
  r->devices = devices;
  std::map<std::pair<int32_t, int32_t>, int32_t> link_of;
  for (size_t i = 0; i < topology.links.size(); ++i) {
    const TopoLink& l = topology.links[i];
    link_of[{std::min(l.a, l.b), std::max(l.a, l.b)}] = static_cast<int32_t>(i);
  }
  for (auto& h : r->hops) h.assign(g * g, {});
  for (size_t s = 0; s < g; ++s) {
    for (size_t d = 0; d < g; ++d) {
      const Route& route = r->plan.routes[s * e + d];
      if (route.kind == RouteKind::kNone) continue;
      const int32_t middleman = route.kind == RouteKind::kRelay ? ep[static_cast<size_t>(route.via)] : -1;
      size_t phase = 0;
      for (size_t h = 1; h < route.path.size(); ++h) {
        const int32_t a = route.path[h - 1], b = route.path[h];
        const int32_t li = link_of.at({std::min(a, b), std::max(a, b)});
        r->hops[phase][s * g + d].push_back(2 * li + (topology.links[static_cast<size_t>(li)].a == a ? 0 : 1));
        if (b == middleman) phase = 1;
      }
    }
  }
  return r;
}

int32_t DeviceTier::ModuloOwner(uint64_t key, int32_t devices) {
  return static_cast<int32_t>(detail::Mix64(key) % static_cast<uint64_t>(devices));  // ids sharing low bits still spread
}

HostBatch::HostBatch(MemCache& cache, const uint64_t* keys, uint64_t n, uint8_t* const* addresses,
                     const SparseOptimizer& optimizer)
    : cache_(cache), optimizer_(optimizer), keys_(keys, keys + n) {
  Setup(addresses);
}

// Not delegating to the constructor above: once that one returned, a throw
// here would run the destructor, which unpins keys this batch never held.
HostBatch::HostBatch(MemCache& cache, const uint64_t* keys, uint64_t n, const SparseOptimizer& optimizer)
    : cache_(cache), optimizer_(optimizer), keys_(keys, keys + n) {
  Setup(nullptr);
  BuildIndex();
  cache.PinnedRows(keys, n, rows_->addresses());
}

void HostBatch::Setup(uint8_t* const* addresses) {
  optimizer_.validate();
  if (cache_.row_bytes() != sizeof(float) * static_cast<uint64_t>(optimizer_.row_floats())) {
    throw std::invalid_argument("host batch: MEM-PS rows are " + std::to_string(cache_.row_bytes()) +
                                " bytes, the optimizer's " + std::to_string(sizeof(float) * optimizer_.row_floats()));
  }
  const uint64_t n = keys_.size();
  if (n >= detail::KeyIndex::kNone) throw std::invalid_argument("host batch: more than 2^32 - 2 keys");
  rows_ = std::make_unique<detail::BatchRows>(optimizer_, "host batch");
  rows_->Reset(n);
  if (addresses != nullptr) std::copy(addresses, addresses + n, rows_->addresses());
}

void HostBatch::BuildIndex() const {
  auto index = std::make_unique<detail::KeyIndex>(keys_.size());
  for (uint64_t i = 0; i < keys_.size(); ++i) {
    if (index->Upsert(keys_[i], static_cast<uint32_t>(i)) != detail::KeyIndex::kNone) {
      throw std::invalid_argument("host batch: keys[" + std::to_string(i) + "] = " + std::to_string(keys_[i]) +
                                  " repeats an earlier key; give distinct keys");
    }
  }
  index_ = std::move(index);
}

HostBatch::~HostBatch() {
  if (released_) return;
  // Release counted a failure in the cache's stats; a destructor cannot throw
  // it, so it says so where a user sees it.
  try {
    Release();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "hps: a host batch of %zu keys released by its destructor: %s\n", keys_.size(), e.what());
  } catch (...) {
    std::fprintf(stderr, "hps: a host batch of %zu keys released by its destructor: unknown error\n", keys_.size());
  }
}

void HostBatch::CheckLive(const char* what) const {
  // (Unfinished: some keys are released already, their rows no longer the batch's.)
  if (released_ || unfinished_) throw std::logic_error(std::string("host batch: ") + what + " after release");
}

void HostBatch::Positions(const uint64_t* keys, uint64_t n, int64_t* positions) const {
  CheckLive("positions");
  if (!index_) BuildIndex();
  for (uint64_t i = 0; i < n; ++i) {
    const uint32_t at = index_->Find(keys[i]);
    if (at == detail::KeyIndex::kNone) {
      throw std::out_of_range("host batch: keys[" + std::to_string(i) + "] = " + std::to_string(keys[i]) +
                              " is not in the batch");
    }
    positions[i] = at;
  }
}

void HostBatch::Get(const int64_t* positions, uint64_t n, float* embeddings, RowLayout layout) const {
  CheckLive("get");
  rows_->Get(positions, n, embeddings, layout);
}

void HostBatch::Accumulate(const int64_t* positions, uint64_t n, const float* grads, RowLayout layout) {
  CheckLive("accumulate");
  rows_->Accumulate(positions, n, grads, layout);
}

uint64_t HostBatch::Apply() {
  CheckLive("apply");
  return rows_->Apply(keys_.data());
}

void HostBatch::Rows(const int64_t* positions, uint64_t n, float* rows) const {
  CheckLive("rows");
  rows_->Rows(positions, n, rows);
}

std::vector<uint64_t> HostBatch::UpdatedKeys() const {
  std::vector<uint64_t> out;
  const std::vector<uint8_t>& updated = rows_->updated();
  for (uint64_t p = 0; p < keys_.size(); ++p) {
    if (updated[p]) out.push_back(keys_[p]);
  }
  return out;
}

void HostBatch::Release() {
  if (released_) return;
  // Every failure counted, once, wherever it came from.
  try {
    ReleaseRemaining();
  } catch (...) {
    cache_.CountFailedRelease();
    throw;
  }
}

void HostBatch::ReleaseRemaining() {
  const std::vector<uint8_t>& updated = rows_->updated();
  uint8_t* const* rows = rows_->addresses();
  // Bulk first; a key something else unpinned makes UnpinUpdated refuse the
  // whole call (changing nothing), and then the keys go one by one. Once a
  // call has released keys the release is unfinished: a failure after that
  // (bad_alloc) leaves what it found in members and its next key in
  // next_key_, and the retry goes on from there without calling again for
  // any key before it (a second unpin would take the pin of the next batch
  // that holds the key). Key by key, a call that fails with anything but
  // BrokenPinError or std::invalid_argument has released nothing
  // (MemCache's contract): next_key_ stays at it.
  if (!unfinished_) {
    try {
      cache_.UnpinUpdated(keys_.data(), keys_.size(), updated.data(), rows);
      released_ = true;
      return;
    } catch (BrokenPinError& e) {
      // Released, but for keys something else unpinned during the call,
      // whose steps it marked already (as below). What it found is moved
      // (no room needed) and no key is left to call.
      refused_ = e.TakeUnpinned();
      lost_ = e.TakeLost();
      next_key_ = keys_.size();
    } catch (const std::invalid_argument&) {
      // Room first, while nothing is released: the bookkeeping below cannot
      // fail (each key is refused, lost or to mark once).
      refused_.reserve(keys_.size());
      lost_.reserve(keys_.size());
      to_mark_.reserve(keys_.size());
      next_key_ = 0;
    }  // anything else: nothing released, and a retry does it all again
    unfinished_ = true;
  }
  for (; next_key_ < keys_.size(); ++next_key_) {
    const uint64_t p = next_key_;
    try {
      cache_.UnpinUpdated(&keys_[p], 1, &updated[p], rows + p);
      continue;
    } catch (const BrokenPinError& e) {  // unpinned during the call, its step marked
      if (!e.lost().empty()) lost_.push_back(p);
    } catch (const std::invalid_argument&) {
      // Its unpin did not mark its step: marked below where its row still
      // lies, so MEM-PS stores it when it evicts the row.
      if (updated[p]) to_mark_.push_back(p);
    }  // anything else: key p released nothing, and a retry goes on from it
    refused_.push_back(p);
  }
  if (!to_mark_.empty()) {
    // Until it passes (marking a step twice is harmless). A row that left
    // its slot meanwhile (unpinned, then evicted clean) took its step with it.
    std::vector<uint64_t> stepped;
    std::vector<uint8_t*> where;
    stepped.reserve(to_mark_.size());
    where.reserve(to_mark_.size());
    for (uint64_t p : to_mark_) {
      stepped.push_back(keys_[p]);
      where.push_back(rows[p]);
    }
    for (uint64_t j : cache_.MarkUpdated(stepped.data(), stepped.size(), where.data())) lost_.push_back(to_mark_[j]);
    to_mark_.clear();
    std::sort(lost_.begin(), lost_.end());
  }
  const std::vector<uint64_t>& refused = refused_;
  const std::vector<uint64_t>& lost = lost_;
  const auto named = [&](const std::vector<uint64_t>& at, bool say_updated) {
    std::string which;
    for (size_t j = 0; j < at.size() && j < 8; ++j) {
      which += (j > 0 ? ", keys[" : "keys[") + std::to_string(at[j]) + "] = " + std::to_string(keys_[at[j]]) +
               (say_updated && updated[at[j]] ? " (updated)" : "");
    }
    if (at.size() > 8) which += ", ...";
    return which;
  };
  // Built before the batch counts as released: if that runs out of memory,
  // the retry reports it.
  const std::runtime_error error(
      "host batch release: " + std::to_string(refused.size()) + " of " + std::to_string(keys_.size()) +
      " keys were no longer pinned by this batch (" + named(refused, true) + "): something else unpinned them; " +
      (lost.empty() ? std::string("the updated ones' steps were kept")
                    : "the steps of " + named(lost, false) +
                          " are lost (their rows left MEM-PS before the release), the other updated ones' were kept") +
      " (dirty in MEM-PS), and the other keys were released");
  released_ = true;
  throw error;  // a copy that shares the message: nothing to allocate
}

std::unique_ptr<DeviceTier> DeviceTier::New(const DeviceTierOptions& options) {
  if (options.devices <= 0) throw std::invalid_argument("device tier: devices must be > 0");
  if (options.capacity == 0) throw std::invalid_argument("device tier: capacity must be > 0 rows per device");
  options.optimizer.validate();
  return std::make_unique<Tier>(options);
}

}  // namespace hps
